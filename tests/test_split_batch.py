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
TINY = (0.3, 2.7, 1e-3, 9)  # device 2's exact share, b x 0.001 / 12.001, is under 1 up to b = 12001
# The cases refused, and the device each names: the first with no example after
# largest-remainder rounding (floors first, then the spares by largest fraction).
STARVED = {
    (2, (1, 5)): 0,  # exact 0.33, 1.67: floors 0, 1; the spare goes to 0.67: [0, 2]
    (2, (1.5, 0.25)): 1,  # exact 1.71, 0.29: floors 1, 0; the spare to 0.71: [2, 0]
    (3, (1.5, 0.25)): 1,  # exact 2.57, 0.43: floors 2, 0; the spare to 0.57: [3, 0]
    (7, TINY): 0,  # exact 0.17, 1.57, 0.0006, 5.25: floors 0, 1, 0, 5; the spare to 0.57
    **{(b, TINY): 2 for b in (64, 100, 101, 1000, 1023, 1024, 4097)},  # device 0 has >= 1.6
}
CASES = [(b, p) for b in BATCHES for p in POWERS if b >= len(p)]


def test_the_refused_cases_are_among_the_cases():
    assert len(CASES) == 65
    assert set(STARVED) <= {(b, tuple(p)) for b, p in CASES}
    assert len(STARVED) == 11


@pytest.mark.parametrize("batch, powers", [c for c in CASES if (c[0], tuple(c[1])) in STARVED])
def test_a_device_with_no_example_is_refused(batch, powers):
    device = STARVED[batch, tuple(powers)]
    with pytest.raises(ConfigError, match=f"^powers=.*: device {device} would get 0 of {batch} "):
        split_batch(batch, powers)


@pytest.mark.parametrize("batch, powers", [c for c in CASES if (c[0], tuple(c[1])) not in STARVED])
def test_exact_sum_and_within_one_of_proportional(batch, powers):
    shares = split_batch(batch, powers)  # none of these may raise
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
