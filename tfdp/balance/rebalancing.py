"""What measures the devices and re-splits the batch during a run.

A trainer is used through its probes (`trainer.Probes`: `alone`, `together`,
`set_delays`, and the split they time, `probes.split`); the arithmetic is arithmetic.py's.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Callable, Sequence

from tfdp.balance.arithmetic import (
    FIT_SPLITS,
    MIN_SCATTER,
    PROBE_WINDOW,
    PROBE_WINDOWS,
    Rebalancer,
    _read,
    _sign,
    beyond_noise,
    departures,
    imbalance,
    pick_of,
    powers_from_seconds,
    spread,
    whole_shares,
    window_scatter,
)
from tfdp.balance.leaving import taken_back, worth_taking_back
from tfdp.devices import short_name


def seconds_alone(probes, batch, index: int, repeats: int = 3) -> float:
    """Median seconds of device `index` for forward and backward on `batch`, alone.

    One untimed run first: tracing and first-run costs are not the device's speed.
    """
    probes.alone(batch, index)
    return statistics.median(probes.alone(batch, index) for _ in range(repeats))


def _examples(batch) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(batch)[0].shape[0])


def calibrate_slowdown(probes, batch, factors: Sequence[float], repeats: int = 3) -> list[float]:
    """Sets the simulated slowdown: device i becomes `factors[i]` times slower in a step,
    timed with every device at once on its piece of an even split of `batch` (a global
    batch), as in training, where devices may share cores: a device timed alone would
    have them all, and be slowed less than `factors[i]` in training.

    Returns the seconds of sleep per example each device gets.
    """
    given = list(probes.split.shards)
    even = whole_shares(
        probes.split.global_batch_size, [1.0] * len(probes.split.devices), probes.split.max_rows
    )
    probes.split.set(even)
    try:
        probes.together(batch)  # tracing and first-run costs are not the speed
        seconds = [
            statistics.median(column)
            for column in zip(*(probes.together(batch) for _ in range(repeats)))
        ]
    finally:
        probes.split.set(given)
    delays = [
        0.0 if factor == 1 else (factor - 1) * second / shard
        for factor, second, shard in zip(factors, seconds, even)
    ]
    probes.set_delays(delays)
    return delays


def measure_powers(probes, batch) -> list[float]:
    """Auto powers: each device's examples per second on `batch`, alone."""
    return powers_from_seconds(
        _examples(batch), [seconds_alone(probes, batch, i) for i in range(len(probes.split.devices))]
    )


def settle_under_load(
    probes,
    batch,
    log: Callable[[str], None] = print,
    window: int = PROBE_WINDOW,
    windows: int = PROBE_WINDOWS,
) -> Rebalancing:
    """Auto powers, second part: all devices at once, as in training.

    Timed alone, a device may have resources to itself that it shares in
    training (cores, memory bandwidth, the host that feeds a GPU), so the
    split from `measure_powers` can be off under load. Here every device
    runs forward and backward on its shard of the global `batch` at the
    same time, without updating the weights, and `Rebalancing` re-splits
    after each of `windows` windows of `window` probe steps. One untimed run
    first, as for the devices alone.

    Returns the `Rebalancing`, whose `resplits` say what changed.
    """
    probes.together(batch)
    rebalancing = Rebalancing(probes, window, log, first_window=window, unit="probe step")
    for step in range(window * windows):
        rebalancing.observe(step, probes.together(batch))
    return rebalancing


class Rebalancing:
    """Watches each device's seconds per step and re-splits at the end of each window.

    Windows are `every` steps long, except the first ones of a run: 1, 1, 2,
    4, ... steps, up to `every`. The starting split is a guess (or a
    measurement of each device alone), and the first steps under load
    correct it most. The first re-split goes all the way to its target, and
    so does one right after a move that fell short (the window after a
    re-split finds every moved device's target on the far side of its new
    share): damping guards against overshooting, and that move did not
    overshoot.
    Later, a split is judged on the median times of all its steps so far (up
    to the last `HISTORY` windows): the longer a split stands, the finer the
    difference that can be told from noise. A window re-splits only if its
    split is off the target by more than the noise measured so far allows
    (`beyond_noise`; the first windows, with too few steps to measure the
    noise, go by the tolerance alone). With the noise measured, the target
    is the fastest expected step (`fastest_shares`).

    With `every` = 0 it only keeps the latest steps' times, for the record.
    """

    HISTORY = 4  # windows of the current split that its medians are taken over

    def __init__(
        self,
        probes,
        every: int,
        log: Callable[[str], None] = print,
        first_window: int = 1,
        unit: str = "iteration",
    ):
        self.probes = probes
        self.every = every
        self.log = log
        self.unit = unit  # what the log calls a step
        self.rebalancer = Rebalancer(
            probes.split.global_batch_size, getattr(probes.split, "max_rows", None)
        )
        self.window = []
        self.window_length = min(first_window, every)  # steps in the current window
        self.split_steps = []  # device times of the current split's latest steps
        self.earlier_splits = []  # (shares, median seconds, steps) of the splits before it
        self.last_seconds = None  # the medians of the last full window
        self.resplits = []  # one dict per re-split, for the result
        self.scatter = []  # rows of `window_scatter`, over the windows so far
        self.measured = False  # whether the starting split was measured under load
        self.windows = 0  # full windows so far
        self.last_move = None  # per device: +1, -1 or 0, how the last re-split moved its share
        self.left_out = []  # `leaving.LeftOut` of each device auto left out, until taken back

    def carry_over(self, probe: Rebalancing) -> None:
        """Starts from what `probe` (`settle_under_load`) measured: its steps at the
        current split, the splits before it and the noise. The current split is
        then no guess: the first window is as long as the probe's, and the
        first re-split is damped like any other.
        """
        self.split_steps = list(probe.split_steps)
        self.earlier_splits = list(probe.earlier_splits)
        self.scatter = list(probe.scatter)
        self.window_length = min(probe.every, self.every) if self.every else 0
        self.last_move = probe.last_move
        self.left_out = list(probe.left_out)
        self.measured = True

    def observe(self, iteration: int, device_seconds) -> None:
        """Iteration `iteration` (counted from 0) is done and took `device_seconds`.

        The times may be tensors still being computed: they are read only at
        the end of a window, so the loop does not wait for each step.
        """
        self.window.append(device_seconds)
        if not self.every:
            self.window = self.window[-10:]
            return
        if len(self.window) < self.window_length:
            return
        self.window = _read(self.window)
        self.last_seconds = self.seconds()
        if len(self.window) > 1:
            self.scatter += window_scatter(self.window, self.last_seconds)
        self.split_steps = (self.split_steps + self.window)[-self.HISTORY * self.every :]
        self.window = []
        self.windows += 1
        if self.windows > 1 or self.measured:  # after a guessed start: 1, 1, 2, 4, ...
            self.window_length = min(2 * self.window_length, self.every)

        seconds = [statistics.median(column) for column in zip(*self.split_steps)]
        old = list(self.probes.split.shards)
        # the devices with rows (a device left out has none): the split's arithmetic is theirs
        active = [j for j, s in enumerate(old) if s > 0]
        pick = functools.partial(pick_of, active)
        rebalancer, variances = self.rebalancer, self.log_variances()
        if len(active) < len(old):
            caps = rebalancer.max_rows and tuple(pick(rebalancer.max_rows))
            rebalancer, variances = dataclasses.replace(rebalancer, max_rows=caps), variances and pick(variances)
        earlier = [(pick(s), pick(t), n) for s, t, n in self.earlier_splits if min(pick(s)) > 0]
        rates, overheads = rebalancer.times(
            pick(old), pick(seconds), variances, earlier, len(self.split_steps)
        )
        if self.left_out and self._take_back(iteration, old, rates, overheads, pick(seconds)):
            return
        target = rebalancer.aim(rates, overheads, variances)
        fell_short = self.last_move is not None and all(
            _sign(t - s) == m for s, t, m in zip(pick(old), target, pick(self.last_move)) if m
        )
        all_the_way = fell_short or not (self.resplits or self.measured)
        new = spread(active, rebalancer.move_toward(pick(old), target, first=all_the_way), len(old))
        significant = beyond_noise(
            departures(pick(old), target), variances, len(self.split_steps), rebalancer.tolerance
        )
        if new == old or not significant:
            self.last_move = None  # the split held: a later move starts afresh
            return
        self.probes.split.set(new)
        self.last_move = [_sign(n - o) for o, n in zip(old, new)]
        earlier = (old, seconds, len(self.split_steps))
        self.earlier_splits = [*self.earlier_splits, earlier][-(FIT_SPLITS - 1) :]
        self.split_steps = []
        noise = [math.sqrt(v) for v in variances] if variances else None
        self.resplits.append(
            {
                "iteration": iteration,
                "old": old,
                "new": new,
                "seconds": seconds,
                "target": spread(active, [round(t, 1) for t in target], len(old)),
                # the model the target came from: overhead + share x time per example
                "ms_per_example": spread(active, [round(1000.0 / r, 4) for r in rates], len(old), None),
                "overhead_seconds": spread(active, [round(a, 4) for a in overheads], len(old), None),
                "all_the_way": all_the_way,
                "log_sd": noise,
            }
        )
        aim = (
            "equal finishing times"
            if noise is None
            else f"the fastest expected step at noise {', '.join(f'{n:.0%}' for n in noise)}"
        )
        self.log(
            f"rebalanced after {self.unit} {iteration}: shares {old} -> {new} "
            f"(device seconds per step {', '.join(f'{t:.3f}' for t in pick(seconds))}, "
            f"imbalance {imbalance(pick(seconds)):.0%}; aiming at {aim}"
            f"{', all the way' if all_the_way else ''})"
        )

    def _take_back(self, iteration, old, rates, overheads, seconds) -> bool:
        """Takes back the first device left out that would shorten the step
        (`leaving.worth_taking_back`), at the split of every device by its speed."""
        total = self.rebalancer.global_batch
        for left in self.left_out:
            if not worth_taking_back(left, rates, overheads, seconds, total):
                continue
            new = taken_back(old, left, rates, self.rebalancer.max_rows)
            self.probes.split.set(new)
            self.left_out = [other for other in self.left_out if other is not left]
            self.split_steps, self.earlier_splits, self.last_move = [], [], None
            name = short_name(self.probes.split.devices[left.index])
            self.resplits.append({"iteration": iteration, "old": old, "new": new, "taken_back": name})
            self.log(
                f"rebalanced after {self.unit} {iteration}: {name} taken back, shares {old} -> "
                f"{new} (a step without it: {max(seconds):.3f} s; with it, as it was measured, "
                f"shorter)"
            )
            return True
        return False

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
        return [statistics.median(column) for column in zip(*_read(self.window))]
