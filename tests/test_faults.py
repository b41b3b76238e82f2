"""Runs that meet each other, end, change settings or go wrong after start-up.

The toy model, in this process (`tfdp.train`), but for the lock's holder: a
`tfdp` subprocess, so that the lock a killed process held is seen to drop.
"""

import os

import numpy as np
import pytest
from helpers import TOY, latest_step, load_weights, tfdp, toy_config, train, wait_for, write_idx

import tfdp as tfdp_library
from tfdp.errors import ConfigError
from tfdp.run.training import NonFinite


@pytest.mark.slow
def test_a_second_run_on_a_model_dir_in_use_is_refused(tmp_path):
    model_dir = str(tmp_path / "run")
    never_saves = ["--iterations=1000000", "--checkpoint_every=1000000"]
    first = tfdp(*TOY, *never_saves, f"--model_dir={model_dir}", wait=False)
    try:
        lock = os.path.join(model_dir, "lock")

        def locked():
            return os.path.exists(lock) and open(lock).read().startswith("pid")

        wait_for(locked, [first], "the first run's lock")
        with pytest.raises(ConfigError) as refused:
            train(toy_config(iterations=1, checkpoint_every=1000000, model_dir=model_dir))
        assert refused.value.field == "model_dir"
        assert refused.value.reason.startswith(f"is in use by another run (pid {first.pid} on "), (
            refused.value.reason
        )
        assert first.poll() is None  # the first one trains on, undisturbed
    finally:
        first.kill()
        first.wait()
    # The kernel dropped the killed run's lock: the directory is usable again.
    result, _ = train(toy_config(iterations=1, model_dir=model_dir))
    assert result["iterations"] == 1


def test_a_finished_run_run_again_changes_nothing(tmp_path):
    model_dir = str(tmp_path)
    config = toy_config(iterations=20, checkpoint_every=10, model_dir=model_dir)
    train(config)

    def files():
        return {
            os.path.join(root, name): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(model_dir)
            for name in names
            if name != "lock"
        }

    before = files()
    again, lines = train(config)
    assert f"the run in {model_dir} is finished (iteration 20 of 20); nothing to do" in lines
    assert not any(line.startswith("time for") for line in lines)
    assert again["iterations"] == 20
    assert files() == before

    with pytest.raises(ConfigError) as shorter:
        train(toy_config(iterations=5, checkpoint_every=10, model_dir=model_dir))
    assert (shorter.value.field, shorter.value.value) == ("iterations", 5)
    assert shorter.value.reason == (
        f"ends at iteration 5, before the checkpoint of iteration 20 in {model_dir}; "
        "train at least to 20, or use another --model_dir"
    )
    assert files() == before


def test_a_resume_trains_at_the_new_learning_rate(tmp_path):
    first_dir, model_dir = str(tmp_path / "first"), str(tmp_path / "run")
    for directory in (first_dir, model_dir):
        train(toy_config(iterations=10, checkpoint_every=10, model_dir=directory))
    at_10 = load_weights(model_dir)
    for x, y in zip(load_weights(first_dir), at_10, strict=True):  # the runs are reproducible
        np.testing.assert_array_equal(x, y)

    # 10 more steps at a rate 1e8 times smaller: the weights barely move...
    _, lines = train(
        toy_config(iterations=20, checkpoint_every=10, learning_rate=1e-9, model_dir=model_dir)
    )
    assert any("resuming at iteration 10" in line for line in lines)
    moved = max(np.abs(x - y).max() for x, y in zip(load_weights(model_dir), at_10, strict=True))
    assert moved < 1e-6, moved
    # ...where 10 more at the first rate move them by far more.
    train(toy_config(iterations=20, checkpoint_every=10, model_dir=first_dir))
    moved = max(np.abs(x - y).max() for x, y in zip(load_weights(first_dir), at_10, strict=True))
    assert moved > 1e-3, moved


BLOWUP_MODEL = '''
import keras


class Blowup(keras.layers.Layer):
    """Passes its input through; in training, multiplies a statistic by 1e30."""

    def build(self, shape):
        self.scale = self.add_weight(shape=(), initializer="ones", trainable=False, name="scale")

    def call(self, x, training=False):
        if training:
            self.scale.assign(self.scale * 1e30)
        return x


def make():
    inputs = keras.Input((128,))
    outputs = keras.layers.Dense(10)(Blowup(name="blowup")(inputs))
    model = keras.Model(inputs, outputs)
    model.compile(optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model
'''


def test_non_finite_weights_are_never_saved(tmp_path):
    # The loss stays finite (the statistic is not on the loss's path); the state is not.
    (tmp_path / "blowup.py").write_text(BLOWUP_MODEL)
    model_dir = str(tmp_path / "run")
    with pytest.raises(NonFinite) as stopped:
        train(
            toy_config(
                model=f"{tmp_path / 'blowup.py'}:make",
                dataset="toy",
                checkpoint_every=1,
                iterations=10,
                model_dir=model_dir,
            )
        )
    # 1e30 is finite after one step; 1e60 overflows float32 at the second.
    assert str(stopped.value) == (
        "the weights became non-finite by iteration 2 (blowup/scale); stopped "
        f"before saving them; the last good checkpoint is {model_dir}/checkpoints/ckpt-1"
    )
    assert latest_step(model_dir) == 1


def test_an_empty_test_split_fails_before_training(tmp_path):
    from tfdp.data.mnist import IDX_FILES, IMAGES_MAGIC, LABELS_MAGIC

    rng = np.random.default_rng(0)
    sizes = {"train": 64, "test": 0}
    for split, (images, labels) in IDX_FILES.items():
        n = sizes[split]
        write_idx(tmp_path / images, rng.integers(0, 256, (n, 28, 28)), IMAGES_MAGIC)
        write_idx(tmp_path / labels, rng.integers(0, 10, (n,)), LABELS_MAGIC)
    model_dir = str(tmp_path / "run")
    with pytest.raises(ConfigError) as refused:
        train(
            toy_config(
                model="lenet",
                mnist_dir=str(tmp_path),
                batch_size=32,
                iterations=2,
                model_dir=model_dir,
            )
        )
    assert (refused.value.field, refused.value.value) == ("mnist_dir", str(tmp_path))
    assert refused.value.reason == "its test split has no examples; evaluation needs at least one"
    assert not os.path.exists(model_dir)


def test_fit_refuses_empty_validation_data():
    import keras

    def make():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = np.zeros((8, 3), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ConfigError, match="validation_data"):
        tfdp_library.fit(make, x, y, validation_data=(x[:0], y[:0]), batch_size=4, iterations=1)
