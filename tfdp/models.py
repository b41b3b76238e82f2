"""Models as tfdp trains them: any compiled Keras model, or a function that returns one;
the tutorial's two networks are the built-in ones.
"""

from __future__ import annotations

import contextlib

import keras
import numpy as np
import tensorflow as tf

from tfdp import internals
from tfdp.errors import ConfigError, DoesNotFit


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
    (BUILD_NOTES, "oneDNN's CPU kernels: on by default").
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
        jit_compile=False,  # tfdp's --jit_compile decides
    )
    return model


def the_model(model, field: str = "model", source=None, precision: str = "float32"):
    """The Keras model to train: `model` itself (any compiled Keras model: Functional,
    Sequential, subclassed, a Keras Trainer that is a layer), or what `model`, a function
    of no arguments, returns, built under the Keras dtype policy `precision`.

    A model object keeps the dtypes it was built with, so it takes only float32 here.

    Raises:
      ConfigError: naming `field` and what is wrong.
    """
    label = source or getattr(model, "name", None) or repr(model)
    if isinstance(model, internals.keras_trainer()):
        if precision != "float32":
            raise ConfigError(
                "precision",
                precision,
                "needs a function that builds the model, so that tfdp builds it under "
                "the policy; a model object keeps the dtypes it was built with",
            )
    elif callable(model):
        try:
            with dtype_policy(precision):
                model = model()
        except ConfigError:
            raise
        except Exception as error:  # the user's code: any error, reported on one line
            raise ConfigError(field, label, f"raised {type(error).__name__}: {error}") from None
        if not isinstance(model, internals.keras_trainer()):
            raise ConfigError(
                field, label, f"returned {type(model).__name__}, not a compiled Keras model"
            )
    else:
        raise ConfigError(
            field, label, "must be a compiled Keras model or a function that returns one"
        )
    check_model(model, field)
    return model


def has_batch_statistics(model) -> bool:
    """Whether the model has layers whose output depends on the batch (batch
    normalization): cutting a shard into chains would change them."""
    return any(
        isinstance(layer, keras.layers.BatchNormalization) for layer in internals.layers_of(model)
    )


def built_in(config, build: bool = False):
    """The config's built-in model, compiled as the tutorial trains it; with `build`, its
    variables made (for a caller without data at hand)."""
    model = compiled(
        config.model,
        config.init,
        config.seed,
        config.hidden_units,
        config.learning_rate,
        config.precision,
    )
    if build:
        import tensorflow as tf

        shape = BUILT_IN_INPUTS[config.model]
        build_on(model, (tf.zeros((2, *shape), tf.float32), tf.zeros((2,), tf.int32)))
    return model


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


def check_model(model, field: str = "model") -> None:
    """ConfigError unless `model` is a compiled Keras trainer (a Model, or a layer that is
    a Keras Trainer)."""
    if not isinstance(model, internals.keras_trainer()):
        raise ConfigError(
            field,
            getattr(model, "name", type(model).__name__),
            "is not a Keras model: give a compiled keras.Model (any kind), or a function "
            "that returns one",
        )
    if not model.compiled:
        raise ConfigError(
            field,
            model.name,
            "is not compiled; call model.compile(optimizer=..., loss=...) first",
        )


def build_on(model, batch, field: str = "x") -> None:
    """Builds what `fit` builds before its first step (the model, its compiled loss and
    metrics, the optimizer) from a batch of examples, as Keras does (symbolically);
    ConfigError naming `field` if the data does not fit the model."""
    own = internals.model_strategy(model)  # built in a strategy's scope: there
    try:
        with own.scope() if own else tf.device("/cpu:0"):
            internals.symbolic_build(model, batch)
    except Exception as error:  # Keras raises many kinds for data that does not fit
        raise DoesNotFit(field, described(batch), error) from None


def check_fits(model, batch, field: str) -> None:
    """ConfigError naming `field` unless a batch of it fits the built model: its inputs the
    model's, its targets the compiled loss's (checked symbolically, as Keras builds)."""
    unpack_x_y_sample_weight = internals.data_adapter_utils().unpack_x_y_sample_weight

    def symbolic(leaf):
        return None if leaf is None else internals.keras_tensor(leaf.shape, leaf.dtype.name)

    try:
        x, y, sample_weight = unpack_x_y_sample_weight(tf.nest.map_structure(symbolic, batch))
        y_pred = internals.compute_output_spec(model, x, training=False)
        if y is not None:
            internals.compute_output_spec(
                internals.compute_loss_of(model),
                x,
                y,
                y_pred,
                sample_weight=sample_weight,
                training=False,
            )
    except Exception as error:  # Keras raises many kinds for data that does not fit
        raise DoesNotFit(field, described(batch), error) from None


def described(structure) -> str:
    """Shapes of a nested structure, for an error line."""
    try:
        return str(tf.nest.map_structure(lambda t: tuple(t.shape), structure))
    except Exception:  # noqa: BLE001 - only for a message
        return type(structure).__name__
