"""Data sources (MNIST from IDX files or tensorflow-datasets, toy data) and input pipelines.

Every source yields an `Arrays` held in memory; `train_dataset` turns any of them into
the same deterministic, resumable stream of global batches.
"""

import dataclasses
import gzip
import os
import zlib

import numpy as np
import tensorflow as tf

from tfdp import leaves
from tfdp.errors import ConfigError
from tfdp.streams import EvalStream, Stream, first_of

MNIST_DIR_ENV = "TFDP_MNIST_DIR"
IDX_FILES = {  # split -> (images file, labels file)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
IMAGES_MAGIC = 2051  # 0x00000803: uint8 data, 3 dims (N, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: uint8 data, 1 dim (N,)
NUM_CLASSES = 10
IMAGE_SIZE = 28


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


def read_idx(path, magic=None):
    """Reads one gzip-compressed IDX file of uint8 data (the MNIST format).

    Args:
        path: path of the `.gz` file.
        magic: the expected magic number; None accepts MNIST images (2051) or labels (2049).

    Returns:
        The uint8 array, shaped by the dims in the file's header.

    Raises:
        FileNotFoundError: `path` does not exist.
        ValueError: `path` is not gzip, or its header or payload length is wrong.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"IDX file not found: {path}")
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as e:
        raise ValueError(f"{path} is not a valid gzip file: {e}") from e

    expected = (IMAGES_MAGIC, LABELS_MAGIC) if magic is None else (magic,)
    found = int.from_bytes(data[:4], "big") if len(data) >= 4 else None
    if found not in expected:
        raise ValueError(
            f"{path}: bad IDX magic number, expected {' or '.join(map(str, expected))}, "
            f"found {found}"
        )
    ndim = found & 0xFF  # the low byte of the magic counts the dims
    header_size = 4 + 4 * ndim
    if len(data) < header_size:
        raise ValueError(
            f"{path}: truncated IDX header, expected {header_size} bytes, found {len(data)}"
        )
    dims = tuple(np.frombuffer(data, dtype=">u4", count=ndim, offset=4).tolist())
    payload_size = len(data) - header_size
    if payload_size != int(np.prod(dims)):
        raise ValueError(
            f"{path}: IDX payload for dims {dims} should be {int(np.prod(dims))} bytes, "
            f"found {payload_size}"
        )
    return np.frombuffer(data, dtype=np.uint8, offset=header_size).reshape(dims)


def load_mnist_idx(directory, split="train"):
    """Reads one MNIST split from the four standard IDX files in `directory`.

    Args:
        directory: directory holding the files named in `IDX_FILES`.
        split: "train" or "test".

    Returns:
        Arrays with uint8 images (N, 28, 28, 1) and int32 labels (N,).

    Raises:
        FileNotFoundError: `directory` or one of its files is missing.
        ConfigError: unknown split.
        ValueError: the files are inconsistent.
    """
    if split not in IDX_FILES:
        raise ConfigError("split", split, f"must be one of {sorted(IDX_FILES)}")
    if not os.path.isdir(directory):
        expected = [name for names in IDX_FILES.values() for name in names]
        raise FileNotFoundError(
            f"MNIST directory not found: {directory} (expected it to hold {', '.join(expected)})"
        )
    images_path, labels_path = (os.path.join(directory, name) for name in IDX_FILES[split])
    images = read_idx(images_path, magic=IMAGES_MAGIC)
    labels = read_idx(labels_path, magic=LABELS_MAGIC)

    if len(images) != len(labels):
        raise ValueError(
            f"MNIST {split} count mismatch: {images_path} has {len(images)} images, "
            f"{labels_path} has {len(labels)} labels"
        )
    if images.shape[1:] != (IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(
            f"{images_path}: images must be {IMAGE_SIZE}x{IMAGE_SIZE}, found {images.shape[1:]}"
        )
    if labels.size and labels.max() >= NUM_CLASSES:
        raise ValueError(
            f"{labels_path}: labels must be in 0..{NUM_CLASSES - 1}, found {labels.max()}"
        )
    return Arrays(images=images[..., np.newaxis], labels=labels.astype(np.int32))


def load_mnist_tfds(split="train", data_dir=None):
    """Loads one MNIST split through tensorflow-datasets.

    Args:
        split: a tfds split, e.g. "train" or "test".
        data_dir: tfds data directory; None means tfds' default (honours TFDS_DATA_DIR).

    Returns:
        Arrays with uint8 images (N, 28, 28, 1) and int32 labels (N,).
    """
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  # slow import

    dataset = tfds.load("mnist", split=split, data_dir=data_dir, as_supervised=True, batch_size=-1)
    images, labels = tfds.as_numpy(dataset)
    return Arrays(images=images.astype(np.uint8), labels=labels.astype(np.int32))


def load_mnist(split="train", mnist_dir=None, data_dir=None):
    """Loads one MNIST split from local IDX files if any are named, else tensorflow-datasets.

    Args:
        split: "train" or "test".
        mnist_dir: directory of IDX files; None falls back to $TFDP_MNIST_DIR.
        data_dir: tfds data directory, used only when no IDX directory is named.

    Returns:
        Arrays with uint8 images (N, 28, 28, 1) and int32 labels (N,).
    """
    # A named local directory is used exclusively: on an offline machine a tfds
    # attempt would spend minutes retrying a download before failing.
    directory = mnist_dir or os.environ.get(MNIST_DIR_ENV)
    if directory:
        return load_mnist_idx(directory, split)
    return load_mnist_tfds(split, data_dir=data_dir)


def synthetic_mnist(num_examples=60000, seed=0):
    """Random images and labels of MNIST's shapes and types (for benchmarks without the data)."""
    rng = np.random.default_rng(seed)
    return Arrays(
        rng.integers(0, 256, (num_examples, 28, 28, 1), dtype=np.uint8),
        rng.integers(0, 10, num_examples).astype(np.int32),
    )


def make_toy_data(
    seed, num_examples=10000, num_classes=10, num_features=128, sigma=0.1, split="train"
):
    """Makes the MXNet tutorial's toy data: Gaussian clusters around random class centres.

    Args:
        seed: seed for `np.random.default_rng`; equal seeds give identical arrays.
        num_examples: number of examples N.
        num_classes: number of classes; labels are balanced over them.
        num_features: length of each feature vector.
        sigma: standard deviation of the noise around each class centre.
        split: "train", or "test" for other examples around the same centres.

    Returns:
        Arrays with float32 features (N, num_features) and int32 labels (N,).
    """
    for name, value in (
        ("num_examples", num_examples),
        ("num_classes", num_classes),
        ("num_features", num_features),
    ):
        if value < 1:
            raise ConfigError(name, value, "must be >= 1")
    if sigma < 0:
        raise ConfigError("sigma", sigma, "must be >= 0")
    rng = np.random.default_rng(seed)
    centres = rng.uniform(size=(num_classes, num_features))
    if split == "test":
        rng = np.random.default_rng([seed, 1])  # the same clusters, fresh examples
    elif split != "train":
        raise ConfigError("split", split, "must be train or test")
    labels = rng.permutation(np.arange(num_examples) % num_classes)
    noise = rng.standard_normal((num_examples, num_features))
    features = centres[labels] + sigma * noise
    return Arrays(images=features.astype(np.float32), labels=labels.astype(np.int32))


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
    if isinstance(data, EvalStream):
        return None
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


def _as_they_are(*batch):
    return batch if len(batch) > 1 else batch[0]


def first_examples(data, count):
    """The first `count` examples as a model batch, on the host (for timing probes)."""
    if is_stream(data):
        return data.first_examples(count)
    if isinstance(data, EvalStream):
        return first_of(data.sample, count)
    with tf.device("/cpu:0"):
        first = (
            Arrays(data.images[:count], data.labels[:count])
            if isinstance(data, Arrays)
            else leaves.take(data, 0, count)
        )
        tensors = _to_tensors(first)
        return _model_inputs(data)(*tensors) if isinstance(tensors, tuple) else tensors


# Batches made ahead of the step that reads them. The pipeline (a gather and a scale) makes
# one batch in about 2 ms, so two are plenty; see _without_autotune for why the depth is
# fixed rather than tf.data.AUTOTUNE.
PREFETCH_BATCHES = 2


def _without_autotune():
    """tf.data options with autotuning off, for every tfdp pipeline.

    With autotuning on, deleting an iterator was seen to block until a tf.data background
    thread woke up, at points 10 ms x (2^k - 1) after the iterator was made: a 6-second
    training run ended at 10.23 s (TensorFlow 2.21; BUILD_NOTES, "tf.data autotuning: off").
    tfdp deletes an iterator at the end of every run and after every evaluation, and this
    pipeline has nothing to tune.
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
                lambda i, indices: tf.random.experimental.stateless_shuffle(
                    indices, seed=key + tf.stack([tf.constant(0, tf.int64), i + 1])
                )
            )
        return batches

    start_epoch, start_offset = divmod(start_step, epoch_steps)
    return (
        tf.data.Dataset.counter(start_epoch)
        .flat_map(epoch_batches)
        .skip(start_offset)  # skips index batches only: no gathers for the skipped steps
    )


def gatherer(arrays):
    """The function from an index batch of `train_indices` to the batch of those
    examples of `arrays`, as the model reads it; it reads only the examples named."""
    tensors, prepare = _to_tensors(arrays), _model_inputs(arrays)

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
    return dataset.prefetch(PREFETCH_BATCHES).with_options(_without_autotune())


def eval_batches(arrays, batch_size, steps=None):
    """Builds the finite, unshuffled evaluation batches (the last one may be partial).

    Args:
        arrays: the evaluation split; or a streamed one (`streams.EvalStream`), read
            batch by batch as it makes them.
        batch_size: examples per batch, >= 1 (a batched stream keeps its own).
        steps: only the first `steps` batches (None: all).

    Returns:
        The batches (x, y) or (x, y, sample_weight) covering every example once, in order.
    """
    if batch_size < 1:
        raise ConfigError("batch_size", batch_size, "must be >= 1")
    if isinstance(arrays, EvalStream):
        return arrays.batches(batch_size, steps)
    batches = _eval_dataset(arrays, batch_size)
    return batches.take(steps) if steps else batches


def _eval_dataset(arrays, batch_size):
    return (
        tf.data.Dataset.from_tensor_slices(_to_tensors(arrays))
        .batch(batch_size)
        .map(_model_inputs(arrays))
        .prefetch(PREFETCH_BATCHES)
        .with_options(_without_autotune())
    )
