"""The `tfdp` command end to end, in subprocesses (each sets up its own devices)."""

import gzip
import json
import os
import struct
import subprocess
import sys

import pytest

TOY_RUN = [
    "--mode=weighted",
    "--model=toy",
    "--logical_cpus=2",
    "--devices=cpu:0,cpu:1",
    "--powers=1,5",
    "--batch_size=100",
]
# Lines TensorFlow's native runtime prints at start-up, whatever the log level.
NATIVE_PREFIXES = ("WARNING: All log messages before absl", "I0000", "W0000", "E0000")


def tfdp(*args, cwd=None):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFDP_MNIST_DIR", None)  # every run here names its data explicitly
    return subprocess.run(
        [sys.executable, "-m", "tfdp", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )


def own_stderr_lines(process):
    return [
        line
        for line in process.stderr.splitlines()
        if line.strip() and not line.startswith(NATIVE_PREFIXES)
    ]


def test_toy_run_writes_result_json(tmp_path):
    path = tmp_path / "result.json"
    process = tfdp(*TOY_RUN, f"--result_json={path}")
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    assert lines[0] == "workload partition: [('CPU:0', 17), ('CPU:1', 83)]"
    assert lines[1].startswith("iteration 0, accuracy ")
    assert lines[5].startswith("iteration 40, accuracy ")
    assert lines[6].startswith("time for 50 iterations of toy on 2 device(s), mode weighted")
    result = json.loads(path.read_text())
    assert result["mode"] == "weighted"
    assert result["devices"] == ["CPU:0", "CPU:1"]
    assert result["shards"] == [17, 83]
    assert [e["iteration"] for e in result["log"]] == [0, 10, 20, 30, 40]
    assert result["final_accuracy"] >= 0.95
    assert result["seconds"] > 0 and result["images_per_second"] > 0
    # The printed accuracy is the recorded one.
    assert f"iteration 40, accuracy {result['log'][-1]['accuracy']:f}" in process.stdout


def test_flagfile(tmp_path):
    flagfile = tmp_path / "toy.flags"
    flagfile.write_text("\n".join(TOY_RUN + ["--iterations=2", "--log_every=1"]) + "\n")
    process = tfdp(f"--flagfile={flagfile}")
    assert process.returncode == 0, process.stderr
    assert process.stdout.splitlines()[0] == "workload partition: [('CPU:0', 17), ('CPU:1', 83)]"
    assert "iteration 1, accuracy" in process.stdout


def write_idx(path, magic, dims, payload):
    with gzip.open(path, "wb") as f:
        f.write(struct.pack(f">I{len(dims)}I", magic, *dims) + payload)


@pytest.fixture
def corrupt_mnist(tmp_path):
    """An MNIST directory whose training images carry the labels' magic number."""
    write_idx(tmp_path / "train-images-idx3-ubyte.gz", 2049, (2, 28, 28), bytes(2 * 784))
    write_idx(tmp_path / "train-labels-idx1-ubyte.gz", 2049, (2,), bytes(2))
    return tmp_path


BAD_FLAGS = [
    (["--mode=async"], "--mode=async"),
    (["--model=resnet"], "--model=resnet"),
    (["--batch_size=abc"], "--batch_size=abc"),
    (["--batch_size=0"], "--batch_size=0"),
    (["--learning_rate=nan"], "--learning_rate=nan"),
    (["--model=toy", "--dataset=mnist"], "--dataset=mnist"),
    (["--mode=weighted", "--powers=1,fast"], "--powers=1,fast"),
    (["--mode=weighted", "--powers=1,0"], "--powers=1,0"),
    (["--mode=weighted", "--powers=1,nan"], "--powers=1,nan"),
    (["--powers=1,5"], "--powers=1,5"),  # powers with mode single
    (["--model=toy", "--devices=gpu:0"], "--devices=gpu:0"),
    (["--model=toy", "--devices=cpu:0;cpu:1"], "--devices=cpu:0;cpu:1"),
    (
        ["--model=toy", "--mode=weighted", "--logical_cpus=2", "--devices=all", "--powers=1,2,3"],
        "--powers=1,2,3",
    ),
    (["--model=toy", "--mode=mirrored", "--logical_cpus=4", "--batch_size=3"], "--batch_size=3"),
    (["--model=toy", "--mode=mirrored", "--logical_cpus=4", "--batch_size=6"], "--batch_size=6"),
    (
        [
            "--model=toy",
            "--mode=weighted",
            "--logical_cpus=2",
            "--powers=1,1000",
            "--batch_size=10",
        ],
        "--powers=1,1000",
    ),
    (["--logical_cpus=-1"], "--logical_cpus=-1"),
    (["--mnist_dir=/no/such/dir"], "--mnist_dir=/no/such/dir"),
    (["--model=toy", "--result_json=/no/such/dir/result.json"], "--result_json=/no/such/dir"),
    (["--nosuchflag=1"], "nosuchflag"),
    (["--model=toy", "extra"], "unexpected arguments extra"),
]


@pytest.mark.parametrize("args, named", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flags_fail_early_with_one_line(args, named, tmp_path):
    process = tfdp(*args, cwd=tmp_path)
    assert process.returncode == 2
    lines = own_stderr_lines(process)
    assert len(lines) == 1, process.stderr
    assert lines[0].startswith("tfdp: error: ")
    assert named in lines[0]
    assert "Traceback" not in process.stderr
    assert process.stdout == ""  # no training started
    assert list(tmp_path.iterdir()) == []  # nothing written


def test_corrupt_mnist_is_named(corrupt_mnist):
    process = tfdp(f"--mnist_dir={corrupt_mnist}", "--iterations=1")
    assert process.returncode == 2
    [line] = own_stderr_lines(process)
    assert line.startswith(f"tfdp: error: --mnist_dir={corrupt_mnist}: ")
    assert "train-images-idx3-ubyte.gz" in line and "2051" in line
