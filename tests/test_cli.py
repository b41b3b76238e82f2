"""The `tfdp` command: a few runs end to end in subprocesses (each sets up its own
devices), and every bad flag checked in this process as the command checks it."""

import json
import os
import subprocess
import sys

import pytest
from absl import flags
from helpers import environment, own_stderr_lines, refusal, tfdp, write_idx

from tfdp import Config
from tfdp.devices import default_chains, default_intra_op_threads
from tfdp.errors import ConfigError

TOY_RUN = [
    "--mode=weighted",
    "--model=toy",
    "--logical_cpus=2",
    "--devices=cpu:0,cpu:1",
    "--powers=1,5",
    "--batch_size=100",
]


@pytest.mark.slow
def test_toy_run_writes_result_json(tmp_path):
    path = tmp_path / "result.json"
    env = environment()
    del env["TF_CPP_MIN_LOG_LEVEL"]  # as a user runs it: tfdp quiets TensorFlow's start-up
    process = tfdp(*TOY_RUN, f"--result_json={path}", env=env)
    assert process.returncode == 0, process.stderr
    # TensorFlow's C++ start-up lines (absl's notice, oneDNN, CUDA probing) are not shown
    assert "InitializeLog" not in process.stderr and "oneDNN" not in process.stderr
    assert "cuInit" not in process.stderr and "cuda" not in process.stderr.lower()
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


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, expected, chains",
    [
        # tfdp's choice for this machine: more logical CPUs than there may be cores
        (["--mode=mirrored", "--logical_cpus=4"], None, None),
        # the user's
        (["--mode=single", "--chains=3", "--intra_op_threads=3"], 3, 3),
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


def test_flagfile_is_read_as_the_command_line(tmp_path):
    from tfdp import cli

    flagfile = tmp_path / "toy.flags"
    flagfile.write_text("\n".join(TOY_RUN + ["--iterations=2", "--log_every=1"]) + "\n")
    try:
        config = cli.checked_config(cli.FLAGS(["tfdp", f"--flagfile={flagfile}"]))
    finally:
        cli.FLAGS.unparse_flags()
    assert config == Config(
        mode="weighted",
        model="toy",
        devices="cpu:0,cpu:1",
        powers=(1.0, 5.0),
        batch_size=100,
        iterations=2,
        log_every=1,
        progress=False,
    )


IMAGES, LABELS = "train-images-idx3-ubyte.gz", "train-labels-idx1-ubyte.gz"
CORRUPTIONS = {
    # name: (images (magic, shape), labels (magic, shape), payload bytes cut from the
    # images, words the error must contain)
    "wrong magic": ((2049, (2, 28, 28)), (2049, (2,)), 0, [IMAGES, "2051"]),
    "truncated": ((2051, (2, 28, 28)), (2049, (2,)), 784, [IMAGES, "1568", "784"]),
    "wrong count": ((2051, (2, 28, 28)), (2049, (3,)), 0, [IMAGES, LABELS, "2", "3"]),
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
def test_corrupt_mnist_is_named(corruption, tmp_path, monkeypatch):
    images, labels, cut, words = CORRUPTIONS[corruption]
    data = tmp_path / "mnist"
    data.mkdir()
    for name, (magic, shape), drop in ((IMAGES, images, cut), (LABELS, labels, 0)):
        write_idx(data / name, bytes_of(shape), magic=magic, cut=drop)
    monkeypatch.chdir(tmp_path)
    error, line = refusal(f"--mnist_dir={data}", "--iterations=1")
    assert (error.field, error.value) == ("mnist_dir", str(data))
    assert line.startswith(f"tfdp: error: --mnist_dir={data}: ")
    for word in words:
        assert word in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mnist"]  # nothing written


def bytes_of(shape):
    import numpy as np

    return np.zeros(shape, np.uint8)


# Every refusal of the command line: the arguments, and the setting the error names with
# its value as typed (absl's own errors name the flag in their text).
BAD_FLAGS = [
    (["--mode=async"], "mode", "async"),
    (["--model=resnet"], "model", "resnet"),
    (["--batch_size=abc"], "batch_size", "abc"),
    (["--batch_size=0"], "batch_size", 0),
    (["--learning_rate=nan"], "learning_rate", float("nan")),
    (["--model=toy", "--dataset=mnist"], "dataset", "mnist"),
    (["--mode=weighted", "--powers=1,fast"], "powers", ["1", "fast"]),
    (["--mode=weighted", "--powers=1,0"], "powers", (1.0, 0.0)),
    (["--mode=weighted", "--powers=1,nan"], "powers", (1.0, float("nan"))),
    (["--powers=1,5"], "powers", (1.0, 5.0)),  # powers with mode single
    (["--model=toy", "--devices=gpu:0"], "devices", "gpu:0"),
    (["--model=toy", "--devices=cpu:0;cpu:1"], "devices", "cpu:0;cpu:1"),
    (
        ["--model=toy", "--mode=weighted", "--logical_cpus=2", "--devices=all", "--powers=1,2,3"],
        "powers",
        (1.0, 2.0, 3.0),
    ),
    (["--model=toy", "--mode=mirrored", "--all_reduce=magic"], "all_reduce", "magic"),
    (
        [
            "--model=toy",
            "--mode=weighted",
            "--logical_cpus=2",
            "--devices=cpu:0,cpu:1",
            "--powers=1,1000",
            "--batch_size=10",
        ],
        "powers",
        [1.0, 1000.0],
    ),
    (
        [
            "--model=toy",
            "--mode=weighted",
            "--logical_cpus=2",
            "--devices=cpu:0,cpu:1",
            "--simulate_slowdown=cpu:2=4",
        ],
        "simulate_slowdown",
        "cpu:2=4",
    ),
    (["--model=toy", "--simulate_slowdown=cpu:0=0.5"], "simulate_slowdown", "cpu:0=0.5"),
    (["--model=toy", "--mode=mirrored", "--rebalance_every=5"], "rebalance_every", 5),
    (["--model=toy", "--reduce=allreduce"], "reduce", "allreduce"),
    (
        ["--model=toy", "--mode=weighted", "--devices=cpu:0", "--rebalance_every=2"],
        "rebalance_every",
        2,
    ),
    (["--model=toy", "--mode=weighted", "--powers=auto,1"], "powers", ["auto", "1"]),
    (["--model=toy", "--max_rows=64,x"], "max_rows", ["64", "x"]),
    (["--model=toy", "--max_rows=0"], "max_rows", [0]),
    (["--model=toy", "--max_rows=-3"], "max_rows", [-3]),
    (
        ["--model=toy", "--max_rows=50", "--simulate_slowdown=cpu:0=2"],
        "simulate_slowdown",
        "cpu:0=2",
    ),
    (
        ["--model=toy", "--mode=weighted", "--logical_cpus=2", "--devices=cpu:0,cpu:1", "--max_rows=64"],
        "max_rows",
        [64],
    ),
    (["--logical_cpus=-1"], "logical_cpus", -1),
    (["--model=toy", "--intra_op_threads=-1"], "intra_op_threads", -1),
    (["--model=toy", "--chains=-2"], "chains", -2),
    (["--mode=multiworker", "--chains=2"], "chains", 2),
    (["--mnist_dir=/no/such/dir"], "mnist_dir", "/no/such/dir"),
    (
        ["--model=toy", "--result_json=/no/such/dir/result.json"],
        "result_json",
        "/no/such/dir/result.json",
    ),
    (["--model=toy", "--epochs=2", "--iterations=5"], "epochs", 2),
    (["--model=toy", "--eval_every=-1"], "eval_every", -1),
    (["--model=toy", "--checkpoint_every=0"], "checkpoint_every", 0),
    (["--model=toy", "--model_dir=/proc/tfdp"], "model_dir", "/proc/tfdp"),
    (["--nosuchflag=1"], "nosuchflag", "1"),
    (["--model=toy", "extra"], "arguments", "extra"),
]


def same_value(got, expected):
    if isinstance(expected, float) and expected != expected:  # nan
        return isinstance(got, float) and got != got
    if isinstance(expected, (list, tuple)):
        return len(got) == len(expected) and all(map(same_value, got, expected))
    return got == expected


@pytest.mark.parametrize(
    "args, field, value", BAD_FLAGS, ids=[" ".join(a) for a, _, _ in BAD_FLAGS]
)
def test_bad_flags_fail_early_with_one_line(args, field, value, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    error, line = refusal(*args)
    assert error is not None, "accepted"
    assert line.startswith("tfdp: error: ") and "\n" not in line
    if isinstance(error, flags.Error):  # absl's parsing names the flag in its text
        assert f"--{field}={value}" in line or f"flag '{field}'" in line, line
    else:
        assert isinstance(error, ConfigError)
        assert error.field == field and same_value(error.value, value), (error.field, error.value)
        typed = next((a for a in args if a.startswith(f"--{field}=")), None)
        assert typed is None or typed in line, line  # the flag as the user typed it
    assert capsys.readouterr().out == ""  # no training started
    assert list(tmp_path.iterdir()) == []  # nothing written


TENSORFLOW_IMPORTED = """
import os, runpy, sys
sys.argv = ["tfdp", *sys.argv[1:]]
try:
    runpy.run_module("tfdp", run_name="__main__")
finally:
    with open(os.environ["TFDP_TEST_REPORT"], "w") as report:
        report.write(str("tensorflow" in sys.modules))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    "args, line, before_tensorflow",
    [
        (["--mode=async"], "tfdp: error: flag --mode=async: value should be one of", True),
        (["--mode=weighted", "--powers=1,0"], "tfdp: error: --powers=1,0: every power", True),
        (["--model=toy", "extra"], "tfdp: error: unexpected arguments extra: flags take", True),
        (["--model=toy", "--result_json=/no/dir/r.json"], "tfdp: error: --result_json=", True),
        (
            ["--mode=multiworker", "--model=toy", "--cluster=slurm"],
            "tfdp: error: --cluster=slurm: found no Slurm step here",
            True,
        ),
        # found once TensorFlow lists the devices
        (["--model=toy", "--devices=gpu:0"], "tfdp: error: --devices=gpu:0: GPU:0 does not", False),
    ],
)
def test_a_refusal_exits_2_with_one_line_and_writes_nothing(
    args, line, before_tensorflow, tmp_path
):
    report = tmp_path.parent / f"{tmp_path.name}.report"
    process = subprocess.run(
        [sys.executable, "-c", TENSORFLOW_IMPORTED, *args, f"--model_dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        env=environment(TFDP_TEST_REPORT=str(report)),
        cwd=tmp_path,
        timeout=300,
    )
    assert process.returncode == 2
    [printed] = own_stderr_lines(process)
    assert printed.startswith(line), printed
    assert "Traceback" not in process.stderr
    assert process.stdout == ""  # no training started
    assert list(tmp_path.iterdir()) == []  # nothing written
    assert report.read_text() == str(not before_tensorflow)
