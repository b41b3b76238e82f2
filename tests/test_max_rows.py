"""Devices of unequal memory: `max_rows`, the most examples a device takes in one step.

The split follows the powers up to each cap, and what a capped device cannot take goes to
the others by their powers, in every cut (the host's and the step's), every door and
every re-split; a bad cap is one line naming `max_rows` before anything runs."""

import numpy as np
import pytest

from tfdp import ConfigError, split_batch
from tfdp.devices import capped_split
from tfdp.engine.pieces import piece_sizes


@pytest.mark.parametrize(
    "rows, powers, caps, expected",
    [
        (64, [1, 3], [64, 40], [24, 40]),  # 16/48 by the powers; 8 rows over the cap go to device 0
        (64, [1, 3], [64, 64], [16, 48]),  # caps above the split: the powers' split
        (100, [1, 5, 1], [30, 20, 100], [30, 20, 50]),  # two capped: the rest to the third
        (10, [1, 5, 1], [3, 2, 100], [3, 2, 5]),
        (6, [1, 1, 1], [2, 2, 2], [2, 2, 2]),  # the batch fills every cap
        (4, [1, 5, 1], [3, 0, 100], [2, 0, 2]),  # a cap of 0: the device takes nothing
    ],
)
def test_a_capped_split_on_literal_cases(rows, powers, caps, expected):
    assert split_batch(rows, powers, max_rows=caps) == expected
    assert list(piece_sizes(rows, [float(p) for p in powers], caps).numpy()) == expected


def _caps_for(random, rows, count):
    """Caps that hold `rows` in all, some below and some above an even share."""
    caps = [int(c) for c in random.integers(1, max(2, rows), size=count)]
    while sum(caps) < rows:
        caps[int(random.integers(count))] += int(random.integers(1, rows + 1))
    return caps


def test_the_step_cuts_as_the_host_splits_within_the_caps():
    """The step's rule (`piece_sizes`) and the host's (`split_batch`) agree on full batches
    under random powers and caps, and no piece passes its cap."""
    random, compared = np.random.default_rng(7), 0
    for _ in range(150):
        count = int(random.integers(1, 5))
        powers = [float(w) for w in random.uniform(0.1, 10, size=count)]
        rows = int(random.integers(count, 300))
        caps = _caps_for(random, rows, count)
        step = [int(s) for s in piece_sizes(rows, powers, caps).numpy()]
        assert sum(step) == rows and all(s <= c for s, c in zip(step, caps)), (rows, powers, caps)
        try:
            host = split_batch(rows, powers, max_rows=caps)
        except ConfigError:  # a device would get no example: the host refuses such a split
            continue
        assert step == host, (rows, powers, caps)
        compared += 1
    assert compared > 100


def test_short_batches_are_cut_within_the_caps():
    """A short batch (fewer rows than a full one, even fewer than the replicas) is cut by
    the split of the full batch: every piece within that split, so within the caps."""
    random = np.random.default_rng(11)
    for _ in range(60):
        count = int(random.integers(2, 5))
        full = int(random.integers(count, 200))
        caps = _caps_for(random, full, count)
        shards = split_batch(full, [float(w) for w in random.uniform(0.1, 10, size=count)],
                             few=True, max_rows=caps)
        for rows in sorted({0, 1, count - 1, full // 3, full - 1, full}):
            sizes = [int(s) for s in piece_sizes(rows, shards).numpy()]
            assert sum(sizes) == rows
            assert all(s <= c for s, c in zip(sizes, caps)), (rows, shards, caps)


def test_the_rest_goes_by_the_powers_not_evenly():
    """What a capped device cannot take is shared by the others' powers: 90 rows over
    [4, 1, 2] with device 0 capped at 20 leave 70 for powers 1 and 2."""
    assert capped_split(90, [4, 1, 2], [20, 90, 90]) == [20, 23, 47]


@pytest.mark.parametrize(
    "caps, says",
    [
        ([0, 0], "hold no example"),
        ([-1, 64], "-1 is not a whole number"),
        ([1.5, 64], "1.5 is not a whole number"),
        ([64], "needs one cap per device (2), got 1"),
        ("lots", "must be one whole number"),
        ([8, 8], "holds 16 examples in a step, fewer than the batch of 64"),
    ],
)
def test_a_cap_that_cannot_hold_the_split_is_one_line_naming_max_rows(caps, says):
    with pytest.raises(ConfigError) as error:
        split_batch(64, [1, 3], max_rows=caps)
    assert error.value.field == "max_rows"
    assert says in str(error.value) and "\n" not in str(error.value)
