"""A user's own compiled Keras model through the engine: every mode makes the update
plain Keras makes on the whole global batch (its compiled loss with sample weights,
model.losses, its optimizer with global clipping), and bad models and data are
refused before any work."""

import os

import helpers
import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import CPUS, cli_in_process, refusal
from helpers import tfdp as run_tfdp

import tfdp
from tfdp import Config, ConfigError
from tfdp.data.arrays import train_dataset
from tfdp.models import build_on

BATCH = 60
SEED = 3
EXAMPLES = 240


def two_input_model(batch_norm=None):
    """A functional model with two dict inputs, L2 regularisers, Adam with global_clipnorm."""
    keras.utils.set_random_seed(7)
    a = keras.Input((6,), name="a")
    b = keras.Input((4,), name="b")
    h = keras.layers.Concatenate()(
        [
            keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2")(a),
            keras.layers.Dense(8, activation="relu")(b),
        ]
    )
    if batch_norm is not None:
        h = keras.layers.BatchNormalization(synchronized=batch_norm)(h)
    out = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.05))(h)
    model = keras.Model({"a": a, "b": b}, out, name="two_inputs")
    model.compile(
        # a small clip, so that clipping acts on these steps
        optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(0)
    x = {
        "a": rng.normal(size=(EXAMPLES, 6)).astype(np.float32),
        "b": rng.normal(size=(EXAMPLES, 4)).astype(np.float32),
    }
    y = rng.integers(0, 3, EXAMPLES).astype(np.int32)
    sample_weight = rng.uniform(0.2, 2.0, EXAMPLES).astype(np.float32)
    return x, y, sample_weight


def train_steps(mode, devices, powers, steps, data, make=two_input_model, **options):
    config = Config(
        mode=mode,
        model="test:two_inputs",
        dataset="test:data",
        devices=",".join(devices),
        powers=powers,
        batch_size=BATCH,
        seed=SEED,
        **options,
    )
    model = make()
    build_on(model, tfdp_first(data))
    return helpers.train_steps(config, devices, data, steps, model)


def tfdp_first(data, count=2):
    return tf.nest.map_structure(lambda leaf: tf.constant(leaf[:count]), data)


def keras_reference(steps, data, make=two_input_model):
    """Plain Keras: train_on_batch on the same global batches, from the same weights."""
    model = make()
    batches = iter(train_dataset(data, BATCH, SEED))
    for _ in range(steps):
        x, y, sample_weight = next(batches)
        model.reset_metrics()  # the last batch's logs alone (Keras 3.10 kept a running mean)
        logs = model.train_on_batch(x, y, sample_weight=sample_weight, return_dict=True)
    return model, logs


CASES = [
    ("mirrored", CPUS[:2], (), {}),
    ("mirrored", CPUS[:3], (), {}),  # 60 = 20 + 20 + 20 (3 steps)
    ("weighted", CPUS[:2], (1, 5), {}),
    ("weighted", CPUS[:4], (3, 1, 1, 1), {}),
    ("weighted", CPUS[:2], (1, 5), {"reduce": "allreduce"}),
    ("weighted", CPUS[:4], (3, 1, 1, 1), {"reduce": "allreduce"}),
]


@pytest.fixture(scope="module")
def reference(data):
    return {steps: train_steps("single", CPUS[:1], (), steps, data) for steps in (1, 3)}


@pytest.mark.parametrize("steps", [1, 3])
def test_single_is_plain_keras(steps, data, reference):
    trainer, metrics = reference[steps]
    model, logs = keras_reference(steps, data)
    start = two_input_model().get_weights()
    moved = [np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), start)]
    assert min(moved) > 1e-4  # every variable moved: the comparison is not vacuous
    for got, expected in zip(trainer.model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    # train_on_batch reports the loss before its update: the same batch, the same loss
    assert metrics["loss"] == pytest.approx(float(logs["loss"]), rel=1e-5)


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("mode, devices, powers, options", CASES)
def test_every_mode_makes_the_single_update(mode, devices, powers, options, steps, data, reference):
    trainer, metrics = train_steps(mode, devices, powers, steps, data, **options)
    expected_trainer, expected = reference[steps]
    for got, want in zip(trainer.model.get_weights(), expected_trainer.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5)
    assert metrics["accuracy"] == expected["accuracy"]


def test_clipping_acts_on_the_summed_gradient(data):
    """With clipping per shard, the update would depend on the split."""
    trainer, _ = train_steps("weighted", CPUS[:2], (1, 5), 1, data)
    unclipped = lambda: two_input_model_with(keras.optimizers.Adam(0.01))
    free, _ = train_steps("weighted", CPUS[:2], (1, 5), 1, data, make=unclipped)
    # Adam's first step moves each weight by about lr x sign: clipping shows in the moments
    assert not np.allclose(
        trainer.model.optimizer.variables[2].numpy(), free.model.optimizer.variables[2].numpy()
    )


def two_input_model_with(optimizer):
    model = two_input_model()
    model.compile(optimizer=optimizer, loss=model.loss, metrics=["accuracy"])
    return model


def test_synchronized_batch_norm_is_exact_in_mirrored(data):
    make = lambda: two_input_model(batch_norm=True)
    single, _ = train_steps("single", CPUS[:1], (), 2, data, make=make)
    for devices, powers, options in (
        (CPUS[:3], (), {"mode": "mirrored"}),
        (CPUS[:2], (1, 5), {"mode": "weighted", "reduce": "allreduce"}),
    ):
        mode = options.pop("mode")
        trainer, _ = train_steps(mode, devices, powers, 2, data, make=make, **options)
        for got, want in zip(trainer.model.get_weights(), single.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_batch_norm_is_exact_in_every_mode(data):
    """A BatchNormalization layer as Keras makes it (not synchronized) normalizes every
    shard by the whole batch's statistics: mirrored and weighted make single's update."""
    make = lambda: two_input_model(batch_norm=False)
    single, _ = train_steps("single", CPUS[:1], (), 2, data, make=make)
    for mode, devices, powers in (("mirrored", CPUS[:3], ()), ("weighted", CPUS[:2], (1, 3))):
        trainer, _ = train_steps(mode, devices, powers, 2, data, make=make)
        for got, want in zip(trainer.model.get_weights(), single.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


def test_weighted_batch_norm_by_replica_keeps_the_whole_batch_moving_mean(data):
    """With batch_statistics="replica", per-shard batch statistics change the forward pass,
    but the moving mean after the first step is the whole batch's, however the batch was
    split."""
    make = lambda: two_input_model(batch_norm=False)
    single, _ = train_steps("single", CPUS[:1], (), 1, data, make=make)
    weighted, _ = train_steps("weighted", CPUS[:2], (1, 3), 1, data, make=make,
                              batch_statistics="replica")
    names = [w.path for w in single.model.weights]
    moving_mean = next(i for i, name in enumerate(names) if name.endswith("moving_mean"))
    got, want = weighted.model.get_weights()[moving_mean], single.model.get_weights()[moving_mean]
    assert np.abs(want).max() > 1e-3  # it moved
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    gamma = next(i for i, name in enumerate(names) if name.endswith("gamma"))
    assert not np.allclose(weighted.model.get_weights()[gamma], single.model.get_weights()[gamma],
                           rtol=1e-6, atol=0)  # the forward pass differs: not single's update


def test_fit_trains_a_model_object_in_place(data, tmp_path):
    model = two_input_model()
    start = model.get_weights()
    x, y, sample_weight = data
    result = tfdp.fit(
        model,
        x,
        y,
        sample_weight=sample_weight,
        validation_data=(x, y),
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 2),
        batch_size=BATCH,
        iterations=8,
        model_dir=str(tmp_path / "run"),
        log=lambda line: None,
    ).result
    assert result["model"] == "two_inputs" and result["iterations"] == 8
    assert result["optimizer"] == "Adam"
    assert set(result["test_metrics"]) == {"loss", "accuracy"}
    trained = result.model.get_weights()
    for got, want in zip(model.get_weights(), trained, strict=True):
        np.testing.assert_array_equal(got, want)  # the user's model holds the trained weights
    assert any(np.abs(w - w0).max() > 1e-4 for w, w0 in zip(trained, start))
    # model.keras is the user's model, loadable by plain Keras, with the trained weights
    loaded = keras.models.load_model(tmp_path / "run" / "model.keras")
    for got, want in zip(loaded.get_weights(), trained, strict=True):
        np.testing.assert_array_equal(got, want)
    # the validation metrics are Keras' own evaluation of the trained model
    logs = model.evaluate(x, y, batch_size=BATCH, return_dict=True, verbose=0)
    assert result["test_metrics"]["accuracy"] == pytest.approx(logs["accuracy"], abs=1e-6)
    assert result["test_metrics"]["loss"] == pytest.approx(logs["loss"], rel=1e-4)


def test_fit_takes_an_unbatched_dataset_and_a_factory(data):
    x, y, _ = data
    dataset = tf.data.Dataset.from_tensor_slices((x, y))
    result = tfdp.fit(
        two_input_model,
        dataset,
        mode="mirrored",
        devices="cpu:0,cpu:1",
        batch_size=BATCH,
        iterations=2,
        log=lambda line: None,
    ).result
    assert result["iterations"] == 2 and result["test_metrics"] is None
    assert result.model.name == "two_inputs"


def uncompiled():
    model = two_input_model()
    return keras.Model(model.inputs, model.outputs)


@pytest.mark.parametrize(
    "model, train, field, words",
    [
        (uncompiled, None, "model", "is not compiled"),
        (lambda: 3, None, "model", "returned int, not a compiled Keras model"),
        (two_input_model, "short", "x", "leaves of different lengths"),
    ],
)
def test_bad_models_and_data_are_refused_before_training(model, train, field, words, data):
    x, y, _ = data
    if train == "short":
        train = (x, y[:-1])
    else:
        train = (x, y)
    lines = []
    with pytest.raises(ConfigError) as raised:
        tfdp.fit(model, *train, batch_size=BATCH, iterations=1, log=lines.append)
    assert raised.value.field == field
    assert words in raised.value.reason
    assert lines == []  # nothing ran


@pytest.mark.parametrize("train", ["labels", "inputs"])
def test_data_that_does_not_fit_the_model_raises_what_model_fit_raises(train, data):
    """Keras' own error, as model.fit raises it, before anything runs; the command says it
    in one line naming the flag (`test_cli_refuses_bad_user_models_and_data`)."""
    x, y, _ = data
    if train == "labels":
        train = (x, np.zeros((EXAMPLES, 5), np.float32))  # one-hot of 5 classes for 3 outputs
    else:
        train = ({"a": x["a"]}, y)  # an input left out
    with pytest.raises(Exception) as keras_raised:
        two_input_model().fit(*train, batch_size=BATCH, epochs=1, verbose=0)
    lines = []
    with pytest.raises(type(keras_raised.value)) as raised:
        tfdp.fit(two_input_model(), *train, batch_size=BATCH, iterations=1, log=lines.append)
    assert str(raised.value) == str(keras_raised.value)
    assert lines == []  # nothing ran


USER_FILE = """
import keras
import numpy as np


def compiled():
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)], name="tiny")
    model.compile(optimizer=keras.optimizers.Adam(0.05), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def uncompiled():
    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])


def not_a_model():
    return "a string"


def data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return (x, y), (x[:50], y[:50])


def ragged():
    x = np.zeros((200, 4), np.float32)
    return (x, np.zeros(199, np.int32)), None


def wide_labels():
    x = np.zeros((200, 4), np.float32)
    return (x, np.zeros((200, 7), np.float32)), None
"""


@pytest.fixture(scope="module")
def user_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("user") / "user_model.py"
    path.write_text(USER_FILE)
    return path


def test_cli_trains_a_model_and_dataset_named_by_module_and_function(user_file, tmp_path, capsys):
    # the command's own main function, in this process (which has its logical CPUs already)
    result = tmp_path / "result.json"
    status = cli_in_process(
        f"--model={user_file}:compiled",
        f"--dataset={user_file}:data",
        "--mode=weighted",
        "--devices=cpu:0,cpu:1",
        "--powers=1,3",
        "--batch_size=40",
        "--iterations=30",
        "--intra_op_threads=0",
        f"--result_json={result}",
    )
    assert status == 0
    import json

    saved = json.loads(result.read_text())
    assert saved["model"] == "tiny" and saved["shards"] == [10, 30]
    assert saved["optimizer"] == "Adam"
    assert saved["test_metrics"]["accuracy"] > 0.6  # it learns (chance: about 0.4)
    assert f"iteration 30, test accuracy {saved['test_accuracy']:f}" in capsys.readouterr().out


@pytest.mark.parametrize(
    "model, dataset, words",
    [
        ("{f}:missing", "{f}:data", "--model={f}:missing: {f} has no function missing"),
        ("nowhere_module_xyz:make", "{f}:data", "--model=nowhere_module_xyz:make: cannot import"),
        ("{f}:uncompiled", "{f}:data", "is not compiled; call model.compile("),
        ("{f}:not_a_model", "{f}:data", "returned str, not a compiled Keras model"),
        ("{f}:compiled", "{f}:ragged", "has leaves of different lengths [199, 200]"),
        ("{f}:compiled", "{f}:wide_labels", "does not fit the model (ValueError: "),
    ],
)
def test_cli_refuses_bad_user_models_and_data(model, dataset, words, user_file, tmp_path):
    result = tmp_path / "result.json"
    _, line = refusal(
        "--model=" + model.format(f=user_file),
        "--dataset=" + dataset.format(f=user_file),
        "--batch_size=40",
        "--iterations=2",
        f"--model_dir={tmp_path / 'run'}",
        f"--result_json={result}",
    )
    assert line.startswith("tfdp: error: --") and "\n" not in line, line
    assert words.format(f=user_file) in line
    assert not result.exists() and not (tmp_path / "run").exists()  # nothing written


def test_help_lists_tfdps_flags():
    process = run_tfdp("--help")
    assert process.returncode == 0, process.stderr
    for flag in ("--mode:", "--powers:", "--batch_size:", "--model:", "--dataset:"):
        assert flag in process.stdout, flag
    assert "MODULE:FUNCTION" in process.stdout


def mixed_model(policy):
    """The two-input model computing in `policy` (its variables stay float32)."""

    def make():
        keras.utils.set_random_seed(7)
        a = keras.Input((6,), name="a")
        b = keras.Input((4,), name="b")
        h = keras.layers.Concatenate(dtype=policy)(
            [
                keras.layers.Dense(16, activation="tanh", dtype=policy)(a),
                keras.layers.Dense(8, activation="relu", dtype=policy)(b),
            ]
        )
        out = keras.layers.Dense(3, dtype=policy, kernel_regularizer="l2")(h)
        out = keras.layers.Activation("linear", dtype="float32")(out)  # float32 logits
        model = keras.Model({"a": a, "b": b}, out, name=f"two_inputs_{policy}")
        optimizer = keras.optimizers.Adam(0.01)
        if policy == "mixed_float16":
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
        model.compile(
            optimizer=optimizer,
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            metrics=["accuracy"],
        )
        return model

    return make


@pytest.mark.parametrize("policy, tolerance", [("mixed_bfloat16", 2e-2), ("mixed_float16", 2e-3)])
def test_mixed_precision_makes_the_same_update_in_every_mode(policy, tolerance, data):
    make = mixed_model(policy)
    single, _ = train_steps("single", CPUS[:1], (), 3, data, make=make)
    model, _ = keras_reference(3, data, make=make)
    start = make().get_weights()
    assert min(np.abs(w - w0).max() for w, w0 in zip(model.get_weights(), start)) > 1e-3
    for got, want in zip(single.model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)
    for mode, devices, powers in (("mirrored", CPUS[:2], ()), ("weighted", CPUS[:2], (1, 3))):
        trainer, _ = train_steps(mode, devices, powers, 3, data, make=make)
        for got, want in zip(trainer.model.get_weights(), single.model.get_weights(), strict=True):
            np.testing.assert_allclose(got, want, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "mode, devices, powers, options",
    [
        ("single", CPUS[:1], (), {}),
        ("mirrored", CPUS[:3], (), {}),
        ("mirrored", CPUS[:3], (), {"mirrored_input": "dataset"}),
        ("weighted", CPUS[:2], (1, 5), {}),
        ("weighted", CPUS[:4], (3, 1, 1, 1), {"reduce": "allreduce"}),
    ],
)
def test_an_epochs_partial_last_batch_is_trained_on_exactly(mode, devices, powers, options, data):
    """250 examples in batches of 60: the fifth step reads the 10 left, split over the
    devices, and makes Keras' update on those 10."""
    ragged = tf.nest.map_structure(lambda leaf: np.concatenate([leaf, leaf[:10]]), data)
    sizes = [len(b[1]) for b in train_dataset(ragged, BATCH, SEED).take(6)]
    assert sizes == [60, 60, 60, 60, 10, 60]
    trainer, metrics = train_steps(mode, devices, powers, 5, ragged, **options)
    model = two_input_model()
    batches = iter(train_dataset(ragged, BATCH, SEED))
    for _ in range(5):
        bx, by, bw = next(batches)
        model.reset_metrics()  # the last batch's logs alone (Keras 3.10 kept a running mean)
        logs = model.train_on_batch(bx, by, sample_weight=bw, return_dict=True)
    for got, want in zip(trainer.model.get_weights(), model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert metrics["loss"] == pytest.approx(float(logs["loss"]), rel=1e-5)


def test_every_example_of_an_epoch_is_read_unless_the_remainder_is_dropped():
    indexed = (np.arange(240), np.arange(240))  # 240 = 3 x 70 + 30
    epoch = [y.numpy() for _, y in train_dataset(indexed, 70, SEED).take(4)]
    assert [len(b) for b in epoch] == [70, 70, 70, 30]
    assert sorted(np.concatenate(epoch).tolist()) == list(range(240))
    dropped = [y.numpy() for _, y in train_dataset(indexed, 70, SEED, drop_remainder=True).take(4)]
    assert [len(b) for b in dropped] == [70, 70, 70, 70]
    np.testing.assert_array_equal(np.concatenate(dropped[:3]), np.concatenate(epoch[:3]))
    assert len(set(dropped[3])) == 70  # the next epoch's first batch


def test_a_user_model_resumes_exactly(data, tmp_path):
    """3 steps, then a resume to 7 (through the epoch's partial last batch) in another
    mode, give the weights of 7 straight steps: the optimizer's slots and the input
    position come back with the checkpoint."""
    x, y, weights = tf.nest.map_structure(lambda leaf: np.concatenate([leaf, leaf[:10]]), data)
    ragged = dict(x=x, y=y, sample_weight=weights)
    settings = dict(batch_size=BATCH, seed=SEED, log=lambda line: None)
    straight = tfdp.fit(two_input_model, **ragged, iterations=7, **settings).result
    run = str(tmp_path / "run")
    first = tfdp.fit(two_input_model, **ragged, iterations=3, model_dir=run, **settings).result
    assert first["start_iteration"] == 0
    resumed = tfdp.fit(
        two_input_model,
        **ragged,
        iterations=7,
        model_dir=run,
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 2),
        **settings,
    ).result
    assert resumed["start_iteration"] == 3
    for got, want in zip(resumed.model.get_weights(), straight.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert resumed["final_loss"] == pytest.approx(straight["final_loss"], rel=1e-5)


def test_the_example_cnn_reports_its_own_learning_rate(tmp_path):
    """The example compiles AdamW at 2e-3: the banner, the result and TensorBoard say so."""
    model_dir = str(tmp_path / "run")
    config = Config(
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 3),
        model=os.path.join(helpers.ROOT, "examples", "mnist_cnn.py") + ":make_model",
        mnist_dir=str(tmp_path / "mnist"),
        batch_size=64,
        iterations=4,
        log_every=2,
        model_dir=model_dir,
    )
    (tmp_path / "mnist").mkdir()
    helpers.write_mnist_dir(tmp_path / "mnist", 256, 64)
    result, lines = helpers.train(config)
    banner = next(line for line in lines if line.startswith("global batch 64 = 16 + 48"))
    assert "at learning rate 0.002;" in banner, banner
    assert result["learning_rate"] == pytest.approx(2e-3)
    assert result["optimizer_config"]["class"] == "AdamW"
    assert result["optimizer_config"]["weight_decay"] == pytest.approx(1e-4)
    rates = []
    for name in os.listdir(os.path.join(model_dir, "train")):
        for event in tf.compat.v1.train.summary_iterator(os.path.join(model_dir, "train", name)):
            rates += [
                float(tf.make_ndarray(v.tensor))
                for v in event.summary.value
                if v.tag == "learning_rate"
            ]
    assert rates == pytest.approx([2e-3, 2e-3])


def test_the_example_cnn_is_evaluated_on_one_device_at_the_tutorials_batch(tmp_path):
    """The example CNN on one device, batch 1024, a test set whose last batch is short:
    the evaluation at the end runs (the cut of a short batch once took a branch whose adds
    Grappler rewrote into a per-step temporary variable: AlreadyExists in the test step)."""
    (tmp_path / "mnist").mkdir()
    helpers.write_mnist_dir(tmp_path / "mnist", 1024, 3000)
    config = Config(
        mode="single",
        model=os.path.join(helpers.ROOT, "examples", "mnist_cnn.py") + ":make_model",
        mnist_dir=str(tmp_path / "mnist"),
        batch_size=1024,
        iterations=1,
    )
    result, lines = helpers.train(config)
    assert 0 <= result["test_accuracy"] <= 1
    assert lines[-1].startswith("iteration 1, test accuracy") and "(3000 examples)" in lines[-1]
