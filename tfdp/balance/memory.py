"""Caps measured (`max_rows="auto"`): the most examples a device's step holds.

On a GPU, the model's own step (forward and backward, no update: a probe) runs alone at
two piece sizes; TensorFlow's allocator reports the device's peak memory after each. The
peak grows by a fixed part and a part per example; the line through the two points,
extended to the allocator's limit less a margin, is the cap. A CPU has no cap (it holds
what the host holds). The reading is injectable (`READING`), so the arithmetic and its
use run on CPUs in tests; no GPU has run it yet.
"""

from __future__ import annotations

import math

MARGIN = 0.1  # the share of a device's memory left free (fragmentation, other kernels)
PROBE_ROWS = (8, 16)  # the two piece sizes the step is probed at


class AllocatorReading:
    """TensorFlow's allocator on a GPU: its limit and its peak since the last reset; no
    limit (None) on any other device."""

    def limit(self, device: str) -> int | None:
        if ":GPU:" not in device.upper():
            return None
        from tfdp import internals

        return internals.device_memory_limit(device)

    def reset(self, device: str) -> None:
        import tensorflow as tf

        tf.config.experimental.reset_memory_stats(device)

    def peak(self, device: str) -> int:
        import tensorflow as tf

        return int(tf.config.experimental.get_memory_info(device)["peak"])


READING = AllocatorReading()  # what `measure` reads; tests put a reading of their own here


def cap_from_peaks(limit: int, first, second, margin: float = MARGIN) -> int | None:
    """The most examples whose step's peak stays under `limit` less `margin`, from two
    (examples, peak bytes) points; None where the peak does not grow with the examples."""
    (rows_1, peak_1), (rows_2, peak_2) = first, second
    per_example = (peak_2 - peak_1) / (rows_2 - rows_1)
    if per_example <= 0:
        return None
    fixed = peak_1 - per_example * rows_1
    return max(0, math.floor((limit * (1.0 - margin) - fixed) / per_example))


def measure(probes, examples, batch_size: int, log) -> list[int] | None:
    """Each device's cap, measured by the model's own step alone on it (`probes.alone`)
    on `examples(n)`, n examples of the training data; a device without a limit (a CPU)
    is capped at the whole batch. None where no device has a limit."""
    reading, caps, said = READING, [], []
    for index, device in enumerate(probes.split.devices):
        limit = reading.limit(device)
        if limit is None:
            caps.append(None)
            continue
        points = []
        for rows in PROBE_ROWS:
            batch = examples(rows)
            probes.alone(batch, index)  # traced and run once: its kernels are set up
            reading.reset(device)
            probes.alone(batch, index)
            points.append((rows, reading.peak(device)))
        cap = cap_from_peaks(limit, *points)
        caps.append(cap)
        said.append(
            f"{device} {'no cap' if cap is None else cap} (peak {points[0][1] / 2**20:.1f} MB "
            f"at {points[0][0]} examples, {points[1][1] / 2**20:.1f} MB at {points[1][0]}, of "
            f"{limit / 2**20:.0f} MB less {MARGIN:.0%})"
        )
    if not said:
        return None
    log("max_rows auto, the model's step alone on each GPU: " + "; ".join(said))
    return [batch_size if cap is None else cap for cap in caps]
