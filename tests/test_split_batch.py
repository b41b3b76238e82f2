import math

import pytest

from tfdp import ConfigError, split_batch
from tfdp.devices import even_split


def test_tutorial_partition():
    assert split_batch(100, [1, 5]) == [17, 83]


def test_equal_powers_where_round_loses_an_example():
    # The tutorial's int(round(100 / 3)) * 3 gives 99.
    assert split_batch(100, [1, 1, 1]) == [34, 33, 33]


BATCHES = [1, 2, 3, 7, 64, 100, 101, 1000, 1023, 1024, 4097]
POWERS = [[1], [1, 1], [1, 5], [3, 1, 1, 1], [0.3, 2.7, 1e-3, 9], [2] * 7, [1.5, 0.25]]


@pytest.mark.parametrize("batch, powers", [(b, p) for b in BATCHES for p in POWERS if b >= len(p)])
def test_exact_sum_and_within_one_of_proportional(batch, powers):
    try:
        shares = split_batch(batch, powers)
    except ConfigError as error:
        # Only a device whose exact share is under one example may be refused.
        assert "would get 0" in str(error)
        assert min(batch * p / sum(powers) for p in powers) < 1
        return
    assert sum(shares) == batch
    assert len(shares) == len(powers)
    for share, power in zip(shares, powers):
        assert abs(share - batch * power / sum(powers)) < 1
        assert share >= 1


def test_largest_remainder_goes_first():
    # Exact shares 2.5, 1.25, 1.25 of 5: the device with the largest fraction gets the spare.
    assert split_batch(5, [2, 1, 1]) == [3, 1, 1]
    assert split_batch(7, [1, 1, 1]) == [3, 2, 2]


@pytest.mark.parametrize(
    "powers, message",
    [
        ([], "got none"),
        ([1, 0], "positive finite"),
        ([1, -2], "positive finite"),
        ([1, math.nan], "positive finite"),
        ([1, math.inf], "positive finite"),
        ([1, "fast"], "not a number"),
    ],
)
def test_rejects_bad_powers(powers, message):
    with pytest.raises(ConfigError, match=message) as info:
        split_batch(100, powers)
    assert info.value.field == "powers"


def test_rejects_batch_smaller_than_devices():
    with pytest.raises(ConfigError, match="smaller than the number of devices") as info:
        split_batch(2, [1, 1, 1])
    assert info.value.field == "global_batch"


def test_rejects_a_starved_device():
    with pytest.raises(ConfigError, match="device 0 would get 0 of 10"):
        split_batch(10, [1, 100])


@pytest.mark.parametrize(
    "batch, replicas, expected",
    [
        (1024, 4, [256] * 4),
        (100, 3, [34, 34, 32]),
        (66, 4, [17, 17, 17, 15]),
        (6, 4, [2, 2, 2, 0]),
    ],
)
def test_even_split_is_tf_distribute_rule(batch, replicas, expected):
    assert even_split(batch, replicas) == expected
