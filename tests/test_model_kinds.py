"""Any model `model.fit` trains, `tfdp.fit` trains, in every mode, as `model.fit` does on one
device: the same History and the same weights, in the object passed.

Each kind of model a Keras user writes: Functional, Sequential (built, or built on its first
batch), subclassed (with or without `get_config`, with constructor arguments and a layer
that takes `training`), a Keras `Trainer` that is a layer, and losses beyond the compiled
one (weight regularizers, `add_loss`)."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

import tfdp
from tfdp.errors import ConfigError

EXAMPLES, FEATURES, CLASSES, BATCH = 100, 6, 3, 32  # 100 = 3 x 32 + 4: a short last batch
MODES = {
    "single": {"mode": "single"},
    "mirrored 2": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
    "weighted [1, 3]": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
}


def data():
    rng = np.random.default_rng(4)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 0.5).astype(np.int32)
    return x, y


def compiled(model):
    model.compile(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


class Halved(keras.layers.Layer):
    """Halves its input while training: a layer whose output depends on `training`."""

    def call(self, x, training=False):
        return x * 0.5 if training else x


class Subclassed(keras.Model):
    """A model of one's own, as keras.io teaches it: layers made in __init__ from
    constructor arguments, a call that passes `training` on. No get_config."""

    def __init__(self, hidden, classes, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(hidden, activation="tanh")
        self.halved = Halved()
        self.out = keras.layers.Dense(classes)

    def call(self, x, training=False):
        return self.out(self.halved(self.hidden(x), training=training))


class Configured(Subclassed):
    """The same, serializable: get_config and from_config."""

    def get_config(self):
        return {"hidden": self.hidden.units, "classes": self.out.units}


class TrainerLayer(TensorFlowTrainer, keras.layers.Dense):
    """A Keras Trainer that is a layer, not a keras.Model."""

    def __init__(self, units):
        keras.layers.Dense.__init__(self, units, kernel_initializer="glorot_uniform")
        TensorFlowTrainer.__init__(self)


class WithAddedLoss(keras.Model):
    """Weight regularizers and an activity loss of its own (`add_loss`, a batch mean)."""

    def __init__(self):
        super().__init__()
        self.hidden = keras.layers.Dense(8, activation="relu", kernel_regularizer="l2")
        self.out = keras.layers.Dense(CLASSES, bias_regularizer=keras.regularizers.L1(0.01))

    def call(self, x):
        hidden = self.hidden(x)
        self.add_loss(0.05 * keras.ops.mean(keras.ops.square(hidden)))
        return self.out(hidden)


def functional():
    inputs = keras.Input((FEATURES,))
    return keras.Model(inputs, keras.layers.Dense(CLASSES)(keras.layers.Dense(8)(inputs)))


KINDS = {
    "functional": functional,
    "sequential": lambda: keras.Sequential(
        [
            keras.Input((FEATURES,)),
            keras.layers.Dense(8, activation="relu"),
            keras.layers.Dense(CLASSES),
        ]
    ),
    "sequential built on its first batch": lambda: keras.Sequential(
        [keras.layers.Dense(8, activation="relu"), keras.layers.Dense(CLASSES)]
    ),
    "subclassed": lambda: Subclassed(8, CLASSES),
    "subclassed with get_config": lambda: Configured(8, CLASSES),
    "a Trainer that is a layer": lambda: TrainerLayer(CLASSES),
    "regularizers and add_loss": WithAddedLoss,
}


def make(kind):
    keras.utils.set_random_seed(11)
    return compiled(KINDS[kind]())


@pytest.fixture(scope="module")
def fitted_by_keras():
    """model.fit of each kind on one device: its History and weights."""
    x, y = data()
    fitted = {}
    for kind in KINDS:
        model = make(kind)
        history = model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        fitted[kind] = history.history, model.get_weights()
    return fitted


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_of_model_trains_as_model_fit_in_every_mode(kind, mode, fitted_by_keras):
    x, y = data()
    model = make(kind)
    history = tfdp.fit(
        model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, **MODES[mode]
    )
    want_history, want_weights = fitted_by_keras[kind]
    assert sorted(history.history) == sorted(want_history)
    for name, values in want_history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-5, err_msg=name)
    assert model.history is history  # Keras' History, on the object passed
    got = model.get_weights()
    assert len(got) == len(want_weights)
    for have, want in zip(got, want_weights):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)
    # the object is as Keras left it: plain variables on one device, usable by Keras itself
    assert all(not isinstance(v.value, tf.distribute.DistributedValues) for v in model.weights)
    logs = model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)
    assert logs["accuracy"] == pytest.approx(keras_evaluate(kind, want_weights)["accuracy"])


def keras_evaluate(kind, weights):
    x, y = data()
    model = make(kind)
    model(x[:1])  # built, so that the weights can be set
    model.set_weights(weights)
    return model.evaluate(x, y, batch_size=BATCH, verbose=0, return_dict=True)


def test_the_weights_move():
    """Not vacuous: two epochs move every weight of every kind far beyond the tolerance."""
    x, y = data()
    for kind in KINDS:
        model = make(kind)
        model(x[:1])
        start = model.get_weights()
        tfdp.fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0)
        assert min(np.abs(a - b).max() for a, b in zip(model.get_weights(), start)) > 1e-3, kind


class RawVariable(keras.layers.Layer):
    """A layer holding a tf.Variable made outside Keras (not add_weight)."""

    def __init__(self):
        super().__init__()
        self.scale = tf.Variable(2.0)

    def call(self, x):
        return x * self.scale


def test_a_model_with_a_variable_keras_does_not_know_is_refused_in_one_line():
    """A tf.Variable that is not a Keras variable cannot be made again in a strategy's
    scope: mirrored and weighted refuse it, naming it, before any step; single trains the
    model as model.fit does."""
    x, y = data()

    def model():
        keras.utils.set_random_seed(5)
        return compiled(
            keras.Sequential([keras.Input((FEATURES,)), RawVariable(), keras.layers.Dense(CLASSES)])
        )

    for mode in ("mirrored 2", "weighted [1, 3]"):
        refused_model = model()
        start = refused_model.get_weights()
        with pytest.raises(ConfigError) as refused:
            tfdp.fit(refused_model, x, y, batch_size=BATCH, verbose=0, **MODES[mode])
        assert refused.value.field == "model"
        assert "tf.Variable" in refused.value.reason and ".scale" in refused.value.reason
        assert "add_weight" in refused.value.reason and "\n" not in str(refused.value)
        for have, want in zip(refused_model.get_weights(), start):
            np.testing.assert_array_equal(have, want)  # nothing was trained
    keras_model = model()
    keras_model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0)
    trained = model()
    tfdp.fit(trained, x, y, batch_size=BATCH, shuffle=False, verbose=0, **MODES["single"])
    for have, want in zip(trained.get_weights(), keras_model.get_weights()):
        np.testing.assert_allclose(have, want, rtol=1e-5, atol=1e-6)


class Counting(keras.Model):
    """Counts its calls in a variable of its own, as Keras' callback tests do."""

    def __init__(self):
        super().__init__()
        self.calls = self.add_variable(shape=(), initializer="zeros", trainable=False)
        self.out = keras.layers.Dense(CLASSES)

    def call(self, x):
        self.calls.assign(self.calls + 1)
        return self.out(x)


def test_single_hands_callbacks_the_models_variables_as_model_fit_does():
    """In single the model's variables stay as Keras made them: a callback reads
    `int(model.calls)` after each batch, as under model.fit (a strategy's mirrored
    variable refuses int())."""
    x, y = data()

    class Reads(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.read = []

        def on_train_batch_end(self, batch, logs=None):
            self.read.append(int(self.model.calls))

    runs = {}
    for name, fit in (("keras", None), ("single", tfdp.fit)):
        keras.utils.set_random_seed(5)
        model = compiled(Counting())
        reads = Reads()
        if fit is None:
            model.fit(x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[reads])
        else:
            fit(model, x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0,
                callbacks=[reads], **MODES["single"])
        runs[name] = reads.read
    assert runs["keras"] == [1, 2, 3, 4, 5, 6, 7, 8]  # 4 batches an epoch
    assert runs["single"] == runs["keras"]

