"""CLI paths no other test takes: MNIST through tensorflow-datasets (and its offline
hint), checkpoint retention, --init=keras, and a resume on another device set.

Every run is a subprocess (its own device layout). The tensorflow-datasets runs
never reach the network: tfds is mocked in the subprocess and its sockets refuse
to connect, so a wrong path fails at once instead of retrying a download.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from conftest import own_stderr_lines, tfdp
from test_resume import latest_step, load_weights, result

TOY = ["--model=toy", "--logical_cpus=2", "--batch_size=100", "--progress=never"]

# Runs the tfdp command in this process with tfds mocked: N examples per split (tfds'
# deterministic fake MNIST), then writes those examples, read by tfds itself, as IDX
# files to argv[1].
MOCKED_TFDS = """
import socket, sys
from unittest import mock

def refuse(*args, **kwargs):
    raise OSError("this test has no network")

socket.socket.connect = refuse
socket.create_connection = refuse
import tensorflow_datasets as tfds
from tfdp.cli import run

idx_dir, N, flags = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
# tfds' mock has no split sizes for MNIST; batch_size=-1 batches by their total.
with tfds.testing.mock_data(num_examples=N), mock.patch.object(
    tfds.core.SplitDict, "total_num_examples", N
):
    sys.argv = ["tfdp", *flags]
    try:
        run()
    except SystemExit as stop:
        status = stop.code
    import gzip, os
    for split, prefix in (("train", "train"), ("test", "t10k")):
        images, labels = tfds.as_numpy(
            tfds.load("mnist", split=split, as_supervised=True, batch_size=-1)
        )
        for kind, magic, array in (
            ("images-idx3", 2051, images[..., 0]),
            ("labels-idx1", 2049, labels),
        ):
            header = magic.to_bytes(4, "big") + b"".join(
                d.to_bytes(4, "big") for d in array.shape
            )
            with gzip.open(os.path.join(idx_dir, f"{prefix}-{kind}-ubyte.gz"), "wb") as f:
                f.write(header + array.astype("uint8").tobytes())
sys.exit(status)
"""

# tfds with every download failing at once, as offline.
FAILING_DOWNLOAD = """
import socket, sys
from unittest import mock

def refuse(*args, **kwargs):
    raise OSError("this test has no network")

socket.socket.connect = refuse
socket.create_connection = refuse
import tensorflow_datasets as tfds
from tfdp.cli import run

def download_fails(*args, **kwargs):
    raise ConnectionError("simulated: no route to the download server")

with mock.patch.object(tfds.core.DatasetBuilder, "download_and_prepare", download_fails):
    sys.argv = ["tfdp", *sys.argv[1:]]
    run()
"""


def python(code, *args):
    """`code` in a fresh python with these args, as the tfdp command runs (no TFDP_MNIST_DIR)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFDP_MNIST_DIR", None)
    return subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )


def test_mnist_through_tensorflow_datasets(tmp_path):
    """A run reads MNIST from tfds (mocked: 200 examples a split), and trains on exactly
    the examples a run reading the same examples from IDX files trains on."""
    idx_dir, empty = tmp_path / "idx", tmp_path / "tfds"
    idx_dir.mkdir()
    empty.mkdir()
    run = ["--batch_size=50", "--iterations=6", "--log_every=1", "--progress=never"]
    from_tfds = python(
        MOCKED_TFDS,
        str(idx_dir),
        "200",
        *run,
        f"--data_dir={empty}",
        f"--result_json={tmp_path / 'tfds.json'}",
    )
    assert from_tfds.returncode == 0, from_tfds.stderr
    assert "4 steps per epoch of 200 examples" in from_tfds.stdout
    assert "iteration 6, test accuracy" in from_tfds.stdout and "(200 examples)" in from_tfds.stdout
    from_idx = tfdp(*run, f"--mnist_dir={idx_dir}", f"--result_json={tmp_path / 'idx.json'}")
    assert from_idx.returncode == 0, from_idx.stderr
    tfds_result, idx_result = (
        json.loads((tmp_path / name).read_text()) for name in ("tfds.json", "idx.json")
    )
    assert [e["iteration"] for e in tfds_result["log"]] == [0, 1, 2, 3, 4, 5]
    assert tfds_result["log"] == idx_result["log"]
    assert tfds_result["test_metrics"] == idx_result["test_metrics"]
    losses = [e["loss"] for e in tfds_result["log"]]
    assert len(set(losses)) == 6  # the weights change at every step


def test_tensorflow_datasets_offline_names_both_flags(tmp_path):
    empty = str(tmp_path)
    process = python(FAILING_DOWNLOAD, f"--data_dir={empty}", "--iterations=1")
    assert process.returncode == 2, process.stderr
    # tfds may log a warning of its own first; tfdp's one line comes last
    lines = own_stderr_lines(process)
    [line] = [line for line in lines if line.startswith("tfdp:")]
    assert line == lines[-1] and "Traceback" not in process.stderr
    assert line.startswith(
        f"tfdp: error: --data_dir={empty}: MNIST through tensorflow-datasets failed "
        "(ConnectionError: simulated: no route to the download server)"
    )
    assert line.endswith("offline, point --mnist_dir or TFDP_MNIST_DIR at the four IDX files")


def test_keep_checkpoints_keeps_the_newest(tmp_path):
    model_dir = str(tmp_path)
    process = tfdp(
        *TOY,
        "--iterations=10",
        "--checkpoint_every=2",  # saves after 2, 4, 6, 8 and 10
        "--keep_checkpoints=2",
        f"--model_dir={model_dir}",
    )
    assert process.returncode == 0, process.stderr
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
    one_step = [*TOY, "--iterations=1", "--log_every=1"]
    for init, model_dir in (("keras", keras_dir), ("tutorial", tutorial_dir)):
        process = tfdp(*one_step, f"--init={init}", f"--model_dir={model_dir}")
        assert process.returncode == 0, process.stderr
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

    more = tfdp(
        *TOY, "--iterations=30", "--log_every=1", "--init=keras", f"--model_dir={keras_dir}"
    )
    assert more.returncode == 0, more.stderr
    assert "resuming at iteration 1" in more.stdout
    assert result(keras_dir)["log"][-1]["loss"] < 0.5 * first["loss"]  # it trains


def test_resume_on_another_device_set_is_exact(tmp_path):
    """Saved by weighted 1,3 on 2 CPUs at step 10, resumed by mirrored on 3 CPUs: the
    same weights and losses as the weighted run straight to 20."""
    straight, moved = str(tmp_path / "straight"), str(tmp_path / "moved")
    weighted = ["--mode=weighted", "--powers=1,3"]
    common = ["--model=toy", "--batch_size=100", "--progress=never", "--log_every=1"]
    process = tfdp(
        *common, "--logical_cpus=2", *weighted, "--iterations=20", f"--model_dir={straight}"
    )
    assert process.returncode == 0, process.stderr
    process = tfdp(
        *common, "--logical_cpus=2", *weighted, "--iterations=10", f"--model_dir={moved}"
    )
    assert process.returncode == 0, process.stderr
    assert latest_step(moved) == 10
    process = tfdp(
        *common, "--logical_cpus=3", "--mode=mirrored", "--iterations=20", f"--model_dir={moved}"
    )
    assert process.returncode == 0, process.stderr
    assert "resuming at iteration 10" in process.stdout
    assert "34 + 33 + 33 over 3" in process.stdout
    assert result(moved)["devices"] == ["CPU:0", "CPU:1", "CPU:2"]
    for got, expected in zip(load_weights(moved), load_weights(straight), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    losses = {e["iteration"]: e["loss"] for e in result(straight)["log"]}
    assert [e["iteration"] for e in result(moved)["log"]] == list(range(10, 20))
    for entry in result(moved)["log"]:
        assert entry["loss"] == pytest.approx(losses[entry["iteration"]], rel=1e-5)
