"""The tutorial's two networks in plain Keras, and their seeded initial weights."""

from __future__ import annotations

import keras
import numpy as np

from tfdp.errors import ConfigError


def _initializers(init: str, seed: int, layer: int):
    """Kernel and bias initialisers for the `layer`-th weighted layer."""
    layer_seed = seed * 1000 + layer  # distinct, reproducible per layer
    if init == "tutorial":
        # The MXNet tutorial: weights uniform in [-0.1, 0.1], biases zero.
        return keras.initializers.RandomUniform(-0.1, 0.1, seed=layer_seed), "zeros"
    if init == "keras":
        return keras.initializers.GlorotUniform(seed=layer_seed), "zeros"
    raise ConfigError("init", init, "must be one of tutorial, keras")


def lenet(init: str = "tutorial", seed: int = 0, num_classes: int = 10) -> keras.Model:
    """LeNet-5 as in the tutorial; outputs logits (softmax is in the loss)."""

    def weights(layer):
        kernel, bias = _initializers(init, seed, layer)
        return dict(kernel_initializer=kernel, bias_initializer=bias)

    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(20, 5, activation="tanh", **weights(0)),
            keras.layers.MaxPooling2D(2, strides=2),
            keras.layers.Conv2D(50, 5, activation="tanh", **weights(1)),
            keras.layers.MaxPooling2D(2, strides=2),
            keras.layers.Flatten(),
            keras.layers.Dense(500, activation="tanh", **weights(2)),
            keras.layers.Dense(num_classes, **weights(3)),
        ],
        name="lenet",
    )


def pool_first_lenet(model):
    """A copy of `model` (LeNet) with each convolution's tanh after its max-pooling.

    tanh is increasing, so max(tanh(a), tanh(b)) = tanh(max(a, b)): the same
    function, with tanh and its gradient on a quarter of the values. Measured
    by `python -m tfdp.bench_steps --variant=pool_first`; not used by the modes
    (BUILD_NOTES, "The other things tried").
    """
    layers = []
    for layer in model.layers:
        config = layer.get_config()
        if isinstance(layer, keras.layers.Conv2D):
            activation = config["activation"]
            layers.append(layer.__class__.from_config({**config, "activation": "linear"}))
        else:
            layers.append(layer.__class__.from_config(config))
            if isinstance(layer, keras.layers.MaxPooling2D):
                layers.append(keras.layers.Activation(activation))
    copy = keras.Sequential([keras.Input((28, 28, 1))] + layers)
    copy.set_weights(model.get_weights())
    return copy


def toy_mlp(
    init: str = "tutorial",
    seed: int = 0,
    num_features: int = 128,
    hidden_units: int = 64,
    num_classes: int = 10,
) -> keras.Model:
    """The tutorial's small MLP: one hidden relu layer; outputs logits."""
    kernel0, bias0 = _initializers(init, seed, 0)
    kernel1, bias1 = _initializers(init, seed, 1)
    return keras.Sequential(
        [
            keras.Input((num_features,)),
            keras.layers.Dense(
                hidden_units, activation="relu", kernel_initializer=kernel0, bias_initializer=bias0
            ),
            keras.layers.Dense(num_classes, kernel_initializer=kernel1, bias_initializer=bias1),
        ],
        name="toy",
    )


def build_model(
    name: str, init: str = "tutorial", seed: int = 0, hidden_units: int = 64
) -> keras.Model:
    """A fresh model by name; the same arguments give the same initial weights."""
    if name == "lenet":
        return lenet(init, seed)
    if name == "toy":
        return toy_mlp(init, seed, hidden_units=hidden_units)
    raise ConfigError("model", name, "must be one of lenet, toy")


def initial_weights(
    name: str, init: str = "tutorial", seed: int = 0, hidden_units: int = 64
) -> list[np.ndarray]:
    """The initial weights every mode starts from, made once on the host CPU.

    Every trainer builds its own model copies and sets these, so no mode
    depends on how a device or a strategy would run the initialisers.
    """
    import tensorflow as tf

    with tf.device("/device:CPU:0"):
        return build_model(name, init, seed, hidden_units).get_weights()
