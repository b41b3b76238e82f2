"""Checkpoints, exact resume after SIGKILL, export, summaries and the guards.

Each run is a `tfdp` subprocess on 2 logical CPUs with the toy model, so that
a kill is a real SIGKILL of a real training process.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import own_stderr_lines, tfdp

TOY = ["--model=toy", "--logical_cpus=2", "--batch_size=100", "--progress=never"]
MODES = {
    "mirrored": ["--mode=mirrored"],
    "weighted": ["--mode=weighted", "--powers=1,3"],
}


def latest_step(model_dir):
    """The step of the checkpoint the index file points at, or None."""
    index = os.path.join(model_dir, "checkpoints", "checkpoint")
    try:
        first = open(index).readline()
    except FileNotFoundError:
        return None
    return int(first.rsplit("ckpt-", 1)[1].strip().strip('"'))


def kill_when(process, ready, timeout=300):
    """SIGKILLs `process` as soon as `ready()` holds; fails if it ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        assert process.poll() is None, f"ended before the kill: {process.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def load_weights(model_dir):
    """The exported model's weights, read by Keras alone in a fresh process."""
    code = (
        "import sys, numpy, keras; "
        "m = keras.models.load_model(sys.argv[1]); "
        "assert 'tfdp' not in sys.modules; "
        "numpy.savez(sys.argv[2], *m.get_weights())"
    )
    out = os.path.join(model_dir, "weights.npz")
    subprocess.run(
        [sys.executable, "-c", code, os.path.join(model_dir, "model.keras"), out],
        check=True,
        capture_output=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2"),
    )
    with np.load(out) as arrays:
        return [arrays[f"arr_{i}"] for i in range(len(arrays.files))]


def result(model_dir):
    with open(os.path.join(model_dir, "result.json")) as f:
        return json.load(f)


def assert_same_run(a, b):
    for x, y in zip(load_weights(a), load_weights(b), strict=True):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert result(a)["iterations"] == result(b)["iterations"]
    # The resumed run logs from where it resumed: the same numbers as the straight run.
    straight = {entry["iteration"]: entry for entry in result(a)["log"]}
    for entry in result(b)["log"]:
        assert entry == pytest.approx(straight[entry["iteration"]], rel=1e-5)
    assert result(a)["test_accuracy"] == result(b)["test_accuracy"]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Runs straight through, once per mode, to compare interrupted runs with."""
    runs = {}

    def run(mode):
        if mode not in runs:
            model_dir = str(tmp_path_factory.mktemp(f"straight-{mode}"))
            args = [*TOY, *MODES[mode], "--iterations=1500", "--checkpoint_every=50"]
            process = tfdp(*args, f"--model_dir={model_dir}")
            assert process.returncode == 0, process.stderr
            runs[mode] = args, model_dir
        return runs[mode]

    return run


@pytest.mark.parametrize("mode", sorted(MODES))
def test_resume_after_sigkill_is_exact(mode, straight_run, tmp_path):
    args, straight = straight_run(mode)
    model_dir = str(tmp_path)
    killed = tfdp(*args, f"--model_dir={model_dir}", wait=False)
    kill_when(killed, lambda: (latest_step(model_dir) or 0) >= 100)
    stopped_at = latest_step(model_dir)
    assert stopped_at < 1500 and not os.path.exists(os.path.join(model_dir, "model.keras"))

    resumed = tfdp(*args, f"--model_dir={model_dir}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at iteration {stopped_at}" in resumed.stdout
    assert result(model_dir)["start_iteration"] == stopped_at
    assert latest_step(model_dir) == 1500
    assert_same_run(straight, model_dir)


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_the_restart_is_exact(mode, signum, straight_run, tmp_path):
    args, straight = straight_run(mode)
    model_dir = str(tmp_path)
    stopped = tfdp(*args, f"--model_dir={model_dir}", wait=False)
    deadline = time.monotonic() + 300
    while (latest_step(model_dir) or 0) < 100:  # mid-run, and past a scheduled save
        assert stopped.poll() is None, f"ended before the signal: {stopped.communicate()}"
        assert time.monotonic() < deadline, "no checkpoint appeared"
        time.sleep(0.02)
    stopped.send_signal(signum)
    _, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signum, err  # the conventional status: it was running
    step = latest_step(model_dir)
    assert 100 <= step < 1500
    name = signal.Signals(signum).name
    [line] = [line for line in err.splitlines() if line.startswith("tfdp: ")]
    assert line == (
        f"tfdp: stopped by {name} after iteration {step}; saved "
        f"{model_dir}/checkpoints/ckpt-{step}; run the same command again to resume"
    )
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))

    resumed = tfdp(*args, f"--model_dir={model_dir}")
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming at iteration {step}" in resumed.stdout
    assert_same_run(straight, model_dir)


def save_period(process, model_dir, saves=5, timeout=300):
    """Seconds per save of a run saving at every step, timed over `saves` index updates
    once it has saved at least once; the process must keep running meanwhile."""
    deadline = time.monotonic() + timeout

    def wait_past(step):
        while (latest_step(model_dir) or 0) <= step:
            assert process.poll() is None, f"ended before the kill: {process.communicate()}"
            assert time.monotonic() < deadline, f"no checkpoint after iteration {step}"
            time.sleep(0.005)
        return latest_step(model_dir), time.monotonic()

    first, began = wait_past(latest_step(model_dir) or 0)
    last, ended = wait_past(first + saves - 1)
    return (ended - began) / (last - first)


def test_kills_during_checkpoint_writes(straight_run, tmp_path):
    """SIGKILLs at moments spread over a save: saving at every step, nearly all of a
    step's time goes to writing its checkpoint, and kill k of K lands at a random
    point of the k-th K-th of a save's duration after an index update."""
    args, straight = straight_run("weighted")
    model_dir = str(tmp_path)
    every_step = [*args, f"--model_dir={model_dir}", "--checkpoint_every=1"]
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kills = 4
    for k in range(kills):
        process = tfdp(*every_step, wait=False)
        period = save_period(process, model_dir)
        delay = period * (k + rng.random()) / kills
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        # Killed, not ended: it was still saving (1500 steps take far longer than this).
        assert process.returncode == -signal.SIGKILL, (seed, process.communicate())
    finished = tfdp(*every_step)
    assert finished.returncode == 0, finished.stderr
    assert "resuming at iteration" in finished.stdout
    assert_same_run(straight, model_dir)


def test_leftovers_of_a_torn_save_do_not_break_the_next_start(tmp_path):
    model_dir = str(tmp_path)
    args = [*TOY, "--iterations=40", "--checkpoint_every=20", f"--model_dir={model_dir}"]
    assert tfdp(*args).returncode == 0
    # What a save killed half-way leaves: a temporary directory and files of a
    # checkpoint that the index file does not name yet.
    checkpoints = os.path.join(model_dir, "checkpoints")
    os.makedirs(os.path.join(checkpoints, "ckpt-60_temp"))
    with open(os.path.join(checkpoints, "ckpt-60_temp", "part-00000-of-00001.data"), "wb") as f:
        f.write(b"\x00" * 100)
    with open(os.path.join(checkpoints, "ckpt-60.index"), "wb") as f:
        f.write(b"truncated")
    more = [a if not a.startswith("--iterations") else "--iterations=80" for a in args]
    process = tfdp(*more)
    assert process.returncode == 0, process.stderr
    assert "resuming at iteration 40" in process.stdout
    assert latest_step(model_dir) == 80


def test_incompatible_checkpoint_is_an_error(tmp_path):
    model_dir = str(tmp_path)
    assert tfdp(*TOY, "--iterations=5", f"--model_dir={model_dir}").returncode == 0
    before = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))

    other = tfdp(*TOY, "--iterations=5", "--hidden_units=32", f"--model_dir={model_dir}")
    assert other.returncode == 2
    [line] = own_stderr_lines(other)
    assert line.startswith(
        f"tfdp: error: --model_dir={model_dir}: holds checkpoints of another run"
    )
    assert "hidden_units 64 (now 32)" in line

    # Without run.json, the checkpoint itself is checked against the model.
    os.remove(os.path.join(model_dir, "run.json"))
    other = tfdp(*TOY, "--iterations=5", "--hidden_units=32", f"--model_dir={model_dir}")
    assert other.returncode == 2, other.stderr
    [line] = own_stderr_lines(other)
    assert "does not fit this model" in line and "Traceback" not in other.stderr
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == before


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    model_dir = str(tmp_path)
    process = tfdp(
        *TOY,
        "--learning_rate=1e30",
        "--checkpoint_every=1",
        "--iterations=30",
        f"--model_dir={model_dir}",
    )
    assert process.returncode == 1
    [line] = own_stderr_lines(process)
    assert line == (
        "tfdp: error: the loss became non-finite at iteration 1; stopped before saving that "
        f"state; the last good checkpoint is {model_dir}/checkpoints/ckpt-1"
    )
    assert latest_step(model_dir) == 1
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))


def test_export_summaries_and_result(tmp_path):
    import tensorflow as tf

    model_dir = str(tmp_path)
    process = tfdp(
        *TOY,
        "--mode=weighted",
        "--powers=1,3",
        "--iterations=30",
        "--eval_every=10",
        f"--model_dir={model_dir}",
        "--progress=always",
    )
    assert process.returncode == 0, process.stderr
    saved = result(model_dir)
    assert [e["iteration"] for e in saved["evals"]] == [10, 20, 30]
    assert saved["test_accuracy"] == saved["evals"][-1]["test_accuracy"] > 0.9
    assert "iteration 30, test accuracy" in process.stdout

    tags = {}
    for kind in ("train", "eval"):
        for name in os.listdir(os.path.join(model_dir, kind)):
            for event in tf.compat.v1.train.summary_iterator(os.path.join(model_dir, kind, name)):
                for value in event.summary.value:
                    tags.setdefault(value.tag, []).append(event.step)
    assert {
        "loss",
        "accuracy",
        "learning_rate",
        "images_per_second",
        "shard/CPU:0",
        "shard/CPU:1",
        "test_accuracy",
    } <= set(tags)
    assert tags["test_accuracy"] == [10, 20, 30]

    # The progress line on stderr, with step, speed and ETA (text mode reads its \r as \n).
    assert "\nstep 30/30 | loss " in process.stderr
    assert "images/s | ETA " in process.stderr

    # model.keras holds the trained weights: same test accuracy without tfdp.
    from tfdp.data import make_toy_data

    weights = load_weights(model_dir)
    test = make_toy_data(0, num_examples=2000, split="test")
    hidden = np.maximum(test.images @ weights[0] + weights[1], 0)
    accuracy = np.mean(np.argmax(hidden @ weights[2] + weights[3], -1) == test.labels)
    assert accuracy == pytest.approx(saved["test_accuracy"], abs=1e-6)


def test_a_resumed_run_keeps_its_measured_split(tmp_path):
    model_dir = str(tmp_path)
    args = [
        *TOY,
        "--mode=weighted",
        "--powers=auto",
        "--rebalance_every=2",
        "--simulate_slowdown=cpu:1=4",
        f"--model_dir={model_dir}",
    ]
    first = tfdp(*args, "--iterations=10")
    assert first.returncode == 0, first.stderr
    assert "auto powers, each device alone" in first.stdout
    split = result(model_dir)["final_shards"]
    with open(os.path.join(model_dir, "shares.json")) as f:
        saved = json.load(f)
    assert saved["step"] == 10 and saved["shards"] == split

    second = tfdp(*args, "--iterations=14")
    assert second.returncode == 0, second.stderr
    assert "resuming at iteration 10" in second.stdout
    assert "auto powers" not in second.stdout  # not measured again
    assert f"shares {split}: the split at iteration 10, from " in second.stdout
    resumed = result(model_dir)
    assert resumed["shards"] == split
    assert resumed["resumed_shares"]["shards"] == split


def test_an_unreadable_shares_file_is_an_error(tmp_path):
    model_dir = str(tmp_path)
    args = [*TOY, "--mode=weighted", "--powers=auto", f"--model_dir={model_dir}"]
    assert tfdp(*args, "--iterations=4").returncode == 0
    with open(os.path.join(model_dir, "shares.json"), "w") as f:
        f.write("{not json")
    process = tfdp(*args, "--iterations=6")
    assert process.returncode != 0
    assert f"--model_dir={model_dir}: {model_dir}/shares.json is unreadable" in process.stderr
    assert "delete it to measure the split again" in process.stderr
