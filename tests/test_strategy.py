"""tfdp.MirroredStrategy: under its scope, unchanged Keras code and TensorFlow's own custom
loops give one device's results, with the replicas' shares of each batch uneven (1:3 on two
logical CPUs).

Each test runs the same code twice, on one device and under the strategy's scope, from the
same initial weights, and compares: the weights (rtol 1e-5), History's epoch logs, the logs
batch-level callbacks see, `evaluate`'s totals and `predict`'s rows in order.
"""

import contextlib
import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_keras_data import Batches as Sequence  # a PyDataset of (x, y) batches

import tfdp
from tfdp import internals

DEVICES = ["/cpu:0", "/cpu:1"]
FEATURES, CLASSES = 4, 3
_strategies = {}


def strategy(powers=(1, 3)):
    """One strategy per shares in this process (each holds collective keys of its own)."""
    if powers not in _strategies:
        _strategies[powers] = tfdp.MirroredStrategy(DEVICES, powers=powers)
    return _strategies[powers]


def examples(n, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)).astype(np.int32)
    return x, y


def functional():
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh", kernel_regularizer=keras.regularizers.L2(0.01))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden(inputs)))


def sequential():
    return keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(CLASSES)]
    )


def unbuilt():
    return keras.Sequential([keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(CLASSES)])


class Subclassed(keras.Model):
    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(CLASSES)

    def call(self, x, training=False):
        return self.out(self.hidden(x))


class OwnTrainStep(Subclassed):
    """keras.io's `train_step` on `compute_loss`, with a loss of its own added."""

    def train_step(self, data):
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return self.compute_metrics(x, y, y_pred, sample_weight=sample_weight)


def compiled(make, **compile_args):
    keras.utils.set_random_seed(2)
    model = make()
    model.compile(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compile_args,
    )
    return model


class Batches(keras.callbacks.Callback):
    """The logs each batch-level hook sees."""

    def __init__(self):
        super().__init__()
        self.logs = []

    def on_train_batch_end(self, batch, logs=None):
        self.logs.append(dict(logs))


def generator(x, y, size):
    while True:
        for start in range(0, len(x), size):
            yield x[start : start + size], y[start : start + size]


def fit_arguments(name):
    """`fit`'s arguments for one form of data, made anew for each run (a generator is used up)."""
    x, y = examples(193)  # batches of 64: the last one holds 1 row, and replica 0 none of it
    vx, vy = examples(50, seed=4)
    weights = np.linspace(0.5, 2.0, len(x)).astype(np.float32)
    return {
        "arrays": dict(x=x, y=y, batch_size=64, epochs=2, shuffle=False),
        "arrays, validation, sample weights": dict(
            x=x, y=y, batch_size=64, epochs=2, shuffle=False, sample_weight=weights,
            validation_data=(vx, vy),
        ),
        "arrays, class weights, validation split": dict(
            x=x, y=y, batch_size=32, epochs=2, shuffle=False, class_weight={0: 1.0, 1: 2.0, 2: 0.5},
            validation_split=0.2,
        ),
        "tf.data": dict(x=tf.data.Dataset.from_tensor_slices((x, y)).batch(48), epochs=2),
        "tf.data, validation dataset": dict(
            x=tf.data.Dataset.from_tensor_slices((x, y)).batch(48), epochs=2,
            validation_data=tf.data.Dataset.from_tensor_slices((vx, vy)).batch(16),
        ),
        "PyDataset": dict(x=Sequence(x, y, 40), epochs=2, shuffle=False),
        "generator": dict(x=generator(x, y, 40), steps_per_epoch=5, epochs=2),
    }[name]


DATA = [
    "arrays",
    "arrays, validation, sample weights",
    "arrays, class weights, validation split",
    "tf.data",
    "tf.data, validation dataset",
    "PyDataset",
    "generator",
]
MODELS = {"functional": functional, "sequential": sequential, "unbuilt": unbuilt,
          "subclassed": Subclassed, "own train_step": OwnTrainStep}


def run(make, arguments, scope=None):
    """fit, evaluate and predict, on one device or in `scope`: what each gives."""
    if scope is None:
        model = make()
    else:
        with scope.scope():
            model = make()
    batches = Batches()
    history = model.fit(**arguments, callbacks=[batches], verbose=0)
    x, y = examples(101, seed=5)
    return {
        "weights": model.get_weights(),
        "history": history.history,
        "batches": batches.logs,
        "evaluate": model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True),
        "predict": model.predict(x, batch_size=32, verbose=0),
    }


def assert_same_results(expected, got, rtol=1e-5, atol=1e-6):
    for e, g in zip(expected["weights"], got["weights"]):
        np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
    assert got["history"].keys() == expected["history"].keys()
    for key in expected["history"]:
        np.testing.assert_allclose(got["history"][key], expected["history"][key], rtol=rtol, atol=atol,
                                   err_msg=f"History {key}")
    assert len(got["batches"]) == len(expected["batches"])
    for e, g in zip(expected["batches"], got["batches"]):
        assert g.keys() == e.keys()
        for key in e:
            np.testing.assert_allclose(g[key], e[key], rtol=rtol, atol=atol, err_msg=f"batch log {key}")
    for key in expected["evaluate"]:
        np.testing.assert_allclose(got["evaluate"][key], expected["evaluate"][key], rtol=rtol, atol=atol)
    np.testing.assert_allclose(got["predict"], expected["predict"], rtol=rtol, atol=atol)


@pytest.mark.parametrize("data", DATA)
def test_model_fit_on_every_form_of_data_gives_one_devices_results(data):
    make = lambda: compiled(functional)  # noqa: E731
    assert_same_results(run(make, fit_arguments(data)), run(make, fit_arguments(data), strategy()))


@pytest.mark.parametrize("kind", MODELS)
def test_every_kind_of_model_gives_one_devices_results(kind):
    make = lambda: compiled(MODELS[kind])  # noqa: E731
    arguments = lambda: fit_arguments("arrays, validation, sample weights")  # noqa: E731
    assert_same_results(run(make, arguments()), run(make, arguments(), strategy()))


def test_metrics_of_mixed_dtypes_give_the_whole_batchs_logs():
    """An IoU metric (a float64 confusion matrix) beside float32 ones."""
    def make():
        keras.utils.set_random_seed(2)
        model = functional()
        model.compile(keras.optimizers.SGD(0.2),
                      keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy", keras.metrics.MeanIoU(CLASSES, sparse_y_pred=False, name="iou")])
        return model

    arguments = lambda: fit_arguments("arrays")  # noqa: E731
    assert_same_results(run(make, arguments()), run(make, arguments(), strategy()))


def test_each_outputs_loss_is_the_whole_batchs():
    """Two outputs, a loss each: the logs of each output's loss (`a_loss`, `b_loss`) count
    each replica by its share, as one device counts the batch."""
    x, y = examples(193)

    def make():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((FEATURES,))
        hidden = keras.layers.Dense(8, activation="tanh")(inputs)
        model = keras.Model(inputs, {"a": keras.layers.Dense(CLASSES, name="a")(hidden),
                                     "b": keras.layers.Dense(1, name="b")(hidden)})
        model.compile(keras.optimizers.SGD(0.2),
                      loss={"a": keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                            "b": "mse"},
                      loss_weights={"a": 1.0, "b": 0.5})
        return model

    arguments = dict(x=x, y={"a": y, "b": x[:, :1]}, batch_size=64, epochs=2, shuffle=False,
                     validation_data=(x[:50], {"a": y[:50], "b": x[:50, :1]}), verbose=0)
    expected = make()
    history = expected.fit(**arguments).history
    with strategy().scope():
        model = make()
    got = model.fit(**arguments).history
    assert {"a_loss", "b_loss", "val_a_loss"} <= set(history) and sorted(got) == sorted(history)
    for name, values in history.items():
        np.testing.assert_allclose(got[name], values, rtol=1e-5, err_msg=name)
    for e, g in zip(expected.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_without_the_weighing_uneven_shares_would_not_be_one_device(monkeypatch):
    """The check above can fail: the same cut with Keras' own 1/R weight is off."""
    make = lambda: compiled(functional)  # noqa: E731
    expected = run(make, fit_arguments("arrays"))
    monkeypatch.setattr(tfdp.MirroredStrategy, "run", tf.distribute.MirroredStrategy.run)
    got = run(make, fit_arguments("arrays"), strategy())
    difference = max(np.abs(e - g).max() for e, g in zip(expected["weights"], got["weights"]))
    assert difference > 1e-3


def tensorflows_strategy():
    """TensorFlow's MirroredStrategy, on collective keys of its own."""
    from tfdp.internals import next_collective_key_base

    before = tf.distribute.MirroredStrategy._collective_key_base  # noqa: SLF001
    tf.distribute.MirroredStrategy._collective_key_base = next_collective_key_base()  # noqa: SLF001
    try:
        return tf.distribute.MirroredStrategy(DEVICES)
    finally:
        tf.distribute.MirroredStrategy._collective_key_base = before  # noqa: SLF001


def test_even_shares_are_tensorflows_mirrored_strategy():
    """powers=None: TensorFlow's own strategy's results on a batch it splits evenly."""
    make = lambda: compiled(functional)  # noqa: E731
    x, y = examples(128)
    arguments = lambda: dict(x=x, y=y, batch_size=64, epochs=2, shuffle=False)  # noqa: E731
    reference = tensorflows_strategy()
    expected = run(make, arguments(), reference)
    even = strategy(powers=None)
    assert even.shares == [0.5, 0.5]
    assert_same_results(expected, run(make, arguments(), even))


def test_shares_cut_each_batch_in_order():
    """Replica i holds rows [b_i, b_i+1) of every batch, b from the shares: 17/83 of 100 for
    powers [1, 5], as the tutorial's workload partition; a short batch by share too."""
    uneven = tfdp.MirroredStrategy(DEVICES, powers=[1, 5])
    rows = np.arange(230, dtype=np.int64)
    dataset = uneven.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices(rows).batch(100))
    pieces = [[p.numpy() for p in uneven.experimental_local_results(batch)] for batch in dataset]
    assert [[len(p) for p in batch] for batch in pieces] == [[17, 83], [17, 83], [5, 25]]
    np.testing.assert_array_equal(np.concatenate([np.concatenate(b) for b in pieces]), rows)


def test_variable_length_batches_give_one_devices_results():
    """padded_batch: every batch has a length of its own, and Keras' masking."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, 12, size=90)
    sequences = [rng.integers(1, 50, size=n) for n in lengths]
    labels = (lengths > 6).astype(np.int32)

    def data():
        dataset = tf.data.Dataset.from_generator(
            lambda: iter(zip(sequences, labels)),
            output_signature=(tf.TensorSpec([None], tf.int64), tf.TensorSpec([], tf.int32)),
        )
        return dataset.padded_batch(16)

    def make():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([
            keras.layers.Embedding(50, 8, mask_zero=True),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(2),
        ])
        model.compile(keras.optimizers.SGD(0.5), keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                      metrics=["accuracy"])
        return model

    def results(scope):
        if scope is None:
            model = make()
        else:
            with scope.scope():
                model = make()
        history = model.fit(data(), epochs=2, verbose=0)
        return model.get_weights(), history.history, model.evaluate(data(), verbose=0), model.predict(data(), verbose=0)

    expected, got = results(None), results(strategy())
    for e, g in zip(expected[0], got[0]):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    for key in expected[1]:
        np.testing.assert_allclose(got[1][key], expected[1][key], rtol=1e-5)
    np.testing.assert_allclose(got[2], expected[2], rtol=1e-5)
    np.testing.assert_allclose(got[3], expected[3], rtol=1e-5, atol=1e-6)


def custom_loop(loss_kind, scope=None):
    """TensorFlow's tutorial loop: distributed dataset, `strategy.run`, `strategy.reduce`."""
    active = scope or tf.distribute.get_strategy()
    x, y = examples(200)
    global_batch = 64
    with active.scope():
        keras.utils.set_random_seed(2)
        model = functional()
        optimizer = keras.optimizers.SGD(0.2)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
        mean_loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch)
    if scope is not None:
        dataset = scope.experimental_distribute_dataset(dataset)

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            if loss_kind == "compute_average_loss":
                loss = tf.nn.compute_average_loss(per_example(labels, logits), global_batch_size=global_batch)
                loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
            else:  # a Keras loss that takes the mean over its batch
                loss = mean_loss(labels, logits) + tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        gradients = tape.gradient(loss, model.trainable_variables)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return loss

    @tf.function
    def train_step(inputs):
        if scope is None:
            return step(inputs)
        losses = scope.run(step, args=(inputs,))
        return scope.reduce(tf.distribute.ReduceOp.SUM, losses, axis=None)

    for _ in range(2):
        for batch in dataset:
            train_step(batch)
    return model.get_weights()


@pytest.mark.parametrize("loss_kind", ["compute_average_loss", "keras mean loss"])
def test_tensorflows_custom_loop_gives_the_same_loop_on_one_device(loss_kind):
    expected = custom_loop(loss_kind)
    got = custom_loop(loss_kind, strategy())
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def batch_normalized(synchronized=False, frozen=False):
    def make():
        keras.utils.set_random_seed(2)
        inputs = keras.Input((FEATURES,))
        normalized = keras.layers.BatchNormalization(synchronized=synchronized, momentum=0.5)
        normalized.trainable = not frozen
        hidden = normalized(keras.layers.Dense(6)(inputs), training=False if frozen else None)
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
        model.compile(keras.optimizers.SGD(0.2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    return make


@pytest.mark.parametrize("kind", ["synchronized", "frozen"])
def test_batch_normalization_synchronized_or_frozen_is_one_device(kind):
    make = batch_normalized(synchronized=kind == "synchronized", frozen=kind == "frozen")
    arguments = lambda: fit_arguments("arrays")  # noqa: E731
    assert_same_results(run(make, arguments()), run(make, arguments(), strategy()))


def test_batch_normalization_moving_statistics_are_combined_by_share():
    """With per-replica batch statistics (`batch_statistics="replica"`, as TensorFlow's
    MirroredStrategy computes them) the moving mean and variance move by the pieces'
    statistics weighed by share, the same on every replica."""
    make = batch_normalized()
    x, y = examples(64)
    uneven = tfdp.MirroredStrategy(DEVICES, powers=[1, 3], batch_statistics="replica")
    with uneven.scope():
        model = make()
    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
    layer = next(l for l in model.layers if isinstance(l, keras.layers.BatchNormalization))
    copies = [v.numpy() for v in uneven.experimental_local_results(layer.moving_mean.value)]
    np.testing.assert_array_equal(copies[0], copies[1])
    # recomputed: the Dense layer's outputs before the step, on each piece (16 and 48 rows)
    plain = make()
    hidden = plain.layers[1](x).numpy()
    pieces = [hidden[:16], hidden[16:]]
    shares = [16 / 64, 48 / 64]
    mean = sum(s * p.mean(0) for s, p in zip(shares, pieces))
    variance = sum(s * p.var(0) for s, p in zip(shares, pieces))
    np.testing.assert_allclose(layer.moving_mean.numpy(), 0.5 * mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(layer.moving_variance.numpy(), 0.5 + 0.5 * variance, rtol=1e-5, atol=1e-6)
    # the pieces' own statistics: the mean is the whole batch's, the variance is not
    assert not np.allclose(variance, hidden.var(0), rtol=1e-3)


def test_bad_arguments_name_themselves():
    with pytest.raises(tfdp.ConfigError, match=r"powers.*one power per replica \(2\)"):
        tfdp.MirroredStrategy(DEVICES, powers=[1, 2, 3])
    with pytest.raises(tfdp.ConfigError, match=r"powers.*positive finite.*0"):
        tfdp.MirroredStrategy(DEVICES, powers=[1, 0])
    with pytest.raises(tfdp.ConfigError, match=r"reduce.*allreduce, device0"):
        tfdp.MirroredStrategy(DEVICES, reduce="ring")


def test_the_strategy_is_tensorflows():
    assert isinstance(strategy(), tf.distribute.MirroredStrategy)
    assert isinstance(strategy(), tf.distribute.Strategy)
    assert strategy().num_replicas_in_sync == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert strategy().shares == [0.25, 0.75]


def test_steps_per_execution_and_jit_compile_give_one_devices_results():
    """Keras' multi-step loop fails inside TensorFlow's MirroredStrategy (keras-team/keras#19246)
    and one XLA program cannot span two CPU devices: under tfdp's both train, as one device."""
    arguments = lambda: fit_arguments("arrays, validation, sample weights")  # noqa: E731
    make = lambda: compiled(functional, steps_per_execution=3, jit_compile=True)  # noqa: E731
    expected = run(make, arguments())
    with pytest.warns(UserWarning, match="runs without XLA"):
        got = run(make, arguments(), strategy())
    # Keras calls the batch hooks once per execution of 3 steps, on one device as here
    assert len(got["batches"]) == len(expected["batches"]) == 2 * 2
    assert_same_results(expected, got)


def test_auto_powers_move_work_off_a_slow_replica_and_stay_exact():
    """powers="auto": the shares start even, are measured on the model's own step (replica 1
    made 4x slower) and move toward equal finishing times (0.8 / 0.2 here); the batches
    cut before and after the change all make one device's update."""
    auto = tfdp.MirroredStrategy(DEVICES, powers="auto", measure_steps=2, simulate_slowdown={1: 4})
    assert auto.shares == [0.5, 0.5]

    def make():
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(512, activation="tanh"),
                                  keras.layers.Dense(512, activation="tanh"), keras.layers.Dense(1)])
        model.compile(keras.optimizers.SGD(0.01), "mse")
        return model

    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(512 * 6, 64)).astype(np.float32), rng.normal(size=(512 * 6, 1)).astype(np.float32)
    expected = make()
    expected.fit(x, y, batch_size=512, epochs=1, shuffle=False, verbose=0)
    with auto.scope():
        model = make()
    model.fit(x, y, batch_size=512, epochs=1, shuffle=False, verbose=0)
    assert 0.6 < auto.shares[0] < 0.97, auto.shares
    assert auto.measured_speeds[0] > auto.measured_speeds[1] > 0
    for e, g in zip(expected.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_the_simulated_slowdown_sleeps_in_every_step(monkeypatch):
    """The slow replica's sleep runs in every step, with even shares given (nothing reads
    its clock there: a sleep only ordered before the gradients' hand-over was pruned)."""
    from tfdp.engine import clock

    slept = []
    sleep_then_now = clock._sleep_then_now  # noqa: SLF001

    def counted(after, seconds):
        slept.append(float(seconds))
        return sleep_then_now(after, seconds)

    monkeypatch.setattr(clock, "_sleep_then_now", counted)
    slow = tfdp.MirroredStrategy(DEVICES, simulate_slowdown={1: 2})
    with slow.scope():
        model = compiled(functional)
    x, y = examples(96)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    assert len(slept) == 6, slept  # one per step, on replica 1 only


def test_the_replicas_clocks_leave_their_steps_side_by_side():
    """The clock and the simulated slowdown in each replica's part of a step are stateless
    ops: with stateful ones (tf.timestamp, a stateful numpy_function) a tf.function runs
    them in program order, and replica 1 would start only once replica 0 had slept."""
    from tfdp.engine import clock

    mirrored = tfdp.MirroredStrategy(DEVICES)

    @tf.function
    def step(x):
        def replica(x):
            start = clock.read_after(x)
            end = clock.sleep_then_read(start, 0.4)
            return tf.stack([start, end])

        return mirrored.experimental_local_results(mirrored.run(replica, args=(x,)))

    step(tf.constant(1.0, tf.float64))
    (start_0, end_0), (start_1, end_1) = [t.numpy() for t in step(tf.constant(1.0, tf.float64))]
    assert start_1 < end_0 and start_0 < end_1, "one replica's sleep waited for the other's"


TWO_WORKERS = '''
import json, sys
import keras
import numpy as np


def make():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
    model.compile(keras.optimizers.SGD(0.2, momentum=0.5),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True), metrics=["accuracy"])
    return model


def data():
    rng = np.random.default_rng(3)
    x = rng.normal(size=(193, 4)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)


def results(model):
    x, y = data()
    history = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, validation_data=(x[:50], y[:50]))
    return {"weights": [w.tolist() for w in model.get_weights()], "history": history.history,
            "evaluate": model.evaluate(x, y, batch_size=32, verbose=0, return_dict=True),
            "predict": model.predict(x, batch_size=32, verbose=0).tolist()}


if __name__ == "__main__":
    import os

    import tfdp

    strategy = tfdp.MultiWorkerMirroredStrategy(powers=[1, 3])
    with strategy.scope():
        model = make()
    found = results(model)
    found["shares"] = strategy.shares
    index = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    with open(f"{sys.argv[1]}{index}.json", "w") as f:
        json.dump(found, f)
'''


@pytest.mark.slow
@pytest.mark.parametrize("started", ["by hand", "tfdp-launch"])
def test_two_workers_under_plain_model_fit_give_one_devices_results(started, tmp_path):
    """tfdp.MultiWorkerMirroredStrategy(powers=[1, 3]) on two workers (one replica each, as
    TensorFlow gives CPU-only workers), each with its TF_CONFIG, or started by `tfdp-launch
    -- COMMAND`: each worker reads the global batches and trains its piece; every worker
    ends with one device's weights, History, evaluate and predict."""
    import json
    import sys

    from helpers import environment, launch, run_together

    from tfdp.cluster.workers import free_ports, tf_configs

    script = tmp_path / "worker.py"
    script.write_text(TWO_WORKERS)
    prefix = str(tmp_path / "worker")
    if started == "by hand":
        ran = run_together(
            [[sys.executable, str(script), prefix]] * 2,
            [environment(TF_CONFIG=c) for c in tf_configs(free_ports(2))],
            cwd=tmp_path,
        )
        assert [status for status, _, _ in ran] == [0, 0], ran
    else:
        done = launch("--", sys.executable, str(script), prefix, cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
    outs = [tmp_path / f"worker{i}.json" for i in (0, 1)]
    reference = {}
    exec(TWO_WORKERS, reference)  # noqa: S102 (the workers' own model and data, on one device)
    expected = reference["results"](reference["make"]())
    for out in outs:
        got = json.loads(out.read_text())
        assert got["shares"] == [0.25, 0.75]
        for e, g in zip(expected["weights"], got["weights"]):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
        for key, values in expected["history"].items():
            np.testing.assert_allclose(got["history"][key], values, rtol=1e-5, atol=1e-6)
        for key, value in expected["evaluate"].items():
            np.testing.assert_allclose(got["evaluate"][key], value, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got["predict"], expected["predict"], rtol=1e-5, atol=1e-6)


class OwnMeanLoss(Subclassed):
    """A step that takes the mean of its own loss, and tracks it in a Mean of its own
    (keras.io's "lower-level" step): Keras never sees either to weigh it."""

    def __init__(self):
        super().__init__()
        self.tracker = keras.metrics.Mean(name="loss")

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            logits = self(x, training=True)
            loss = tf.reduce_mean(tf.keras.losses.sparse_categorical_crossentropy(y, logits, from_logits=True))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def test_an_own_mean_loss_is_weighed_by_share_and_said_in_one_line():
    """An own step's own mean loss, which Keras never sees to weigh: each replica's gradients
    count by its share (one device's update, where TensorFlow's strategy sums the replicas'
    means), and so does the loss its own Mean tracks (one device's History, where the
    replicas' losses would count alike); said in one line. tfdp.fit's weighted mode runs
    the same step on the same strategy."""
    x, y = examples(96)

    def make():
        keras.utils.set_random_seed(2)
        model = OwnMeanLoss()
        model.compile(keras.optimizers.SGD(0.2, momentum=0.5))  # the step has its own loss
        return model

    expected = make()
    history = expected.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    with strategy().scope():
        model = make()
    with pytest.warns(UserWarning) as said:
        got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    lines = [str(w.message) for w in said if "OwnMeanLoss.train_step" in str(w.message)]
    assert len(lines) == 1 and "weighed by its share of the batch's examples" in lines[0], lines
    fitted = make()
    weighted = tfdp.fit(fitted, x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        mode="weighted", devices="cpu:0,cpu:1", powers=(1, 3), log=lambda _: None)
    for run in (model, fitted):
        for e, g in zip(expected.get_weights(), run.get_weights()):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    for logs in (got, weighted.history):
        np.testing.assert_allclose(logs["loss"], history["loss"], rtol=1e-5)


class TracksItsLoss(Subclassed):
    """A compute_loss override that tracks the loss Keras' compute_loss returns (Keras' own
    `test_metric_update_in_compute_loss`): in a replica, that loss is its weighed part."""

    def __init__(self):
        super().__init__()
        self.tracker = keras.metrics.Mean(name="tracked")

    def compute_loss(self, x=None, y=None, y_pred=None, sample_weight=None, training=True):
        loss = super().compute_loss(x, y, y_pred, sample_weight, training)
        self.tracker.update_state(loss * 4)
        return loss


def test_a_loss_tracked_in_compute_loss_reads_the_whole_batchs():
    x, y = examples(96)

    def make():
        keras.utils.set_random_seed(2)
        model = TracksItsLoss()
        model.compile(keras.optimizers.SGD(0.2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    history = make().fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    with strategy().scope():
        model = make()
    got = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0).history
    weighted = tfdp.fit(make(), x, y, batch_size=32, epochs=2, shuffle=False, verbose=0,
                        mode="weighted", devices="cpu:0,cpu:1", powers=(1, 3), log=lambda _: None)
    for logs in (got, weighted.history):
        np.testing.assert_allclose(logs["tracked"], history["tracked"], rtol=1e-5)
        np.testing.assert_allclose(logs["tracked"], np.multiply(history["loss"], 4), rtol=1e-5)


def test_an_optional_input_given_none_gives_one_devices_results():
    if internals.keras_release() < (3, 12):
        pytest.skip("Keras' own fit takes an optional input given None from Keras 3.12")
    """An input declared optional and given None: every piece holds None for it."""
    from helpers import with_an_optional_input

    x, y = examples(96)
    data = dict(x={"x": x, "o": None}, y=y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    expected = with_an_optional_input()
    history = expected.fit(**data).history
    with strategy().scope():
        model = with_an_optional_input()
    got = model.fit(**data).history
    for e, g in zip(expected.get_weights(), model.get_weights()):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["loss"], history["loss"], rtol=1e-5)


def test_clipping_acts_on_the_summed_gradient():
    """global_clipnorm, clipnorm, clipvalue: Keras clips each replica's gradient before the
    sum; under tfdp's strategy the sum is clipped, as on one device."""
    x, y = examples(96)
    for clip in ({"global_clipnorm": 0.05}, {"clipnorm": 0.02}, {"clipvalue": 0.004}):
        def make():
            keras.utils.set_random_seed(2)
            model = functional()
            model.compile(keras.optimizers.SGD(0.5, **clip), "sparse_categorical_crossentropy")
            return model

        expected = make()
        expected.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        with strategy().scope():
            model = make()
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, verbose=0)
        for e, g in zip(expected.get_weights(), model.get_weights()):
            np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6, err_msg=str(clip))


def test_the_tutorials_reduction_on_device_0_gives_one_devices_results():
    """reduce="device0": the gradients summed on device 0 and sent back from there (the MXNet
    tutorial's reduction), TensorFlow's ReductionToOneDevice under the strategy."""
    device0 = tfdp.MirroredStrategy(DEVICES, powers=(1, 3), reduce="device0")
    ops = device0.extended._cross_device_ops  # noqa: SLF001
    assert isinstance(ops, tf.distribute.ReductionToOneDevice)
    assert ops.reduce_to_device == "/cpu:0"
    x, y = examples(96)  # two steps: 64 rows cut 16 / 48, then 32 cut 8 / 24
    results = []
    for scope in (None, device0):
        with (scope.scope() if scope else contextlib.nullcontext()):
            model = compiled(functional)
        history = model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0)
        results.append((model.get_weights(), history.history))
    (expected, expected_history), (got, got_history) = results
    for e, g in zip(expected, got):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    for key in expected_history:
        np.testing.assert_allclose(got_history[key], expected_history[key], rtol=1e-5)


def _tensorflow_trainer():
    from keras.src.backend.tensorflow import trainer

    return trainer


def _loss_scaling_is_tfdps():
    """Keras scales a replica's loss through `keras.src.losses.loss.scale_loss_for_distribution`
    (its trainer and its Loss call it by module attribute): tfdp's replacement weighs by share."""
    from keras.src.losses import loss as loss_module

    from tfdp.engine import patches, shards

    patches.install()
    with shards.piece(0.25):
        assert float(loss_module.scale_loss_for_distribution(tf.constant(8.0))) == 2.0
        assert float(loss_module.unscale_loss_for_distribution(tf.constant(2.0))) == 8.0
    import inspect

    assert "loss_module.scale_loss_for_distribution" in inspect.getsource(
        _tensorflow_trainer().TensorFlowTrainer._aggregate_additional_loss  # noqa: SLF001
    )
    assert "scale_loss_for_distribution(loss)" in inspect.getsource(loss_module.reduce_values)


def _keras_functions_are_there():
    """Keras' TensorFlow trainer builds its step functions in `_make_function(step_function)`
    and `make_predict_function(force)`, and builds the model in `_maybe_symbolic_build(
    iterator, data_batch)` / `_symbolic_build(data_batch=...)` from shapes and dtypes."""
    import inspect

    from tfdp.engine.patches import ORIGINALS

    trainer = _tensorflow_trainer().TensorFlowTrainer  # Keras' own, before tfdp wraps them
    make = ORIGINALS.get("make_function", trainer._make_function)  # noqa: SLF001
    make_predict = ORIGINALS.get("make_predict_function", trainer.make_predict_function)
    build = ORIGINALS.get("maybe_symbolic_build", trainer._maybe_symbolic_build)  # noqa: SLF001
    assert list(inspect.signature(make).parameters) == ["self", "step_function"]
    assert "force" in inspect.signature(make_predict).parameters
    assert list(inspect.signature(build).parameters) == ["self", "iterator", "data_batch"]
    assert "KerasTensor(\n                    v.shape" in inspect.getsource(trainer._symbolic_build)  # noqa: SLF001
    assert "self.steps_per_execution" in inspect.getsource(make)


def _epoch_iterator_distributes():
    """Keras' TFEpochIterator hands the data to `strategy.experimental_distribute_dataset` and
    keeps the result as `_distributed_dataset`; Keras passes `model.train_step` itself to
    `strategy.run` (tfdp finds the model there, for the whole batch's logs)."""
    import inspect

    trainer = _tensorflow_trainer()
    source = inspect.getsource(trainer.TFEpochIterator.__init__)
    assert "experimental_distribute_dataset" in source and "self._distributed_dataset" in source
    assert "self._make_function(self.train_step)" in inspect.getsource(
        trainer.TensorFlowTrainer.make_train_function)


def _collective_keys_from_the_base():
    """TensorFlow numbers a MirroredStrategy's collective groups from its
    `_collective_key_base` (read when the strategy is built)."""
    made = strategy()
    keys = made.extended._collective_keys  # noqa: SLF001
    base = made._collective_key_base  # noqa: SLF001
    assert base + 1 <= keys._group_key < base + 100_000  # noqa: SLF001


def _assignment_goes_through_on_write_assign():
    """A MirroredVariable's `assign` in a replica goes through
    `tensorflow.python.distribute.values_util.on_write_assign` (tfdp's hook combines
    BatchNormalization's moving statistics there)."""
    import inspect

    from tensorflow.python.distribute import values

    assert "values_util.on_write_assign" in inspect.getsource(values.MirroredVariable) or (
        "values_util.on_write_assign" in inspect.getsource(values.OnWritePolicy))


def _round_robin_gives_replica_i_piece_i():
    """Elements of a per-worker dataset go to the replicas in turn (MultiDeviceIterator's
    round robin): tfdp's pieces reach their replicas in order."""
    made = strategy()
    dataset = made.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(8))
    pieces = [p.numpy() for p in made.experimental_local_results(next(iter(dataset)))]
    assert [list(p) for p in pieces] == [[0, 1], [2, 3, 4, 5, 6, 7]]


def _optimizers_clip_before_their_all_reduce():
    """Keras' optimizer clips in `BaseOptimizer._clip_gradients(grads)`, inside the replica,
    before `_backend_update_step`, whose TensorFlow version sums the replicas' gradients
    (tfdp's hook weighs and clips the sum there); each output's loss tracker is a metric
    of `model._compile_loss.metrics` updated with `update_state(value, sample_weight=...)`."""
    import inspect

    from keras.src.backend.tensorflow.optimizer import TFOptimizer
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    from tfdp.engine.patches import ORIGINALS

    keras_clip = ORIGINALS.get("clip_gradients", BaseOptimizer._clip_gradients)  # noqa: SLF001
    assert list(inspect.signature(keras_clip).parameters) == ["self", "grads"]
    apply = inspect.getsource(BaseOptimizer._backend_apply_gradients)  # noqa: SLF001
    assert apply.index("self._clip_gradients(grads)") < apply.index("self._backend_update_step(")
    assert "_all_reduce_sum_gradients" in inspect.getsource(TFOptimizer._backend_update_step)  # noqa: SLF001
    from keras.src.metrics.reduction_metrics import Mean, MeanMetricWrapper
    from keras.src.trainers.compile_utils import CompileLoss

    assert "update_state(" in inspect.getsource(CompileLoss.call)
    # a Mean of a scalar counts its sample_weight (tfdp weighs an own step's by share)
    mean = Mean()
    mean.update_state(2.0, sample_weight=0.25)
    mean.update_state(4.0, sample_weight=0.75)
    assert float(mean.result()) == 3.5 and issubclass(MeanMetricWrapper, Mean)


def _tensorflow_lifts_a_tf_function_by_cloning_it():
    """TensorFlow lifts a tf.function handed to `run` over the replicas by cloning it around
    `call_for_each_replica` of its Python function (`Function._clone(python_function=...)`,
    skipped for XLA on GPUs only): tfdp does the same, with its weighing inside."""
    import inspect

    from tensorflow.python.distribute import mirrored_run

    source = inspect.getsource(mirrored_run.call_for_each_replica)
    assert "fn._clone(" in source and "python_function=wrapped_fn" in source
    assert "fn._jit_compile" in source


def _batch_normalization_moments():
    """Keras' BatchNormalization computes its training statistics in `_moments(inputs, mask)`
    over `_reduction_axes`, then assigns its moving statistics (tfdp's replacement of
    `_moments` gives the whole batch's)."""
    import inspect

    from tfdp.engine.patches import ORIGINALS

    layer = keras.layers.BatchNormalization
    moments = ORIGINALS.get("moments", layer._moments)  # noqa: SLF001
    assert list(inspect.signature(moments).parameters) == ["self", "inputs", "mask"]
    call = inspect.getsource(layer.call)
    assert call.index("self._moments(inputs, mask)") < call.index("self.moving_mean.assign(")
    built = layer()
    built.build((None, 3, 5))
    assert built._reduction_axes == [0, 1]  # noqa: SLF001


def _optimizer_variables_come_from_add_variable():
    """A Keras optimizer makes every variable of its own through `BaseOptimizer.add_variable`
    (its slots through `add_variable_from_reference`): tfdp's check of a build inside a
    distributed tf.function sits there."""
    import inspect

    from keras.src.optimizers.base_optimizer import BaseOptimizer

    assert "self.add_variable(" in inspect.getsource(BaseOptimizer.add_variable_from_reference)
    assert "return self.add_weight(" in inspect.getsource(keras.layers.Layer.add_variable)


def _every_replacement_target_is_there():
    """Each function tfdp replaces (`internals.replacement_targets`) is where tfdp takes it,
    a function of Keras' or TensorFlow's own (not tfdp's replacement) before tfdp's."""
    import inspect

    from tfdp import internals as tfdp_internals
    from tfdp.engine.patches import ORIGINALS, install

    install()
    for name, (owner, attribute) in tfdp_internals.replacement_targets().items():
        original = ORIGINALS[name]
        assert callable(original) and not original.__module__.startswith("tfdp"), name
        assert getattr(owner, attribute).__module__ == "tfdp.engine.patches", name
        assert inspect.signature(original).parameters, name
    assert ORIGINALS["compute_average_loss"].__module__.startswith("tensorflow")


def _a_distributed_dataset_without_rebatching():
    """`input_util.get_distributed_dataset(..., num_replicas_in_sync=None)` deals the
    dataset's elements to the replicas in turn, unrebatched (tfdp's pieces, one each)."""
    from tfdp import internals as tfdp_internals

    made = strategy()
    pieces = tf.data.Dataset.from_tensor_slices(tf.constant([[1, 2], [3, 4]], tf.int64))
    distributed = tfdp_internals.distribute_without_rebatching(made, pieces, None)
    got = [list(p.numpy()) for p in made.experimental_local_results(next(iter(distributed)))]
    assert got == [[1, 2], [3, 4]]


INTERNALS = {
    "keras.src.losses.loss.scale_loss_for_distribution": _loss_scaling_is_tfdps,
    "TensorFlowTrainer._make_function / make_predict_function / _maybe_symbolic_build": _keras_functions_are_there,
    "TFEpochIterator + strategy.run(model.train_step)": _epoch_iterator_distributes,
    "MirroredStrategy._collective_key_base": _collective_keys_from_the_base,
    "values_util.on_write_assign": _assignment_goes_through_on_write_assign,
    "MultiDeviceIterator round robin": _round_robin_gives_replica_i_piece_i,
    "BaseOptimizer._clip_gradients before the all-reduce; CompileLoss trackers; Mean": _optimizers_clip_before_their_all_reduce,
    "mirrored_run lifts a tf.function by Function._clone": _tensorflow_lifts_a_tf_function_by_cloning_it,
    "BatchNormalization._moments and _reduction_axes": _batch_normalization_moments,
    "input_util.get_distributed_dataset without rebatching": _a_distributed_dataset_without_rebatching,
    "BaseOptimizer.add_variable, Layer.add_weight make the variables": _optimizer_variables_come_from_add_variable,
    "internals.replacement_targets, each Keras' or TensorFlow's": _every_replacement_target_is_there,
}


@pytest.mark.parametrize("internal", INTERNALS)
def test_each_keras_or_tensorflow_internal_it_relies_on_is_as_tested(internal):
    try:
        INTERNALS[internal]()
    except Exception as error:  # noqa: BLE001 (any change of the internal is this failure)
        pytest.fail(
            f"tfdp.MirroredStrategy relies on {internal}, which this Keras {keras.__version__} / "
            f"TensorFlow {tf.__version__} changed: {type(error).__name__}: {error}"
        )


def test_the_pieces_run_without_tf_data_autotuning_unless_the_user_set_it():
    """Autotuning made Keras' deletion of an iterator wait up to a minute beside another busy
    process; off where the user set nothing, the user's own setting stands."""
    made = strategy()
    plain = made.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
    options = tf.data.Options()
    options.autotune.enabled = True
    tuned = made.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4).with_options(options))
    assert [d.options().autotune.enabled for d in plain._cloned_datasets] == [False]  # noqa: SLF001
    assert [d.options().autotune.enabled for d in tuned._cloned_datasets] == [True]  # noqa: SLF001
