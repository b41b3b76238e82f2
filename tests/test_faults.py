"""Runs that meet each other, end, change settings or go wrong after start-up.

Each run is a `tfdp` subprocess with the toy model on 2 logical CPUs.
"""

import gzip
import os
import struct
import time

import numpy as np
from conftest import own_stderr_lines, tfdp
from test_resume import TOY, latest_step, load_weights


def test_a_second_run_on_a_model_dir_in_use_is_refused(tmp_path):
    model_dir = str(tmp_path / "run")
    never_saves = ["--iterations=1000000", "--checkpoint_every=1000000"]
    first = tfdp(*TOY, *never_saves, f"--model_dir={model_dir}", wait=False)
    try:
        lock = os.path.join(model_dir, "lock")
        deadline = time.monotonic() + 300
        while not (os.path.exists(lock) and open(lock).read().startswith("pid")):
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "the first run never took the lock"
            time.sleep(0.05)
        second = tfdp(*TOY, *never_saves, f"--model_dir={model_dir}")
        assert second.returncode == 2
        [line] = own_stderr_lines(second)
        assert line.startswith(
            f"tfdp: error: --model_dir={model_dir}: is in use by another run (pid {first.pid} on "
        ), line
        assert first.poll() is None  # the first one trains on, undisturbed
    finally:
        first.kill()
        first.wait()
    # The kernel dropped the killed run's lock: the directory is usable again.
    again = tfdp(*TOY, "--iterations=1", f"--model_dir={model_dir}")
    assert again.returncode == 0, again.stderr


def test_a_finished_run_run_again_changes_nothing(tmp_path):
    model_dir = str(tmp_path)
    args = [*TOY, "--iterations=20", "--checkpoint_every=10", f"--model_dir={model_dir}"]
    assert tfdp(*args).returncode == 0

    def files():
        return {
            os.path.join(root, name): open(os.path.join(root, name), "rb").read()
            for root, _, names in os.walk(model_dir)
            for name in names
            if name != "lock"
        }

    before = files()
    again = tfdp(*args)
    assert again.returncode == 0, again.stderr
    assert f"the run in {model_dir} is finished (iteration 20 of 20); nothing to do" in again.stdout
    assert "time for" not in again.stdout
    assert files() == before

    shorter = tfdp(*[a for a in args if not a.startswith("--iterations")], "--iterations=5")
    assert shorter.returncode == 2
    [line] = own_stderr_lines(shorter)
    assert line == (
        f"tfdp: error: --iterations=5: ends at iteration 5, before the checkpoint of "
        f"iteration 20 in {model_dir}; train at least to 20, or use another --model_dir"
    )
    assert files() == before


def test_a_resume_trains_at_the_new_learning_rate(tmp_path):
    first_dir, model_dir = str(tmp_path / "first"), str(tmp_path / "run")
    args = [*TOY, "--checkpoint_every=10"]
    assert tfdp(*args, "--iterations=10", f"--model_dir={first_dir}").returncode == 0
    assert tfdp(*args, "--iterations=10", f"--model_dir={model_dir}").returncode == 0
    at_10 = load_weights(model_dir)
    for x, y in zip(load_weights(first_dir), at_10, strict=True):  # the runs are reproducible
        np.testing.assert_array_equal(x, y)

    # 10 more steps at a rate 1e8 times smaller: the weights barely move...
    slow = tfdp(*args, "--iterations=20", "--learning_rate=1e-9", f"--model_dir={model_dir}")
    assert slow.returncode == 0, slow.stderr
    assert "resuming at iteration 10" in slow.stdout
    moved = max(np.abs(x - y).max() for x, y in zip(load_weights(model_dir), at_10, strict=True))
    assert moved < 1e-6, moved
    # ...where 10 more at the first rate move them by far more.
    fast = tfdp(*args, "--iterations=20", f"--model_dir={first_dir}")
    assert fast.returncode == 0, fast.stderr
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
    process = tfdp(
        f"--model={tmp_path / 'blowup.py'}:make",
        "--dataset=toy",
        "--logical_cpus=2",
        "--batch_size=100",
        "--progress=never",
        "--checkpoint_every=1",
        "--iterations=10",
        f"--model_dir={model_dir}",
    )
    assert process.returncode == 1, process.stderr
    [line] = own_stderr_lines(process)
    # 1e30 is finite after one step; 1e60 overflows float32 at the second.
    assert line == (
        "tfdp: error: the weights became non-finite by iteration 2 (blowup/scale); stopped "
        f"before saving them; the last good checkpoint is {model_dir}/checkpoints/ckpt-1"
    )
    assert latest_step(model_dir) == 1


def write_idx(path, array, magic):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(">I", magic) + b"".join(struct.pack(">I", d) for d in array.shape))
        f.write(array.astype(np.uint8).tobytes())


def test_an_empty_test_split_fails_before_training(tmp_path):
    from tfdp.data import IDX_FILES, IMAGES_MAGIC, LABELS_MAGIC

    rng = np.random.default_rng(0)
    sizes = {"train": 64, "test": 0}
    for split, (images, labels) in IDX_FILES.items():
        n = sizes[split]
        write_idx(tmp_path / images, rng.integers(0, 256, (n, 28, 28)), IMAGES_MAGIC)
        write_idx(tmp_path / labels, rng.integers(0, 10, (n,)), LABELS_MAGIC)
    model_dir = str(tmp_path / "run")
    process = tfdp(
        "--model=lenet",
        f"--mnist_dir={tmp_path}",
        "--batch_size=32",
        "--iterations=2",
        f"--model_dir={model_dir}",
    )
    assert process.returncode == 2
    [line] = own_stderr_lines(process)
    assert line == (
        f"tfdp: error: --mnist_dir={tmp_path}: its test split has no examples; evaluation "
        "needs at least one"
    )
    assert not os.path.exists(model_dir)


def test_fit_refuses_empty_validation_data():
    import keras
    import pytest

    import tfdp
    from tfdp.errors import ConfigError

    def make():
        model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(2)])
        model.compile(optimizer="sgd", loss="mse")
        return model

    x, y = np.zeros((8, 3), np.float32), np.zeros((8, 2), np.float32)
    with pytest.raises(ConfigError, match="validation_data"):
        tfdp.fit(make, (x, y), validation_data=(x[:0], y[:0]), batch_size=4, iterations=1)
