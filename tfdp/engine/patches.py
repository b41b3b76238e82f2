"""Every function of Keras and TensorFlow that tfdp replaces, in one place.

`install()` replaces them once per process, when the first of tfdp's strategies (or a
trainer's device work) is made, and for the rest of the process. Each replacement is
the original, called as it is, except inside a weighed replica step of tfdp's strategy
(`replica.current()`: a step being traced, on tfdp's replicas), or for a model under
tfdp's strategy: a plain Keras model, or TensorFlow's own MirroredStrategy, in the same
process trains as in a process that never imported tfdp. `ORIGINALS` holds what each
replaced; internals.py names each target (`replacement_targets`).

| replaced | inside tfdp's replicas |
| --- | --- |
| Keras' `scale_loss_for_distribution`, `unscale_...` | a piece's loss weighed by its rows, not 1/R (engine/shards.py) |
| `tf.nn.compute_average_loss` (no `global_batch_size`) | the piece's mean times its share |
| `BatchNormalization._moments` | the whole batch's mean and variance (`batch_statistics="whole"`) |
| TensorFlow's `values_util.on_write_assign` | moving statistics combined by share (`batch_statistics="replica"`) |
| `BaseOptimizer._clip_gradients` | an own loss's gradients weighed by share; clipping of the summed gradient |
| `Layer.add_weight`, `BaseOptimizer.add_variable` | a variable built inside a distributed tf.function refused in one line |
| `TensorFlowTrainer._make_function`, `make_predict_function` | for a model under tfdp's strategy: `steps_per_execution` as one-step calls; XLA only where it can span the replicas |
| `TensorFlowTrainer._maybe_symbolic_build` | for a model under tfdp's strategy: built from the data's shapes, no batch read ahead |
"""

from __future__ import annotations

import contextlib
import warnings

import tensorflow as tf

from tfdp import internals
from tfdp.engine import replica, shards, whole_batch
from tfdp.engine.pieces import none_for_none_spec
from tfdp.errors import ConfigError

ORIGINALS = {}  # name -> what tfdp replaced (empty until `install`)


def install() -> None:
    """Every replacement, once per process."""
    if ORIGINALS:
        return
    for name, replacement in (
        ("scale_loss_for_distribution", scale_loss_for_distribution),
        ("unscale_loss_for_distribution", unscale_loss_for_distribution),
        ("on_write_assign", on_write_assign),
        ("clip_gradients", clip_gradients),
        ("add_weight", add_weight),
        ("add_variable", add_variable),
        ("make_function", make_function),
        ("make_predict_function", make_predict_function),
        ("maybe_symbolic_build", maybe_symbolic_build),
        ("moments", moments),
    ):
        ORIGINALS[name] = internals.replace(name, replacement)
    ORIGINALS["compute_average_loss"] = tf.nn.compute_average_loss
    compute_average_loss.__doc__ = tf.nn.compute_average_loss.__doc__
    internals.replace_everywhere(tf.nn.compute_average_loss, compute_average_loss)


def _under_tfdp(model) -> bool:
    return getattr(model.distribute_strategy, "weighs_pieces", False)


# -- the loss of a piece: weighed by its rows ------------------------------------------------


def scale_loss_for_distribution(value):
    """Keras' 1/R for R replicas; in a piece (engine/shards.py), the piece's share."""
    piece = shards.current()
    if piece is None:
        return ORIGINALS["scale_loss_for_distribution"](value)
    piece.scaled = True
    return value * tf.cast(piece.fraction, value.dtype)


def unscale_loss_for_distribution(value):
    piece = shards.current()
    if piece is None:
        return ORIGINALS["unscale_loss_for_distribution"](value)
    return tf.math.divide_no_nan(value, tf.cast(piece.fraction, value.dtype))


def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
    """TensorFlow's; in a weighed replica step without `global_batch_size`, the replica's
    part of the whole batch's mean (its piece's mean times its share), where TensorFlow
    divides by the piece's rows times the replicas, right for even pieces only."""
    tensorflows = ORIGINALS["compute_average_loss"]
    step = replica.current()
    if global_batch_size is not None or step is None:
        return tensorflows(per_example_loss, sample_weight=sample_weight,
                           global_batch_size=global_batch_size)
    per_example_loss = tf.convert_to_tensor(per_example_loss)
    rows = tf.shape(per_example_loss)[0] if per_example_loss.shape.rank else None
    mean = tensorflows(per_example_loss, sample_weight=sample_weight, global_batch_size=rows)
    return mean * tf.cast(step.fraction, mean.dtype)


# -- BatchNormalization ----------------------------------------------------------------------


def moments(self, inputs, mask):
    """Keras' own moments, but in a weighed replica step: the whole global batch's
    (`batch_statistics="whole"`, the default; one all-reduce, as Keras' `synchronized=True`),
    or with "replica" each piece's, its moving statistics then combined by share
    (`on_write_assign`)."""
    keras_moments = ORIGINALS["moments"]
    step = replica.current()
    context = tf.distribute.get_replica_context()
    if step is None or context is None or context.num_replicas_in_sync == 1:
        return keras_moments(self, inputs, mask)
    if context.strategy.batch_statistics == "replica" and not self.synchronized:
        step.moving_statistics.update(
            id(internals.variable_value(v)) for v in self.non_trainable_variables
        )
        return keras_moments(self, inputs, mask)
    return whole_batch.moments(self, inputs, mask, step.all_reduce)


def on_write_assign(var, value, use_locking=False, name=None, read_value=True):
    """TensorFlow's; in a weighed replica step with per-replica batch statistics, an
    assignment to a BatchNormalization layer's moving statistics assigns the replicas'
    values combined by share, on every replica. Every other assignment in a replica is
    TensorFlow's (an ON_WRITE variable with aggregation NONE keeps each replica's value)."""
    step = replica.current()
    if step is not None and id(var) in step.moving_statistics:
        value = tf.convert_to_tensor(value, var.dtype)
        share = tf.cast(step.fraction, value.dtype)
        mine = tf.where(share > 0, value * share, tf.zeros_like(value))
        value = step.all_reduce(tf.distribute.ReduceOp.SUM, mine)
    return ORIGINALS["on_write_assign"](var, value, use_locking=use_locking, name=name,
                                        read_value=read_value)


# -- the optimizer: an own loss's gradients, and clipping of the sum ---------------------------


def clip_gradients(self, grads):
    """Keras' clip; in a weighed replica step, the gradients of an own step whose loss Keras
    never scaled (its own mean) are weighed by the replica's share (exact for a mean over
    the batch), and an optimizer that clips (clipnorm, clipvalue, global_clipnorm) clips
    the gradient summed over the replicas, as on one device: Keras clips each replica's
    gradient before its all-reduce, which depends on the pieces. The replicas' gradients
    are summed, clipped by Keras' own rule, and each replica hands on 1/R of the result:
    Keras' clip then leaves each part as it is and its all-reduce sums them to the
    clipped sum. One more all-reduce per step, only where the optimizer clips."""
    keras_clip = ORIGINALS["clip_gradients"]
    step = replica.current()
    if step is None:
        return keras_clip(self, grads)
    piece = shards.current()
    if step.own_loss and piece is not None and not piece.scaled:
        grads = [None if g is None else shards.weighed(g, step.fraction) for g in grads]
        step.weighed_own = True
    if not any(getattr(self, name, None) for name in ("clipnorm", "clipvalue", "global_clipnorm")):
        return keras_clip(self, grads)
    present = [i for i, g in enumerate(grads) if g is not None]
    summed = step.all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
    clipped = keras_clip(self, list(summed))
    replicas = tf.distribute.get_replica_context().num_replicas_in_sync
    grads = list(grads)
    for i, g in zip(present, clipped):
        grads[i] = g / tf.cast(replicas, g.dtype)
    return keras_clip(self, grads)


# -- variables built inside a distributed tf.function ------------------------------------------


def add_weight(self, *args, **kwargs):
    _refuse_a_build_inside_a_distributed_function("layer", self.name, "call")
    return ORIGINALS["add_weight"](self, *args, **kwargs)


def add_variable(self, *args, **kwargs):
    _refuse_a_build_inside_a_distributed_function("optimizer", self.name, "apply_gradients")
    return ORIGINALS["add_variable"](self, *args, **kwargs)


def _refuse_a_build_inside_a_distributed_function(field, name, first) -> None:
    """A layer or an optimizer that makes variables on its first call inside `strategy.run`
    in a tf.function (TensorFlow's custom-training tutorial, as published: a Sequential
    model without an input shape, Adam) makes a step TensorFlow cannot run on several
    replicas: TensorFlow's MirroredStrategy fails there when the step runs ("You must
    feed a value for placeholder tensor", keras-team/keras#19246). Under tfdp's strategy
    it is one line, when the step is traced, naming what to build first. (An optimizer
    that makes no variables, SGD without momentum, builds there as under TensorFlow's.)"""
    step = replica.current()
    context = tf.distribute.get_replica_context()
    if step is not None and step.traced and context is not None and context.num_replicas_in_sync > 1:
        raise ConfigError(
            field, name,
            f"builds its variables on its first {first}, inside strategy.run in a tf.function, "
            "which TensorFlow cannot run on several replicas: in strategy.scope(), before the "
            "loop, build the model and then the optimizer (model.build(input_shape); "
            "optimizer.build(model.trainable_variables))",
        )


# -- Keras' step functions, for a model under tfdp's strategy -----------------------------------


def make_function(self, step_function):
    """Keras' function of `steps_per_execution` steps, as that many calls of a one-step
    function (Keras' own multi-step loop fails inside tf.distribute on this TensorFlow:
    keras-team/keras#19246), without XLA where the replicas are not all GPUs."""
    keras_make = ORIGINALS["make_function"]
    if not _under_tfdp(self):
        return keras_make(self, step_function)
    with _without_xla(self, self.distribute_strategy):
        one_step = keras_make(self, step_function)
    return _step_by_step(self, one_step)


def make_predict_function(self, force=False):
    keras_make_predict = ORIGINALS["make_predict_function"]
    if not _under_tfdp(self):
        return keras_make_predict(self, force)
    with _without_xla(self, self.distribute_strategy):
        return keras_make_predict(self, force)


def maybe_symbolic_build(self, iterator=None, data_batch=None):
    """Keras builds the model from the data's shapes (`element_spec`) where it would take
    the first batch of a fresh iterator (which loses the batches a generator had read
    ahead)."""
    keras_build = ORIGINALS["maybe_symbolic_build"]
    strategy = internals.model_strategy(self)
    spec = getattr(internals.distributed_dataset(iterator), "_tfdp_element_spec", None)
    if not getattr(strategy, "weighs_pieces", False) or data_batch is not None or spec is None:
        return keras_build(self, iterator=iterator, data_batch=data_batch)
    spec = tf.nest.map_structure(none_for_none_spec, spec)  # an optional input given None
    with strategy.scope():
        internals.build_from_spec(self, spec)


@contextlib.contextmanager
def _without_xla(model, strategy):
    if model.run_eagerly or not model.jit_compile or strategy.compiles_with_xla:
        yield
        return
    warnings.warn(
        f"tfdp.MirroredStrategy: {model.name} runs without XLA (jit_compile=True is set): "
        f"one XLA program cannot span the devices {', '.join(strategy.extended.worker_devices)}",
        stacklevel=4,
    )
    internals.set_jit_compile(model, False)
    try:
        yield
    finally:
        internals.set_jit_compile(model, True)


def _step_by_step(model, one_step):
    """Keras' function of `steps_per_execution` steps, as that many one-step calls."""

    def function(iterator):
        steps = model.steps_per_execution
        outputs = None
        for _ in range(steps):
            model.steps_per_execution = 1  # read when Keras' function traces
            try:
                outputs = one_step(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise
                break
            finally:
                model.steps_per_execution = steps
        return outputs

    return function
