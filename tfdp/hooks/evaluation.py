"""Evaluation on the held-out data: the compiled loss and metrics over every example."""

from __future__ import annotations

import time

from tfdp import data as data_lib
from tfdp.hooks.report import described
from tfdp.loop import Hook


def evaluate(
    trainer, spec, data, batch_size: int, on_batch=None, steps: int | None = None
) -> dict[str, float]:
    """The compiled loss (with `model.losses`) and metrics over every example of `data`
    (the first `steps` batches' only, if given), each batch split over the devices as
    the trainer splits a training batch.

    on_batch: called as on_batch(index, batch, summed_loss, predictions) after each
    batch (the Keras callbacks' test hooks).
    """
    from tfdp.objective import num_examples

    objective = spec.objective
    objective.reset_metrics()
    summed, examples = 0.0, 0
    batches = data_lib.eval_batches(data, batch_size)
    for index, batch in enumerate(batches.take(steps) if steps else batches):
        loss, predictions = trainer.predict(batch)
        summed += float(loss)
        examples += int(num_examples(batch))
        objective.update_metrics(batch, predictions)
        if on_batch is not None:
            on_batch(index, batch, loss, predictions)
    regularization = sum(float(value) for value in trainer.model.losses)
    return {"loss": summed / examples + regularization, **objective.read_metrics()}


class Evaluation(Hook):
    """The test set every `eval_every` steps, and at the end of the run.

    summaries: where the eval scalars go (`observe.Summaries`), or None.
    """

    def __init__(self, summaries=None):
        self.summaries = summaries

    def on_train_begin(self, run):
        run.result["evals"] = []

    def on_step_end(self, run, step):
        every, done = run.plan.config.eval_every, step + 1
        if every and done % every == 0 and done != run.plan.total_steps:
            start = time.perf_counter()
            self.evaluate(run, done)
            run.clock.side_seconds += time.perf_counter() - start

    def on_train_end(self, run):
        self.evaluate(run, run.step)

    def evaluate(self, run, step) -> None:
        plan = run.plan
        if plan.test_data is None:
            return
        values = evaluate(run.trainer, plan.spec, plan.test_data, plan.config.batch_size)
        named = {f"test_{k}": v for k, v in values.items()}
        run.result["evals"].append({"iteration": step, **named})
        run.say(
            f"iteration {step}, {described(values, 'test ')} "
            f"({data_lib.size(plan.test_data)} examples)"
        )
        if self.summaries:
            self.summaries.write_eval(step, named)
