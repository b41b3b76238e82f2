"""Rebalancing during the run: the devices' step times re-split the batch."""

from __future__ import annotations

from tfdp.run.loop import Hook


class Rebalance(Hook):
    """Hands each step's device times to `rebalancing` (`balance.Rebalancing`), but the
    first step's (first-run costs) and those of an epoch's partial last batch (not the
    split's speed); records the re-splits and the last times in the result."""

    def __init__(self, rebalancing):
        self.rebalancing = rebalancing

    def on_step_end(self, run, step):
        if step > run.start_step and not run.plan.partial(step):
            self.rebalancing.observe(step, run.outputs["device_seconds"])

    def on_train_end(self, run):
        self.record(run)

    def close(self, run):
        self.record(run)

    def record(self, run):
        run.result.update(
            rebalances=self.rebalancing.resplits, device_seconds=self.rebalancing.seconds()
        )
