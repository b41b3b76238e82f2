"""SIGTERM and SIGINT: the run saves the step it is in and stops (`signals.Stopped`)."""

from __future__ import annotations

from tfdp.run.loop import Hook
from tfdp.run.signals import Stopped


class StopOnSignal(Hook):
    """After each step, asks whether to stop (`exchange.Local.agree_to_stop`; in a cluster,
    every worker gets the same answer); if so, saves the step and raises `Stopped`. A step
    that ends an epoch stops after the epoch's end, saved with it.

    signals: the run's `signals.StopSignals`.
    checkpoints: the run's `Checkpoints` hook, or None without `model_dir`.
    """

    def __init__(self, signals, checkpoints=None):
        self.signals = signals
        self.checkpoints = checkpoints
        self.signum = 0

    def on_step_end(self, run, step):
        self.signum = run.trainer.exchange.agree_to_stop(self.signals.signum or 0)
        if self.signum and not run.finishing() and not run.at_epoch_end():
            self.stop(run)

    def on_epoch_end(self, run, epoch):
        if self.signum and not run.finishing():
            self.stop(run)

    def stop(self, run):
        saved = self.checkpoints.save(run) if self.checkpoints else None
        raise Stopped(self.signum, run.step, saved)
