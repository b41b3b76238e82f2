"""Stopping on SIGTERM or Ctrl-C without losing work.

Kubernetes and Slurm send SIGTERM some seconds before they kill a job; Ctrl-C
sends SIGINT. While a run trains, either one only raises a flag: the loop
finishes the step it is in, saves a checkpoint of that step (never a
half-done one) and raises `Stopped`, and the command exits with the
conventional status (128 + the signal's number). In a cluster the workers
agree first on the step to stop at (`exchange.Cluster.agree_to_stop`), so all of them
save the same step.
"""

from __future__ import annotations

import signal
import threading

from tfdp.cluster.exchange import SIGNALS


class Stopped(Exception):
    """The run stopped on a signal after saving its state (or with nothing to save)."""

    def __init__(self, signum: int, step: int, checkpoint: str | None):
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        name = signal.Signals(signum).name
        where = (
            f"saved {checkpoint}; run the same command again to resume"
            if checkpoint
            else "nothing saved (no --model_dir)"
        )
        super().__init__(f"stopped by {name} after iteration {step}; {where}")

    @property
    def exit_status(self) -> int:
        return 128 + self.signum


class StopSignals:
    """Within `with StopSignals() as stop:`, SIGTERM and SIGINT set `stop.signum`.

    Outside the main thread Python cannot install handlers; there the signals
    keep their usual effect.
    """

    def __init__(self):
        self.signum = None
        self.previous = {}

    def _handle(self, signum, frame):
        self.signum = self.signum or signum

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self.previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()
