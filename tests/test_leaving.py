"""Auto powers leave out a device that only slows the step, and take it back.

The decision is tested against the cost model (tests/cost_model.py: a step on the host's
clock lasts as long as its slowest device, plus a cost per other device with rows); the
runs through tfdp.fit force it (a device left out, or taken back) and check what the
training then does: one device's update, exactly, with the device idle.
"""

import keras
import numpy as np
import pytest
from cost_model import SimulatedDevice, simulate

import tfdp
from tfdp.balance import leaving
from tfdp.balance.leaving import LeftOut, faster_without, taken_back, without, worth_taking_back
from tfdp.engine.split import Split

BATCH = 100


@pytest.mark.parametrize(
    "shards, index, caps, expected",
    [
        ([40, 20, 4], 2, None, [43, 21, 0]),  # 64 by 40 : 20
        ([40, 20, 4], 2, [42, 64, 64], [42, 22, 0]),  # the first one's cap holds it at 42
        ([60, 4], 1, [62, 64], None),  # the first one cannot take the whole batch
        ([0, 60, 4], 2, None, [0, 64, 0]),  # a device left out before stays out
    ],
)
def test_a_devices_rows_go_to_the_others_by_their_shares(shards, index, caps, expected):
    assert without(shards, index, caps) == expected


@pytest.mark.parametrize(
    "with_device, without_device, faster",
    [
        ([1.0] * 8, [0.9] * 8, True),
        ([1.0] * 8, [0.995] * 8, False),  # within the 1% margin
        ([1.0] * 8, [0.9] * 5 + [1.1] * 3, False),  # 5 of 8 pairs: chance
        ([1.0] * 8, [0.9] * 6 + [1.2] * 2, True),  # 6 of 8
    ],
)
def test_a_step_without_the_device_must_be_faster_beyond_the_margin_and_chance(
    with_device, without_device, faster
):
    assert faster_without(with_device, without_device) is faster


def test_a_device_is_taken_back_where_the_step_it_predicts_is_shorter():
    # The others: 1000 images/s, no overhead, finishing 100 examples in 0.1 s. The device
    # left out computed 50 images/s and cost the step 0.02 s beyond: with it, 100 / 1050 +
    # 0.02 = 0.115 s, longer. Once the others slow to 100 images/s (1 s): 100 / 150 + 0.02.
    left = LeftOut(index=1, rate=50.0, cost=0.02)
    assert not worth_taking_back(left, [1000.0], [0.0], [0.1], BATCH)
    assert worth_taking_back(left, [100.0], [0.0], [1.0], BATCH)
    assert taken_back([100, 0], left, [100.0]) == [67, 33]


def _host_seconds(run, step, link):
    """A step of the simulated run on the host's clock."""
    others = sum(s > 0 for s in run.shards[step]) - 1
    return run.step_seconds(step) + link * others


def test_auto_leaves_out_a_device_20x_slower_whose_taking_part_costs_more_than_it_saves():
    """Device 1 computes 50 images/s beside 1000: 5% of the batch, while each step with it
    waits 20 ms more. Without it a step is 0.1 s; with it about 0.115 s."""
    link = 0.02
    run = simulate([SimulatedDevice(1000.0), SimulatedDevice(50.0)], BATCH, steps=30,
                   powers="auto", rebalance_every=5, link=link, leave=True)
    assert run.auto_shards == [100, 0]
    assert all(shards == [100, 0] for shards in run.shards)
    kept = simulate([SimulatedDevice(1000.0), SimulatedDevice(50.0)], BATCH, steps=30,
                    powers="auto", rebalance_every=5, link=link)
    assert min(kept.auto_shards) > 0  # never leaving out: slower than the fastest device alone
    assert _host_seconds(run, 29, link) < _host_seconds(kept, 29, link) / 1.1
    assert _host_seconds(run, 29, link) == pytest.approx(0.1)


@pytest.mark.parametrize("speeds", [[1000, 1000], [1000, 250], [1000, 1000, 1000, 1000]])
def test_auto_keeps_every_device_that_helps(speeds):
    """Where every device shortens the step by more than it costs (4x slower, 20 ms of
    cost, still saves 20 of 100 ms), none is left out: the split is every device's."""
    run = simulate([SimulatedDevice(float(s)) for s in speeds], BATCH, steps=10,
                   powers="auto", link=0.002, leave=True)
    assert min(run.auto_shards) > 0
    assert run.auto_shards == pytest.approx([BATCH * s / sum(speeds) for s in speeds], abs=2)


def test_of_four_devices_the_two_that_only_slow_the_step_are_left_out():
    devices = [SimulatedDevice(1000.0), SimulatedDevice(1000.0), SimulatedDevice(30.0),
               SimulatedDevice(20.0)]
    run = simulate(devices, BATCH, steps=5, powers="auto", link=0.01, leave=True)
    assert run.auto_shards == [50, 50, 0, 0]


def test_a_device_left_out_is_taken_back_when_the_others_slow_down():
    """Device 0 slows 20x at step 30: without device 1 a step takes 2 s; with it, as it
    was measured, about 1 s. The rebalancing takes it back and balances the two."""
    link = 0.02
    slowing = SimulatedDevice(speed=lambda step: 1000.0 if step < 30 else 50.0)
    run = simulate([slowing, SimulatedDevice(50.0)], BATCH, steps=80, powers="auto",
                   rebalance_every=5, link=link, leave=True)
    assert run.auto_shards == [100, 0]
    assert all(shards == [100, 0] for shards in run.shards[:30])
    back = next(step for step in run.resplits if step >= 30)
    assert back < 50  # once the medians of the split's steps (up to 4 windows) are slow
    assert run.shards[-1] == [50, 50]
    assert _host_seconds(run, 79, link) < _host_seconds(run, 31, link) / 1.8


# --- through tfdp.fit: a device left out trains as one device would


def _model():
    """Two convolutions and max-pooling (oneDNN's pooling gradient takes no empty batch;
    a second convolution checks an empty piece's shape)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([
        keras.Input((12, 12, 1)),
        keras.layers.Conv2D(4, 3, activation="tanh"),
        keras.layers.MaxPooling2D(2),
        keras.layers.Conv2D(6, 3, activation="tanh"),
        keras.layers.Flatten(),
        keras.layers.Dense(5),
    ])
    model.compile(optimizer=keras.optimizers.SGD(0.1),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _data(rows=64 * 6):
    rng = np.random.default_rng(5)
    return rng.random((rows, 12, 12, 1), dtype=np.float32), rng.integers(0, 5, rows)


def _one_device(x, y, validation):
    model = _model()
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                        validation_data=validation)
    return model.get_weights(), history.history


def _fit(x, y, validation, **settings):
    model = _model()
    lines = []
    history = tfdp.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                       validation_data=validation, mode="weighted", devices="cpu:0,cpu:1",
                       powers="auto", log=lines.append, **settings)
    return model, history, lines


def _same(got, expected):
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduce", ["device0", "allreduce"])
def test_a_device_left_out_idles_and_the_run_is_one_devices(monkeypatch, reduce):
    """Auto leaves device 0 out (the comparison forced): every later step gives it no
    rows, it says so in one line, and the weights, losses and validation are one
    device's."""
    monkeypatch.setattr(leaving, "faster_without", lambda *a, **k: True)
    x, y = _data()
    validation = (x[:40], y[:40])
    weights, expected = _one_device(x, y, validation)
    model, history, lines = _fit(x, y, validation, reduce=reduce)
    result = history.result
    (tried,) = result["auto_powers"]["left_out"]
    assert tried["left_out"] and result["shards"] == tried["without"]
    assert sorted(result["shards"]) == [0, 64] and result["final_shards"] == result["shards"]
    out = [line for line in lines if " left out (no rows; it idles" in line]
    assert len(out) == 1 and out[0].startswith(f"auto powers: {tried['device']} left out")
    _same(model.get_weights(), weights)
    for name in ("loss", "val_loss", "val_accuracy"):
        np.testing.assert_allclose(history.history[name], expected[name], rtol=1e-5)


def test_a_device_not_faster_without_keeps_its_rows(monkeypatch):
    monkeypatch.setattr(leaving, "faster_without", lambda *a, **k: False)
    x, y = _data()
    weights, _ = _one_device(x, y, None)
    model, history, lines = _fit(x, y, None)
    (tried,) = history.result["auto_powers"]["left_out"]
    assert not tried["left_out"] and min(history.result["shards"]) > 0
    assert not [line for line in lines if "left out (no rows" in line]
    _same(model.get_weights(), weights)


def test_a_device_left_out_is_taken_back_by_the_rebalancing_and_the_run_stays_exact(monkeypatch):
    monkeypatch.setattr(leaving, "faster_without", lambda *a, **k: True)
    from tfdp.balance import rebalancing

    monkeypatch.setattr(rebalancing, "worth_taking_back", lambda *a, **k: True)
    x, y = _data()
    weights, _ = _one_device(x, y, None)
    model, history, lines = _fit(x, y, None, rebalance_every=2)
    result = history.result
    assert sorted(result["shards"]) == [0, 64]
    back = [move for move in result["rebalances"] if "taken_back" in move]
    assert len(back) == 1 and min(back[0]["new"]) > 0 and sum(back[0]["new"]) == 64
    assert [line for line in lines if " taken back, shares " in line]
    _same(model.get_weights(), weights)


def test_a_saved_split_without_rows_for_a_device_is_taken_only_where_one_may_be_left_out():
    saved = {"step": 4, "devices": ["a", "b"], "shards": [64, 0]}
    assert Split(["a", "b"], [32, 32], leaving=True).takes(saved)
    assert not Split(["a", "b"], [32, 32]).takes(saved)  # fixed powers: every device takes rows


def test_a_cap_of_0_leaves_the_device_out_and_the_run_is_one_devices():
    x, y = _data()
    weights, _ = _one_device(x, y, None)
    model = _model()
    history = tfdp.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                       mode="weighted", devices="cpu:0,cpu:1", powers=[1, 1], max_rows=[0, 64])
    assert history.result["shards"] == [0, 64]
    _same(model.get_weights(), weights)
