"""tfdp's exact weighting of uneven shards, in one place.

Every mode runs the model's own `train_step` on each device's shard of the global
batch (on each of its pieces, when a device cuts its shard into side-by-side
chains). Three things make the sum of the pieces the update of one device on the
whole batch, however unevenly the batch was cut:

1. **The loss of a piece is weighed by its examples.** Keras scales a replica's
   mean-type loss (the compiled loss, `add_loss` terms, regularizers) by 1/R for
   R replicas (`keras.src.losses.loss.scale_loss_for_distribution`), exact only
   for equal shards. While a piece is traced, tfdp's replacement (engine/patches.py)
   scales it by n/N instead (n examples of N in the global batch), and unscales the loss
   trackers' values by the same factor. Keras decides which losses get the
   factor ("sum" reductions do not), so it stays Keras' rule, with tfdp's weight.
2. **The gradients go to the mode's reduction.** While a piece is traced,
   `model.optimizer` is a `ShardOptimizer`: it keeps the gradients the step hands
   to `apply_gradients` / `apply` instead of applying them. The mode then sums
   the pieces' gradients (on device 0, or in the optimizer's all-reduce) and
   applies them once with the model's real optimizer.

3. **Each output's loss tracker counts a piece by its share** (`kind_loss` of a model
   with several outputs): Keras counts a step once there, so the pieces of a step
   add up to it.

A step that computes its loss without Keras' loss machinery (an overridden
`train_step` taking `ops.mean` of its own loss) is never scaled; its gradients
are weighed by n/N when handed over, which is exact for a loss that is a mean
over the batch, and said once (`ShardContext.note`); the scalars its own `Mean`
trackers take are counted by n/N too (`weighing_output_losses`).
"""

from __future__ import annotations

import contextlib
import threading

import tensorflow as tf

from tfdp import internals

_local = threading.local()  # MirroredStrategy traces each replica in a thread of its own


class ShardContext:
    """What one piece's trace carries: its weight and the gradients its step handed over.

    Attributes:
      fraction: examples of the piece over examples of the global batch (a tensor).
      scaled: Keras' distribution scaling was applied to a loss of the piece.
      handed: (gradients, variables) pairs the step handed to `model.optimizer`.
    """

    def __init__(self, fraction):
        self.fraction = fraction
        self.scaled = False
        self.handed = []


def current() -> ShardContext | None:
    return getattr(_local, "context", None)


@contextlib.contextmanager
def piece(fraction):
    """Inside: the losses Keras scales for distribution are weighed by `fraction` (its
    replacement of Keras' scaling is engine/patches.py's)."""
    outer = current()
    context = _local.context = ShardContext(tf.convert_to_tensor(fraction, tf.float32))
    try:
        yield context
    finally:
        _local.context = outer


class ShardOptimizer:
    """Stands in for `model.optimizer` while a piece is traced: gradients handed to it are
    kept in the piece's `ShardContext`; everything else is the real optimizer's (its loss
    scaling, learning rate, iterations)."""

    def __init__(self, optimizer):
        object.__setattr__(self, "_optimizer", optimizer)

    def __getattr__(self, name):
        return getattr(self._optimizer, name)

    def __setattr__(self, name, value):
        setattr(self._optimizer, name, value)

    def apply_gradients(self, grads_and_vars):
        grads, variables = zip(*list(grads_and_vars))
        self.apply(grads, variables)
        return self._optimizer.iterations

    def apply(self, grads, trainable_variables=None):
        context = current()
        if context is None:  # outside tfdp's pieces (a callback's own step): the real one
            return self._optimizer.apply(grads, trainable_variables)
        if trainable_variables is None:
            trainable_variables = internals.optimizer_variables(self._optimizer)
        context.handed.append((list(grads), list(trainable_variables)))


@contextlib.contextmanager
def handing_over(model):
    """Inside: `model.optimizer` is a ShardOptimizer of the model's optimizer."""
    optimizer = model.optimizer
    if optimizer is None or isinstance(optimizer, ShardOptimizer):
        yield
        return
    object.__setattr__(model, "optimizer", ShardOptimizer(optimizer))
    try:
        yield
    finally:
        object.__setattr__(model, "optimizer", optimizer)


def trainer_of(fn):
    """The Keras model whose own step `fn` is (Keras passes `model.train_step`), else None."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if isinstance(owner, internals.keras_trainer()) and name in ("train_step", "test_step"):
        return owner
    return None


def not_scaled(model, step_name, weighed, replicas) -> str | None:
    """The note for a model's own `train_step` whose loss Keras never scaled, run on
    `replicas` replicas (None where there is nothing to say): its gradients were weighed
    by share (`weighed`, exact for a mean over the batch), or not weighed at all."""
    name = f"{type(model).__name__}.{step_name}"
    if step_name != "train_step" or not overrides(model, "train_step"):
        return None
    if replicas == 1 or not model.trainable_weights:  # nothing to weigh
        return None
    if weighed:
        return (
            f"{name} computes its loss without Keras' loss functions (compute_loss): each "
            "replica's gradients and the scalars its Mean trackers take are weighed by its "
            "share of the batch's examples, which is exact for a loss that is a mean over "
            "the batch"
        )
    return (
        f"{name} computes its loss without Keras' loss functions and hands no gradients "
        "to an optimizer: its update is not weighed by each replica's share of the "
        "batch, and is not one device's; compute the loss with self.compute_loss(...)"
    )


def overrides(model, name: str) -> bool:
    """Whether `model`'s class overrides Keras' `name` (train_step, test_step, ...)."""
    keras_own = getattr(internals.tensorflow_trainer(), name, None) or getattr(
        internals.keras_trainer(), name
    )
    return getattr(type(model), name, keras_own) is not keras_own


class Handed:
    """The gradients one piece handed over, summed by variable, in the order first seen."""

    def __init__(self):
        self.variables = []
        self.gradients = {}

    def add(self, gradients, variables, weight=None):
        for gradient, variable in zip(gradients, variables):
            if gradient is None:
                continue
            if weight is not None:
                gradient = weighed(gradient, weight)
            key = id(variable)
            if key in self.gradients:
                self.gradients[key] = add_gradients(self.gradients[key], gradient)
            else:
                self.variables.append(variable)
                self.gradients[key] = gradient

    def pairs(self):
        return [(self.gradients[id(v)], v) for v in self.variables]


def add_gradients(a, b):
    """Two gradients of a variable, summed; two sparse ones (IndexedSlices, an embedding's)
    stay sparse: their rows side by side, as the optimizer adds them up."""
    if isinstance(a, tf.IndexedSlices) and isinstance(b, tf.IndexedSlices):
        return tf.IndexedSlices(
            tf.concat([a.values, b.values], 0), tf.concat([a.indices, b.indices], 0), a.dense_shape
        )
    return tf.convert_to_tensor(a) + tf.convert_to_tensor(b)


def weighed(gradient, weight):
    """A gradient times `weight` (a sparse one's rows)."""
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values * tf.cast(weight, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient * tf.cast(weight, gradient.dtype)


@contextlib.contextmanager
def weighing_output_losses(model, fraction):
    """Inside: the trackers of each output's loss (a multi-output model's `kind_loss`) count a
    piece by `fraction` where Keras counts a step once. Keras weighs those updates by the
    batch's static size, unknown in a traced step, so each step counts once on one device;
    the pieces of a step, weighed by their share, then add up to that step, however uneven.
    The weight is the thread's own (a strategy traces its replicas in threads of their own);
    a tracker keeps tfdp's wrapper, which outside a piece is Keras' own update."""
    compile_loss = internals.compile_loss(model)
    for tracker in list(getattr(compile_loss, "metrics", None) or []):
        if "update_state" not in vars(tracker):
            tracker.update_state = _weighed_by_piece(tracker.update_state)
    for tracker in _own_means(model):
        if "update_state" not in vars(tracker):
            tracker.update_state = _weighed_by_piece(tracker.update_state, scalars_only=True)
    outer = getattr(_local, "output_fraction", None)
    _local.output_fraction = fraction
    try:
        yield
    finally:
        _local.output_fraction = outer


def _own_means(model):
    """The model's `Mean` trackers of a scalar: a step's own (keras.io's `loss_tracker`), and
    Keras' loss tracker where a step of its own updates it without a weight (Keras' own
    step weighs it by the batch's size, which the wrapper leaves as it is)."""
    import keras

    MeanMetricWrapper = internals.mean_metric_wrapper()  # noqa: N806 (Keras' class)
    try:
        metrics = list(model.metrics)
    except Exception:  # noqa: BLE001 - a `metrics` property of the user's that fails unbuilt
        return []
    return [
        m
        for m in metrics
        if isinstance(m, keras.metrics.Mean)
        and not isinstance(m, MeanMetricWrapper)  # of (y_true, y_pred): per example
    ]


def _weighed_by_piece(update_state, scalars_only=False):
    """`update_state` that counts a value by the piece's share where it names no weight
    (with `scalars_only`, a scalar only: a value per example counts its examples
    already). A scalar a step of its own tracks is taken as a mean over its piece, as
    its gradients are (`train_piece`); one taken once Keras has scaled the piece's loss
    (a `compute_loss` override tracking the loss it returns) as that part of the batch's."""

    def update(values, sample_weight=None):
        fraction = getattr(_local, "output_fraction", None)
        if sample_weight is not None or fraction is None:
            return update_state(values, sample_weight=sample_weight)
        if scalars_only:
            values = tf.convert_to_tensor(values)
            if values.shape.rank != 0:
                return update_state(values, sample_weight=sample_weight)
            context = current()
            if context is not None and context.scaled:  # the batch's value, n/N of it
                values = tf.math.divide_no_nan(values, tf.cast(fraction, values.dtype))
        return update_state(values, sample_weight=fraction)

    return update


def train_piece(model, data, fraction):
    """`model.train_step(data)` for a piece of `fraction` of the global batch: (its logs,
    the gradients it handed over as a `Handed`, and a note of how its step was run, or
    None where it has Keras' own form)."""
    with piece(fraction) as context, handing_over(model), weighing_output_losses(model, fraction):
        logs = model.train_step(data)
    handed = Handed()
    own = overrides(model, "train_step")
    weigh = own and context.handed and not context.scaled
    for gradients, variables in context.handed:
        handed.add(gradients, variables, context.fraction if weigh else None)
    note = None
    name = f"{type(model).__name__}.train_step"
    if weigh:
        note = (
            f"{name} computes its loss without Keras' loss functions (compute_loss): each "
            "device's gradients and the scalars its Mean trackers take are weighed by its "
            "share of the batch's examples, which is exact for a loss that is a mean over "
            "the batch"
        )
    elif own and not context.handed and model.trainable_weights:
        note = f"{name} hands no gradients to model.optimizer: it updates the weights itself"
    return logs, handed, note
