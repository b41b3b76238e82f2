"""TensorBoard scalars at the logged steps."""

from __future__ import annotations

from tfdp.devices import short_name
from tfdp.run.hooks.report import learning_rate
from tfdp.run.loop import Hook


class TrainSummaries(Hook):
    """Under DIR/train at each logged step: the loss and metrics of the step's batch, the
    optimizer's learning rate, images/s so far and each device's share.

    summaries: the run's `observe.Summaries` (the chief's only).
    """

    def __init__(self, summaries):
        self.summaries = summaries

    def on_step_end(self, run, step):
        if not run.plan.logs(step):
            return
        seconds = max(run.clock.training_seconds(), 1e-9)
        rate = learning_rate(run.trainer.model.optimizer)
        shares = zip(run.plan.devices, run.trainer.split.shards)
        self.summaries.write_train(
            step,
            {
                **run.metrics,
                **({} if rate is None else {"learning_rate": rate}),
                "images_per_second": run.plan.examples_in(run.start_step, step + 1) / seconds,
                **{f"shard/{short_name(d)}": n for d, n in shares},
            },
        )

    def close(self, run):
        self.summaries.close()
