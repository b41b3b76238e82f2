"""Data held in memory: `Arrays` (a split of images and labels) or a nested structure of
arrays (what Keras `fit` takes as x, y and sample weights).

A run reads them as it reads a pipeline: training data as a `Stream` read by index
(`as_stream`: the same deterministic, resumable global batches as `train_dataset`),
validation data as an `EvalStream` (`as_eval_stream`).
"""

import dataclasses

import numpy as np
import tensorflow as tf

from tfdp.data import leaves
from tfdp.data.streams import EvalStream, Stream
from tfdp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Arrays:
    """One split held in memory.

    Attributes:
        images: uint8 (N, 28, 28, 1) for MNIST; float32 (N, num_features) for toy data.
        labels: int32 (N,).
    """

    images: np.ndarray
    labels: np.ndarray

    def __post_init__(self):
        if len(self.images) != len(self.labels):
            raise ValueError(
                f"images and labels differ in length: {len(self.images)} images, "
                f"{len(self.labels)} labels"
            )

    def __len__(self):
        return len(self.labels)


def is_stream(data) -> bool:
    """Whether `data` is a pipeline read while training (`streams.Stream`), not arrays."""
    return isinstance(data, Stream)


def size(data) -> int | None:
    """The examples in `data`: an Arrays, or a nested structure of arrays (checked), or a
    stream's examples per pass (None: unknown without reading it)."""
    if isinstance(data, Arrays):
        return len(data)
    if is_stream(data):
        return data.examples
    return leaves.length(leaves.first(data))


def check_arrays(data, field: str) -> None:
    """Fails with ConfigError (naming `field`) unless every leaf of `data` is an array of
    the same, non-zero length."""
    if isinstance(data, Arrays):
        return
    parts = [leaf for leaf in tf.nest.flatten(data) if leaf is not None]  # None: left out
    lengths = [leaves.length(leaf) for leaf in parts]
    if not parts or None in lengths:
        raise ConfigError(
            field, type(data).__name__, "must be arrays (or a nested structure of them) of examples"
        )
    if len(set(lengths)) > 1:
        shapes = tf.nest.map_structure(leaves.shape_of, data)
        raise ConfigError(field, shapes, f"has leaves of different lengths {sorted(set(lengths))}")
    if lengths[0] == 0:
        raise ConfigError(field, 0, "has no examples")


def _to_tensors(data):
    # Pinned to the host: tf.data runs there, so a copy on an accelerator would be wasted.
    with tf.device("/cpu:0"):
        if isinstance(data, Arrays):
            return tf.convert_to_tensor(data.images), tf.convert_to_tensor(data.labels)
        return tf.nest.map_structure(
            lambda leaf: leaf
            if leaf is None or leaves.is_composite(leaf)
            else tf.convert_to_tensor(leaf),
            data,
        )


@tf.autograph.experimental.do_not_convert
def _scale(images, labels):
    """Maps a batch to the model's input types: float32 in [0, 1] for images, int32 labels."""
    x = tf.cast(images, tf.float32)
    if images.dtype == tf.uint8:
        x = x / 255.0
    return x, tf.cast(labels, tf.int32)


def _model_inputs(data):
    """What a batch of `data` becomes before the model reads it: MNIST's uint8 images
    scaled to [0, 1] (Arrays); a user's arrays as they are."""
    return _scale if isinstance(data, Arrays) else _as_they_are


@tf.autograph.experimental.do_not_convert
def _as_they_are(*batch):
    return batch if len(batch) > 1 else batch[0]


def first_examples(data, count):
    """The first `count` examples of arrays as a model batch, on the host."""
    with tf.device("/cpu:0"):
        first = (
            Arrays(data.images[:count], data.labels[:count])
            if isinstance(data, Arrays)
            else leaves.take(data, 0, count)
        )
        tensors = _to_tensors(first)
        return _model_inputs(data)(*tensors) if isinstance(tensors, tuple) else tensors


# Batches made ahead of the step that reads them. The pipeline (a gather and a scale) makes
# one batch in about 2 ms, so two are plenty; see without_autotune for why the depth is
# fixed rather than tf.data.AUTOTUNE.
PREFETCH_BATCHES = 2


def without_autotune():
    """tf.data options with autotuning off, where the user set none: on every tfdp
    pipeline, and on a user's dataset the strategy distributes.

    With autotuning on, deleting an iterator (tfdp deletes one at the end of every run and
    after every evaluation, Keras at the end of every fit, evaluation and prediction) was
    seen to wait for a tf.data background thread that sleeps 10 ms x 2^k: a 6-second
    training run ended at 10.23 s (TensorFlow 2.21), up to a minute and more beside another
    busy process (BUILD_NOTES, "tf.data autotuning: off"). tfdp's pipelines have nothing
    to tune.
    """
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def steps_per_epoch(num_examples: int, batch_size: int, drop_remainder: bool = False) -> int:
    """Steps of one epoch: every example once, the last batch partial unless dropped."""
    if drop_remainder:
        return num_examples // batch_size
    return -(-num_examples // batch_size)


def train_indices(arrays, batch_size, seed, start_step=0, drop_remainder=False, shuffle=True):
    """Builds the infinite, deterministic stream of global training batches, as the
    indices of their examples (`gatherer` makes the batches of them).

    Pass e over the data visits the examples in the order
    `tf.random.experimental.stateless_shuffle(tf.range(N), seed=[seed, e])` (with
    `shuffle` False: in order; "batch": in order, each batch shuffled within), cut into
    batches of `batch_size`; the last batch of an epoch holds the N mod batch_size
    examples left, or is dropped with `drop_remainder`. Training step k reads batch
    `k % steps_per_epoch` of epoch `k // steps_per_epoch`, so the stream depends only on
    (arrays, batch_size, seed) and not on the devices that consume it.

    Args:
        arrays: the training split: an Arrays, or a nested structure of arrays
            (`(x, y)`, `(x, y, sample_weight)`, dict inputs) with one leading
            example axis; every leaf is cut the same way.
        batch_size: global batch size, at least 1 (larger than N: each pass is one
            batch of all N, as Keras fit takes it).
        seed: integer seed of the shuffle.
        start_step: first step to produce, for resuming exactly where training stopped.
        drop_remainder: leave out each epoch's last, partial batch.
        shuffle: True, False, or "batch" (Keras `fit`'s meanings).

    Returns:
        A dataset of int32 index batches (batch_size,): the static batch size unless
        partial batches occur.

    Raises:
        ConfigError: `batch_size` below 1, no batch at all, or negative `start_step`.
    """
    num_examples = size(arrays)
    if batch_size < 1:
        raise ConfigError("batch_size", batch_size, "must be at least 1")
    if start_step < 0:
        raise ConfigError("start_step", start_step, "must be >= 0")
    full, partial = divmod(num_examples, batch_size)
    partial = 0 if drop_remainder else partial
    epoch_steps = full + (partial > 0)
    if not epoch_steps:
        raise ConfigError(
            "batch_size", batch_size, f"leaves no batch of the {num_examples} examples"
        )

    @tf.autograph.experimental.do_not_convert
    def epoch_batches(epoch):
        # One order per pass over the data, cut into the index batches of its steps.
        key = tf.stack([tf.constant(seed, tf.int64), epoch])
        order = tf.range(num_examples)
        if shuffle is True:
            order = tf.random.experimental.stateless_shuffle(order, seed=key)
        batches = tf.data.Dataset.from_tensor_slices(
            tf.reshape(order[: full * batch_size], [full, batch_size])
        )
        if partial:
            last = order[full * batch_size :]
            batches = batches.concatenate(tf.data.Dataset.from_tensors(last))
        if shuffle == "batch":  # the batches in order, the examples of each shuffled
            batches = batches.enumerate().map(
                tf.autograph.experimental.do_not_convert(
                    lambda i, indices: tf.random.experimental.stateless_shuffle(
                        indices, seed=key + tf.stack([tf.constant(0, tf.int64), i + 1])
                    )
                )
            )
        return batches

    start_epoch, start_offset = divmod(start_step, epoch_steps)
    return (
        tf.data.Dataset.counter(start_epoch)
        .flat_map(epoch_batches)
        .skip(start_offset)  # skips index batches only: no gathers for the skipped steps
    )


def as_stream(arrays, batch_size, seed, drop_remainder=False, shuffle=True) -> Stream:
    """Arrays held in memory as the one type of training data: a `Stream` read by index,
    whose batches are `train_indices`' (a resumed run reads on from its step's batch,
    nothing read again) and whose examples the trainer gathers (`Stream.gather`)."""
    examples = size(arrays)
    held = [arrays.images, arrays.labels] if isinstance(arrays, Arrays) else tf.nest.flatten(arrays)

    def starting_at(step: int):
        return train_indices(arrays, batch_size, seed, step, drop_remainder, shuffle)

    return Stream(
        starting_at(0),
        batch_size,
        steps_per_epoch(examples, batch_size, drop_remainder),
        examples,
        "arrays",
        False,
        first_examples(arrays, min(batch_size, examples)),  # a model batch, on the host
        starting_at=starting_at,
        held=held,
        gather=gatherer(arrays),
    )


def gatherer(arrays):
    """The function from an index batch of `train_indices` to the batch of those
    examples of `arrays`, as the model reads it; it reads only the examples named."""
    tensors, prepare = _to_tensors(arrays), _model_inputs(arrays)

    @tf.autograph.experimental.do_not_convert
    def gather(indices):
        batch = tf.nest.map_structure(lambda t: leaves.gather_rows(t, indices), tensors)
        return prepare(*batch) if isinstance(batch, tuple) else batch

    return gather


def train_dataset(arrays, batch_size, seed, start_step=0, drop_remainder=False, shuffle=True):
    """The stream of global training batches: `train_indices`' batches, gathered."""
    indices = train_indices(arrays, batch_size, seed, start_step, drop_remainder, shuffle)
    return prefetched(indices.map(gatherer(arrays)))


def prefetched(dataset):
    """`dataset` made PREFETCH_BATCHES ahead of the step, at a fixed depth."""
    return dataset.prefetch(PREFETCH_BATCHES).with_options(without_autotune())


def as_eval_stream(arrays) -> EvalStream:
    """Validation arrays as a run reads its validation data: an `EvalStream` whose
    batches are `eval_batches`'."""
    sample = first_examples(arrays, min(2, size(arrays)))
    return EvalStream(
        "arrays", sample, lambda batch_size, steps: eval_batches(arrays, batch_size, steps)
    )


def eval_batches(arrays, batch_size, steps=None):
    """Builds the finite, unshuffled evaluation batches (the last one may be partial).

    Args:
        arrays: the evaluation split.
        batch_size: examples per batch, >= 1.
        steps: only the first `steps` batches (None: all).

    Returns:
        The batches (x, y) or (x, y, sample_weight) covering every example once, in order.
    """
    if batch_size < 1:
        raise ConfigError("batch_size", batch_size, "must be >= 1")
    batches = _eval_dataset(arrays, batch_size)
    return batches.take(steps) if steps else batches


def _eval_dataset(arrays, batch_size):
    return (
        tf.data.Dataset.from_tensor_slices(_to_tensors(arrays))
        .batch(batch_size)
        .map(_model_inputs(arrays))
        .prefetch(PREFETCH_BATCHES)
        .with_options(without_autotune())
    )
