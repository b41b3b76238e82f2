"""`tfdp.fit` against `keras.Model.fit` on one device: the same History, callback hooks and
their logs, learning rates, CSV rows and final weights, in every mode; each of fit's
arguments; and a killed run resumed with `model_dir` that decides as an unbroken one."""

import csv
import json
import os
import signal
import subprocess
import sys

import keras
import numpy as np
import pytest
from helpers import ROOT, environment, latest_step, run_together, wait_for

import tfdp
from tfdp.errors import ConfigError

EXAMPLES, FEATURES, CLASSES = 240, 8, 3
# A typical Keras script: EarlyStopping that restores the best weights, ReduceLROnPlateau
# that fires, CSVLogger, and a callback that records every hook with its logs.
SCRIPT = '''
import json, os, sys

import keras
import numpy as np


def model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(32, activation="tanh")(inputs)
    m = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    m.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(240, 8)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (rng.random(240) < 0.3)).astype(np.int32) % 3
    return x, y


class Recorder(keras.callbacks.Callback):
    """Every hook fit calls, with its argument, its logs and the learning rate then."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def record(self, name, index=None, logs=None):
        rate = float(keras.ops.convert_to_numpy(self.model.optimizer.learning_rate))
        self.calls.append([name, index, dict(logs or {}), rate])

    def on_train_begin(self, logs=None):
        self.record("train_begin", None, logs)

    def on_train_end(self, logs=None):
        self.record("train_end", None, logs)

    def on_epoch_begin(self, epoch, logs=None):
        self.record("epoch_begin", epoch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self.record("epoch_end", epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self.record("train_batch_begin", batch, logs)

    def on_train_batch_end(self, batch, logs=None):
        self.record("train_batch_end", batch, logs)

    def on_test_begin(self, logs=None):
        self.record("test_begin", None, logs)

    def on_test_end(self, logs=None):
        self.record("test_end", None, logs)

    def on_test_batch_begin(self, batch, logs=None):
        self.record("test_batch_begin", batch, logs)

    def on_test_batch_end(self, batch, logs=None):
        self.record("test_batch_end", batch, logs)


def callbacks(csv_path):
    return [
        keras.callbacks.EarlyStopping(
            monitor="val_loss", patience=3, min_delta=0.005, restore_best_weights=True
        ),
        keras.callbacks.ReduceLROnPlateau(monitor="val_loss", factor=0.5, patience=1),
        keras.callbacks.CSVLogger(csv_path),
        Recorder(),
    ]


FIT = dict(epochs=30, validation_split=0.25, shuffle=False, verbose=0)


def run(fit, out, **settings):
    """Trains with `fit` (model.fit or tfdp.fit); writes what it saw to `out`."""
    m = model()
    x, y = data()
    cbs = callbacks(out + ".csv")
    if fit is None:
        history = m.fit(x, y, callbacks=cbs, **FIT)
    else:
        history = fit(m, x, y, callbacks=cbs, **FIT, **settings)
    np.savez(out + ".npz", *m.get_weights())
    with open(out + ".json", "w") as f:
        json.dump({"history": history.history, "epochs": history.epoch, "calls": cbs[-1].calls,
                   "stopped_epoch": cbs[0].stopped_epoch}, f)


if __name__ == "__main__":  # tfdp.fit in a process of its own: a worker, or a run to kill
    import tfdp

    out, settings = sys.argv[1], json.loads(sys.argv[2])
    if settings.get("mode") == "multiworker":
        tfdp.join_cluster()  # before any TensorFlow op, as a MultiWorkerMirroredStrategy
    run(tfdp.fit, out, **settings)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("script") / "typical.py"
    path.write_text(SCRIPT)
    sys.path.insert(0, str(path.parent))
    import typical

    yield typical, path
    sys.path.remove(str(path.parent))


def saw(out):
    with open(out + ".json") as f:
        seen = json.load(f)
    with np.load(out + ".npz") as arrays:
        seen["weights"] = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    with open(out + ".csv") as f:
        seen["csv"] = list(csv.DictReader(f))
    return seen


@pytest.fixture(scope="module")
def keras_run(script, tmp_path_factory):
    typical, _ = script
    out = str(tmp_path_factory.mktemp("keras") / "keras")
    typical.run(None, out)
    return saw(out)


def assert_same_fit(got, want, rtol=1e-4):
    """The same hooks in the same order with the same logs and rates, the same History, CSV
    and final weights (to float rounding)."""
    assert [c[:2] for c in got["calls"]] == [c[:2] for c in want["calls"]]
    for (name, index, logs, rate), (_, _, expected, expected_rate) in zip(
        got["calls"], want["calls"]
    ):
        assert set(logs) == set(expected), (name, index)
        for key in logs:
            assert logs[key] == pytest.approx(expected[key], rel=rtol, abs=1e-6), (name, index, key)
        assert rate == pytest.approx(expected_rate, rel=1e-7), (name, index)
    assert got["epochs"] == want["epochs"] and got["stopped_epoch"] == want["stopped_epoch"]
    assert set(got["history"]) == set(want["history"])
    for key, values in want["history"].items():
        np.testing.assert_allclose(got["history"][key], values, rtol=rtol, atol=1e-6)
    assert [row.keys() for row in got["csv"]] == [row.keys() for row in want["csv"]]
    for row, expected in zip(got["csv"], want["csv"], strict=True):
        for key in row:
            assert float(row[key]) == pytest.approx(float(expected[key]), rel=rtol, abs=1e-6)
    for a, b in zip(got["weights"], want["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=rtol, atol=1e-5)


def test_the_typical_script_decides_something(keras_run):
    """Not vacuous: the rate is reduced, training stops early and the best weights return."""
    rates = {c[3] for c in keras_run["calls"]}
    assert len(rates) >= 2, rates  # ReduceLROnPlateau fired
    assert 0 < keras_run["stopped_epoch"] < 29  # EarlyStopping stopped the run
    assert any(name == "test_batch_end" for name, *_ in keras_run["calls"])
    losses = keras_run["history"]["val_loss"]
    assert len(losses) == keras_run["stopped_epoch"] + 1


MODES = {
    "single": {},
    "mirrored 2": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
    "weighted [1, 3]": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_typical_script_fits_as_keras_does(mode, script, keras_run, tmp_path):
    typical, _ = script
    out = str(tmp_path / "tfdp")
    typical.run(tfdp.fit, out, **MODES[mode])
    assert_same_fit(saw(out), keras_run)


@pytest.mark.slow
def test_the_typical_script_fits_as_keras_does_on_two_workers(script, keras_run, tmp_path):
    from tfdp.cluster.workers import free_ports, tf_configs

    _, path = script
    settings = json.dumps({"mode": "multiworker"})
    outs = [str(tmp_path / f"worker{i}") for i in (0, 1)]
    ran = run_together(
        [[sys.executable, str(path), out, settings] for out in outs],
        [environment(TF_CONFIG=c, PYTHONPATH=ROOT) for c in tf_configs(free_ports(2))],
        cwd=tmp_path,
    )
    assert [status for status, _, _ in ran] == [0, 0], ran
    chief = saw(outs[0])
    assert_same_fit(chief, keras_run)
    # every worker ran the callbacks on the same logs; only the chief wrote the CSV
    assert not os.path.exists(outs[1] + ".csv")
    with open(outs[1] + ".json") as f:
        other = json.load(f)
    assert other["history"] == json.loads(json.dumps(chief["history"]))
    assert [c[:2] for c in other["calls"]] == [c[:2] for c in chief["calls"]]


@pytest.mark.slow
def test_a_killed_fit_resumes_to_the_same_decisions(script, tmp_path):
    """SIGKILL once a few epochs are saved, then the same script again: the run stops at
    the same epoch with the same weights, History and CSV as an unbroken run."""
    typical, path = script
    straight = str(tmp_path / "straight")
    typical.run(tfdp.fit, straight, model_dir=str(tmp_path / "straight_dir"), checkpoint_every=5)
    model_dir = str(tmp_path / "run")
    out = str(tmp_path / "resumed")
    settings = json.dumps({"model_dir": model_dir, "checkpoint_every": 5})
    killed = subprocess.Popen(
        [sys.executable, str(path), out, settings],
        env=environment(PYTHONPATH=ROOT),
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    wait_for(lambda: (latest_step(model_dir) or 0) >= 15, [killed], "a checkpoint")
    killed.send_signal(signal.SIGKILL)
    killed.wait()
    stopped_at = latest_step(model_dir)
    assert not os.path.exists(out + ".json")  # it did not finish
    typical.run(tfdp.fit, out, model_dir=model_dir, checkpoint_every=5)
    resumed, unbroken = saw(out), saw(straight)
    assert resumed["stopped_epoch"] == unbroken["stopped_epoch"] > 0
    for a, b in zip(resumed["weights"], unbroken["weights"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)
    assert set(resumed["history"]) == set(unbroken["history"])
    for key, values in unbroken["history"].items():
        np.testing.assert_allclose(resumed["history"][key], values, rtol=1e-6)
    assert resumed["epochs"] == unbroken["epochs"]
    assert [row["epoch"] for row in resumed["csv"]] == [row["epoch"] for row in unbroken["csv"]]
    for row, expected in zip(resumed["csv"], unbroken["csv"]):
        assert {k: float(v) for k, v in row.items()} == pytest.approx(
            {k: float(v) for k, v in expected.items()}, rel=1e-6
        )
    # the resumed process called the hooks from the checkpoint's step on
    assert resumed["calls"][0][0] == "train_begin" and stopped_at > 0


# ---------------------------------------------------------------- each argument


def small_model():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    m = keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Dense(8, activation="relu")(inputs)))
    m.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def small_data(n=120, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return x, y


def both_fit(**arguments):
    """(Keras' History and weights, tfdp's) for the same arguments on one device."""
    x, y = small_data()
    keras_model, tfdp_model = small_model(), small_model()
    data = arguments.pop("data", lambda x, y: {"x": x, "y": y})(x, y)
    keras_history = keras_model.fit(**data, verbose=0, **arguments)
    tfdp_history = tfdp.fit(tfdp_model, **data, verbose=0, **arguments)
    return (keras_history, keras_model.get_weights()), (tfdp_history, tfdp_model.get_weights())


def assert_same_history(keras_side, tfdp_side):
    (keras_history, keras_weights), (tfdp_history, tfdp_weights) = keras_side, tfdp_side
    assert tfdp_history.epoch == keras_history.epoch
    assert set(tfdp_history.history) == set(keras_history.history)
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(tfdp_history.history[key], values, rtol=1e-5, atol=1e-6)
    moved = max(np.abs(w - w0).max() for w, w0 in zip(keras_weights, small_model().get_weights()))
    assert moved > 1e-3  # the comparison is not vacuous
    for a, b in zip(tfdp_weights, keras_weights, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


VALIDATION = small_data(40, seed=9)
ARGUMENTS = {
    "batch_size": dict(batch_size=16, epochs=2, shuffle=False),
    "batch_size default (32)": dict(epochs=2, shuffle=False),
    "epochs": dict(batch_size=40, epochs=3, shuffle=False),
    "validation_split": dict(batch_size=16, epochs=2, shuffle=False, validation_split=0.2),
    "validation_data": dict(batch_size=16, epochs=2, shuffle=False, validation_data=VALIDATION),
    "validation_data with weights": dict(
        batch_size=16,
        epochs=2,
        shuffle=False,
        validation_data=(*VALIDATION, np.linspace(0.5, 2, 40).astype(np.float32)),
    ),
    "validation_batch_size": dict(
        batch_size=16, epochs=2, shuffle=False, validation_data=VALIDATION, validation_batch_size=7
    ),
    "validation_steps": dict(
        batch_size=16,
        epochs=2,
        shuffle=False,
        validation_data=VALIDATION,
        validation_batch_size=8,
        validation_steps=3,
    ),
    "validation_freq": dict(
        batch_size=16, epochs=4, shuffle=False, validation_data=VALIDATION, validation_freq=2
    ),
    "validation_freq list": dict(
        batch_size=16, epochs=4, shuffle=False, validation_data=VALIDATION, validation_freq=[1, 4]
    ),
    # one batch per epoch: the order within it does not change the update
    "shuffle (True)": dict(batch_size=120, epochs=3, shuffle=True),
    "class_weight": dict(
        batch_size=16, epochs=2, shuffle=False, class_weight={0: 1.0, 1: 3.0, 2: 0.5}
    ),
    "sample_weight": dict(
        batch_size=16,
        epochs=2,
        shuffle=False,
        data=lambda x, y: {
            "x": x,
            "y": y,
            "sample_weight": np.linspace(0.1, 2, len(y)).astype(np.float32),
        },
    ),
    "initial_epoch": dict(batch_size=16, epochs=4, initial_epoch=2, shuffle=False),
    "steps_per_epoch": dict(batch_size=20, epochs=4, steps_per_epoch=3, shuffle=False),
    "steps_per_epoch without batch_size": dict(epochs=2, steps_per_epoch=4, shuffle=False),
}


@pytest.mark.parametrize("name", list(ARGUMENTS))
def test_each_fit_argument_means_what_it_means_in_keras(name):
    assert_same_history(*both_fit(**dict(ARGUMENTS[name])))


def test_verbose_prints_keras_progress_bar(capsys):
    x, y = small_data()
    small_model().fit(x, y, batch_size=40, epochs=2, verbose=1, shuffle=False)
    keras_lines = capsys.readouterr().out
    tfdp.fit(small_model(), x, y, batch_size=40, epochs=2, verbose=1, shuffle=False)
    tfdp_lines = capsys.readouterr().out
    for text in ("Epoch 1/2", "Epoch 2/2", "3/3", "accuracy: ", "loss: "):
        assert text in keras_lines and text in tfdp_lines, text
    assert tfdp_lines.startswith("workload partition: ")  # tfdp's own lines come first
    tfdp.fit(small_model(), x, y, batch_size=40, epochs=1, verbose=0)
    assert capsys.readouterr().out == ""  # verbose 0: nothing


def test_stop_training_stops_at_the_step_it_is_set():
    class StopAtBatch(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch == 2 and len(self.model.history.epoch) == 1:
                self.model.stop_training = True

    keras_side, tfdp_side = both_fit(
        batch_size=16, epochs=5, shuffle=False, callbacks=[StopAtBatch()]
    )
    assert keras_side[0].epoch == [0, 1]
    assert_same_history(keras_side, tfdp_side)


class SetWeightsAtEpoch(keras.callbacks.Callback):
    """At the end of epoch 1, halves every weight: the next steps start from there."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 1:
            self.model.set_weights([w / 2 for w in self.model.get_weights()])


@pytest.mark.parametrize("mode", ["weighted [1, 3]", "mirrored 2"])
def test_weights_a_callback_sets_reach_every_copy(mode):
    x, y = small_data()
    arguments = dict(batch_size=16, epochs=4, shuffle=False, verbose=0)
    keras_model, tfdp_model = small_model(), small_model()
    keras_model.fit(x, y, callbacks=[SetWeightsAtEpoch()], **arguments)
    tfdp.fit(tfdp_model, x, y, callbacks=[SetWeightsAtEpoch()], **arguments, **MODES[mode])
    for a, b in zip(tfdp_model.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_learning_rate_scheduler_sets_the_rate_of_the_update():
    schedule = keras.callbacks.LearningRateScheduler(lambda epoch, rate: rate * 0.5)
    keras_side, tfdp_side = both_fit(
        batch_size=16, epochs=3, shuffle=False, callbacks=[schedule], **{}
    )
    assert_same_history(keras_side, tfdp_side)
    assert keras_side[0].history["learning_rate"][-1] == pytest.approx(0.2 * 0.5**3)


def test_model_checkpoint_saves_the_best_model_as_keras_does(tmp_path):
    x, y = small_data()
    arguments = dict(batch_size=16, epochs=3, shuffle=False, verbose=0, validation_split=0.25)
    saved = {}
    for name, train in (("keras", None), ("tfdp", tfdp.fit)):
        path = str(tmp_path / f"{name}.keras")
        callback = keras.callbacks.ModelCheckpoint(path, monitor="val_loss", save_best_only=True)
        model = small_model()
        if train is None:
            model.fit(x, y, callbacks=[callback], **arguments)
        else:
            train(
                model,
                x,
                y,
                callbacks=[callback],
                **arguments,
                mode="weighted",
                devices="cpu:0,cpu:1",
            )
        saved[name] = keras.models.load_model(path).get_weights()
    for a, b in zip(saved["tfdp"], saved["keras"], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_tensorboard_writes_each_epochs_scalars(tmp_path):
    import tensorflow as tf

    x, y = small_data()
    tfdp.fit(
        small_model(),
        x,
        y,
        batch_size=16,
        epochs=2,
        verbose=0,
        validation_split=0.25,
        callbacks=[keras.callbacks.TensorBoard(str(tmp_path))],
    )
    steps = {}
    for kind in ("train", "validation"):
        for name in os.listdir(tmp_path / kind):
            for event in tf.compat.v1.train.summary_iterator(str(tmp_path / kind / name)):
                for value in event.summary.value:
                    steps.setdefault((kind, value.tag), []).append(event.step)
    assert steps[("train", "epoch_loss")] == [0, 1]
    assert steps[("validation", "epoch_loss")] == [0, 1]


def test_backup_and_restore_is_refused_beside_model_dir(tmp_path):
    x, y = small_data()
    callback = keras.callbacks.BackupAndRestore(str(tmp_path / "backup"))
    with pytest.raises(ConfigError) as refused:
        tfdp.fit(small_model(), x, y, callbacks=[callback], model_dir=str(tmp_path / "run"))
    assert refused.value.field == "callbacks" and "model_dir" in refused.value.reason
    assert not (tmp_path / "backup").exists() and not (tmp_path / "run").exists()


class StopAfterEpoch(keras.callbacks.Callback):
    """Interrupts a fit at the end of epoch `epoch`, as a crash would."""

    def __init__(self, epoch):
        super().__init__()
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.epoch:
            raise RuntimeError("interrupted")


@pytest.mark.parametrize("settings", [{}, {"mode": "weighted", "devices": "cpu:0,cpu:1"}])
def test_backup_and_restore_resumes_at_its_epoch_as_in_keras(settings, tmp_path):
    """A fit interrupted after epoch 1 and run again with the same BackupAndRestore starts
    at epoch 2 from the backed-up weights, as Keras' fit does: the same History epochs and
    the same weights (without shuffling, Keras' batches are tfdp's)."""
    x, y = small_data()
    runs = {}
    for name, fit in (("keras", None), ("tfdp", tfdp.fit)):
        model, backup = small_model(), str(tmp_path / name)
        train = (model.fit if fit is None else lambda *a, **k: fit(model, *a, **k, **settings))
        common = dict(batch_size=32, shuffle=False, verbose=0)
        with pytest.raises(RuntimeError, match="interrupted"):
            train(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup),
                                             StopAfterEpoch(1)], **common)
        history = train(x, y, epochs=4, callbacks=[keras.callbacks.BackupAndRestore(backup)],
                        **common)
        runs[name] = history.epoch, history.history["loss"], model.get_weights()
    assert runs["tfdp"][0] == runs["keras"][0] == [2, 3]
    np.testing.assert_allclose(runs["tfdp"][1], runs["keras"][1], rtol=1e-5)
    for got, want in zip(runs["tfdp"][2], runs["keras"][2], strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_tuple_of_inputs_without_targets_is_refused():
    x, y = small_data()
    with pytest.raises(ConfigError) as refused:
        tfdp.fit(small_model(), (x, y))
    assert refused.value.field == "y" and "tfdp.fit(model, x, y)" in refused.value.reason


def test_the_history_holds_tfdps_result():
    x, y = small_data()
    model = small_model()
    history = tfdp.fit(model, x, y, batch_size=40, epochs=2, verbose=0)
    assert isinstance(history, keras.callbacks.History) and model.history is history
    assert history.result["iterations"] == 6
    assert set(history.result["history"]) == set(history.history) == {"loss", "accuracy"}
    for key, values in history.history.items():
        assert len(values) == 2
        np.testing.assert_allclose(history.result["history"][key], values, rtol=1e-7)
    assert json.loads(json.dumps(history.result)) == history.result


class BatchCounter(keras.callbacks.Callback):
    """A user's callback that exposes its state: the batches it has seen."""

    def __init__(self, crash_at=None):
        super().__init__()
        self.batches, self.crash_at = 0, crash_at

    def on_train_batch_end(self, batch, logs=None):
        self.batches += 1
        if self.batches == self.crash_at:
            raise RuntimeError("the machine went down")

    def state_dict(self):
        return {"batches": self.batches}

    def load_state_dict(self, state):
        self.batches = state["batches"]


def test_a_user_callbacks_state_survives_a_crash(tmp_path):
    """A run that dies after the checkpoint of step 8 and is run again: the callback
    counts the batches of the whole run, as in one unbroken `model.fit`."""
    x, y = small_data()
    fit = dict(batch_size=20, epochs=3, shuffle=False, verbose=0)
    keras_counter = BatchCounter()
    small_model().fit(x, y, callbacks=[keras_counter], **fit)
    model_dir = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="went down"):
        tfdp.fit(
            small_model(),
            x,
            y,
            callbacks=[BatchCounter(crash_at=10)],
            model_dir=model_dir,
            checkpoint_every=4,
            **fit,
        )
    assert latest_step(model_dir) == 8
    counter = BatchCounter()
    tfdp.fit(
        small_model(), x, y, callbacks=[counter], model_dir=model_dir, checkpoint_every=4, **fit
    )
    assert counter.batches == keras_counter.batches == 18
