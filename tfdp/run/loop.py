"""The training loop: take a batch (or `steps_per_execution` of them), step, hooks.

`Run` is what the loop and its hooks share. A `Hook` acts at the points of the
loop Keras callbacks know (train, epoch, step); `Hooks` calls a list of them in
order. tfdp's own features (logging, evaluation, checkpoints, summaries,
progress, the finite guard, stop signals, rebalancing) are hooks
(tfdp/run/hooks/), and so is the adapter that runs a user's Keras callbacks.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence


@dataclasses.dataclass
class Clock:
    """The run's time: from its first step, the first step's own (tracing), and the
    time hooks spend beside training (evaluation, checkpoints), left out of images/s."""

    start: float = 0.0
    first_step_seconds: float = 0.0
    side_seconds: float = 0.0

    def seconds(self) -> float:
        return time.perf_counter() - self.start

    def training_seconds(self) -> float:
        return self.seconds() - self.side_seconds


@dataclasses.dataclass
class Run:
    """One run in progress.

    Attributes:
      plan: the validated run (`plan.Plan`): config, devices, model, data, steps.
      trainer: the mode's trainer.
      iterator: what `trainer.train_step` reads the global batches from.
      log: where the run's lines go (`say` clears the progress line first).
      start_step: the step the run starts (or resumes) at.
      cursor: where the run is in its epochs and its data (`epochs.Cursor`).
      outputs: the last call's outputs, as the trainer returned them (tensors): `logs`,
        the model's logs after its last step, `device_seconds` and `steps`.
      first_step: the first step of the last call (several steps, with the model's
        `steps_per_execution`, run in one compiled call).
      call: the batch indices of the last call in its epoch, (first, last), as Keras'
        batch hooks get them.
      stopping: a hook asks the loop to stop after this step (and its epoch's end).
      result: what the hooks add to the run's result.
      progress: the live progress line, if any (`observe.Progress`).
      clock: the run's time.
      metrics: the loss and compiled metrics of the last logged step's global batch.
      input_note: how a resumed stream was put at its position, for the banner.
    """

    plan: object
    trainer: object
    iterator: object
    log: Callable[[str], None] = print
    start_step: int = 0
    cursor: object = None
    outputs: dict | None = None
    first_step: int = 0
    call: tuple = (0, 0)
    stopping: bool = False
    result: dict = dataclasses.field(default_factory=dict)
    progress: object = None
    clock: Clock = dataclasses.field(default_factory=Clock)
    metrics: dict | None = None
    input_note: str | None = None
    start_epoch_batch: int = 0  # the batch of its epoch the run started at (a resume)

    def __post_init__(self):
        if self.cursor is None:
            self.cursor = self.plan.schedule.at(self.start_step)
        self.start_epoch_batch = self.cursor.batch

    @property
    def step(self) -> int:
        """Steps done so far, which is also the input position."""
        return self.cursor.step

    @property
    def epoch(self) -> int:
        return self.cursor.epoch

    seek_input: Callable | None = None  # (cursor) -> the iterator at the cursor's step

    def seek(self, epoch: int) -> None:
        """Starts the run at the first batch of `epoch` instead (a callback restored a
        backup of an earlier run there, as Keras' BackupAndRestore does)."""
        self.cursor = self.plan.schedule.at_epoch(epoch)
        if self.seek_input is not None:
            self.iterator = self.seek_input(self.cursor)

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.clear()
        self.log(line)

    def at_epoch_end(self) -> bool:
        """Whether the last call ended its epoch (or the run, which cuts an epoch short)."""
        schedule = self.plan.schedule
        return schedule.ends_epoch(self.cursor) or self.finishing()

    def finishing(self) -> bool:
        """Whether the last call was the run's last (as planned: not a stop)."""
        schedule, cursor = self.plan.schedule, self.cursor
        if schedule.max_steps is not None and cursor.step >= schedule.max_steps:
            return True
        last = schedule.final_epoch is not None and cursor.epoch + 1 >= schedule.final_epoch
        return last and schedule.ends_epoch(cursor)

    def is_log_point(self, step: int) -> bool:
        """Whether the step's metrics are read: a logged step, or the run's last."""
        return self.plan.logs(step) or self.finishing()


class Hook:
    """Acts at the points of the loop; every method does nothing unless overridden."""

    def on_train_begin(self, run: Run) -> None:
        pass

    def on_epoch_begin(self, run: Run, epoch: int) -> None:
        pass

    def on_step_begin(self, run: Run, step: int) -> None:
        pass

    def on_step_end(self, run: Run, step: int) -> None:
        pass

    def on_epoch_end(self, run: Run, epoch: int) -> None:
        pass

    def on_train_end(self, run: Run) -> None:
        pass

    def close(self, run: Run) -> None:
        """Always called at the end of a run, also when the run raises."""


class Hooks(Hook):
    """Several hooks, called in order."""

    def __init__(self, hooks: Sequence[Hook]):
        self.hooks = [hook for hook in hooks if hook is not None]

    def on_train_begin(self, run):
        for hook in self.hooks:
            hook.on_train_begin(run)

    def on_epoch_begin(self, run, epoch):
        for hook in self.hooks:
            hook.on_epoch_begin(run, epoch)

    def on_step_begin(self, run, step):
        for hook in self.hooks:
            hook.on_step_begin(run, step)

    def on_step_end(self, run, step):
        for hook in self.hooks:
            hook.on_step_end(run, step)

    def on_epoch_end(self, run, epoch):
        for hook in self.hooks:
            hook.on_epoch_end(run, epoch)

    def on_train_end(self, run):
        for hook in self.hooks:
            hook.on_train_end(run)

    def close(self, run):
        for hook in self.hooks:
            hook.close(run)


def train_loop(run: Run, hooks: Hook) -> None:
    """Trains from `run.cursor` to the planned end, or until a hook stops the run: epochs
    by Keras' rule (`epochs.Schedule`), each in calls of `steps_per_execution` steps."""
    schedule = run.plan.schedule
    try:
        hooks.on_train_begin(run)
        cursor = run.cursor  # (a callback may have moved it: `Run.seek`)
        while schedule.running(cursor) and not run.stopping:
            hooks.on_epoch_begin(run, cursor.epoch)
            before = cursor.step
            for batch, planned in schedule.calls(cursor):
                count = alone_at(run, planned)
                # Keras' batch hooks: a call's batches are first..first+k-1, also where
                # the pass had fewer left; a call tfdp cuts for its own hooks, its own
                last = batch + (schedule.per_execution if count == planned else count) - 1
                run.first_step, run.call = cursor.step, (batch, last)
                hooks.on_step_begin(run, cursor.step)
                outputs = run.trainer.train_step(run.iterator, count)
                ran = 0 if outputs is None else int(outputs["steps"])
                schedule.ran(cursor, count, ran)
                if not ran:
                    break  # the pass had ended: so does the epoch, as in Keras
                run.outputs = outputs
                hooks.on_step_end(run, cursor.step - 1)
                if run.stopping:
                    break
            hooks.on_epoch_end(run, cursor.epoch)
            schedule.end_epoch(cursor)
            if cursor.step == before and schedule.final_epoch is None:
                break  # the data has ended for good (a generator): nothing more to train on
        hooks.on_train_end(run)
    finally:
        hooks.close(run)


def alone_at(run: Run, count: int) -> int:
    """`count` steps, or fewer so that a step tfdp's hooks act after (a logged step, a
    checkpoint, an evaluation) ends its call."""
    first = run.cursor.step
    for step in range(first, first + count):
        if run.plan.acts_after(step) or run.plan.logs(step + 1):
            return step - first + 1
    return count
