"""Checkpoints every `checkpoint_every` steps, at the end of the run, and on request."""

from __future__ import annotations

import time

from tfdp.run.loop import Hook


class Checkpoints(Hook):
    """Saves the state after every `checkpoint_every`-th step and after the last one.

    A step that ends an epoch is saved after the epoch's end (this hook comes after
    the hooks that act there, the Keras callbacks among them), so that a resumed run
    never runs an epoch's end twice, nor misses it.

    checkpointer: `checkpoints.Checkpointer` of the run.
    guard: the run's `FiniteGuard`: nothing non-finite is saved (None: no guard).
    """

    def __init__(self, checkpointer, guard):
        self.checkpointer = checkpointer
        self.guard = guard
        self.saved = None  # (step, path) of the latest save

    def on_train_begin(self, run):
        if run.start_step:  # restored from there: nothing new to save
            self.saved = run.start_step, self.checkpointer.path(run.start_step)

    def on_step_end(self, run, step):
        if not run.at_epoch_end():
            self.save_if_due(run)

    def on_epoch_end(self, run, epoch):
        self.save_if_due(run)

    def on_train_end(self, run):
        self.save(run)  # a run stopped early (by a callback) saves where it stopped

    def save_if_due(self, run) -> None:
        every = run.plan.config.checkpoint_every
        if run.step % every == 0 or run.finishing():
            self.save(run)

    def save(self, run) -> str:
        """Saves the state after `run.step` steps (once per step); returns its path."""
        if self.saved and self.saved[0] == run.step:
            return self.saved[1]
        start = time.perf_counter()
        if self.guard is not None:
            self.guard.check_before_saving(run)
        self.saved = run.step, self.checkpointer.save(run.step)
        run.clock.side_seconds += time.perf_counter() - start
        return self.saved[1]
