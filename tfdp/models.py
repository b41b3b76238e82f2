"""Models as tfdp trains them: a factory of compiled Keras copies, the initial weights
every copy starts from, and the objective; the tutorial's two networks are the
built-in factories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

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


def channels_first_lenet(model):
    """A copy of `model` (LeNet) that keeps its feature maps as NCHW."""
    copy = keras.Sequential(
        [keras.Input((28, 28, 1)), keras.layers.Permute((3, 1, 2))]
        + [
            layer.__class__.from_config({**layer.get_config(), "data_format": "channels_first"})
            if "data_format" in layer.get_config()
            else layer.__class__.from_config(layer.get_config())
            for layer in model.layers
        ]
    )
    copy.set_weights(model.get_weights())  # same shapes; only the flattening order differs
    return copy


def pool_first_lenet(model):
    """A copy of `model` (LeNet) with each convolution's tanh after its max-pooling.

    tanh is increasing, so max(tanh(a), tanh(b)) = tanh(max(a, b)): the same
    function, with tanh and its gradient on a quarter of the values. Measured
    by `python -m tfdp.bench.steps --variant=pool_first`; not used by the modes
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


BUILT_IN_INPUTS = {"lenet": (28, 28, 1), "toy": (128,)}  # one example's shape


@contextlib.contextmanager
def dtype_policy(precision: str):
    """Keras' global dtype policy set to `precision` inside, and restored after: the
    layers built inside keep it, and nothing built later in the process sees it."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(previous)


def compiled(
    name: str,
    init: str = "tutorial",
    seed: int = 0,
    hidden_units: int = 64,
    learning_rate: float = 0.1,
    precision: str = "float32",
) -> keras.Model:
    """A built-in model, compiled as the tutorial trains it: plain SGD on the softmax
    cross-entropy of its logits, with accuracy as the metric.

    precision: the Keras dtype policy its layers are built with (float32,
    mixed_bfloat16, mixed_float16: they compute in that dtype, their variables
    stay float32; a float32 linear layer last makes the logits float32). mixed_float16 wraps
    SGD in a LossScaleOptimizer, whose dynamic loss scale keeps small
    gradients from flushing to zero in float16 (a step whose gradients
    overflow is skipped, and the scale halved).
    """
    with dtype_policy(precision):
        model = build_model(name, init, seed, hidden_units)
    if precision != "float32":
        # float32 logits, as Keras' mixed precision guide advises: the softmax, the loss
        # and the outputs every mode gathers are float32 (a bfloat16 tensor cannot be
        # all-gathered between workers)
        model.add(keras.layers.Activation("linear", dtype="float32", name="logits"))
    optimizer = keras.optimizers.SGD(learning_rate)
    if precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    model.compile(
        optimizer=optimizer,
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A model as every mode builds it.

    Attributes:
      make: returns a fresh compiled copy; a mode calls it where it needs one
        (in a strategy's scope, under a device).
      weights: the initial weights every copy is set to.
      objective: the compiled loss per shard and the metrics (objective.py).
      name: for the banner and result.
      batch_statistics: the model has layers whose output depends on the batch
        (batch normalization): cutting a shard into chains would change them.
      jit_compile: every mode compiles each device's forward and backward
        with XLA (`steps.xla_gradients`).
    """

    make: Callable[[], keras.Model]
    weights: list
    objective: object
    name: str
    batch_statistics: bool
    jit_compile: bool = False


def model_spec(
    model,
    samples: dict,
    field: str = "model",
    source=None,
    precision: str = "float32",
    jit_compile: bool = False,
) -> ModelSpec:
    """The ModelSpec of `model`: a compiled Keras model, or a function of no arguments
    that returns one.

    precision: the Keras dtype policy a function's models are built under
    (`dtype_policy`); Keras' `compile` then wraps the optimizer of a
    mixed_float16 model in a LossScaleOptimizer. A model object keeps the
    dtypes it was built with, so it takes only float32 here.
    jit_compile: XLA for each device's forward and backward pass.

    One copy is built on the host and checked against `samples` ({setting: a
    few examples}): its inputs, its labels and its compiled loss. A model
    object is copied with `keras.models.clone_model` and recompiled with a
    fresh optimizer of the same config; its current weights are every copy's
    initial weights. A function is called for every copy; its first copy's
    weights are every copy's initial weights.

    Raises:
      ConfigError: naming `field` (or the setting of a sample) and what is wrong.
    """
    import tensorflow as tf

    from tfdp.objective import Objective

    label = source or getattr(model, "name", None) or repr(model)
    with tf.device("/device:CPU:0"):
        if isinstance(model, keras.Model):
            if precision != "float32":
                raise ConfigError(
                    "precision",
                    precision,
                    "needs a function that builds the model, so that tfdp builds it under "
                    "the policy; a model object keeps the dtypes it was built with",
                )
            make, first = _copier(model, field), model
        elif callable(model):
            make = functools.partial(_made_by, model, field, label, precision)
            first = make()
        else:
            raise ConfigError(
                field, label, "must be a compiled Keras model or a function that returns one"
            )
        objective = None
        for setting, batch in samples.items():
            if objective is None:
                objective = Objective(first, batch, setting)
            else:
                objective.check(first, batch, setting)
        weights = first.get_weights()
    return ModelSpec(
        make, weights, objective, first.name, _has_batch_statistics(first), jit_compile
    )


def _made_by(function, field, label, precision="float32"):
    try:
        with dtype_policy(precision):
            model = function()
    except Exception as error:  # the user's code: any error, reported on one line
        raise ConfigError(field, label, f"raised {type(error).__name__}: {error}") from None
    if not isinstance(model, keras.Model):
        raise ConfigError(
            field, label, f"returned {type(model).__name__}, not a compiled Keras model"
        )
    return model


def _copier(model, field):
    """A function that returns compiled copies of `model` (its structure, its compile
    settings, a fresh optimizer of the same config)."""
    from tfdp.objective import compile_settings

    settings = compile_settings(model)
    try:
        keras.models.clone_model(model)
    except Exception as error:  # subclassed models without get_config cannot be cloned
        raise ConfigError(
            field,
            model.name,
            f"cannot be copied by keras.models.clone_model ({type(error).__name__}); "
            "pass a function that builds and compiles it instead",
        ) from None

    def make():
        copy = keras.models.clone_model(model)
        optimizer = model.optimizer.__class__.from_config(model.optimizer.get_config())
        copy.compile(**{**settings, "optimizer": optimizer})
        return copy

    return make


def _has_batch_statistics(model) -> bool:
    return any(
        isinstance(layer, keras.layers.BatchNormalization) for layer in model._flatten_layers()
    )


def built_in_spec(config, samples: dict | None = None) -> ModelSpec:
    """The ModelSpec of the config's built-in model (`samples`: as in `model_spec`; None:
    zeros of the model's input shape)."""
    import tensorflow as tf

    make = functools.partial(
        compiled,
        config.model,
        config.init,
        config.seed,
        config.hidden_units,
        config.learning_rate,
        config.precision,
    )
    if samples is None:
        shape = BUILT_IN_INPUTS[config.model]
        samples = {"dataset": (tf.zeros((2, *shape), tf.float32), tf.zeros((2,), tf.int32))}
    spec = model_spec(make, samples, source=config.model)
    return dataclasses.replace(spec, jit_compile=config.jit_compile)


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
