"""The training loop: take a batch (or `steps_per_execution` of them), step, hooks.

`Run` is what the loop and its hooks share. A `Hook` acts at the points of the
loop Keras callbacks know (train, epoch, step); `Hooks` calls a list of them in
order. tfdp's own features (logging, evaluation, checkpoints, summaries,
progress, the finite guard, stop signals, rebalancing) are hooks
(tfdp/hooks/), and so is the adapter that runs a user's Keras callbacks.
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
      plan: the validated run (`training.Plan`): config, devices, model, data, steps.
      trainer: the mode's trainer.
      iterator: what `trainer.train_step` reads the global batches from.
      log: where the run's lines go (`say` clears the progress line first).
      start_step: the step the run starts (or resumes) at.
      step: steps done so far, which is also the input position.
      outputs: the last execution's outputs, as the trainer returned them (tensors):
        `logs`, the model's logs after its last step, and `device_seconds`.
      first_step: the first step of the last execution (several steps, with the model's
        `steps_per_execution`, run in one compiled call).
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
    step: int = 0
    outputs: dict | None = None
    first_step: int = 0
    stopping: bool = False
    result: dict = dataclasses.field(default_factory=dict)
    progress: object = None
    clock: Clock = dataclasses.field(default_factory=Clock)
    metrics: dict | None = None
    input_note: str | None = None

    def say(self, line: str) -> None:
        if self.progress is not None:
            self.progress.clear()
        self.log(line)

    def epoch_of(self, step: int) -> int:
        """The epoch that step `step` (counted from 0) belongs to."""
        return self.plan.initial_epoch + step // self.plan.steps_per_epoch

    def epochs(self) -> range:
        """The epochs that have steps left to run."""
        if self.start_step >= self.plan.total_steps:
            return range(0)
        return range(self.epoch_of(self.start_step), self.epoch_of(self.plan.total_steps - 1) + 1)

    def steps(self, epoch: int) -> range:
        """The steps of `epoch` not yet run."""
        first = (epoch - self.plan.initial_epoch) * self.plan.steps_per_epoch
        end = min(first + self.plan.steps_per_epoch, self.plan.total_steps)
        return range(max(first, self.start_step), end)

    def executions(self, epoch: int):
        """The steps of `epoch` not yet run, as (first, end) ranges each run in one
        compiled call: `steps_per_execution` steps (Keras' batch hooks see one batch per
        call), fewer where the epoch ends, and a step tfdp's hooks act after (a logged
        step, a checkpoint, an evaluation) alone at its place."""
        steps = self.steps(epoch)
        every = self.plan.steps_per_execution
        first = steps.start
        for step in steps:
            alone = self.plan.acts_after(step)
            if alone and step > first:  # the steps before it, then it alone
                yield first, step
                first = step
            if alone or step + 1 - first == every or step + 1 == steps.stop:
                yield first, step + 1
                first = step + 1

    def batch_in_epoch(self, step: int) -> int:
        return step % self.plan.steps_per_epoch

    def ends_epoch(self, step: int) -> bool:
        """Whether step `step` is its epoch's last (an epoch the planned end cuts short too)."""
        return step + 1 == self.plan.total_steps or self.batch_in_epoch(step + 1) == 0


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
    """Trains from `run.start_step` to the planned end, or until a hook stops the run."""
    try:
        hooks.on_train_begin(run)
        for epoch in run.epochs():
            if run.stopping:  # e.g. a run a callback had stopped, resumed
                break
            hooks.on_epoch_begin(run, epoch)
            for first, end in run.executions(epoch):
                run.first_step = first
                hooks.on_step_begin(run, first)
                run.outputs = run.trainer.train_step(run.iterator, end - first)
                run.step = end
                hooks.on_step_end(run, end - 1)
                if run.stopping:
                    break
            hooks.on_epoch_end(run, epoch)
            if run.stopping:
                break
        hooks.on_train_end(run)
    finally:
        hooks.close(run)
