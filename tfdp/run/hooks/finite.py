"""The finite guard: a non-finite loss or weights stop the run and are never saved."""

from __future__ import annotations

import math

from tfdp.run.loop import Hook


class NonFinite(RuntimeError):
    """The loss or the weights became NaN or infinite; the run stopped without saving
    that state."""


def first_non_finite(pending) -> int | None:
    """The first step among `(step, loss)` pairs whose loss is not finite."""
    for step, loss in pending:
        if not math.isfinite(float(loss)):
            return step
    return None


def non_finite_weights(model) -> list[str]:
    """The model's variables (weights and statistics) holding a NaN or an infinity."""
    import numpy as np

    return [v.path for v in model.weights if not np.isfinite(np.asarray(v)).all()]


class FiniteGuard(Hook):
    """Keeps each step's loss tensor and reads the pending ones at the logged steps and
    before every save: reading a loss waits for the device, so not at every step.

    checkpointer: the run's (None without `model_dir`), to name the last good checkpoint.
    """

    def __init__(self, checkpointer=None):
        self.checkpointer = checkpointer
        self.pending = []

    def on_step_end(self, run, step):
        loss = run.outputs["logs"].get("loss") if isinstance(run.outputs["logs"], dict) else None
        if loss is not None:  # the loss's running mean: non-finite from the bad step on
            self.pending.append((step, loss))
        if run.is_log_point(step):
            self.check_losses(run)

    def check_losses(self, run) -> None:
        bad = first_non_finite(self.pending)
        self.pending.clear()
        if bad is not None:
            raise NonFinite(
                f"the loss became non-finite at iteration {bad}; stopped before saving that "
                + (f"state; the last good checkpoint is {self.kept()}" if self.kept() else "state")
            )

    def check_before_saving(self, run) -> None:
        """Raises NonFinite unless the losses so far and the weights now are finite."""
        self.check_losses(run)
        bad = non_finite_weights(run.trainer.model)
        if bad:
            raise NonFinite(
                f"the weights became non-finite by iteration {run.step} ({', '.join(bad[:3])}); "
                "stopped before saving them"
                + (f"; the last good checkpoint is {self.kept()}" if self.kept() else "")
            )

    def kept(self) -> str | None:
        return self.checkpointer.manager.latest_checkpoint if self.checkpointer else None
