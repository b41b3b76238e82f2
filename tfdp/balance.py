"""Splitting the global batch by measured device speed, and keeping it balanced.

The tutorial asks for each device's power and keeps the split fixed. Here:

  * auto powers: each device, alone, runs a few forward and backward passes on
    a probe shard; its power is the examples per second it managed
    (`powers_from_seconds`), and the powers give a first split. Then all
    devices run at once on their shares of a global batch, and the split
    is corrected under load (`settle_under_load`).
  * rebalancing: during training every step measures how long each device
    took for its shard; at the end of each window of K steps (shorter at the
    start of a run) the `Rebalancer` moves the shares part of the way toward
    the split under which all devices would finish together.

A device's time is modelled as proportional to its shard. Then the split that
equalises finishing times gives each device a share proportional to its rate
(examples per second at the current shares); moving only part of the way
(damping) and leaving splits alone whose times already agree within a
tolerance keep measurement noise from making the split oscillate. Once a
device has been measured at two splits far enough apart, its time is the
line through them instead, a fixed cost per step plus a time per example
(`affine_times`); once the noise is measured too, the line fitted to the
run's latest splits, as steep as the noise leaves possible (`fitted_times`).
A device that shares its cores with the others gets a nearly flat line
there: the examples it gives up are computed on its cores anyway.

Once the devices' step-to-step noise is measured, the target is the split
with the shortest *expected* step (`fastest_shares`), not equal mean times:
a step lasts as long as its slowest device, and when every device's time
scatters, equal means leave each device the slowest half of the time. An
example moved off a slow device saves more time than it costs a fast one,
so the fastest expected step gives slow devices a little less. Without
noise the two targets are the same split.

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
TOLERANCE = 0.05  # shares within 5% of the target (equal times: within 5%) are left alone
MIN_MOVE = 0.01  # a re-split that moves less than 1% of the batch is not worth making
MIN_SCATTER = 8  # steps needed to estimate the step-to-step noise of device times
MIN_FIT_CHANGE = 0.1  # a device's share must change by 10% to fit its time's overhead
FIT_SPLITS = 10  # splits (the current one and those before it) a device's time line is fitted to
FIT_ERROR = 0.25  # a fitted slope is used only if known within 25% of the proportional slope
FLAT_SLOPE = 0.1  # the least time per example of a fitted line, as a fraction of the proportional
PROBE_WINDOW = 4  # auto powers under load: probe steps per window ...
PROBE_WINDOWS = 3  # ... and windows (each may re-split)


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


def expected_slowest(means: Sequence[float], sds: Sequence[float], points: int = 128):
    """The expected time of the slowest of independent normal device times.

    Args:
      means, sds: each device's mean and standard deviation of time.
      points: intervals of the integration grid.

    Returns:
      (E[max_i T_i], [E[T_i; device i is the slowest] for each i]).
      The second part, divided by a device's share, is how fast the expected
      step grows per example added to that device.
    """
    sds = [max(sd, 1e-6 * mean, 1e-12) for mean, sd in zip(means, sds)]
    low = max(m - 6.0 * sd for m, sd in zip(means, sds))  # below: some device is surely later
    high = max(m + 6.0 * sd for m, sd in zip(means, sds))
    width = (high - low) / points
    expected, slowest = low, [0.0] * len(means)
    for k in range(points + 1):
        x = low + k * width
        weight = width * (1 if k in (0, points) else 4 if k % 2 else 2) / 3  # Simpson
        z = [(x - m) / sd for m, sd in zip(means, sds)]
        cdf = [0.5 * (1.0 + math.erf(v / math.sqrt(2.0))) for v in z]
        before, after = [1.0], [1.0]  # products of the cdfs before and after each device
        for c, d in zip(cdf[:-1], reversed(cdf[1:])):
            before.append(before[-1] * c)
            after.append(after[-1] * d)
        after.reverse()
        expected += weight * (1.0 - before[-1] * cdf[-1])
        for i, (v, sd) in enumerate(zip(z, sds)):
            density = math.exp(-0.5 * v * v) / (sd * math.sqrt(2.0 * math.pi))
            slowest[i] += weight * x * density * before[i] * after[i]  # others are done
    return expected, slowest


def fastest_shares(
    rates: Sequence[float],
    log_sds: Sequence[float],
    total: float,
    overheads: Sequence[float] | None = None,
) -> list[float]:
    """Shares of `total` examples with the shortest expected step.

    Device i takes overheads[i] + shares[i] / rates[i] seconds on average
    (no overheads: time proportional to the share), and scatters by
    log_sds[i] (step-to-step standard deviation of log time) around it. The
    step waits for the slowest device, so the expected step is E[max_i T_i],
    which is convex in the shares. Starting from equal mean times (the answer
    without noise), examples move from the device where they cost the
    expected step most to the one where they cost it least, while that
    shortens the step.
    """
    overheads = list(overheads or [0.0] * len(rates))
    # Equal means: overhead + share / rate = T for every device.
    finish = (total + sum(a * r for a, r in zip(overheads, rates))) / sum(rates)
    shares = [r * (finish - a) for a, r in zip(overheads, rates)]
    if min(shares) < 1.0:  # a device too slow to give any work: time as if proportional
        overheads = [0.0] * len(rates)
        shares = [total * r / sum(rates) for r in rates]
    if not any(log_sds):
        return shares

    def cost(shares):
        means = [a + b / r for a, b, r in zip(overheads, shares, rates)]
        expected, slowest = expected_slowest(means, [m * s for m, s in zip(means, log_sds)])
        # d T_i / d share_i = T_i / (rate_i * mean_i): the noise scales with the mean.
        return expected, [t / (r * m) for t, r, m in zip(slowest, rates, means)]

    expected, marginal = cost(shares)
    step = total / 32
    while step >= 0.25:  # a quarter of an example
        worst = marginal.index(max(marginal))
        best = marginal.index(min(marginal))
        move = min(step, shares[worst] - 1.0)
        if worst == best or move <= 0:
            break
        trial = list(shares)
        trial[worst] -= move
        trial[best] += move
        trial_expected, trial_marginal = cost(trial)
        if trial_expected < expected:
            shares, expected, marginal = trial, trial_expected, trial_marginal
        else:
            step /= 2
    return shares


def affine_times(before, now, min_change: float = MIN_FIT_CHANGE):
    """Each device's time per step as overhead + share / rate, from two splits.

    `before` and `now` are (shares, median seconds) of two splits in a row.
    A device whose share changed by at least `min_change` of it, and whose
    time rose with it, gets the line through its two points; a device whose
    share barely moved, or whose line would be non-physical (time falling
    with the share, or a negative overhead), gets time proportional to its
    share, from `now` alone.

    Returns (rates, overheads).
    """
    rates, overheads = [], []
    for b0, t0, b1, t1 in zip(*before, *now):
        slope = (t1 - t0) / (b1 - b0) if b1 != b0 else 0.0
        overhead = t1 - slope * b1
        if abs(b1 - b0) >= min_change * max(b0, b1) and slope > 0 and overhead >= 0:
            rates.append(1.0 / slope)
            overheads.append(overhead)
        else:
            rates.append(b1 / t1)
            overheads.append(0.0)
    return rates, overheads


def fitted_times(splits, log_variances, min_change: float = MIN_FIT_CHANGE):
    """Each device's time per step as overhead + share / rate, from several splits.

    `splits` are (shares, median seconds, steps) of the latest splits, the
    current one last. Each device's line is the least-squares fit through its
    medians, weighted by how precisely each is known: a median of k steps
    scatters by about 1.25 x sqrt(log variance / k) of itself. Older splits
    are left out, oldest first, while the medians lie off the line by more
    than that scatter explains (the device changed speed since). The slope,
    the time per example, is taken two standard errors steeper than fitted
    (an uncertain line is read as the more expensive one), and kept between
    `FLAT_SLOPE` of the proportional slope and the proportional slope (time /
    share at the current split, the steepest line with no negative overhead);
    the line passes through the current median.

    A device whose time hardly rises with its share (one that shares its
    cores with the others, and computes the examples it gives up anyway) thus
    gets a nearly flat line: giving it more examples costs little. A device
    whose shares spanned less than `min_change`, or whose slope is not known
    within `FIT_ERROR` of the proportional slope, gets the proportional model.

    Returns (rates, overheads).
    """
    *_, (shares_now, seconds_now, _) = splits
    rates, overheads = [], []
    for j, variance in enumerate(log_variances):
        points = [(shares[j], seconds[j], steps) for shares, seconds, steps in splits]
        proportional = seconds_now[j] / shares_now[j]
        slope = proportional
        line = _line(points, variance)
        while line and line[2] and len(points) > 2:  # off the line: drop the oldest split
            points = points[1:]
            line = _line(points, variance)
        if line and max(p[0] for p in points) >= (1.0 + min_change) * min(p[0] for p in points):
            fitted, error, _ = line
            if error <= FIT_ERROR * proportional:
                slope = min(proportional, max(FLAT_SLOPE * proportional, fitted + 2 * error))
        rates.append(1.0 / slope)
        overheads.append(seconds_now[j] - slope * shares_now[j])
    return rates, overheads


def _line(points, variance: float):
    """Weighted least squares through (share, median seconds, steps) points.

    Returns (slope, its standard error, whether the points lie off the line
    by more than 3 standard deviations of their chi-square), or None when
    all shares are the same.
    """
    weights = [steps / t**2 for _, t, steps in points]  # 1 / relative variance of a median
    total = sum(weights)
    mean_n = sum(w * n for w, (n, _, _) in zip(weights, points)) / total
    mean_t = sum(w * t for w, (_, t, _) in zip(weights, points)) / total
    spread = sum(w * (n - mean_n) ** 2 for w, (n, _, _) in zip(weights, points))
    if spread <= 0:
        return None
    slope = sum(w * (n - mean_n) * (t - mean_t) for w, (n, t, _) in zip(weights, points)) / spread
    scale = 1.25**2 * variance  # a median's variance, times its weight
    misfit = sum(
        w * (t - mean_t - slope * (n - mean_n)) ** 2 for w, (n, t, _) in zip(weights, points)
    )
    free = len(points) - 2
    off = free > 0 and misfit > scale * (free + 3.0 * math.sqrt(2.0 * free)) + 1e-12 * total
    return slope, math.sqrt(scale / spread), off


def departures(shards: Sequence[int], target: Sequence[float]) -> list[float]:
    """How far each device's share is from its target: log(target / share)."""
    return [math.log(t / s) for s, t in zip(shards, target)]


@dataclasses.dataclass(frozen=True)
class Rebalancer:
    """Proposes new shares of a fixed global batch from measured device times."""

    global_batch: int
    damping: float = DAMPING
    tolerance: float = TOLERANCE
    min_move: float = MIN_MOVE

    def target(
        self,
        shards: Sequence[int],
        seconds: Sequence[float],
        log_variances: Sequence[float] | None = None,
        earlier: Sequence[tuple[Sequence[int], Sequence[float], int]] = (),
        steps: int = 1,
    ) -> list[float]:
        """The split to aim for, given each device's seconds per step at `shards`:
        equal finishing times, or with the devices' noise known
        (`log_variances`), the shortest expected step (`fastest_shares`), under
        the devices' `times`.
        """
        return self.aim(*self.times(shards, seconds, log_variances, earlier, steps), log_variances)

    def aim(self, rates, overheads, log_variances=None) -> list[float]:
        """`target`, given the devices' `times`."""
        log_sds = [math.sqrt(v) for v in log_variances] if log_variances else [0.0] * len(rates)
        return fastest_shares(rates, log_sds, self.global_batch, overheads)

    @staticmethod
    def times(shards, seconds, log_variances=None, earlier=(), steps: int = 1):
        """Each device's time per step as (rates, overheads): overhead + share / rate.

        Proportional to its share (no overhead) or, given `earlier` splits'
        (shares, seconds, steps), the current one measured over `steps`
        steps, a line: through the last earlier split where that line is well
        determined (`affine_times`), or, once the noise is known, fitted to
        all of them (`fitted_times`).
        """
        if not earlier:
            return [s / t for s, t in zip(shards, seconds, strict=True)], [0.0] * len(shards)
        if log_variances is None:
            return affine_times(earlier[-1][:2], (shards, seconds))
        return fitted_times([*earlier, (shards, seconds, steps)], log_variances)

    def propose(
        self,
        shards: Sequence[int],
        seconds: Sequence[float],
        first: bool = False,
        log_variances: Sequence[float] | None = None,
    ) -> list[int]:
        """New shares, given each device's compute seconds per step at `shards`.

        With `first`, the move goes all the way: the first re-split of a run,
        whose starting split was a guess, has no earlier measurement to weigh
        against (`Rebalancing` also goes all the way after a move fell short).

        Returns `shards` unchanged when they are within the tolerance of the
        target (for equal finishing times: the times agree within it), or
        when no share would move by `min_move` of the batch.
        """
        return self.move_toward(shards, self.target(shards, seconds, log_variances), first)

    def move_toward(
        self, shards: Sequence[int], target: Sequence[float], first: bool = False
    ) -> list[int]:
        """`propose`, with the target given."""
        away = departures(shards, target)
        if max(away) - min(away) <= math.log(1.0 + self.tolerance):
            return list(shards)
        damping = 1.0 if first else self.damping
        moved = [s + damping * (t - s) for s, t in zip(shards, target)]
        proposed = whole_shares(self.global_batch, moved)
        largest_move = max(abs(p - s) for p, s in zip(proposed, shards))
        if largest_move < self.min_move * self.global_batch:
            return list(shards)
        return proposed


def seconds_alone(trainer, batch, index: int, repeats: int = 3) -> float:
    """Median seconds of device `index` for forward and backward on `batch`, alone.

    One untimed run first: tracing and first-run costs are not the device's speed.
    """
    trainer.seconds_alone(batch, index)
    return statistics.median(trainer.seconds_alone(batch, index) for _ in range(repeats))


def _examples(batch) -> int:
    import tensorflow as tf

    return int(tf.nest.flatten(batch)[0].shape[0])


def calibrate_slowdown(trainer, batch, factors: Sequence[float]) -> list[float]:
    """Sets the simulated slowdown: device i alone becomes `factors[i]` times slower.

    Returns the seconds of sleep per example each device gets.
    """
    delays = [
        0.0 if factor == 1 else (factor - 1) * seconds_alone(trainer, batch, i) / _examples(batch)
        for i, factor in enumerate(factors)
    ]
    trainer.set_delays(delays)
    return delays


def measure_powers(trainer, batch) -> list[float]:
    """Auto powers: each device's examples per second on `batch`, alone."""
    return powers_from_seconds(
        _examples(batch), [seconds_alone(trainer, batch, i) for i in range(len(trainer.devices))]
    )


def settle_under_load(
    trainer,
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
    trainer.seconds_together(batch)
    rebalancing = Rebalancing(trainer, window, log, first_window=window, unit="probe step")
    for step in range(window * windows):
        rebalancing.observe(step, trainer.seconds_together(batch))
    return rebalancing


def beyond_noise(
    away: Sequence[float],
    log_variances: Sequence[float] | None,
    steps: int,
    tolerance: float = TOLERANCE,
) -> bool:
    """Whether shares measured over `steps` steps are off their target by more
    than chance.

    `away` is each device's `departures` (log of target over share). With
    equal finishing times as the target, the spread of these is the log of
    the slowest device's median time over the fastest's. It must exceed the
    tolerance and, when the devices' step-to-step variances of log time are
    known, 3 standard errors of the difference of those two devices' medians
    (a median's standard error is about 1.25 times a mean's). On a balanced
    split, noise alone makes the medians differ; a real imbalance stands out
    of the noise.
    """
    most, least = away.index(max(away)), away.index(min(away))
    gap = away[most] - away[least]
    threshold = math.log(1.0 + tolerance)
    if log_variances is not None:
        variance = log_variances[most] + log_variances[least]
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
        trainer,
        every: int,
        log: Callable[[str], None] = print,
        first_window: int = 1,
        unit: str = "iteration",
    ):
        self.trainer = trainer
        self.every = every
        self.log = log
        self.unit = unit  # what the log calls a step
        self.rebalancer = Rebalancer(trainer.global_batch_size)
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
        variances = self.log_variances()
        old = list(self.trainer.shards)
        rates, overheads = self.rebalancer.times(
            old, seconds, variances, self.earlier_splits, len(self.split_steps)
        )
        target = self.rebalancer.aim(rates, overheads, variances)
        fell_short = self.last_move is not None and all(
            _sign(t - s) == m for s, t, m in zip(old, target, self.last_move) if m
        )
        all_the_way = fell_short or not (self.resplits or self.measured)
        new = self.rebalancer.move_toward(old, target, first=all_the_way)
        significant = beyond_noise(
            departures(old, target), variances, len(self.split_steps), self.rebalancer.tolerance
        )
        if new == old or not significant:
            self.last_move = None  # the split held: a later move starts afresh
            return
        self.trainer.set_shards(new)
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
                "target": [round(t, 1) for t in target],
                # the model the target came from: overhead + share x time per example
                "ms_per_example": [round(1000.0 / r, 4) for r in rates],
                "overhead_seconds": [round(a, 4) for a in overheads],
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
            f"(device seconds per step {', '.join(f'{t:.3f}' for t in seconds)}, "
            f"imbalance {imbalance(seconds):.0%}; aiming at {aim}"
            f"{', all the way' if all_the_way else ''})"
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
        return [statistics.median(column) for column in zip(*_read(self.window))]


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _read(steps) -> list[list[float]]:
    """Device times per step as floats (reading tensors waits for their steps)."""
    return [[float(t) for t in step] for step in steps]


# A deterministic cost model of devices, for testing the algorithms without TensorFlow.


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
        trainer = _SimulatedTrainer(global_batch, split_batch(global_batch, auto_powers), together)
        probe = settle_under_load(trainer, None, log=lambda line: None)
        auto_shards = list(trainer.shards)
    else:
        shards = split_batch(global_batch, powers or [1.0] * n)
        trainer = _SimulatedTrainer(global_batch, shards, together)

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


@dataclasses.dataclass
class _SimulatedTrainer:
    """What the balancing needs of a trainer: the global batch, settable shares and
    device times under load, here from the cost model (`together(shards)`)."""

    global_batch_size: int
    shards: list[int]
    together: Callable[[list[int]], list[float]]

    def set_shards(self, shards) -> None:
        self.shards = list(shards)

    def seconds_together(self, batch) -> list[float]:
        return self.together(self.shards)
