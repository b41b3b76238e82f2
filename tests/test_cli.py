"""The `tfdp` command end to end, in subprocesses (each sets up its own devices)."""

import gzip
import json
import os
import struct

import pytest
from conftest import own_stderr_lines, tfdp

from tfdp import Config
from tfdp.devices import default_chains, default_intra_op_threads

TOY_RUN = [
    "--mode=weighted",
    "--model=toy",
    "--logical_cpus=2",
    "--devices=cpu:0,cpu:1",
    "--powers=1,5",
    "--batch_size=100",
]


def test_toy_run_writes_result_json(tmp_path):
    path = tmp_path / "result.json"
    process = tfdp(*TOY_RUN, f"--result_json={path}")
    assert process.returncode == 0, process.stderr
    lines = process.stdout.splitlines()
    assert lines[0] == "workload partition: [('CPU:0', 17), ('CPU:1', 83)]"
    assert lines[1].startswith("global batch 100 = 17 + 83 over 2 device(s), mode weighted; ")
    assert lines[2].startswith("iteration 0, accuracy ")
    assert lines[6].startswith("iteration 40, accuracy ")
    assert lines[7].startswith("time for 50 iterations of toy on 2 device(s), mode weighted")
    assert lines[8].startswith("iteration 50, test accuracy ")
    result = json.loads(path.read_text())
    assert result["mode"] == "weighted"
    assert result["devices"] == ["CPU:0", "CPU:1"]
    assert result["shards"] == [17, 83]
    assert [e["iteration"] for e in result["log"]] == [0, 10, 20, 30, 40]
    assert result["final_accuracy"] >= 0.95
    assert result["seconds"] > 0 and result["images_per_second"] > 0
    # The printed accuracy is the recorded one.
    assert f"iteration 40, accuracy {result['log'][-1]['accuracy']:f}" in process.stdout


@pytest.mark.parametrize(
    "args, expected, chains",
    [
        # tfdp's choices for this machine
        (["--mode=mirrored", "--logical_cpus=4"], None, None),
        (["--mode=single"], None, None),
        # the user's
        (["--mode=mirrored", "--logical_cpus=4", "--intra_op_threads=3"], 3, None),
        (["--mode=mirrored", "--logical_cpus=4", "--intra_op_threads=0"], 0, None),
        (["--mode=single", "--chains=3"], None, 3),
    ],
)
def test_threads_and_chains_reach_tensorflow(args, expected, chains, tmp_path):
    mode = args[0].split("=")[1]
    logical_cpus = 4 if "--logical_cpus=4" in args else 0
    config = Config(mode=mode, chains=chains or 0)
    cores = os.cpu_count() or 1
    if expected is None:
        expected = default_intra_op_threads(config, logical_cpus, 0, cores)
    if chains is None:
        devices = [f"/device:CPU:{i}" for i in range(logical_cpus if mode == "mirrored" else 1)]
        chains = default_chains(devices, cores)
    path = tmp_path / "result.json"
    process = tfdp("--model=toy", "--iterations=2", *args, f"--result_json={path}")
    assert process.returncode == 0, process.stderr
    result = json.loads(path.read_text())
    assert result["intra_op_threads"] == expected
    assert result["chains"] == chains


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


IMAGES, LABELS = "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"
CORRUPTIONS = {
    # name: (images (magic, dims, payload bytes), labels (...), words the error must contain)
    "wrong magic": ((2049, (2, 28, 28), 2 * 784), (2049, (2,), 2), [IMAGES, "2051"]),
    "truncated": ((2051, (2, 28, 28), 784), (2049, (2,), 2), [IMAGES, "1568", "784"]),
    "wrong count": ((2051, (2, 28, 28), 2 * 784), (2049, (3,), 3), [IMAGES, LABELS, "2", "3"]),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_mnist_is_named(corruption, tmp_path):
    images, labels, words = CORRUPTIONS[corruption]
    data = tmp_path / "mnist"
    data.mkdir()
    for name, (magic, dims, size) in ((IMAGES, images), (LABELS, labels)):
        write_idx(data / name, magic, dims, bytes(size))
    process = tfdp(f"--mnist_dir={data}", "--iterations=1", cwd=tmp_path)
    assert process.returncode == 2
    [line] = own_stderr_lines(process)
    assert line.startswith(f"tfdp: error: --mnist_dir={data}: ")
    for word in words:
        assert word in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist"]  # nothing written


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
    (
        [
            "--model=toy",
            "--mode=mirrored",
            "--mirrored_input=dataset",
            "--logical_cpus=4",
            "--batch_size=6",
        ],
        "--batch_size=6",
    ),
    (["--model=toy", "--mode=mirrored", "--all_reduce=magic"], "--all_reduce=magic"),
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
    (
        ["--model=toy", "--mode=weighted", "--logical_cpus=2", "--simulate_slowdown=cpu:2=4"],
        "--simulate_slowdown=cpu:2=4",
    ),
    (["--model=toy", "--simulate_slowdown=cpu:0=0.5"], "--simulate_slowdown=cpu:0=0.5"),
    (["--model=toy", "--mode=mirrored", "--rebalance_every=5"], "--rebalance_every=5"),
    (["--model=toy", "--reduce=allreduce"], "--reduce=allreduce"),
    (
        ["--model=toy", "--mode=weighted", "--devices=cpu:0", "--rebalance_every=2"],
        "--rebalance_every=2",
    ),
    (["--model=toy", "--mode=weighted", "--powers=auto,1"], "--powers=auto,1"),
    (["--logical_cpus=-1"], "--logical_cpus=-1"),
    (["--model=toy", "--intra_op_threads=-1"], "--intra_op_threads=-1"),
    (["--model=toy", "--chains=-2"], "--chains=-2"),
    (["--mode=multiworker", "--chains=2"], "--chains=2"),
    (["--mnist_dir=/no/such/dir"], "--mnist_dir=/no/such/dir"),
    (["--model=toy", "--result_json=/no/such/dir/result.json"], "--result_json=/no/such/dir"),
    (["--model=toy", "--epochs=2", "--iterations=5"], "--epochs=2"),
    (["--model=toy", "--eval_every=-1"], "--eval_every=-1"),
    (["--model=toy", "--checkpoint_every=0"], "--checkpoint_every=0"),
    (["--model=toy", "--model_dir=/proc/tfdp"], "--model_dir=/proc/tfdp"),
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
