"""Devices of unequal memory: `max_rows`, the most examples a device takes in one step.

The split follows the powers up to each cap, and what a capped device cannot take goes to
the others by their powers, in every cut (the host's and the step's), every door and
every re-split; a bad cap is one line naming `max_rows` before anything runs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
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


# ------------------------------------------------------------------ a run within the caps


def _model(normalize=False):
    keras.utils.set_random_seed(1)
    layers = [keras.Input((8,))]
    if normalize:  # batch statistics, before anything trained moves them
        layers.append(keras.layers.BatchNormalization(momentum=0.5))
    layers += [keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(3)]
    model = Recording(layers)
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def _data(rows=200):
    random = np.random.default_rng(0)
    return (random.normal(size=(rows, 8)).astype("float32"),
            random.integers(0, 3, rows).astype("int32"))


PIECES = []  # (replica, rows) of every piece a step of a `Recording` model ran on


def _record(replica, rows):
    PIECES.append((int(replica), int(rows)))
    return np.int32(0)


class Recording(keras.Sequential):
    """A Sequential model that records the rows of every piece its train_step gets."""

    def train_step(self, data):
        context = tf.distribute.get_replica_context()
        replica = 0 if context is None else context.replica_id_in_sync_group
        seen = tf.numpy_function(_record, [replica, tf.shape(data[0])[0]], tf.int32)
        with tf.control_dependencies([seen]):
            data = tf.nest.map_structure(tf.identity, data)
        return super().train_step(data)


def _one_device(x, y, batch_size, epochs=2, normalize=False):
    """Plain Keras fit on one device: the update every run below must make."""
    model = _model(normalize)
    model.fit(x, y, batch_size=batch_size, epochs=epochs, shuffle=False, verbose=0)
    return model.get_weights()


def _assert_same_weights(got, expected):
    for a, b in zip(got, expected, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def _pieces_by_replica():
    by = {}
    for replica, rows in PIECES:
        by.setdefault(replica, []).append(rows)
    return by


def test_tfdp_fit_cuts_within_the_caps_and_makes_one_devices_update():
    """Powers [1, 3] at batch 64 with caps [64, 40]: pieces [24, 40] (16 / 48 by the
    powers), the short last batch (200 = 3 x 64 + 8) within them too; exact."""
    x, y = _data()
    expected = _one_device(x, y, 64)
    model = _model()
    PIECES.clear()
    history = tfdp.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                       mode="weighted", devices="cpu:0,cpu:1", powers=[1, 3], max_rows=[64, 40])
    assert history.result["shards"] == [24, 40]
    seen = _pieces_by_replica()
    assert sorted(set(seen[0])) == [3, 24] and sorted(set(seen[1])) == [5, 40]
    _assert_same_weights(model.get_weights(), expected)


@pytest.mark.parametrize(
    "settings",
    [
        dict(mode="single", max_rows=[128]),
        dict(mode="single", max_rows=[128], chains=2),  # each micro-step in two chains
        dict(mode="mirrored", devices="cpu:0,cpu:1", mirrored_input="split", max_rows=[64, 64]),
        dict(mode="weighted", devices="cpu:0,cpu:1", powers=[1, 3], max_rows=[64, 64]),
    ],
    ids=["single", "single-chains", "mirrored", "weighted"],
)
def test_a_batch_beyond_the_caps_is_two_micro_steps_of_one_update(settings):
    """Global batch 256 over caps summing to 128: every update is two micro-steps of 128
    rows (each piece within its cap), their gradients summed: one device's update at
    batch 256. The logs count updates."""
    x, y = _data(512)
    expected = _one_device(x, y, 256)
    model = _model()
    PIECES.clear()
    history = tfdp.fit(model, x, y, batch_size=256, epochs=2, shuffle=False, verbose=0, **settings)
    caps = settings["max_rows"]
    assert sum(history.result["shards"]) == 128
    chains = settings.get("chains", 1)  # 2 epochs x 2 updates x 2 micro-steps x pieces:
    assert len(PIECES) == 2 * 2 * 2 * len(caps) * chains
    assert all(rows <= caps[replica] for replica, rows in PIECES)
    assert history.result["iterations"] == 4 and len(history.history["loss"]) == 2
    _assert_same_weights(model.get_weights(), expected)


def test_batch_normalization_in_micro_steps_moves_by_each_micro_batch():
    """In micro-steps, BatchNormalization normalizes each micro-batch by its own
    statistics (as one device training on that micro-batch), and its moving statistics
    move once per micro-step: after one update of 256 rows in two micro-steps of 128, the
    moving mean is the one of two momentum steps over the two halves' means."""
    x, y = _data(256)
    model = _model(normalize=True)
    tfdp.fit(model, x, y, batch_size=256, epochs=1, shuffle=False, verbose=0,
             mode="single", max_rows=[128])
    norm = model.layers[0]
    moving = np.zeros(8)
    for half in (x[:128], x[128:]):
        moving = 0.5 * moving + 0.5 * half.mean(axis=0)
    np.testing.assert_allclose(norm.moving_mean.numpy(), moving, rtol=1e-5, atol=1e-6)


def test_rebalancing_and_auto_powers_stay_within_the_caps():
    """Device 0 made 20x slower: the balancing would give device 1 nearly all the batch
    (far past its cap, however the timing scatters); its cap of 36 holds it there, in
    every re-split and every piece."""
    x, y = _data(64 * 12)
    model = _model()
    PIECES.clear()
    history = tfdp.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                       mode="weighted", devices="cpu:0,cpu:1", powers="auto", rebalance_every=2,
                       simulate_slowdown="cpu:0=20", max_rows=[64, 36])
    result = history.result
    measured = result["auto_powers"]
    assert result["final_shards"] == [28, 36]  # (about [3, 61] without the cap)
    assert measured["shards_alone"][1] <= 36
    moves = [*measured["probe_resplits"], *result["rebalances"]]
    assert all(move["new"][1] <= 36 for move in moves)
    assert max(rows for replica, rows in PIECES if replica == 1) == 36


def test_plain_model_fit_under_the_strategy_cuts_within_the_caps():
    """`tfdp.MirroredStrategy(powers=[1, 3], max_rows=[64, 40])` under Keras' own fit:
    pieces [24, 40]; the short last batch of 8 by the powers, [2, 6], within the caps;
    exact."""
    x, y = _data()
    expected = _one_device(x, y, 64)
    strategy = tfdp.MirroredStrategy(["cpu:0", "cpu:1"], powers=[1, 3], max_rows=[64, 40])
    with strategy.scope():
        model = _model()
    PIECES.clear()
    model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0)
    seen = _pieces_by_replica()
    assert sorted(set(seen[0])) == [2, 24] and sorted(set(seen[1])) == [6, 40]
    _assert_same_weights(model.get_weights(), expected)


def test_plain_model_fit_beyond_the_caps_names_them_and_the_batch():
    import tensorflow as tf

    x, y = _data()
    strategy = tfdp.MirroredStrategy(["cpu:0", "cpu:1"], powers=[1, 3], max_rows=[64, 40])
    fixed = tf.data.Dataset.from_tensor_slices((x, y)).batch(128, drop_remainder=True)
    with pytest.raises(ConfigError) as static:  # the batch's size is known: before any step
        strategy.experimental_distribute_dataset(fixed)
    assert static.value.field == "max_rows" and "fewer than the batch of 128" in str(static.value)
    with strategy.scope():
        model = _model()
    with pytest.raises(tf.errors.InvalidArgumentError) as running:  # known once read
        model.fit(x, y, batch_size=128, epochs=1, verbose=0)
    assert "max_rows=[64, 40]: hold 104 examples in a step" in str(running.value)
    assert "gradient_accumulation_steps" in str(running.value)


def test_the_command_runs_micro_steps_as_one_devices_update(tmp_path, capsys):
    """`tfdp --max_rows=64,64` at batch 256: two micro-steps of 64 + 64 per update, said in
    the banner; the weights of mode single at batch 256 without caps."""
    from helpers import TOY, cli_in_process, load_weights, toy_config, train

    train(toy_config(mode="single", batch_size=256, iterations=6, model_dir=str(tmp_path / "one")))
    capsys.readouterr()
    status = cli_in_process(
        *[flag for flag in TOY if not flag.startswith(("--logical_cpus", "--batch_size"))],
        "--batch_size=256", "--iterations=6", "--mode=weighted", "--devices=cpu:0,cpu:1",
        "--powers=1,3", "--max_rows=64,64", f"--model_dir={tmp_path / 'capped'}",
    )
    assert status == 0
    said = capsys.readouterr().out
    assert "global batch 256 = 2 micro-steps of at most 64 + 64 (max_rows [64, 64]) over 2" in said
    for got, expected in zip(load_weights(tmp_path / "capped"), load_weights(tmp_path / "one"),
                             strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------ caps measured


def test_a_cap_is_the_line_through_two_peaks_at_the_limit_less_the_margin():
    """1000 bytes fixed and 10 per example, a limit of 2000 less 10%: (1800 - 1000) / 10."""
    from tfdp.balance.memory import cap_from_peaks

    assert cap_from_peaks(2000, (8, 1080), (16, 1160)) == 80
    assert cap_from_peaks(2000, (8, 1080), (16, 1160), margin=0.0) == 100
    assert cap_from_peaks(2000, (8, 1500), (16, 1500)) is None  # no growth with the examples
    assert cap_from_peaks(1000, (8, 1080), (16, 1160)) == 0  # the step alone does not fit


class _Reading:
    """A device's memory as a GPU's allocator would report it, for cpu:1 only: 1000 bytes
    and 10 per example of the largest piece the model's step ran on since the reset."""

    def __init__(self, limit):
        self.limits = {"/device:CPU:1": limit}
        self.since = 0

    def limit(self, device):
        return self.limits.get(device)

    def reset(self, device):
        self.since = len(PIECES)

    def peak(self, device):  # (a probe runs one device alone: the pieces are its)
        return 1000 + 10 * max(rows for _, rows in PIECES[self.since:])


def test_measured_caps_cut_as_given_caps_and_the_run_is_exact(monkeypatch):
    """max_rows="auto" with cpu:1 reading as a GPU whose step of 40 examples fills its
    memory less the margin: cpu:1 is capped at 40, cpu:0 (no limit) at the batch; powers
    [1, 3] at batch 64 then cut [24, 40], as caps [64, 40] given do."""
    from tfdp.balance import memory

    monkeypatch.setattr(memory, "READING", _Reading(limit=1556))  # 0.9 x 1556 = 1000 + 10 x 40.04
    x, y = _data()
    expected = _one_device(x, y, 64)
    model = _model()
    PIECES.clear()
    lines = []
    history = tfdp.fit(model, x, y, batch_size=64, epochs=2, shuffle=False, verbose=0,
                       mode="weighted", devices="cpu:0,cpu:1", powers=[1, 3], max_rows="auto",
                       log=lines.append)
    result = history.result
    assert result["measured_max_rows"] == [64, 40] and result["max_rows"] == [64, 40]
    assert result["shards"] == [24, 40]
    assert any(line.startswith("max_rows auto, the model's step alone on each GPU: "
                               "/device:CPU:1 40 (peak") for line in lines)
    _assert_same_weights(model.get_weights(), expected)


def test_measured_caps_below_the_batch_make_micro_steps(monkeypatch):
    from tfdp.balance import memory

    monkeypatch.setattr(memory, "READING", _Reading(limit=1556))
    x, y = _data(512)
    expected = _one_device(x, y, 256, epochs=1)
    model = _model()
    history = tfdp.fit(model, x, y, batch_size=256, epochs=1, shuffle=False, verbose=0,
                       mode="single", devices="cpu:1", max_rows="auto")
    assert history.result["max_rows"] == [40] and history.result["micro_steps"] == 7
    _assert_same_weights(model.get_weights(), expected)


def test_a_resume_on_smaller_caps_leaves_the_saved_split_beyond_them(tmp_path):
    """A measured split saved with device 1 past 40 rows (device 0 is 4x slower) resumes
    under caps [64, 40]: the saved split passes the new cap and is not taken; the split
    is measured again within the caps, and every piece stays within them."""
    from helpers import toy_config, train

    settings = dict(mode="weighted", devices="cpu:0,cpu:1", powers="auto", batch_size=64,
                    simulate_slowdown="cpu:0=4", model_dir=str(tmp_path))
    first, _ = train(toy_config(**settings, iterations=4))
    assert first["final_shards"][1] > 40
    resumed, lines = train(toy_config(**settings, iterations=6, max_rows=(64, 40)))
    assert any("resuming at iteration 4" in line for line in lines)
    assert resumed["resumed_shares"] is None and resumed["auto_powers"] is not None
    assert resumed["final_shards"][1] <= 40
