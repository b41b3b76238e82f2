"""A deterministic cost model of devices, for testing tfdp.balance without TensorFlow."""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence

from tfdp.balance import Rebalancing, settle_under_load
from tfdp.balance.arithmetic import powers_from_seconds
from tfdp.balance.leaving import leave_out
from tfdp.devices import split_batch


@dataclasses.dataclass(frozen=True)
class SimulatedDevice:
    """A device whose step takes `overhead + shard / speed(step)` seconds, plus
    `shared` seconds per example that the other devices compute at the same
    time (resources it shares with them, such as cores)."""

    speed: float | Callable[[int], float]  # examples per second, or a function of the step
    overhead: float = 0.0  # seconds per step whatever the shard (launches, copies)
    shared: float = 0.0  # seconds per example of the other devices' shards

    def seconds(self, shard: int, step: int, jitter: float = 1.0, others: int = 0) -> float:
        speed = self.speed(step) if callable(self.speed) else self.speed
        return (self.overhead + shard / speed + self.shared * others) * jitter


@dataclasses.dataclass
class Simulation:
    """What `simulate` saw: shares and device times per step, and each re-split."""

    auto_powers: list[float] | None  # measured alone
    auto_shards: list[int] | None  # after the probe under load
    shards: list[list[int]]  # per step
    seconds: list[list[float]]  # per step, per device
    resplits: list[int]  # steps after which the shares changed

    def step_seconds(self, step: int) -> float:
        """The step lasts as long as its slowest device."""
        return max(self.seconds[step])


def simulate(
    devices: Sequence[SimulatedDevice],
    global_batch: int,
    steps: int,
    powers: Sequence[float] | str = (),
    rebalance_every: int = 0,
    probe_repeats: int = 3,
    noise: float = 0.0,
    seed: int = 0,
    link: float = 0.0,
    leave: bool = False,
) -> Simulation:
    """Runs the balancing algorithms against the cost model.

    Args:
      devices: the simulated devices.
      global_batch: examples per step.
      steps: training steps to simulate.
      powers: fixed powers, () for an even split, or "auto" to probe each device
        alone, then all together (`settle_under_load`).
      rebalance_every: re-split in windows of up to K steps (`Rebalancing`); 0: never.
      probe_repeats: timed probe steps per device for "auto" (the median is used).
      noise: relative jitter of every measured time (a seeded lognormal factor).
      seed: seed of the jitter.
      link: seconds a step takes beyond its slowest device per other device with rows
        (the waiting and the all-reduce over it), on the host's clock.
      leave: with "auto", then leave out each device that only slows the step
        (`leaving.leave_out`, on the host's clock).
    """
    rng = random.Random(seed)

    def jitter():
        return math.exp(rng.gauss(0.0, noise)) if noise else 1.0

    def together(shards, step=0):
        total = sum(shards)
        return [d.seconds(s, step, jitter(), total - s) for d, s in zip(devices, shards)]

    n = len(devices)
    auto_powers = auto_shards = None
    if powers == "auto":
        probe = max(1, global_batch // n)
        seconds = [
            statistics.median(d.seconds(probe, 0, jitter()) for _ in range(probe_repeats))
            for d in devices
        ]
        auto_powers = powers_from_seconds(probe, seconds)
        trainer = _SimulatedTrainer(global_batch, split_batch(global_batch, auto_powers), together, link)
        probe = settle_under_load(trainer, None, log=lambda line: None)
        if leave:
            probe.left_out = leave_out(trainer, None, log=lambda line: None)[1]
        auto_shards = list(trainer.shards)
    else:
        shards = split_batch(global_batch, powers or [1.0] * n)
        trainer = _SimulatedTrainer(global_batch, shards, together, link)

    rebalancing = Rebalancing(trainer, rebalance_every, log=lambda line: None)
    if powers == "auto":
        rebalancing.carry_over(probe)
    history = Simulation(auto_powers, auto_shards, [], [], [])
    for step in range(steps):
        shards = list(trainer.shards)
        seconds = together(shards, step)
        history.shards.append(shards)
        history.seconds.append(seconds)
        rebalancing.observe(step, seconds)
        if trainer.shards != shards:
            history.resplits.append(step)
    return history


class _SimulatedTrainer:
    """What the balancing needs of a trainer's probes: the split (tfdp's own object) and
    device times under load, here from the cost model (`together(shards)`)."""

    def __init__(self, global_batch: int, shards: list[int], together: Callable[[list[int]], list[float]],
                 link: float = 0.0):
        from tfdp.engine.split import Split

        self.split = Split([f"device{i}" for i in range(len(shards))], shards)
        self._together = together
        self._link = link

    @property
    def shards(self) -> list[int]:
        return self.split.shards

    def together(self, batch, host=False):
        seconds = self._together(self.split.shards)
        if not host:
            return seconds
        others = sum(s > 0 for s in self.split.shards) - 1
        return max(seconds) + self._link * others, seconds
