"""The built-in models' update against a plain computation written here, so that an
error every mode shares (the loss's scale, the learning rate, the batch order)
cannot hide behind the modes agreeing with each other.

tfdp's side runs as a user's run does: a `Config` through `training.prepare`
and `training.run`, reading its data from disk (LeNet: MNIST IDX files) or
making it (toy). The reference side is plain Keras layers for the forward pass
only, started from the built-in's initial weights; everything else is written
out below: the batch order `data.train_dataset` documents, the /255 scaling, the
softmax cross-entropy summed over the global batch, `tf.GradientTape`, and the
tutorial's update `w -= lr * grad / batch_size`.
"""

import gzip
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import write_idx

from tfdp import Config
from tfdp.data.mnist import make_toy_data
from tfdp.models import initial_weights
from tfdp.run.training import prepare, run

SEED = 3
LEARNING_RATE = 0.1  # the tutorial's, and Config's default
LENET_EXAMPLES, LENET_TEST, LENET_BATCH = 512, 100, 64
TOY_EXAMPLES, TOY_BATCH = 10000, 100  # the toy data set's size in a run (inputs.built_in)
NON_SINGLE = {
    "weighted": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
    "mirrored": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
}


def read_idx(path, header):
    """The uint8 payload of a gzipped IDX file after its `header` bytes."""
    with gzip.open(path, "rb") as f:
        return np.frombuffer(f.read(), np.uint8, offset=header)


@pytest.fixture(scope="module")
def small_mnist(mnist_dir, tmp_path_factory):
    """The first examples of real MNIST, as raw arrays and as an IDX directory for tfdp."""

    def split(images_file, labels_file, count):
        images = read_idx(os.path.join(mnist_dir, images_file), 16).reshape(-1, 28, 28)
        labels = read_idx(os.path.join(mnist_dir, labels_file), 8)
        return images[:count], labels[:count]

    train = split("train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz", LENET_EXAMPLES)
    test = split("t10k-images-idx3-ubyte.gz", "t10k-labels-idx1-ubyte.gz", LENET_TEST)
    directory = tmp_path_factory.mktemp("mnist")
    for (images, labels), prefix in ((train, "train"), (test, "t10k")):
        write_idx(directory / f"{prefix}-images-idx3-ubyte.gz", images, 2051)
        write_idx(directory / f"{prefix}-labels-idx1-ubyte.gz", labels, 2049)
    return {
        "dir": str(directory),
        "train": (as_inputs(train[0]), train[1].astype(np.int32)),
        "test": (as_inputs(test[0]), test[1].astype(np.int32)),
    }


def as_inputs(images):
    """uint8 images as the model reads them: float32 in [0, 1], one channel."""
    return (images[..., None] / np.float32(255)).astype(np.float32)


def plain_lenet():
    """LeNet's layers in plain Keras (models.lenet's architecture, default initialisers)."""
    return keras.Sequential(
        [
            keras.Input((28, 28, 1)),
            keras.layers.Conv2D(20, 5, activation="tanh"),
            keras.layers.MaxPooling2D(2, strides=2),
            keras.layers.Conv2D(50, 5, activation="tanh"),
            keras.layers.MaxPooling2D(2, strides=2),
            keras.layers.Flatten(),
            keras.layers.Dense(500, activation="tanh"),
            keras.layers.Dense(10),
        ]
    )


def plain_toy():
    """The toy MLP in plain Keras: 128 features, 64 relu units, 10 logits."""
    return keras.Sequential(
        [keras.Input((128,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(10)]
    )


def batch_indices(num_examples, batch_size, seed, steps):
    """The examples of steps 0..steps-1 (all in epoch 0): epoch e's order is
    stateless_shuffle(range(N), seed=[seed, e]), cut into consecutive batches."""
    assert steps * batch_size <= num_examples
    order = tf.random.experimental.stateless_shuffle(
        tf.range(num_examples), seed=tf.constant([seed, 0], tf.int64)
    ).numpy()
    return [order[k * batch_size : (k + 1) * batch_size] for k in range(steps)]


def summed_cross_entropy(logits, labels):
    """sum over examples of -log softmax(logits)[label]."""
    picked = tf.gather(logits, labels, axis=1, batch_dims=1)
    return tf.reduce_sum(tf.reduce_logsumexp(logits, axis=1) - picked)


def plain_sgd(model, weights, x, y, batch_size, seed, steps):
    """The tutorial's loop from `weights`: per step the mean loss of the global batch,
    then w -= lr * grad / batch_size. Returns (weights after, each step's loss)."""
    model.set_weights(weights)
    losses = []
    for indices in batch_indices(len(y), batch_size, seed, steps):
        with tf.GradientTape() as tape:
            summed = summed_cross_entropy(model(x[indices]), y[indices])
        gradients = tape.gradient(summed, model.trainable_variables)
        for variable, gradient in zip(model.trainable_variables, gradients, strict=True):
            variable.assign(variable - LEARNING_RATE * gradient / batch_size)
        losses.append(float(summed) / batch_size)
    return model.get_weights(), losses


def tfdp_run(model, steps, mode="single", **settings):
    """A run of a built-in model through the library, logging every step's loss."""
    config = Config(
        model=model,
        iterations=steps,
        seed=SEED,
        log_every=1,
        learning_rate=LEARNING_RATE,
        **{"devices": "cpu:0", **settings, **NON_SINGLE.get(mode, {"mode": mode})},
    )
    result = run(prepare(config), log=lambda line: None)
    return result.model.get_weights(), [entry["loss"] for entry in result["log"]], result


def assert_same(tfdp_side, reference, start):
    (weights, losses, _), (expected_weights, expected_losses) = tfdp_side, reference
    moved = [np.abs(w - w0).max() for w, w0 in zip(expected_weights, start, strict=True)]
    assert min(moved) > 1e-4  # every variable moved, far beyond the tolerance: not vacuous
    for got, expected in zip(weights, expected_weights, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(losses, expected_losses, rtol=1e-5)


def lenet_reference(small_mnist, steps):
    x, y = small_mnist["train"]
    start = initial_weights("lenet", "tutorial", SEED)
    return plain_sgd(plain_lenet(), start, x, y, LENET_BATCH, SEED, steps), start


def toy_reference(steps):
    data = make_toy_data(SEED, num_examples=TOY_EXAMPLES)  # the run's raw inputs
    start = initial_weights("toy", "tutorial", SEED)
    return plain_sgd(plain_toy(), start, data.images, data.labels, TOY_BATCH, SEED, steps), start


def test_initial_weights_are_the_tutorials():
    """--init=tutorial (the default): weights uniform in [-0.1, 0.1], biases zero."""
    for name in ("lenet", "toy"):
        weights = initial_weights(name, "tutorial", SEED)
        kernels, biases = weights[0::2], weights[1::2]
        assert all(np.abs(k).max() <= 0.1 and np.abs(k).max() > 0.09 for k in kernels)
        assert all(not b.any() for b in biases)


@pytest.mark.parametrize("steps", [1, 3])
def test_lenet_single_is_plain_sgd(steps, small_mnist):
    reference, start = lenet_reference(small_mnist, steps)
    got = tfdp_run("lenet", steps, mnist_dir=small_mnist["dir"], batch_size=LENET_BATCH)
    assert_same(got, reference, start)
    # The final evaluation too: the mean loss and accuracy of the test split, recomputed.
    x, y = small_mnist["test"]
    model = plain_lenet()
    model.set_weights(reference[0])
    logits = model(x)
    test = got[2]["test_metrics"]
    assert test["loss"] == pytest.approx(float(summed_cross_entropy(logits, y)) / len(y), rel=1e-5)
    assert test["accuracy"] == pytest.approx(np.mean(np.argmax(logits, 1) == y), abs=1e-7)


@pytest.mark.parametrize("steps", [1, 3])
def test_toy_single_is_plain_sgd(steps):
    reference, start = toy_reference(steps)
    assert_same(tfdp_run("toy", steps, batch_size=TOY_BATCH), reference, start)


@pytest.mark.parametrize("mode", sorted(NON_SINGLE))
def test_lenet_other_modes_are_plain_sgd(mode, small_mnist):
    reference, start = lenet_reference(small_mnist, 3)
    got = tfdp_run("lenet", 3, mode, mnist_dir=small_mnist["dir"], batch_size=LENET_BATCH)
    assert_same(got, reference, start)


@pytest.mark.parametrize("mode", sorted(NON_SINGLE))
def test_toy_other_modes_are_plain_sgd(mode):
    reference, start = toy_reference(3)
    assert_same(tfdp_run("toy", 3, mode, batch_size=TOY_BATCH), reference, start)
