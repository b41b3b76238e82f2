"""The arithmetic of a split: shares from speeds, device time lines, the target split.

No state and no TensorFlow: every function maps measured numbers to numbers
(see the package's docstring for the model).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from tfdp.devices import capped_split

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


def whole_shares(global_batch: int, fractions: Sequence[float], max_rows=None) -> list[int]:
    """`split_batch` within the caps (`max_rows`, None: none), but every device that may
    take an example (a cap above 0) keeps at least one."""
    caps = max_rows or [global_batch] * len(fractions)
    taking = [1 if cap > 0 else 0 for cap in caps]
    if all(global_batch * f / sum(fractions) >= 1 for f, t in zip(fractions, taking) if t):
        shares = capped_split(global_batch, fractions, max_rows)
        if all(s >= t for s, t in zip(shares, taking)):
            return shares
    # one each, then the rest in proportion (largest remainder), within what the caps leave
    rest = capped_split(global_batch - sum(taking), fractions,
                        None if max_rows is None else [c - t for c, t in zip(caps, taking)])
    return [t + r for t, r in zip(taking, rest)]


def capped_target(total: float, target: Sequence[float], max_rows=None) -> list[float]:
    """A target split within the caps: a device aimed past its cap is aimed at it, and
    what it leaves goes to the others in proportion to their targets."""
    target = list(target)
    if max_rows is None:
        return target
    capped = [False] * len(target)
    for _ in range(len(target)):
        over = [not c and t > cap for t, cap, c in zip(target, max_rows, capped)]
        if not any(over):
            break
        capped = [c or o for c, o in zip(capped, over)]
        held = sum(cap for cap, c in zip(max_rows, capped) if c)
        free = sum(t for t, c in zip(target, capped) if not c)
        scale = (total - held) / free if free > 0 else 0.0
        target = [float(cap) if c else t * scale for t, cap, c in zip(target, max_rows, capped)]
    return target


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
    max_rows: tuple[int, ...] | None = None  # the caps every split stays within
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
        target = fastest_shares(rates, log_sds, self.global_batch, overheads)
        return capped_target(self.global_batch, target, self.max_rows)

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
        proposed = whole_shares(self.global_batch, moved, self.max_rows)
        largest_move = max(abs(p - s) for p, s in zip(proposed, shards))
        if largest_move < self.min_move * self.global_batch:
            return list(shards)
        return proposed


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
        # (a device left out, without rows, has no time to scatter)
        deviations = [math.log(step[j] / median) if median > 0 < step[j] else 0.0 for step in window]
        if len(window) % 2:
            deviations.remove(min(deviations, key=abs))
        columns.append(deviations)
    return [list(row) for row in zip(*columns)]


def pick_of(indices, values) -> list:
    """The `values` of the devices at `indices` (those with rows, where a device is left out)."""
    return [values[j] for j in indices]


def spread(indices, values, length, fill=0) -> list:
    """`values` of the devices at `indices` over all `length` devices, `fill` for the others."""
    spread = [fill] * length
    for j, value in zip(indices, values):
        spread[j] = value
    return spread


def _sign(x: float) -> int:
    return (x > 0) - (x < 0)


def _read(steps) -> list[list[float]]:
    """Device times per step as floats (reading tensors waits for their steps)."""
    return [[float(t) for t in step] for step in steps]
