"""What a person watching a run reads: the tutorial's lines and the live progress line."""

from __future__ import annotations

import math
import time

from tfdp import internals
from tfdp.devices import short_name
from tfdp.run.loop import Hook

# what the banner says of a trainer's reduction (`Trainer.info`), where the split is the run's
REDUCTIONS = {
    "device0": "; gradients summed on device0 and sent back",
    "allreduce": "; gradients summed by allreduce",
}


def learning_rate(optimizer) -> float | None:
    """The rate `optimizer` applies at its next step: a schedule's value at its iteration
    count, a wrapped optimizer's (loss scaling) its inner one's; None for an optimizer
    without one rate (a MultiOptimizer's optimizers have their own)."""
    import tensorflow as tf

    try:
        rate = optimizer.learning_rate  # a Keras variable, mirrored under a strategy, or a tensor
    except AttributeError:
        return None
    return float(tf.convert_to_tensor(getattr(rate, "value", rate)))


def rate_words(optimizer) -> str:
    """`at learning rate 0.1`, or, for an optimizer without one rate, whose rates."""
    rate = learning_rate(optimizer)
    if rate is None:
        return f"at the learning rates of {type(optimizer).__name__}'s optimizers"
    return f"at learning rate {rate:g}"


def schedule_of(optimizer):
    """The optimizer's learning-rate schedule, or None for a fixed (settable) rate."""
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    rate = internals.learning_rate_of(inner)
    return rate if isinstance(rate, keras.optimizers.schedules.LearningRateSchedule) else None


def banner(plan, trainer, start_step: int, shards: list[int], input_note=None) -> str:
    """The batch arithmetic, printed once at start."""
    config, n = plan.config, len(plan.devices)
    split = " + ".join(str(s) for s in shards)
    micro = trainer.split.micro_steps
    if micro > 1:  # the caps hold less than the batch
        split = f"{micro} micro-steps of at most {split} (max_rows {list(trainer.split.max_rows)})"
    per_pass, total = plan.batches_per_pass, plan.total_steps
    if per_pass is None:
        data = "passes of a stream of unknown length (an epoch ends where a pass does)"
    elif per_pass == math.inf:
        data = "an endless stream" + (
            f", epochs of {plan.steps_per_epoch} steps" if plan.steps_per_epoch else ""
        )
    else:
        of = "a stream" if plan.examples is None else f"{plan.examples} examples"
        data = f"{per_pass} steps per epoch of {of}"
    if total is None:
        steps = f"epochs {plan.initial_epoch}-{plan.final_epoch - 1}"
    elif per_pass in (None, math.inf):
        steps = f"{total} iterations"
    else:
        steps = f"{total} iterations ({total / per_pass:.2f} epochs)"
    text = (
        f"global batch {config.batch_size}"
        + (f" ({plan.batch_from})" if plan.batch_from else "")
        + f" = {split} over {n} {trainer.split.unit}, mode {config.mode}; "
        f"{data}; {steps} {rate_words(trainer.model.optimizer)}"
    )
    schedule = schedule_of(trainer.model.optimizer)
    if schedule is not None:  # its value at the first step
        text += f" ({type(schedule).__name__} at iteration {start_step})"
    text += REDUCTIONS.get(trainer.info()["reduction"], "")
    if config.rebalance_every:
        text += (
            f"; re-split by measured device times, in windows of up to "
            f"{config.rebalance_every} iterations"
        )
    if start_step:
        text += f"; resuming at iteration {start_step} from {config.model_dir}"
        if input_note:  # a stream: how it resumes
            text += f" ({input_note})"
    if config.mode == "weighted" and config.reduce == "device0":
        from tfdp.devices import master_on_cpu

        warning = master_on_cpu(plan.devices)
        if warning:
            text += f"; warning: {warning}"
    return text


def keras_logs(logs) -> dict:
    """A step's logs as Keras' fit hands them to callbacks: nested dicts flattened, each
    value a Python float where it converts to one (Keras' `pythonify_logs`)."""
    return internals.pythonify_logs(logs)


def floats(logs) -> dict[str, float]:
    """A step's logs as Python numbers, for tfdp's lines and result: Keras' logs
    (`keras_logs`) without the entries that are not single numbers."""
    return {name: v for name, v in keras_logs(logs).items() if isinstance(v, float)}


def described(values: dict[str, float], prefix: str = "") -> str:
    """'accuracy 0.910000, loss 0.300000': the metrics first, as the tutorial prints them."""
    names = [name for name in values if name != "loss"] + ["loss"]
    return ", ".join(f"{prefix}{name} {values[name]:f}" for name in names if name in values)


class TutorialLog(Hook):
    """The tutorial's lines: the workload partition and the batch arithmetic first, the
    training batch's metrics every `log_every` iterations, then the time; also starts
    the run's clock. With `log_every` 0 only the first and last lines are printed.

    A logged step's metrics are its batch's: the model's metrics are reset before it,
    unless Keras callbacks read their running values (`running`: then the lines show
    those, as Keras' progress bar does)."""

    def __init__(self, running: bool = False):
        self.running = running

    def on_train_begin(self, run):
        shards = list(run.trainer.split.shards)
        pairs = [(short_name(d), n) for d, n in zip(run.plan.devices, shards)]
        run.say(f"workload partition: {pairs}")
        run.say(banner(run.plan, run.trainer, run.start_step, shards, run.input_note))
        run.result.update(shards=shards, log=[])
        run.clock.start = time.perf_counter()

    def on_step_begin(self, run, step):
        if self.running:
            return
        total, last = run.plan.total_steps, step + run.call[1] - run.call[0]
        if run.plan.logs(step) or (total is not None and step < total <= last + 1):
            run.trainer.model.reset_metrics()  # the logged step's own batch, and the last's

    def on_step_end(self, run, step):
        if run.first_step == run.start_step:
            _wait_for(run.outputs)  # the first call includes tracing
            run.clock.first_step_seconds = run.clock.seconds()
            self.first_end = run.step
            for note in run.trainer.notes():  # how the model's own step is run
                run.say(f"tfdp: {note}")
        if not run.is_log_point(step):
            return
        run.metrics = floats(run.outputs["logs"])
        if run.plan.logs(step):
            run.result["log"].append({"iteration": step, **run.metrics})
            run.say(f"iteration {step}, {described(run.metrics)}")

    def on_train_end(self, run):
        plan, clock = run.plan, run.clock
        seconds = clock.seconds()
        steps_run = run.step - run.start_step
        steady = seconds - clock.side_seconds - clock.first_step_seconds
        first_end = getattr(self, "first_end", run.start_step + 1)
        images_per_second = (
            plan.examples_in(first_end, run.step) / steady
            if run.step > first_end and steady > 0
            else plan.examples_in(run.start_step, run.step) / max(seconds, 1e-9)
        )
        run.say(
            f"time for {steps_run} iterations of {plan.model_name} on "
            f"{len(plan.devices)} {run.trainer.split.unit}, mode {plan.config.mode}: {seconds:f} sec "
            f"(first step {clock.first_step_seconds:.2f} sec with tracing; then "
            f"{images_per_second:.0f} images/sec)"
        )
        run.result.update(
            seconds=seconds,
            first_step_seconds=clock.first_step_seconds,
            images_per_second=images_per_second,
        )


class ProgressLine(Hook):
    """One line on stderr, rewritten in place (`observe.Progress`)."""

    def __init__(self, progress):
        self.progress = progress

    def on_train_begin(self, run):
        run.progress = self.progress

    def on_step_end(self, run, step):
        self.run = run
        done = step + 1
        self.progress.update(done, self.metrics, force=run.finishing())

    def metrics(self):
        """The last step's metrics, read only when the line is shown."""
        return floats(self.run.outputs["logs"])

    def close(self, run):
        self.progress.close()
        run.progress = None


def _wait_for(outputs) -> None:
    """Blocks until a step's outputs are computed."""
    import tensorflow as tf

    for value in tf.nest.flatten(outputs):
        if hasattr(value, "numpy"):
            value.numpy()
