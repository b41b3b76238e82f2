"""What a compiled Keras model minimises, cut so that the shards of a batch add up exactly.

Keras' compiled loss is a mean over the batch a device sees. tfdp needs the
same number however the batch is split, so each shard contributes

    (sum over its examples of the compiled per-example loss) / global batch
    + model.losses x (its examples / global batch)

and the shards' contributions (and gradients) sum to the compiled loss of
the whole global batch plus `model.losses` once, as Keras computes it on one
device. Loss weights, several outputs and sample weights are honoured as
Keras does ("sum_over_batch_size": each example's loss is weighted by its
sample weight and averaged over its own entries, and the sum is divided by
the number of examples, not by the sum of the weights).

Metrics are computed on the host, over the whole global batch (or the whole
validation set), from the shards' predictions: any Keras metric, additive or
not, reads as it would on one device.
"""

from __future__ import annotations

import copy

import keras
import numpy as np
import tensorflow as tf
from keras.src.trainers.compile_utils import CompileLoss, CompileMetrics

from tfdp.errors import ConfigError


def unpack(batch):
    """(x, y, sample_weight) of a batch, as Keras `fit` reads its data."""
    return keras.utils.unpack_x_y_sample_weight(batch)


def num_examples(batch) -> tf.Tensor:
    """The examples in a batch: the length of its first leaf."""
    return tf.shape(tf.nest.flatten(batch)[0])[0]


class _SummedOverExamples(keras.losses.Loss):
    """One output's loss, summed over the batch's examples.

    Each example's value is averaged over its own entries (a per-pixel loss
    counts once per example), which is what "sum_over_batch_size" divides by
    apart from the batch. A loss function that returns one number for the
    whole batch is read as its mean and multiplied back by the examples.
    """

    def __init__(self, loss):
        super().__init__(name=loss.name, reduction="none", dtype=loss.dtype)
        self.per_entry = copy.copy(loss)
        self.per_entry.reduction = "none"

    def __call__(self, y_true, y_pred, sample_weight=None):
        values = self.per_entry(y_true, y_pred, sample_weight)
        if values.shape.rank == 0:
            return values * tf.cast(tf.shape(y_pred)[0], values.dtype)
        if values.shape.rank > 1:
            values = tf.reduce_mean(tf.reshape(values, [tf.shape(values)[0], -1]), axis=1)
        return tf.reduce_sum(values)


class _SummedCompileLoss(CompileLoss):
    """Keras' CompileLoss (outputs, loss weights, sample weights) with every loss
    summed over the examples instead of averaged, and no loss-tracking metrics."""

    def build(self, y_true, y_pred):
        super().build(y_true, y_pred)
        self._flat_losses = [
            CompileLoss.Loss(path, _SummedOverExamples(loss), weight, name)
            for path, loss, weight, name in self._flat_losses
        ]

    @property
    def metrics(self):
        # One empty slot per loss: CompileLoss.call zips its losses with these.
        return [None] * len(self._flat_losses or [None])

    @property
    def variables(self):
        return []


def compile_settings(model) -> dict:
    """The arguments `model` was compiled with; ConfigError if it was not compiled."""
    config = getattr(model, "_compile_config", None)
    if not isinstance(model, keras.Model) or config is None or not model.compiled:
        raise ConfigError(
            "model",
            getattr(model, "name", model),
            "is not a compiled Keras model; call model.compile(optimizer=..., loss=...) first",
        )
    settings = dict(config.config)
    if settings.get("loss") is None:
        raise ConfigError(
            "model", model.name, "was compiled without a loss; tfdp trains on the compiled loss"
        )
    return settings


class Objective:
    """The compiled loss of `model`, per shard, and its metrics, on the host.

    Built eagerly from one small host batch: the loss and metric structures
    are fixed there, and labels that do not fit the model's outputs fail
    here, before any training work.
    """

    def __init__(self, model, sample_batch, field: str = "train_data"):
        settings = compile_settings(model)
        output_names = getattr(model, "output_names", None)
        self._loss = _SummedCompileLoss(
            settings["loss"], settings.get("loss_weights"), output_names=output_names
        )
        self._metrics = CompileMetrics(
            settings.get("metrics"), settings.get("weighted_metrics"), output_names=output_names
        )
        self.check(model, sample_batch, field)

    def check(self, model, batch, field: str) -> None:
        """Runs `model`, the loss and the metrics on a few examples of a split, on the
        host; ConfigError naming `field` if its inputs or labels do not fit."""
        x, y, sample_weight = unpack(batch)
        with tf.device("/cpu:0"):
            try:
                y_pred = model(x, training=False)
            except Exception as error:  # Keras raises many kinds for an input it cannot take
                raise ConfigError(
                    field, _describe(x), f"does not fit the model's inputs ({_first_line(error)})"
                ) from None
            try:
                value = self._loss(y, y_pred, sample_weight)
                self._metrics.update_state(y, y_pred, sample_weight)
                self._metrics.reset_state()
            except Exception as error:
                raise ConfigError(
                    field,
                    _describe(y),
                    f"labels do not fit the model's outputs {_describe(y_pred)} "
                    f"({_first_line(error)})",
                ) from None
        if not np.all(np.isfinite(np.asarray(value))):
            raise ConfigError(field, _describe(y), "gives a non-finite loss on its first examples")

    def shard_loss(self, model, batch, global_batch_size, training=True):
        """This shard's part of the global batch's loss, and its predictions."""
        x, y, sample_weight = unpack(batch)
        y_pred = model(x, training=training)
        summed = self._loss(y, y_pred, sample_weight)
        total = tf.cast(global_batch_size, summed.dtype)  # a number, or this step's tensor
        loss = summed / total
        if model.losses:
            share = tf.cast(num_examples(batch), loss.dtype) / total
            loss += tf.cast(tf.add_n(model.losses), loss.dtype) * share
        return loss, y_pred

    def summed_loss(self, model, batch):
        """The compiled loss summed over `batch`'s examples (no `model.losses`), and predictions."""
        x, y, sample_weight = unpack(batch)
        y_pred = model(x, training=False)
        return self._loss(y, y_pred, sample_weight), y_pred

    def reset_metrics(self) -> None:
        self._metrics.reset_state()

    def update_metrics(self, batch, y_pred) -> None:
        """Adds one batch (host tensors) to the metrics."""
        _, y, sample_weight = unpack(batch)
        self._metrics.update_state(y, y_pred, sample_weight)

    def read_metrics(self) -> dict[str, float]:
        return {name: float(value) for name, value in self._metrics.result().items()}

    def batch_metrics(self, batch, y_pred) -> dict[str, float]:
        """The compiled metrics of one whole batch."""
        self.reset_metrics()
        self.update_metrics(batch, y_pred)
        return self.read_metrics()


def concat(shards):
    """Per-shard nested tensors -> one nested tensor, leaves joined along the batch."""
    shards = list(shards)
    if len(shards) == 1:
        return shards[0]
    flat = [tf.nest.flatten(s) for s in shards]
    with tf.device("/cpu:0"):
        joined = [tf.concat(list(leaves), axis=0) for leaves in zip(*flat)]
    return tf.nest.pack_sequence_as(shards[0], joined)


def _describe(structure) -> str:
    """Shapes of a nested structure, for an error line."""
    try:
        return str(tf.nest.map_structure(lambda t: tuple(np.shape(t)), structure))
    except Exception:  # noqa: BLE001 - only for a message
        return type(structure).__name__


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]
