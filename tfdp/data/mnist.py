"""The tutorial's data: MNIST from its IDX files or tensorflow-datasets, and the toy
data of its MLP example, each an `Arrays` held in memory."""

import gzip
import os
import zlib

import numpy as np

from tfdp.data.arrays import Arrays
from tfdp.errors import ConfigError

MNIST_DIR_ENV = "TFDP_MNIST_DIR"
IDX_FILES = {  # split -> (images file, labels file)
    "train": ("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"),
    "test": ("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz"),
}
IMAGES_MAGIC = 2051  # 0x00000803: uint8 data, 3 dims (N, rows, cols)
LABELS_MAGIC = 2049  # 0x00000801: uint8 data, 1 dim (N,)
NUM_CLASSES = 10
IMAGE_SIZE = 28


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
