"""Auto powers and rebalancing against the cost model (pure Python, no TensorFlow)."""

import math
import random
import statistics

import pytest
from cost_model import SimulatedDevice, simulate

from tfdp.balance import (
    Rebalancer,
    Rebalancing,
    affine_times,
    beyond_noise,
    calibrate_slowdown,
    expected_slowest,
    fastest_shares,
    fitted_times,
    imbalance,
    powers_from_seconds,
    whole_shares,
)
from tfdp.engine.split import Split

BATCH = 1024
SPEEDS = {"one slow of two": [1, 4], "one fast of four": [1, 1, 1, 8], "even": [3, 3]}


def devices(speeds, overhead_share=0.03):
    """Devices of the given relative speeds (examples/s x 1000), each with a fixed
    overhead worth `overhead_share` of its time for an even shard."""
    even = BATCH / len(speeds)
    return [
        SimulatedDevice(speed=1000.0 * s, overhead=overhead_share * even / (1000.0 * s))
        for s in speeds
    ]


def relative(values):
    return [v / sum(values) for v in values]


@pytest.mark.parametrize("speeds", SPEEDS.values(), ids=SPEEDS.keys())
@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_auto_powers_land_within_10_percent_of_the_true_ratio(speeds, noise):
    run = simulate(devices(speeds), BATCH, steps=1, powers="auto", noise=noise, seed=1)
    for got, true in zip(relative(run.auto_powers), relative(speeds), strict=True):
        assert got == pytest.approx(true, rel=0.10)
    # Then all devices at once: the training starts from the split settled under load.
    assert run.shards[0] == run.auto_shards


def test_auto_powers_settle_under_load_what_devices_alone_cannot_see():
    # The fast device shares its resources: the slow device's examples cost it a
    # quarter of its own. Alone, the devices look 4:1; at once, 3:1 is balanced.
    shared = [SimulatedDevice(4000.0, shared=1 / 4000.0), SimulatedDevice(1000.0)]
    run = simulate(shared, BATCH, steps=1, powers="auto")
    alone = whole_shares(BATCH, run.auto_powers)
    assert alone == [819, 205]

    def under_load(shards):
        return [d.seconds(s, 0, others=BATCH - s) for d, s in zip(shared, shards)]

    assert imbalance(under_load(alone)) > 0.2
    assert run.shards[0] == run.auto_shards
    assert imbalance(run.seconds[0]) <= 0.05


def finishing_spread(run, step):
    return imbalance(run.seconds[step])


@pytest.mark.parametrize("speeds", SPEEDS.values(), ids=SPEEDS.keys())
def test_rebalancing_from_an_even_split_converges_without_oscillating(speeds):
    every = 5
    run = simulate(devices(speeds), BATCH, steps=200, rebalance_every=every)
    # Within a few re-splits the devices finish within 10% of each other ...
    assert len(run.resplits) <= 4
    settled = (run.resplits[-1] + 1) if run.resplits else 0
    assert settled <= 4 * every
    for step in range(settled, 200):
        assert finishing_spread(run, step) <= 0.10
    # ... and every device's share moved one way only: no overshoot, no oscillation.
    for device in range(len(speeds)):
        shares = [run.shards[step][device] for step in range(200)]
        moves = [b - a for a, b in zip(shares, shares[1:]) if b != a]
        assert all(m > 0 for m in moves) or all(m < 0 for m in moves)


def test_a_far_off_start_is_corrected_after_one_step():
    run = simulate(devices([1, 4]), BATCH, steps=50, rebalance_every=5)
    assert run.resplits[0] == 0
    assert all(finishing_spread(run, step) <= 0.10 for step in range(1, 50))


class StubTrainer:
    def __init__(self):
        self.split = Split(["cpu:0", "cpu:1"], [512, 512])

    @property
    def shards(self):
        return self.split.shards


def test_windows_grow_from_one_step_to_every():
    trainer = StubTrainer()
    rebalancing = Rebalancing(trainer, every=5, log=lambda line: None)
    for iteration in range(21):
        # The device with more examples is 4x slower: every window re-splits.
        more = trainer.shards.index(max(trainer.shards))
        rebalancing.observe(iteration, [4.0 if device == more else 1.0 for device in (0, 1)])
    assert [r["iteration"] for r in rebalancing.resplits] == [0, 1, 3, 7, 12, 17]


def test_a_move_that_fell_short_is_followed_all_the_way():
    # Device 0 shares its cores with device 1, whose examples cost it a third of
    # a millisecond each. At an even start device 0 looks slow, and its time
    # even falls as its share grows, so every move by the proportional model
    # leaves device 1 too many examples.
    def seconds(shards):
        fast, slow = shards
        return [fast / 6200 + slow / 3000, 0.043 + slow / 1064]

    equal = next(
        s for s in range(1, 512) if seconds([BATCH - s, s])[1] >= seconds([BATCH - s, s])[0]
    )
    trainer = StubTrainer()
    rebalancing = Rebalancing(trainer, every=5, log=lambda line: None)
    for iteration in range(8):
        rebalancing.observe(iteration, seconds(trainer.shards))
    slow_shares = [512] + [r["new"][1] for r in rebalancing.resplits]
    assert slow_shares[1] == pytest.approx(333, abs=2)  # the first move, 70 examples short
    # Each window after a move finds device 1 still late, and goes all the way:
    # windows of 1, 1, 2 and 4 steps, and within 6% of equal times after 8 steps
    # (damped moves would still be 35% above it).
    assert [r["iteration"] for r in rebalancing.resplits] == [0, 1, 3, 7]
    assert all(r["all_the_way"] for r in rebalancing.resplits)
    # Each re-split records the model it aimed by: the first, one split seen,
    # is proportional; the second has device 1's line through two splits.
    first, second = rebalancing.resplits[:2]
    assert first["overhead_seconds"] == [0.0, 0.0]
    # Step 0 at 512 + 512, per example: device 0, 1000 x (1/6200 + 1/3000) = 0.161290 +
    # 0.333333 = 0.494624 ms; device 1, 1000 x (0.043/512 + 1/1064) = 0.083984 + 0.939850
    # = 1.023834 ms (the record keeps 4 decimals).
    assert first["ms_per_example"] == pytest.approx([0.494624, 1.023834], abs=5e-5)
    assert second["overhead_seconds"][1] == pytest.approx(0.043, abs=1e-3)
    assert second["ms_per_example"][1] == pytest.approx(1000 / 1064, abs=1e-3)
    assert slow_shares == sorted(slow_shares, reverse=True)  # no overshoot
    assert trainer.shards[1] == pytest.approx(equal, rel=0.06)


def test_rebalancing_beats_the_even_split_by_the_expected_margin():
    even = simulate(devices([1, 4]), BATCH, steps=100)
    balanced = simulate(devices([1, 4]), BATCH, steps=100, rebalance_every=5)
    # An even split waits for the slow device: 512/1000 s; balanced ~ 1024/5000 s.
    assert even.step_seconds(99) / balanced.step_seconds(99) == pytest.approx(2.5, rel=0.1)


def test_rebalancing_follows_a_device_whose_speed_changes_mid_run():
    every = 5
    slowing = SimulatedDevice(speed=lambda step: 4000.0 if step < 100 else 1000.0)
    run = simulate([SimulatedDevice(1000.0), slowing], BATCH, steps=200, rebalance_every=every)
    assert finishing_spread(run, 99) <= 0.10  # balanced for the first speeds
    assert finishing_spread(run, 100) > 1.0  # then device 1 slows down 4x
    after = [s for s in run.resplits if s >= 100]
    assert 1 <= len(after) <= 4
    for step in range(after[-1] + 1, 200):
        assert finishing_spread(run, step) <= 0.10
    assert run.shards[-1] == pytest.approx([512, 512], abs=30)


def test_noisy_times_do_not_make_the_split_wander():
    run = simulate(devices([1, 4]), BATCH, steps=400, rebalance_every=10, noise=0.05, seed=3)
    late = [s for s in run.resplits if s >= 100]
    assert len(late) <= 2  # a balanced split is left alone despite 5% jitter per step
    shares = [shards[1] for shards in run.shards[100:]]
    assert max(shares) - min(shares) <= 0.03 * BATCH


def test_noise_of_10_percent_per_step_does_not_make_the_split_wander():
    late = []
    for seed in range(8):
        run = simulate(devices([1, 4]), BATCH, steps=300, rebalance_every=5, noise=0.10, seed=seed)
        late += [s for s in run.resplits if s >= 50]
        shares = [shards[1] for shards in run.shards[50:]]
        assert max(shares) - min(shares) <= 0.06 * BATCH
    # 8 runs of 50 windows each: a window re-splits only if its imbalance stands out
    # of its own scatter (each re-split on a false alarm takes about one more to undo).
    assert len(late) <= 16


def away_from_equal_times(seconds):
    """`departures` from the split of equal finishing times, from the times alone."""
    return [-math.log(t) for t in seconds]


def test_beyond_noise():
    assert beyond_noise(away_from_equal_times([1.0, 1.2]), None, steps=1)  # the tolerance alone
    assert not beyond_noise(away_from_equal_times([1.0, 1.03]), None, steps=5)  # within 5%
    quiet, noisy = [0.01**2] * 2, [0.2**2] * 2  # log-time scatter of 1% and 20% per step
    assert beyond_noise(away_from_equal_times([1.0, 1.2]), quiet, steps=5)
    assert not beyond_noise(away_from_equal_times([1.0, 1.2]), noisy, steps=5)  # by chance
    assert beyond_noise(away_from_equal_times([1.0, 1.2]), noisy, steps=80)  # seen long enough
    assert beyond_noise(away_from_equal_times([1.0, 2.0]), noisy, steps=5)


def normal_cdf(z):
    return 0.5 * (1 + math.erf(z / math.sqrt(2)))


def test_expected_slowest_of_two_matches_the_closed_form():
    # Clark (1961): E[max] of two independent normals.
    for means, sds in [
        ([1.0, 1.0], [0.1, 0.1]),
        ([1.0, 0.8], [0.1, 0.05]),
        ([2.0, 1.0], [0.1, 0.1]),
    ]:
        theta = math.hypot(*sds)
        a = (means[0] - means[1]) / theta
        density = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
        exact = means[0] * normal_cdf(a) + means[1] * normal_cdf(-a) + theta * density
        # Each device's part, E[T_i; T_i is the later]: m_i Phi(+-a) + s_i^2 / theta phi(a).
        parts = [
            means[0] * normal_cdf(a) + sds[0] ** 2 / theta * density,
            means[1] * normal_cdf(-a) + sds[1] ** 2 / theta * density,
        ]
        expected, slowest = expected_slowest(means, sds)
        assert expected == pytest.approx(exact, rel=1e-6)
        assert slowest == pytest.approx(parts, rel=1e-6)


def test_expected_slowest_of_four_matches_sampling():
    means, sds = [1.0, 1.1, 0.9, 1.05], [0.1, 0.05, 0.2, 0.1]
    rng = random.Random(0)
    samples = [max(rng.gauss(m, s) for m, s in zip(means, sds)) for _ in range(100_000)]
    assert expected_slowest(means, sds)[0] == pytest.approx(statistics.fmean(samples), abs=0.002)


def expected_step(shares, rates, log_sds):
    """E[max] of two devices' normal times, share / rate each, by Clark's closed form."""
    means = [b / r for b, r in zip(shares, rates)]
    sds = [m * s for m, s in zip(means, log_sds)]
    theta = math.hypot(*sds)
    a = (means[0] - means[1]) / theta
    density = math.exp(-a * a / 2) / math.sqrt(2 * math.pi)
    return means[0] * normal_cdf(a) + means[1] * normal_cdf(-a) + theta * density


def test_fastest_shares():
    # Without noise: equal finishing times, i.e. shares in proportion to the rates.
    assert fastest_shares([1000, 4000], [0, 0], BATCH) == pytest.approx([204.8, 819.2])
    # Equal devices, equal noise: still an even split.
    assert fastest_shares([3000, 3000], [0.1, 0.1], BATCH) == pytest.approx([512, 512], abs=1)
    # A slow and a fast device, both scattering 10%: the slow one gets less than
    # equal finishing times would give it, and no nearby split is faster.
    rates, noise = [1000, 4000], [0.1, 0.1]
    shares = fastest_shares(rates, noise, BATCH)
    assert sum(shares) == pytest.approx(BATCH)
    assert 150 < shares[0] < 200
    best = expected_step(shares, rates, noise)
    assert best < 0.99 * expected_step([204.8, 819.2], rates, noise)
    # Every whole split, tried: the best is within one example of the one found.
    brute = min(range(1, BATCH), key=lambda s: expected_step([s, BATCH - s], rates, noise))
    assert abs(shares[0] - brute) <= 1
    assert best <= expected_step([brute, BATCH - brute], rates, noise) * (1 + 1e-6)
    # A noisier device gets less too.
    shares = fastest_shares([3000, 3000, 3000], [0.02, 0.02, 0.2], BATCH)
    assert shares[2] < min(shares[:2])


def test_rebalancing_under_noise_beats_equal_finishing_times():
    # The same seeded jitter for both runs, so they differ only in their splits.
    speeds, steps = [1, 4], 300
    equal = simulate(devices(speeds), BATCH, steps, powers=[1, 4], noise=0.10, seed=5)
    rebalanced = simulate(
        devices(speeds), BATCH, steps, powers=[1, 4], rebalance_every=5, noise=0.10, seed=5
    )

    def late_mean(run):
        return statistics.fmean(run.step_seconds(step) for step in range(100, steps))

    assert late_mean(rebalanced) < 0.98 * late_mean(equal)
    assert rebalanced.shards[-1][0] < 0.9 * equal.shards[-1][0]


def test_auto_then_rebalancing_needs_at_most_one_correction():
    run = simulate(devices([1, 1, 1, 8]), BATCH, steps=100, powers="auto", rebalance_every=5)
    assert len(run.resplits) <= 1
    assert all(finishing_spread(run, step) <= 0.10 for step in range(10, 100))


def test_rebalancing_after_auto_powers_carries_on_from_the_probe():
    # The probe under load measured the split and the noise: one noisy training
    # step does not throw the split over, as it would at the start of a run.
    resplits = []
    for seed in range(8):
        run = simulate(
            devices([1, 4]), BATCH, 100, powers="auto", rebalance_every=5, noise=0.10, seed=seed
        )
        assert 0 not in run.resplits
        resplits += run.resplits
    assert len(resplits) <= 8


def test_rebalancer_leaves_a_balanced_split_alone():
    rebalancer = Rebalancer(BATCH)
    assert rebalancer.propose([512, 512], [1.0, 1.04]) == [512, 512]
    assert rebalancer.propose([512, 512], [1.0, 4.0]) != [512, 512]


def test_rebalancer_moves_part_of_the_way():
    # Device 1 is 4x slower per example: the balanced split is 819/205.
    new = Rebalancer(BATCH, damping=0.5).propose([512, 512], [0.5, 2.0])
    assert new == [666, 358]  # halfway from 512 to 819.2
    assert Rebalancer(BATCH, damping=1.0).propose([512, 512], [0.5, 2.0]) == [819, 205]
    # A run's first re-split replaces a guess: it goes all the way.
    assert Rebalancer(BATCH, damping=0.5).propose([512, 512], [0.5, 2.0], first=True) == [
        819,
        205,
    ]


def test_powers_from_seconds():
    assert powers_from_seconds(100, [0.5, 2.0]) == [200.0, 50.0]


@pytest.mark.parametrize(
    "fractions", [[0.5, 0.5], [0.999, 0.001], [1e-9, 1.0, 1e-9], [0.2, 0.3, 0.5], [1.0]]
)
def test_whole_shares_give_everyone_at_least_one_example(fractions):
    shares = whole_shares(BATCH, fractions)
    assert sum(shares) == BATCH
    assert min(shares) >= 1
    assert len(shares) == len(fractions)


def test_two_splits_give_each_device_its_overhead():
    # Devices with a fixed cost per step: time = overhead + share / rate. The
    # proportional model, from one split, misses equal finishing times; the line
    # through two splits finds them.
    overheads, rates = [0.05, 0.01], [1000.0, 4000.0]

    def seconds(shares):
        return [a + b / r for a, b, r in zip(overheads, shares, rates)]

    first, second = [512, 512], [300, 724]
    rebalancer = Rebalancer(BATCH)
    exact = rebalancer.target(second, seconds(second), earlier=[(first, seconds(first), 1)])
    times = seconds(exact)
    assert max(times) / min(times) == pytest.approx(1.0, abs=1e-9)
    assert sum(exact) == pytest.approx(BATCH)
    one_split = rebalancer.target(second, seconds(second))
    assert imbalance(seconds(one_split)) > 0.05


def test_a_device_whose_share_barely_moved_keeps_the_proportional_model():
    rates, overheads = affine_times(([512, 512], [0.5, 0.2]), ([500, 524], [0.3, 0.21]))
    assert overheads == [0.0, 0.0]  # 2% changes: too small to fit a line through
    assert rates == [500 / 0.3, 524 / 0.21]
    rates, overheads = affine_times(([512, 512], [0.5, 0.2]), ([300, 724], [0.3, 0.19]))
    # The line through (512, 0.5 s) and (300, 0.3 s): 0.2 s / 212 examples, a rate of 1060
    # examples/s, and an overhead of 0.5 - 512 x 0.2 / 212 = 0.5 - 0.483019 = 0.016981 s.
    assert rates[0] == pytest.approx(1060)
    assert overheads[0] == pytest.approx(0.016981, abs=1e-6)
    assert overheads[1] == 0.0  # time fell as the share rose: not a line to trust


def test_fitted_times_are_the_line_through_exact_splits():
    overheads, rates = [0.05, 0.01], [1000.0, 4000.0]

    def split(shares, steps):
        return shares, [a + b / r for a, b, r in zip(overheads, shares, rates)], steps

    splits = [split([512, 512], 1), split([300, 724], 2), split([200, 824], 4)]
    got_rates, got_overheads = fitted_times(splits, [0.0, 0.0])
    assert got_rates == pytest.approx(rates)
    assert got_overheads == pytest.approx(overheads)


def test_a_device_sharing_the_cores_gets_a_nearly_flat_line():
    # Device 0 computes the examples it gives up anyway (the others run them on
    # its cores): its time stays at 0.2 s whatever its share. Device 1's time is
    # proportional to its share.
    splits = [
        ([512, 512], [0.200, 0.550], 2),
        ([790, 234], [0.206, 0.250], 4),
        ([850, 174], [0.197, 0.188], 8),
    ]
    rates, overheads = fitted_times(splits, [0.05**2, 0.05**2])
    proportional = [850 / 0.197, 174 / 0.188]
    assert rates[0] > 3 * proportional[0]  # a cheap place for more examples
    # The line passes through the current median: 0.197 s at 850 examples.
    assert overheads[0] + 850 / rates[0] == pytest.approx(0.197)
    # Device 1's own slope, 1.07 ms per example, taken two standard errors steeper, is
    # capped at the proportional one: 0.188 s / 174 examples (925.5 examples/s), no overhead.
    assert rates[1] == pytest.approx(925.532, rel=1e-5)
    assert overheads[1] == pytest.approx(0.0, abs=1e-12)
    # With the fitted lines, the fastest expected step gives device 1 fewer
    # examples than equal finishing times (175 here) would.
    shares = fastest_shares(rates, [0.05, 0.05], BATCH, overheads)
    assert shares[1] < 165


def test_an_uncertain_line_is_read_as_proportional():
    splits = [([512, 512], [0.20, 0.55], 4), ([530, 494], [0.20, 0.53], 4)]
    # Shares 4% apart: no line.
    rates, overheads = fitted_times(splits, [0.01**2, 0.01**2])
    assert rates == pytest.approx([530 / 0.20, 494 / 0.53])
    assert overheads == pytest.approx([0.0, 0.0])
    # 30% apart, but a 30% scatter per step: the slope is not known well enough.
    splits = [([512, 512], [0.20, 0.55], 4), ([690, 334], [0.20, 0.40], 4)]
    rates, overheads = fitted_times(splits, [0.3**2, 0.3**2])
    assert rates == pytest.approx([690 / 0.20, 334 / 0.40])
    # With 2% scatter, the same points give lines.
    rates, overheads = fitted_times(splits, [0.02**2, 0.02**2])
    assert rates[0] > 3 * 690 / 0.20
    assert overheads[1] > 0.05  # 0.12 s + 0.84 ms per example, with its slope's margin


def test_on_shared_cores_rebalancing_moves_work_to_the_device_that_computes_it_anyway():
    # Device 0 shares the cores with device 1: whatever the split, the cores
    # compute all 1024 examples, so device 0 takes 0.2 s. Device 1 is slower and
    # its own time grows with its share; the devices finish together at 179
    # examples on it. Every split below that is as fast on average, and the
    # further below, the less often device 1's scatter makes it the straggler.
    shared = [SimulatedDevice(5120.0, shared=1 / 5120.0), SimulatedDevice(943.0, overhead=0.01)]
    equal = next(s for s in range(1, 512) if shared[1].seconds(s, 0) >= 0.2)
    assert equal == 180
    finals, late = [], []
    for seed in range(8):
        run = simulate(shared, BATCH, 200, rebalance_every=5, noise=0.07, seed=seed)
        best = simulate(shared, BATCH, 200, powers=[BATCH - 150, 150], noise=0.07, seed=seed)
        finals.append(run.shards[-1][1])
        late.append(
            sum(run.step_seconds(s) for s in range(100, 200))
            / sum(best.step_seconds(s) for s in range(100, 200))
        )
    # Device 0's line comes out nearly flat, and the fastest expected step moves
    # work onto it: device 1 ends well below equal finishing times ...
    assert statistics.median(finals) <= 162
    assert max(finals) < 172
    # ... and the steps are within 1.5% of the split of 150.
    assert statistics.median(late) <= 1.015


@pytest.mark.parametrize("noise", [0.05, 0.10])
def test_a_device_that_changes_speed_is_fitted_to_its_new_speed(noise):
    # Device 1 slows from 4x to 1x device 0's speed at step 100. Its medians
    # from before lie off any line through those after, and are dropped: the
    # split returns to even without wandering.
    for seed in range(6):
        slowing = SimulatedDevice(speed=lambda step: 4000.0 if step < 100 else 1000.0)
        run = simulate(
            [SimulatedDevice(1000.0), slowing],
            BATCH,
            200,
            rebalance_every=5,
            noise=noise,
            seed=seed,
        )
        assert len([s for s in run.resplits if s >= 100]) <= 4
        assert run.shards[-1][1] == pytest.approx(512, rel=0.04)


def test_the_simulated_slowdown_is_calibrated_at_the_even_split_with_every_device_at_once():
    """A device made 4x slower sleeps 3x its seconds per example in a step at the even
    split, all devices at once (where they share cores), whatever split the run has."""

    class Probes:
        split = Split(["cpu:0", "cpu:1"], [160, 40])  # the run's given split
        timed_at, delays = [], None

        def together(self, batch):
            shards = self.split.shards
            self.timed_at.append(list(shards))
            return [0.002 * shards[0], 0.003 * shards[1]]  # cpu:1 is 1.5x slower

        def set_delays(self, delays):
            self.delays = delays

    probes = Probes()
    delays = calibrate_slowdown(probes, batch=None, factors=[1.0, 4.0])
    assert probes.timed_at == [[100, 100]] * 4  # a first untimed run, then 3
    assert delays == probes.delays == pytest.approx([0.0, 3 * 0.003])
    assert probes.split.shards == [160, 40]  # the run's split back
