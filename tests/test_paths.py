"""Paths no other test takes: MNIST through tensorflow-datasets (and its offline
hint), checkpoint retention, --init=keras, and a resume on another device set.

Every run is `tfdp.train` in this process. The tensorflow-datasets runs never
reach the network: tfds is mocked and this process's sockets refuse to connect
meanwhile, so a wrong path fails at once instead of retrying a download.
"""

import os
import socket
from unittest import mock

import numpy as np
import pytest
from helpers import latest_step, load_weights, result, toy_config, train, write_idx

from tfdp import Config
from tfdp.data.mnist import IDX_FILES, IMAGES_MAGIC, LABELS_MAGIC, MNIST_DIR_ENV
from tfdp.errors import ConfigError


@pytest.fixture
def offline(monkeypatch):
    """No network for the test, and no MNIST directory from the environment."""

    def refuse(*args, **kwargs):
        raise OSError("this test has no network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.delenv(MNIST_DIR_ENV, raising=False)


def test_mnist_through_tensorflow_datasets(tmp_path, offline):
    """A run reads MNIST from tfds (mocked: 200 examples a split), and trains on exactly
    the examples a run reading the same examples from IDX files trains on; the IDX
    files hold what tfds itself reads."""
    import tensorflow_datasets as tfds

    idx_dir, empty = tmp_path / "idx", tmp_path / "tfds"
    idx_dir.mkdir()
    empty.mkdir()
    run = dict(batch_size=50, iterations=6, log_every=1)
    # tfds' mock has no split sizes for MNIST; batch_size=-1 batches by their total.
    with (
        tfds.testing.mock_data(num_examples=200),
        mock.patch.object(tfds.core.SplitDict, "total_num_examples", 200),
    ):
        from_tfds, lines = train(Config(data_dir=str(empty), **run))
        for split, (images_file, labels_file) in IDX_FILES.items():
            images, labels = tfds.as_numpy(
                tfds.load("mnist", split=split, as_supervised=True, batch_size=-1)
            )
            write_idx(idx_dir / images_file, images[..., 0], IMAGES_MAGIC)
            write_idx(idx_dir / labels_file, labels, LABELS_MAGIC)
    assert any("4 steps per epoch of 200 examples" in line for line in lines)
    assert any(
        line.startswith("iteration 6, test accuracy") and "(200 examples)" in line for line in lines
    )
    from_idx, _ = train(Config(mnist_dir=str(idx_dir), **run))
    assert [e["iteration"] for e in from_tfds["log"]] == [0, 1, 2, 3, 4, 5]
    assert from_tfds["log"] == from_idx["log"]
    assert from_tfds["test_metrics"] == from_idx["test_metrics"]
    losses = [e["loss"] for e in from_tfds["log"]]
    assert len(set(losses)) == 6  # the weights change at every step


def test_tensorflow_datasets_offline_names_both_flags(tmp_path, offline):
    import tensorflow_datasets as tfds

    def download_fails(*args, **kwargs):
        raise ConnectionError("simulated: no route to the download server")

    empty = str(tmp_path)
    with mock.patch.object(tfds.core.DatasetBuilder, "download_and_prepare", download_fails):
        with pytest.raises(ConfigError) as refused:
            train(Config(data_dir=empty, iterations=1))
    assert (refused.value.field, refused.value.value) == ("data_dir", empty)
    assert refused.value.reason.startswith(
        "MNIST through tensorflow-datasets failed "
        "(ConnectionError: simulated: no route to the download server)"
    )
    assert refused.value.reason.endswith(
        "offline, point --mnist_dir or TFDP_MNIST_DIR at the four IDX files"
    )


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    model_dir = str(tmp_path)
    # saves after 2, 4, 6, 8 and 10
    train(toy_config(iterations=10, checkpoint_every=2, keep_checkpoints=2, model_dir=model_dir))
    checkpoints = os.path.join(model_dir, "checkpoints")
    assert sorted(os.listdir(checkpoints)) == [
        "checkpoint",
        "ckpt-10.data-00000-of-00001",
        "ckpt-10.index",
        "ckpt-8.data-00000-of-00001",
        "ckpt-8.index",
    ]
    with open(os.path.join(checkpoints, "checkpoint")) as f:
        index = f.read()
    assert [
        line.split('"')[1] for line in index.splitlines() if "all_model" in line and '"' in line
    ] == [
        "ckpt-8",
        "ckpt-10",
    ]
    assert latest_step(model_dir) == 10


def glorot_bound(fan_in, fan_out):
    return np.sqrt(6 / (fan_in + fan_out))


def test_init_keras_starts_from_glorot_uniform(tmp_path):
    """The toy MLP's kernels are 128x64 and 64x10: Glorot-uniform bounds 0.177 and 0.285,
    the tutorial's 0.1. One step moves a weight by far less than the margins below."""
    keras_dir, tutorial_dir = str(tmp_path / "keras"), str(tmp_path / "tutorial")
    for init, model_dir in (("keras", keras_dir), ("tutorial", tutorial_dir)):
        train(toy_config(iterations=1, log_every=1, init=init, model_dir=model_dir))
    keras_weights, tutorial_weights = load_weights(keras_dir), load_weights(tutorial_dir)
    for kernel, (fan_in, fan_out) in zip(keras_weights[0::2], [(128, 64), (64, 10)], strict=True):
        bound = glorot_bound(fan_in, fan_out)
        assert kernel.shape == (fan_in, fan_out)
        assert 0.97 * bound < np.abs(kernel).max() < bound + 0.01
        # uniform on [-b, b]: standard deviation b / sqrt(3), mean 0
        assert kernel.std() == pytest.approx(bound / np.sqrt(3), rel=0.06)
        assert abs(kernel.mean()) < 0.05 * bound
    for kernel in tutorial_weights[0::2]:
        assert 0.097 < np.abs(kernel).max() < 0.1 + 0.01
    for bias in keras_weights[1::2]:  # zeros, moved by one step only
        assert np.abs(bias).max() < 0.05
    assert result(keras_dir)["init"] == "keras"
    [first] = result(keras_dir)["log"]

    _, lines = train(toy_config(iterations=30, log_every=1, init="keras", model_dir=keras_dir))
    assert any("resuming at iteration 1" in line for line in lines)
    assert result(keras_dir)["log"][-1]["loss"] < 0.5 * first["loss"]  # it trains


def test_resume_on_another_device_set_is_exact(tmp_path):
    """Saved by weighted 1,3 on 2 CPUs at step 10, resumed by mirrored on 3 CPUs: the
    same weights and losses as the weighted run straight to 20."""
    straight, moved = str(tmp_path / "straight"), str(tmp_path / "moved")
    weighted = dict(mode="weighted", devices="cpu:0,cpu:1", powers=(1, 3))
    train(toy_config(**weighted, log_every=1, iterations=20, model_dir=straight))
    train(toy_config(**weighted, log_every=1, iterations=10, model_dir=moved))
    assert latest_step(moved) == 10
    mirrored = dict(mode="mirrored", devices="cpu:0,cpu:1,cpu:2")
    _, lines = train(toy_config(**mirrored, log_every=1, iterations=20, model_dir=moved))
    assert any("resuming at iteration 10" in line for line in lines)
    assert any("34 + 33 + 33 over 3" in line for line in lines)
    assert result(moved)["devices"] == ["CPU:0", "CPU:1", "CPU:2"]
    for got, expected in zip(load_weights(moved), load_weights(straight), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    losses = {e["iteration"]: e["loss"] for e in result(straight)["log"]}
    assert [e["iteration"] for e in result(moved)["log"]] == list(range(10, 20))
    for entry in result(moved)["log"]:
        assert entry["loss"] == pytest.approx(losses[entry["iteration"]], rel=1e-5)
