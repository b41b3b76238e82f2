"""Tests for tfdp.data: IDX reading, MNIST sources, toy data and the input pipelines."""

import os

import numpy as np
import pytest
import tensorflow as tf
import tensorflow_datasets as tfds
from helpers import write_idx, write_mnist_dir

from tfdp.data import arrays as in_memory
from tfdp.data import mnist

TRAIN_COUNTS = [5923, 6742, 5958, 6131, 5842, 5421, 5918, 6265, 5851, 5949]
TEST_COUNTS = [980, 1135, 1032, 1010, 982, 892, 958, 1028, 974, 1009]


def take(dataset, count):
    return [(x.numpy(), y.numpy()) for x, y in dataset.take(count)]


def shuffled(n, seed, epoch):
    return tf.random.experimental.stateless_shuffle(tf.range(n), seed=[seed, epoch]).numpy()


def indexed_arrays(n):
    """Arrays whose feature equals the example's index, so batches reveal the order."""
    return in_memory.Arrays(
        images=np.arange(n, dtype=np.float32)[:, None], labels=np.arange(n, dtype=np.int32)
    )


# read_idx


def test_read_idx_round_trips(tmp_path):
    images = np.random.default_rng(1).integers(0, 256, size=(3, 28, 28), dtype=np.uint8)
    labels = np.array([7, 0, 9], dtype=np.uint8)
    read_images = mnist.read_idx(write_idx(tmp_path / "i.gz", images))
    read_labels = mnist.read_idx(write_idx(tmp_path / "l.gz", labels))
    assert read_images.dtype == np.uint8 and read_images.shape == (3, 28, 28)
    np.testing.assert_array_equal(read_images, images)
    np.testing.assert_array_equal(read_labels, labels)


def test_read_idx_rejects_wrong_magic(tmp_path):
    path = write_idx(tmp_path / "bad.gz", np.zeros(4, np.uint8), magic=2052)
    with pytest.raises(ValueError, match=r"bad\.gz.*expected 2051 or 2049, found 2052"):
        mnist.read_idx(path)
    good = write_idx(tmp_path / "labels.gz", np.zeros(4, np.uint8))
    with pytest.raises(ValueError, match=r"labels\.gz.*expected 2051, found 2049"):
        mnist.read_idx(good, magic=mnist.IMAGES_MAGIC)


def test_read_idx_rejects_truncated_payload(tmp_path):
    path = write_idx(tmp_path / "short.gz", np.zeros((2, 28, 28), np.uint8), cut=5)
    with pytest.raises(ValueError, match=r"short\.gz.*should be 1568 bytes, found 1563"):
        mnist.read_idx(path)


def test_read_idx_rejects_trailing_bytes(tmp_path):
    path = write_idx(tmp_path / "long.gz", np.zeros(6, np.uint8), extra=b"xy")
    with pytest.raises(ValueError, match=r"long\.gz.*should be 6 bytes, found 8"):
        mnist.read_idx(path)


def test_read_idx_rejects_non_gzip(tmp_path):
    path = tmp_path / "plain.gz"
    path.write_bytes(b"\x00\x00\x08\x01\x00\x00\x00\x00")
    with pytest.raises(ValueError, match=r"plain\.gz is not a valid gzip"):
        mnist.read_idx(str(path))


def test_read_idx_rejects_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"nothing-here\.gz"):
        mnist.read_idx(str(tmp_path / "nothing-here.gz"))


# load_mnist_idx / load_mnist


def test_load_mnist_idx_shapes_and_values(tmp_path):
    contents = write_mnist_dir(tmp_path, num_train=50, num_test=20)
    for split, (images, labels) in contents.items():
        arrays = mnist.load_mnist_idx(str(tmp_path), split)
        assert len(arrays) == len(labels)
        assert arrays.images.dtype == np.uint8 and arrays.images.shape == (len(labels), 28, 28, 1)
        assert arrays.labels.dtype == np.int32 and arrays.labels.shape == (len(labels),)
        np.testing.assert_array_equal(arrays.images[..., 0], images)
        np.testing.assert_array_equal(arrays.labels, labels)


def test_load_mnist_idx_rejects_count_mismatch(tmp_path):
    write_mnist_dir(tmp_path, num_train=50)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.zeros(49, np.uint8))
    with pytest.raises(
        ValueError, match=r"train-images-idx3-ubyte\.gz has 50.*train-labels-idx1-ubyte\.gz has 49"
    ):
        mnist.load_mnist_idx(str(tmp_path), "train")


def test_load_mnist_idx_rejects_bad_labels_and_dims(tmp_path):
    write_mnist_dir(tmp_path, num_train=4)
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", np.array([0, 1, 10, 2], np.uint8))
    with pytest.raises(ValueError, match=r"train-labels-idx1-ubyte\.gz.*0\.\.9, found 10"):
        mnist.load_mnist_idx(str(tmp_path), "train")
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", np.zeros((20, 28, 27), np.uint8))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte\.gz.*28x28, found \(28, 27\)"):
        mnist.load_mnist_idx(str(tmp_path), "test")


def test_load_mnist_idx_rejects_missing_directory(tmp_path):
    missing = str(tmp_path / "no-mnist")
    with pytest.raises(FileNotFoundError, match=r"no-mnist.*t10k-labels-idx1-ubyte\.gz"):
        mnist.load_mnist_idx(missing)


@pytest.mark.mnist
def test_real_mnist_from_env_dir():
    if not os.environ.get(mnist.MNIST_DIR_ENV):
        pytest.fail(
            f"set {mnist.MNIST_DIR_ENV} to the directory holding the four MNIST IDX files, "
            f"e.g. {mnist.MNIST_DIR_ENV}=/work/shared/data/mnist"
        )
    for split, counts in (("train", TRAIN_COUNTS), ("test", TEST_COUNTS)):
        arrays = mnist.load_mnist(split)
        assert arrays.images.shape == (sum(counts), 28, 28, 1)
        assert arrays.images.dtype == np.uint8 and arrays.labels.dtype == np.int32
        assert np.bincount(arrays.labels, minlength=10).tolist() == counts


def _forbid_tfds(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("tfds.load must not be called when a local MNIST dir is named")

    monkeypatch.setattr(tfds, "load", refuse)


def test_load_mnist_prefers_env_dir_over_tfds(tmp_path, monkeypatch):
    contents = write_mnist_dir(tmp_path)
    _forbid_tfds(monkeypatch)
    monkeypatch.setenv(mnist.MNIST_DIR_ENV, str(tmp_path))
    arrays = mnist.load_mnist("test", data_dir=str(tmp_path / "tfds"))
    np.testing.assert_array_equal(arrays.labels, contents["test"][1])


def test_load_mnist_argument_overrides_env(tmp_path, monkeypatch):
    contents = write_mnist_dir(tmp_path)
    _forbid_tfds(monkeypatch)
    monkeypatch.setenv(mnist.MNIST_DIR_ENV, str(tmp_path / "elsewhere"))
    arrays = mnist.load_mnist("train", mnist_dir=str(tmp_path))
    np.testing.assert_array_equal(arrays.labels, contents["train"][1])


def test_load_mnist_without_local_dir_uses_tfds(tmp_path, monkeypatch):
    calls = []

    def fake_load(name, **kwargs):
        calls.append((name, kwargs))
        return tf.zeros([3, 28, 28, 1], tf.uint8), tf.constant([4, 5, 6], tf.int64)

    monkeypatch.delenv(mnist.MNIST_DIR_ENV, raising=False)
    monkeypatch.setattr(tfds, "load", fake_load)
    arrays = mnist.load_mnist("test", data_dir=str(tmp_path))
    assert calls == [
        ("mnist", dict(split="test", data_dir=str(tmp_path), as_supervised=True, batch_size=-1))
    ]
    assert arrays.labels.dtype == np.int32 and arrays.labels.tolist() == [4, 5, 6]


def test_load_mnist_tfds_offline_with_mock_data(tmp_path):
    # mock_data needs the split sizes (from metadata files) for batch_size=-1: without
    # them tfds batches by sys.maxsize and aborts the process.
    builder = tfds.builder("mnist", data_dir=str(tmp_path))
    builder.info.set_splits(
        tfds.core.SplitDict(
            [
                tfds.core.SplitInfo(
                    name=name, shard_lengths=[n], num_bytes=0, filename_template=None
                )
                for name, n in (("train", 12), ("test", 12))
            ]
        )
    )
    os.makedirs(builder.data_dir)
    builder.info.write_to_directory(builder.data_dir)
    with tfds.testing.mock_data(num_examples=12, data_dir=str(tmp_path)):
        arrays = mnist.load_mnist_tfds("train", data_dir=str(tmp_path))
    assert arrays.images.dtype == np.uint8 and arrays.images.shape == (12, 28, 28, 1)
    assert arrays.labels.dtype == np.int32 and arrays.labels.shape == (12,)
    assert arrays.labels.min() >= 0 and arrays.labels.max() <= 9


# make_toy_data


def test_toy_data_deterministic_per_seed():
    a, b = mnist.make_toy_data(3, num_examples=200), mnist.make_toy_data(3, num_examples=200)
    c = mnist.make_toy_data(4, num_examples=200)
    assert a.images.dtype == np.float32 and a.images.shape == (200, 128)
    assert a.labels.dtype == np.int32
    np.testing.assert_array_equal(a.images, b.images)
    np.testing.assert_array_equal(a.labels, b.labels)
    assert not np.array_equal(a.images, c.images)
    assert not np.array_equal(a.labels, c.labels)


def test_toy_data_balanced_and_separable():
    toy = mnist.make_toy_data(0, num_examples=1000, num_classes=10, sigma=0.1)
    assert np.bincount(toy.labels).tolist() == [100] * 10
    centres = np.stack([toy.images[toy.labels == c].mean(axis=0) for c in range(10)])
    distances = ((toy.images[:, None, :] - centres[None]) ** 2).sum(axis=-1)
    assert (distances.argmin(axis=1) == toy.labels).mean() >= 0.99
    # The noise really has std sigma around the centres.
    assert abs((toy.images - centres[toy.labels]).std() - 0.1) < 0.005


def test_toy_data_rejects_bad_arguments():
    with pytest.raises(ValueError, match="num_classes=0: must be >= 1"):
        mnist.make_toy_data(0, num_classes=0)


# train_dataset


def test_train_batches_full_typed_and_scaled():
    images = np.full((10, 28, 28, 1), 255, np.uint8)
    images[3] = 51
    arrays = in_memory.Arrays(images=images, labels=np.arange(10, dtype=np.int32) % 10)
    dataset = in_memory.train_dataset(arrays, batch_size=5, seed=0)
    assert dataset.element_spec[0].shape == (5, 28, 28, 1)  # static: no partial batch
    batches = take(dataset, 7)  # beyond 2 epochs: the stream is infinite
    for x, y in batches:
        assert x.dtype == np.float32 and x.shape == (5, 28, 28, 1)
        assert y.dtype == np.int32 and y.shape == (5,)
        assert set(np.unique(x)) <= {1.0, np.float32(0.2)}
        np.testing.assert_array_equal(x[:, 0, 0, 0], np.where(y == 3, np.float32(0.2), 1.0))


def test_train_features_pass_unchanged():
    toy = mnist.make_toy_data(0, num_examples=50)
    ((x, y),) = take(in_memory.train_dataset(toy, batch_size=8, seed=1), 1)
    np.testing.assert_array_equal(x, toy.images[shuffled(50, 1, 0)[:8]])
    np.testing.assert_array_equal(y, toy.labels[shuffled(50, 1, 0)[:8]])


def test_train_order_follows_stateless_shuffle_per_epoch():
    n, batch, spe = 23, 5, 4  # 3 examples dropped per epoch
    batches = take(
        in_memory.train_dataset(indexed_arrays(n), batch, seed=7, drop_remainder=True), 3 * spe
    )
    got = np.concatenate([y for _, y in batches]).reshape(3, spe * batch)
    for epoch in range(3):
        np.testing.assert_array_equal(got[epoch], shuffled(n, 7, epoch)[: spe * batch])
    assert len(set(got[0].tolist())) == spe * batch  # no repeats within an epoch
    assert not np.array_equal(got[0], got[1])  # epochs are reshuffled


def test_train_deterministic_and_seed_dependent():
    arrays = indexed_arrays(40)
    first = take(in_memory.train_dataset(arrays, 8, seed=5), 6)
    again = take(in_memory.train_dataset(arrays, 8, seed=5), 6)
    other = take(in_memory.train_dataset(arrays, 8, seed=6), 6)
    for (x1, y1), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)
    assert not all(np.array_equal(y1, y3) for (_, y1), (_, y3) in zip(first, other))


@pytest.mark.parametrize("start_step", [1, 4, 5, 11])
def test_train_start_step_resumes_exactly(start_step):
    arrays = indexed_arrays(21)  # 6 steps per epoch with batch 4, the last of 1 example
    from_zero = take(in_memory.train_dataset(arrays, 4, seed=2), start_step + 3)
    resumed = take(in_memory.train_dataset(arrays, 4, seed=2, start_step=start_step), 3)
    for (x1, y1), (x2, y2) in zip(from_zero[start_step:], resumed):
        np.testing.assert_array_equal(x1, x2)
        np.testing.assert_array_equal(y1, y2)


def test_train_rejects_a_batch_size_below_one():
    with pytest.raises(ValueError, match=r"batch_size=0: must be at least 1"):
        in_memory.train_dataset(indexed_arrays(10), 0, seed=0)
    with pytest.raises(ValueError, match=r"batch_size=11: leaves no batch of the 10 examples"):
        in_memory.train_dataset(indexed_arrays(10), 11, seed=0, drop_remainder=True)


def test_a_batch_larger_than_the_data_is_all_of_it_each_pass():
    """As Keras fit takes it: one batch of every example, in a new order each pass."""
    batches = iter(in_memory.train_indices(indexed_arrays(10), 11, seed=0))
    first, second = next(batches).numpy(), next(batches).numpy()
    assert sorted(first.tolist()) == sorted(second.tolist()) == list(range(10))
    assert first.tolist() != second.tolist()


def test_train_and_eval_reject_bad_arguments():
    with pytest.raises(ValueError, match=r"start_step=-1: must be >= 0"):
        in_memory.train_dataset(indexed_arrays(10), 2, seed=0, start_step=-1)
    with pytest.raises(ValueError, match=r"batch_size=0: must be >= 1"):
        in_memory.eval_batches(indexed_arrays(10), 0)
    with pytest.raises(ValueError, match=r"split='validation'"):
        mnist.load_mnist_idx("/nonexistent", "validation")


# eval_batches


def test_eval_batches_cover_every_example_once():
    images = np.arange(11 * 4, dtype=np.uint8).reshape(11, 2, 2, 1)
    arrays = in_memory.Arrays(images=images, labels=np.arange(11, dtype=np.int32))
    batches = [(x.numpy(), y.numpy()) for x, y in in_memory.eval_batches(arrays, 4)]
    assert [len(y) for _, y in batches] == [4, 4, 3]
    x = np.concatenate([b[0] for b in batches])
    y = np.concatenate([b[1] for b in batches])
    assert x.dtype == np.float32 and y.dtype == np.int32
    np.testing.assert_array_equal(y, np.arange(11))
    np.testing.assert_allclose(x, images / 255.0, rtol=1e-6)


def test_pipelines_run_without_autotune():
    # Autotuning's model thread can hold up an iterator's deletion until its next
    # re-tuning interval ends (in_memory.without_autotune); tfdp's pipelines turn it off,
    # and datasets built on top of them inherit that.
    toy = mnist.make_toy_data(0, num_examples=50)
    train = in_memory.train_dataset(toy, batch_size=8, seed=1)
    for dataset in (train, in_memory.eval_batches(toy, 8), train.map(lambda x, y: (x, y))):
        assert dataset.options().autotune.enabled is False
