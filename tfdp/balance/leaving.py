"""Leaving out a device that only slows the step, and taking it back (`powers="auto"`).

A device's rows save the others the time to compute them, but taking part costs the
step too: the waiting for the slowest device, the all-reduce over it, the cores or the
host it shares with the others. A device 20x slower than the others saves them 5% of the
batch and can cost more than that. So once auto powers have settled under load, the step
is timed on the host's clock, the settled split against the split that gives the
slowest device's rows to the others, in interleaved pairs (`leave_out`); where the step
without the device is faster beyond the margin and beyond chance (`faster_without`), the
device gets no rows: it idles, and keeps its variables in sync (it takes part in the
update with nothing to add). Then the next slowest, while two devices have rows.

A device left out is remembered (`LeftOut`): its examples per second, and what its
taking part cost the step beyond what the speeds predict (the step measured with it, less
the step its speed and the others' predict). While training, the
rebalancing takes it back when the step it predicts with the device (the others as they
are measured now, the device as remembered) is shorter beyond the margin than the step
measured without it (`worth_taking_back`): the others may have become slower.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence

from tfdp.balance.arithmetic import spread, whole_shares
from tfdp.devices import capped_split, short_name

MARGIN = 0.01  # a step must be 1% shorter without a device to leave it out (with it: to take it back)
PAIRS = 8  # interleaved pairs of probe steps, with and without the device
AGREEING = 6  # ... of which this many must be shorter without it (a sign test: 37 in 256 by chance)


@dataclasses.dataclass(frozen=True)
class LeftOut:
    """A device left out: its index, its examples per second when it had rows, and the
    seconds its taking part added to the step beyond what the speeds predict."""

    index: int
    rate: float
    cost: float


def without(shards: Sequence[int], index: int, max_rows=None) -> list[int] | None:
    """`shards` with device `index`'s rows given to the others in proportion to their
    shares, within the caps; None where the others' caps cannot hold the batch."""
    total = sum(shards)
    caps = list(max_rows or [total] * len(shards))
    caps[index] = 0
    if sum(caps) < total:
        return None
    weights = [0 if j == index else s for j, s in enumerate(shards)]
    return capped_split(total, weights, caps)


def faster_without(with_device: Sequence[float], without_device: Sequence[float],
                   margin: float = MARGIN, agreeing: int = AGREEING) -> bool:
    """Whether steps timed without a device are shorter than the steps with it, timed in
    interleaved pairs: by more than `margin` at the median of the pairs' ratios, and in
    at least `agreeing` of the pairs (not by chance)."""
    ratios = [b / a for a, b in zip(with_device, without_device, strict=True)]
    shorter = sum(r < 1.0 for r in ratios)
    return statistics.median(ratios) < 1.0 / (1.0 + margin) and shorter >= agreeing


def leave_out(probes, batch, log: Callable[[str], None] = print,
              pairs: int = PAIRS) -> tuple[list[dict], list[LeftOut]]:
    """Leaves out, one by one from the slowest, each device whose rows only slow the step
    (see the module's docstring), from the split as it stands.

    Args:
      probes: a trainer's probes, whose split is set.
      batch: a global batch to time the steps on.

    Returns what was compared for each device tried (left out or not), and the devices
    left out.
    """
    tried, left = [], []
    shards = list(probes.split.shards)
    seconds = [statistics.median(c) for c in zip(*(probes.together(batch) for _ in range(3)))]
    while sum(s > 0 for s in shards) > 1:
        rates = [s / t if s else 0.0 for s, t in zip(shards, seconds)]
        index = min((j for j, s in enumerate(shards) if s > 0), key=rates.__getitem__)
        other = without(shards, index, probes.split.max_rows)
        if other is None:
            break
        hosts, device = _pairs_of_steps(probes, batch, shards, other, pairs)
        with_device, without_device = hosts[0::2], hosts[1::2]
        out = faster_without(with_device, without_device)
        # what its taking part cost the step: the step with it, less the step its speed
        # predicts with the others as they ran without it
        apart = [statistics.median(c) for c in zip(*device[1::2])]
        others = sum(s / t for s, t in zip(other, apart) if s)
        predicted = sum(other) / (others + rates[index])
        cost = max(0.0, statistics.median(with_device) - statistics.median(without_device)
                   - (predicted - statistics.median(max(d) for d in device[1::2])))
        name = short_name(probes.split.devices[index])
        tried.append({
            "device": name,
            "shards": shards,
            "without": other,
            "step_seconds": round(statistics.median(with_device), 5),
            "step_seconds_without": round(statistics.median(without_device), 5),
            "left_out": out,
        })
        if not out:
            break
        log(
            f"auto powers: {name} left out (no rows; it idles, its variables kept in sync): "
            f"a step without it takes {tried[-1]['step_seconds_without']:.4f} s, with it "
            f"{tried[-1]['step_seconds']:.4f} s; shares {shards} -> {other}"
        )
        left.append(LeftOut(index, rates[index], cost))
        shards, seconds = other, apart
        probes.split.set(shards)
    return tried, left


def _pairs_of_steps(probes, batch, shards, other, pairs):
    """Host and device seconds of `pairs` probe steps at `shards`, each followed by one
    at `other` (interleaved: a drift of the machine's speed falls on both); one untimed
    step at each first."""
    hosts, seconds = [], []
    for timed in [False] + [True] * pairs:
        for split in (shards, other):
            probes.split.set(split)
            host, device = probes.together(batch, host=True)
            if timed:
                hosts.append(host)
                seconds.append([float(t) for t in device])
    probes.split.set(shards)
    return hosts, seconds


def worth_taking_back(left: LeftOut, rates: Sequence[float], overheads: Sequence[float],
                      seconds: Sequence[float], total: int, margin: float = MARGIN) -> bool:
    """Whether device `left` would shorten the step: the devices with rows take
    overheads[j] + share / rates[j] seconds and now finish in max(`seconds`); with the
    device as remembered, all would finish together at (total + sum of rates x
    overheads) / (sum of rates), plus what its taking part cost. Shorter by `margin`."""
    together = (total + sum(r * a for r, a in zip(rates, overheads))) / (sum(rates) + left.rate)
    return together + left.cost < max(seconds) / (1.0 + margin)


def taken_back(shards: Sequence[int], left: LeftOut, rates: Sequence[float], max_rows=None):
    """The split with device `left` back, every device by its examples per second (the
    others' `rates`, in the order of their positive `shards`), within the caps."""
    speeds = spread([j for j, s in enumerate(shards) if s > 0], rates, len(shards), 0.0)
    speeds[left.index] = left.rate
    caps = list(max_rows or [sum(shards)] * len(shards))
    caps = [c if speed > 0 else 0 for c, speed in zip(caps, speeds)]
    return whole_shares(sum(shards), speeds, caps)
