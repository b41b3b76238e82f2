"""A model's own `train_step`, `test_step`, `compute_loss` and `compute_metrics` are the ones
`tfdp.fit` runs, as `model.fit` runs them: the same History (its keys too) and weights
on one device; with uneven shares, exact where the step has Keras' own form, weighed by
each device's examples where it computes its own mean loss (and said so in one line);
keras.io's transfer-learning recipe (a frozen base with batch normalization) too."""

import keras
import numpy as np
import pytest

import tfdp

EXAMPLES, FEATURES, BATCH = 96, 5, 32
MODES = {
    "single": {"mode": "single"},
    "mirrored 2": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
    "weighted [1, 3]": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
    "weighted over all-reduce": {
        "mode": "weighted",
        "devices": "cpu:0,cpu:1",
        "powers": (1, 3),
        "reduce": "allreduce",
    },
}


def data():
    rng = np.random.default_rng(9)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = np.stack([x[:, 0] - x[:, 1], 0.5 * x[:, 2]], axis=1).astype(np.float32)
    return x, y


class KerasFormStep(keras.Model):
    """keras.io's "Customizing what happens in fit()": the loss from compute_loss, a tracker
    of its own for the gradient norm, and its own logs."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(2)
        self.norm = keras.metrics.Mean(name="gradient_norm")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply_gradients(zip(gradients, self.trainable_variables))
        for metric in self.metrics:  # as keras.io's guide updates them
            if metric.name == "loss":
                metric.update_state(loss)
            elif metric.name == "gradient_norm":
                metric.update_state(tf.linalg.global_norm(gradients))
            else:
                metric.update_state(y, y_pred)
        return {m.name: m.result() for m in self.metrics}


class OwnMeanLoss(keras.Model):
    """A train_step that takes the mean of its own squared error (no compute_loss) and
    hands its gradients to `optimizer.apply`."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(2)
        self.tracker = keras.metrics.Mean(name="own_loss")

    def call(self, x):
        return self.out(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(y - self(x, training=True)))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.tracker.update_state(loss, sample_weight=keras.ops.shape(x)[0])
        return {"own_loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


class OwnTestAndMetrics(keras.Model):
    """An overridden test_step (an extra log of its own) and compute_metrics (a metric
    of its own beside the compiled ones)."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(2)
        self.largest = keras.metrics.Mean(name="mean_abs_prediction")

    def call(self, x):
        return self.out(x)

    def compute_metrics(self, x, y, y_pred, sample_weight=None):
        logs = super().compute_metrics(x, y, y_pred, sample_weight)
        self.largest.update_state(keras.ops.mean(keras.ops.abs(y_pred), axis=1))
        return {**logs, "mean_abs_prediction": self.largest.result()}

    def test_step(self, data):
        logs = super().test_step(data)
        return {**logs, "tested": 1.0}


def compiled(model):
    model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse", metrics=["mae"])
    return model


def seeded(make):
    keras.utils.set_random_seed(21)  # the layers' initializers draw their seeds when made
    return make()


def under_mirrored_strategy(make, **fit):
    """model.fit's History under Keras' own MirroredStrategy on tfdp's two devices."""
    import tensorflow as tf

    x, y = data()
    with tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"]).scope():
        model = compiled(seeded(make))
    return model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **fit).history


def both(make, modes=MODES, **fit):
    """model.fit's (History, weights) and tfdp.fit's in each mode."""
    x, y = data()
    arguments = dict(batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **fit)
    keras_model = compiled(seeded(make))
    keras_history = keras_model.fit(x, y, **arguments)
    runs = {}
    for mode in modes:
        lines = []
        model = compiled(seeded(make))
        history = tfdp.fit(model, x, y, **arguments, **MODES[mode], log=lines.append)
        runs[mode] = history.history, model.get_weights(), lines
    return (keras_history.history, keras_model.get_weights()), runs


def assert_same(got, want):
    (history, weights, _), (want_history, want_weights) = got, want
    assert sorted(history) == sorted(want_history)
    for name, values in want_history.items():
        np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=name)
    for have, expected in zip(weights, want_weights, strict=True):
        np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6)


def test_a_train_step_of_keras_form_runs_as_model_fit_runs_it_in_every_mode():
    """single is model.fit; with two devices, the loss the step hands its own tracker is its
    device's part (compute_loss scales it), which tfdp reads as that share of the batch's
    loss: every mode's History is single's, where Keras under its MirroredStrategy halves
    it, but for the gradient norm, which is not linear in the parts; every mode makes
    single's update."""
    want, runs = both(KerasFormStep)
    assert sorted(want[0]) == ["gradient_norm", "loss", "mae"]  # the step's own logs
    assert_same(runs["single"], want)
    linear = {name: values for name, values in want[0].items() if name != "gradient_norm"}
    for mode in ("mirrored 2", "weighted [1, 3]", "weighted over all-reduce"):
        history, weights, lines = runs[mode]
        assert "gradient_norm" in history, mode
        history = {name: values for name, values in history.items() if name != "gradient_norm"}
        assert_same((history, weights, lines), (linear, want[1]))
    halved = under_mirrored_strategy(KerasFormStep)["loss"]  # the comparison tells them apart
    np.testing.assert_allclose(halved, np.multiply(want[0]["loss"], 0.5), rtol=1e-5)
    for mode, (_, _, lines) in runs.items():
        assert not any("train_step" in line for line in lines), mode  # nothing to say


def test_a_train_step_with_its_own_mean_loss_is_weighed_by_examples_and_said():
    """Uneven shares: each device's gradients count by its examples, the update of one
    device on the whole batch; the run says how it ran the step, in one line."""
    want, runs = both(OwnMeanLoss)
    assert sorted(want[0]) == ["own_loss"]
    for mode, got in runs.items():
        assert_same(got, want)
        said = [line for line in got[2] if "OwnMeanLoss.train_step" in line]
        assert len(said) == (0 if mode == "single" else 1), (mode, got[2])
        if said:
            assert "weighed by its share of the batch's examples" in said[0]


def test_a_test_step_and_compute_metrics_of_its_own_run_in_validation():
    x, y = data()
    want, runs = both(OwnTestAndMetrics, validation_data=(x[:40], y[:40]))
    assert {"val_tested", "val_mean_abs_prediction", "mean_abs_prediction"} <= set(want[0])
    for got in runs.values():
        assert_same(got, want)


class OwnUpdates(keras.Model):
    """A step that applies its own second optimizer (as a GAN's does), beside model.optimizer."""

    def __init__(self):
        super().__init__()
        self.out = keras.layers.Dense(2)
        self.other = keras.optimizers.SGD(0.05)

    def call(self, x):
        return self.out(x)

    def train_step(self, data):
        import tensorflow as tf

        x, y = data
        with tf.GradientTape() as tape:
            y_pred = self(x, training=True)
            loss = self.compute_loss(x=x, y=y, y_pred=y_pred)
        self.other.apply(tape.gradient(loss, self.trainable_variables), self.trainable_variables)
        return {**self.compute_metrics(x, y, y_pred), "loss": loss}


def test_a_step_that_applies_an_optimizer_of_its_own_runs_as_model_fit_runs_it():
    """A second optimizer of the step's own (as a GAN's): every mode runs the step under the
    mode's strategy, its optimizer summing the devices' gradients as model.optimizer does."""
    want, runs = both(OwnUpdates)
    for mode, got in runs.items():
        assert_same(got, want)


def transfer_learning(fit):
    """keras.io's transfer-learning recipe: a base with batch normalization, frozen and called
    with training=False, under a new head; then the base unfrozen but its batch
    normalization, and the whole model recompiled at a small learning rate. (Each fit's
    History; the moving statistics after the first, and the weights at the end.)"""
    keras.utils.set_random_seed(21)
    base = keras.Sequential(
        [keras.Input((FEATURES,)), keras.layers.Dense(8), keras.layers.BatchNormalization(),
         keras.layers.Activation("relu")],
        name="base",
    )
    base.trainable = False
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, keras.layers.Dense(2)(base(inputs, training=False)))
    model.compile(keras.optimizers.Adam(0.05), "mse")
    first = fit(model, 2)
    normalization = base.layers[1]
    frozen = [normalization.moving_mean.numpy(), normalization.moving_variance.numpy()]
    base.trainable = True
    normalization.trainable = False  # its statistics stay frozen (Keras 3 reads no training=False here)
    model.compile(keras.optimizers.Adam(1e-3), "mse")
    return first, fit(model, 2), frozen + model.get_weights()


def test_keras_io_transfer_learning_recipe_trains_as_model_fit_does_in_every_mode():
    """Batch statistics that Keras keeps frozen (training=False) stay frozen in every mode."""
    x, y = data()
    arguments = dict(batch_size=BATCH, shuffle=False, verbose=0)
    want = transfer_learning(lambda model, epochs: model.fit(x, y, epochs=epochs, **arguments).history)
    for moving in (want[2][0], want[2][-4]):  # after each fit, Keras kept them
        np.testing.assert_array_equal(moving, np.zeros(8))
    for mode, settings in MODES.items():
        got = transfer_learning(
            lambda model, epochs: tfdp.fit(model, x, y, epochs=epochs, **arguments, **settings).history
        )
        for history, expected in zip(got[:2], want[:2]):
            for name, values in expected.items():
                np.testing.assert_allclose(history[name], values, rtol=1e-5, err_msg=mode)
        for have, expected in zip(got[2], want[2], strict=True):
            np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6, err_msg=mode)


def test_batches_of_one_example_over_two_devices_train_as_model_fit_does():
    """A global batch smaller than the devices leaves one device none, every step."""
    x, y = data()
    x, y = x[:6], y[:6]

    def make():
        keras.utils.set_random_seed(21)
        model = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(2)])
        model.compile(keras.optimizers.SGD(0.1), "mse")
        return model

    want = make()
    history = want.fit(x, y, batch_size=1, shuffle=False, verbose=0).history
    for mode, settings in MODES.items():
        model = make()
        got = tfdp.fit(model, x, y, batch_size=1, shuffle=False, verbose=0, **settings).history
        np.testing.assert_allclose(got["loss"], history["loss"], rtol=1e-5, err_msg=mode)
        for have, expected in zip(model.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6, err_msg=mode)


def test_a_multi_optimizer_trains_as_model_fit_trains_it_in_every_mode():
    """Keras' MultiOptimizer (an optimizer per layer): every mode makes Keras' update; the
    banner names whose learning rates apply (it has none of its own)."""
    if not hasattr(keras.optimizers, "MultiOptimizer"):
        pytest.skip(f"Keras {keras.__version__} has no MultiOptimizer (new in 3.15)")
    x, y = data()

    def make():
        keras.utils.set_random_seed(21)
        model = keras.Sequential([
            keras.Input((FEATURES,)), keras.layers.Dense(4, name="dense_1"),
            keras.layers.Dense(2, name="dense_2"),
        ])
        optimizer = keras.optimizers.MultiOptimizer(keras.optimizers.OptimizerMap(
            default_optimizer=keras.optimizers.SGD(0.1),
            optimizer_map={".*dense_2/.*": keras.optimizers.Adam(0.01)},
        ))
        model.compile(optimizer, "mse")
        return model

    want = make()
    history = want.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0).history
    for mode, settings in MODES.items():
        lines, model = [], make()
        got = tfdp.fit(model, x, y, batch_size=BATCH, shuffle=False, verbose=0, log=lines.append,
                       **settings).history
        np.testing.assert_allclose(got["loss"], history["loss"], rtol=1e-5, err_msg=mode)
        for have, expected in zip(model.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_allclose(have, expected, rtol=1e-5, atol=1e-6, err_msg=mode)
        assert any("at the learning rates of MultiOptimizer's optimizers" in line for line in lines)
