"""Evaluation on the held-out data: the model's test_step over every example."""

from __future__ import annotations

import time

import tensorflow as tf

from tfdp.data import bad_data, leaves
from tfdp.run.hooks.report import described
from tfdp.run.loop import Hook


def evaluate(trainer, data, batch_size: int, callbacks=None, steps: int | None = None, seen=None):
    """The model's test_step over every example of `data` (the first `steps` batches' only,
    if given), each batch split over the devices as the trainer splits a training batch,
    as Keras' `evaluate` runs it: the metrics reset first, then running over the batches.
    Returns the logs after the last batch (Python numbers).

    callbacks: a Keras CallbackList whose test-batch hooks are called for each batch.
    seen: a list that gets each batch's examples.

    Raises:
      bad_data.ValidationFailed: reading the data failed (a corrupt file, a generator
        that raised).
    """
    from tfdp.run.hooks.report import keras_logs

    trainer.model.reset_metrics()
    logs = {}
    batches = bad_data.reading(data.batches(batch_size, steps))
    for index, batch in enumerate(batches):
        if seen is not None:
            seen.append(leaves.length(tf.nest.flatten(batch)[0]))
        if callbacks is not None:
            callbacks.on_test_batch_begin(index)
        logs = keras_logs(trainer.test_step(batch))
        if callbacks is not None:
            callbacks.on_test_batch_end(index, logs)
    return logs


def metrics_kept(model):
    """Inside: the model's metrics may be reset and run (an evaluation between training
    steps); afterwards they hold their running values of before again."""
    from tfdp.engine.placement import kept

    return kept(model.metrics_variables)


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
        if every and done % every == 0 and not run.finishing():
            start = time.perf_counter()
            self.evaluate(run, done)
            run.clock.side_seconds += time.perf_counter() - start

    def on_train_end(self, run):
        self.evaluate(run, run.step)

    def evaluate(self, run, step) -> None:
        plan = run.plan
        if plan.test_data is None:
            return
        from tfdp.run.hooks.report import floats

        config, seen = plan.config, []
        with metrics_kept(run.trainer.model):
            logs = evaluate(
                run.trainer, plan.test_data, config.batch_size, steps=config.eval_steps, seen=seen
            )
        values = floats(logs)
        named = {f"test_{k}": v for k, v in values.items()}
        run.result["evals"].append({"iteration": step, **named})
        run.say(f"iteration {step}, {described(values, 'test ')} ({sum(seen)} examples)")
        if self.summaries:
            self.summaries.write_eval(step, named)
