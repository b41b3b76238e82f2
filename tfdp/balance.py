"""Splitting the global batch by measured device speed, and keeping it balanced.

The tutorial asks for each device's power and keeps the split fixed. Here:

  * auto powers: each device, alone, runs a few forward and backward passes on
    a probe shard; its power is the examples per second it managed
    (`powers_from_seconds`). The partition follows from `split_batch`.
  * rebalancing: during training every step measures how long each device
    took for its shard; at the end of each window of K steps (shorter at the
    start of a run) the `Rebalancer` moves the shares part of the way toward
    the split under which all devices would finish together.

A device's time is modelled as proportional to its shard. Then the split that
equalises finishing times gives each device a share proportional to its rate
(examples per second at the current shares); moving only part of the way
(damping) and leaving splits alone whose times already agree within a
tolerance keep measurement noise from making the split oscillate.

Pure Python (trainers are used through their methods, tensors read with
float()): the training loop, tfdp-bench and the cost model below
(`simulate`, used by the unit tests) run the same code.
"""

from __future__ import annotations

import dataclasses
import math
import random
import statistics
from collections.abc import Callable, Sequence

from tfdp.devices import split_batch

DAMPING = 0.7  # move 70% of the way to the balanced split per re-split
TOLERANCE = 0.05  # finishing times within 5% of each other count as balanced
MIN_MOVE = 0.01  # a re-split that moves less than 1% of the batch is not worth making
MIN_SCATTER = 8  # steps needed to estimate the step-to-step noise of device times


def powers_from_seconds(examples: int, seconds: Sequence[float]) -> list[float]:
    """Each device's examples per second, from its time for a probe of `examples`."""
    return [examples / t for t in seconds]


def imbalance(seconds: Sequence[float]) -> float:
    """How much later the slowest device finishes than the fastest: max/min - 1."""
    return max(seconds) / min(seconds) - 1.0


def whole_shares(global_batch: int, fractions: Sequence[float]) -> list[int]:
    """`split_batch`, but every device keeps at least one example."""
    n = len(fractions)
    if all(global_batch * f / sum(fractions) >= 1 for f in fractions):
        return split_batch(global_batch, fractions)
    shares = [1] * n  # one each, then the rest in proportion (largest remainder)
    rest = global_batch - n
    if rest:
        for i, extra in enumerate(_largest_remainder(rest, fractions)):
            shares[i] += extra
    return shares


def _largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    exact = [total * w / sum(weights) for w in weights]
    shares = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


@dataclasses.dataclass(frozen=True)
class Rebalancer:
    """Proposes new shares of a fixed global batch from measured device times."""

    global_batch: int
    damping: float = DAMPING
    tolerance: float = TOLERANCE
    min_move: float = MIN_MOVE

    def propose(
        self, shards: Sequence[int], seconds: Sequence[float], first: bool = False
    ) -> list[int]:
        """New shares, given each device's compute seconds per step at `shards`.

        The `first` re-split of a run goes all the way: its starting split was
        a guess, and there is no earlier measurement to weigh against.

        Returns `shards` unchanged when the times already agree within the
        tolerance, or when no share would move by `min_move` of the batch.
        """
        if imbalance(seconds) <= self.tolerance:
            return list(shards)
        rates = [s / t for s, t in zip(shards, seconds, strict=True)]
        balanced = [r / sum(rates) for r in rates]
        current = [s / self.global_batch for s in shards]
        damping = 1.0 if first else self.damping
        moved = [c + damping * (b - c) for c, b in zip(current, balanced)]
        proposed = whole_shares(self.global_batch, moved)
        largest_move = max(abs(p - s) for p, s in zip(proposed, shards))
        if largest_move < self.min_move * self.global_batch:
            return list(shards)
        return proposed


def seconds_alone(trainer, x, y, index: int, repeats: int = 3) -> float:
    """Median seconds of device `index` for forward and backward on (x, y), alone.

    One untimed run first: tracing and first-run costs are not the device's speed.
    """
    trainer.seconds_alone(x, y, index)
    return statistics.median(trainer.seconds_alone(x, y, index) for _ in range(repeats))


def calibrate_slowdown(trainer, x, y, factors: Sequence[float]) -> list[float]:
    """Sets the simulated slowdown: device i alone becomes `factors[i]` times slower.

    Returns the seconds of sleep per example each device gets.
    """
    delays = [
        0.0 if factor == 1 else (factor - 1) * seconds_alone(trainer, x, y, i) / len(x)
        for i, factor in enumerate(factors)
    ]
    trainer.set_delays(delays)
    return delays


def measure_powers(trainer, x, y) -> list[float]:
    """Auto powers: each device's examples per second on (x, y), alone."""
    return powers_from_seconds(
        len(x), [seconds_alone(trainer, x, y, i) for i in range(len(trainer.devices))]
    )


def beyond_noise(
    seconds: Sequence[float],
    log_variances: Sequence[float] | None,
    steps: int,
    tolerance: float = TOLERANCE,
) -> bool:
    """Whether the slowest and fastest devices' median times over a window of
    `steps` steps differ by more than the tolerance and, when the devices'
    step-to-step variances of log time are known, by more than 3 standard
    errors of that difference (a median's standard error is about 1.25 times
    a mean's).

    On a balanced split, noise alone makes the medians differ; a real
    imbalance stands out of the noise.
    """
    slowest, fastest = seconds.index(max(seconds)), seconds.index(min(seconds))
    gap = math.log(seconds[slowest] / seconds[fastest])
    threshold = math.log(1.0 + tolerance)
    if log_variances is not None:
        variance = log_variances[slowest] + log_variances[fastest]
        threshold = max(threshold, 3.0 * 1.25 * math.sqrt(variance / steps))
    return gap > threshold


def window_scatter(window: Sequence[Sequence[float]], medians: Sequence[float]):
    """Per device, the log of each step's time over the window's median time.

    In a window of an odd number of steps, one step of each device is the
    median itself; its deviation of 0 says nothing about the noise and is
    left out. Returns rows of one deviation per device.
    """
    columns = []
    for j, median in enumerate(medians):
        deviations = [math.log(step[j] / median) for step in window]
        if len(window) % 2:
            deviations.remove(min(deviations, key=abs))
        columns.append(deviations)
    return [list(row) for row in zip(*columns)]


class Rebalancing:
    """Watches each device's seconds per step and re-splits at the end of each window.

    Windows are `every` steps long, except the first ones of a run: 1, 2, 4,
    ... steps, up to `every`. The starting split is a guess (or a measurement
    of each device alone), and the first steps under load correct it most;
    later, the median over a whole window keeps step-to-step noise out, and
    a window re-splits only if its imbalance stands out of the noise measured
    so far (`beyond_noise`; the first windows, with too few steps to measure
    the noise, go by the tolerance alone).

    With `every` = 0 it only keeps the latest steps' times, for the record.
    """

    def __init__(self, trainer, every: int, log: Callable[[str], None] = print):
        self.trainer = trainer
        self.every = every
        self.log = log
        self.rebalancer = Rebalancer(trainer.global_batch_size)
        self.window = []
        self.window_length = min(1, every)  # steps in the current window
        self.last_seconds = None  # the medians of the last full window
        self.resplits = []  # one dict per re-split, for the result
        self.scatter = []  # rows of `window_scatter`, over the windows so far

    def observe(self, iteration: int, device_seconds) -> None:
        """Iteration `iteration` (counted from 0) is done and took `device_seconds`."""
        self.window.append([float(t) for t in device_seconds])
        if not self.every:
            self.window = self.window[-10:]
            return
        if len(self.window) < self.window_length:
            return
        seconds = self.last_seconds = self.seconds()
        if len(self.window) > 1:
            self.scatter += window_scatter(self.window, seconds)
        significant = beyond_noise(
            seconds, self.log_variances(), len(self.window), self.rebalancer.tolerance
        )
        self.window = []
        self.window_length = min(2 * self.window_length, self.every)
        old = list(self.trainer.shards)
        new = self.rebalancer.propose(old, seconds, first=not self.resplits)
        if new == old or not significant:
            return
        self.trainer.set_shards(new)
        self.resplits.append({"iteration": iteration, "old": old, "new": new, "seconds": seconds})
        self.log(
            f"rebalanced after iteration {iteration}: shares {old} -> {new} "
            f"(device seconds per step {', '.join(f'{t:.3f}' for t in seconds)}, "
            f"imbalance {imbalance(seconds):.0%})"
        )

    def log_variances(self) -> list[float] | None:
        """Each device's step-to-step variance of log time, pooled over the windows so
        far; None until there are `MIN_SCATTER` steps to estimate it from.

        A robust estimate, (1.4826 x the median absolute deviation) squared: a
        window in which a device's speed changed does not inflate it for good.
        """
        if len(self.scatter) < MIN_SCATTER:
            return None
        return [
            (1.4826 * statistics.median(abs(d) for d in column)) ** 2
            for column in zip(*self.scatter)
        ]

    def seconds(self) -> list[float] | None:
        """Median seconds per step of each device over the current (else the last) window."""
        if not self.window:
            return self.last_seconds
        return [statistics.median(column) for column in zip(*self.window)]


# A deterministic cost model of devices, for testing the algorithms without TensorFlow.


@dataclasses.dataclass(frozen=True)
class SimulatedDevice:
    """A device whose step takes `overhead + shard / speed(step)` seconds."""

    speed: float | Callable[[int], float]  # examples per second, or a function of the step
    overhead: float = 0.0  # seconds per step whatever the shard (launches, copies)

    def seconds(self, shard: int, step: int, jitter: float = 1.0) -> float:
        speed = self.speed(step) if callable(self.speed) else self.speed
        return (self.overhead + shard / speed) * jitter


@dataclasses.dataclass
class Simulation:
    """What `simulate` saw: shares and device times per step, and each re-split."""

    auto_powers: list[float] | None
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
) -> Simulation:
    """Runs the balancing algorithms against the cost model.

    Args:
      devices: the simulated devices.
      global_batch: examples per step.
      steps: training steps to simulate.
      powers: fixed powers, () for an even split, or "auto" to probe each device.
      rebalance_every: re-split in windows of up to K steps (`Rebalancing`); 0: never.
      probe_repeats: timed probe steps per device for "auto" (the median is used).
      noise: relative jitter of every measured time (a seeded lognormal factor).
      seed: seed of the jitter.
    """
    rng = random.Random(seed)

    def jitter():
        return math.exp(rng.gauss(0.0, noise)) if noise else 1.0

    n = len(devices)
    auto_powers = None
    if powers == "auto":
        probe = max(1, global_batch // n)
        seconds = [
            statistics.median(d.seconds(probe, 0, jitter()) for _ in range(probe_repeats))
            for d in devices
        ]
        auto_powers = powers_from_seconds(probe, seconds)
        shards = split_batch(global_batch, auto_powers)
    else:
        shards = split_batch(global_batch, powers or [1.0] * n)

    trainer = _SimulatedTrainer(global_batch, shards)
    rebalancing = Rebalancing(trainer, rebalance_every, log=lambda line: None)
    history = Simulation(auto_powers, [], [], [])
    for step in range(steps):
        shards = list(trainer.shards)
        seconds = [d.seconds(s, step, jitter()) for d, s in zip(devices, shards)]
        history.shards.append(shards)
        history.seconds.append(seconds)
        rebalancing.observe(step, seconds)
        if trainer.shards != shards:
            history.resplits.append(step)
    return history


@dataclasses.dataclass
class _SimulatedTrainer:
    """What `Rebalancing` needs of a trainer: the global batch and settable shares."""

    global_batch_size: int
    shards: list[int]

    def set_shards(self, shards) -> None:
        self.shards = list(shards)
