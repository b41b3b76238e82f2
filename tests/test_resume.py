"""Checkpoints, exact resume after SIGKILL and signals, export, summaries and the guards.

The toy model on 2 logical CPUs. A run that is killed or signalled is a `tfdp`
subprocess, so that a kill is a real SIGKILL of a real training process; the
straight runs it is compared with, and the resumes, run in this process
(`tfdp.train`, the same devices and the same numbers).
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
from helpers import (
    TOY,
    TOY_MODE_FLAGS,
    TOY_MODES,
    assert_same_run,
    environment,
    kill_when,
    latest_step,
    load_weights,
    result,
    tfdp,
    toy_config,
    train,
    wait_for,
)

from tfdp.errors import ConfigError
from tfdp.run.training import NonFinite

ITERATIONS = 600  # far longer than the time to the kills
# mirrored is the same trainer with even shares; weighted also saves its split
KILLED = {"weighted"}


def run_config(mode, model_dir, **changes):
    """The config of the runs of `mode` that are killed, as `run_flags` gives them."""
    return toy_config(
        **TOY_MODES[mode],
        iterations=ITERATIONS,
        checkpoint_every=50,
        model_dir=str(model_dir),
        **changes,
    )


def run_flags(mode, model_dir, *more):
    return [
        *TOY,
        *TOY_MODE_FLAGS[mode],
        f"--iterations={ITERATIONS}",
        "--checkpoint_every=50",
        f"--model_dir={model_dir}",
        *more,
    ]


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory):
    """Runs straight through, once per mode, to compare interrupted runs with."""
    runs = {}

    def run(mode):
        if mode not in runs:
            model_dir = str(tmp_path_factory.mktemp(f"straight-{mode}"))
            train(run_config(mode, model_dir))
            runs[mode] = model_dir
        return runs[mode]

    return run


def resume(mode, model_dir, **changes):
    """Runs `mode`'s run in `model_dir` to its end; returns the lines it logged."""
    _, lines = train(run_config(mode, model_dir, **changes))
    return lines


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(KILLED))
def test_resume_after_sigkill_is_exact(mode, straight_run, tmp_path):
    straight = straight_run(mode)
    model_dir = str(tmp_path)
    killed = tfdp(*run_flags(mode, model_dir), wait=False)
    kill_when(killed, lambda: (latest_step(model_dir) or 0) >= 100)
    stopped_at = latest_step(model_dir)
    assert stopped_at < ITERATIONS and not os.path.exists(os.path.join(model_dir, "model.keras"))

    lines = resume(mode, model_dir)
    assert any(f"resuming at iteration {stopped_at}" in line for line in lines)
    assert result(model_dir)["start_iteration"] == stopped_at
    assert latest_step(model_dir) == ITERATIONS
    assert_same_run(straight, model_dir)


@pytest.mark.slow
def test_a_kill_between_micro_stepped_updates_resumes_exactly(tmp_path_factory):
    """Caps [32, 32] under batch 100: every update is two micro-steps ([18, 32] each). A
    SIGKILL mid-run (between two updates or inside one) leaves the last saved update, and
    the resumed run is the straight run."""
    straight = str(tmp_path_factory.mktemp("straight-micro"))
    train(run_config("weighted", straight, max_rows=(32, 32)))
    model_dir = str(tmp_path_factory.mktemp("killed-micro"))
    killed = tfdp(*run_flags("weighted", model_dir, "--max_rows=32,32"), wait=False)
    kill_when(killed, lambda: (latest_step(model_dir) or 0) >= 100)
    stopped_at = latest_step(model_dir)
    assert stopped_at < ITERATIONS

    lines = resume("weighted", model_dir, max_rows=(32, 32))
    assert any("2 micro-steps of at most 18 + 32" in line for line in lines)
    assert any(f"resuming at iteration {stopped_at}" in line for line in lines)
    assert_same_run(straight, model_dir)


@pytest.mark.slow
@pytest.mark.parametrize("mode", sorted(KILLED))
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_saves_the_step_and_the_restart_is_exact(mode, signum, straight_run, tmp_path):
    straight = straight_run(mode)
    model_dir = str(tmp_path)
    stopped = tfdp(*run_flags(mode, model_dir), wait=False)
    # mid-run, and past a scheduled save
    wait_for(lambda: (latest_step(model_dir) or 0) >= 100, [stopped], "a checkpoint")
    stopped.send_signal(signum)
    _, err = stopped.communicate(timeout=300)
    assert stopped.returncode == 128 + signum, err  # the conventional status: it was running
    step = latest_step(model_dir)
    assert 100 <= step < ITERATIONS
    name = signal.Signals(signum).name
    [line] = [line for line in err.splitlines() if line.startswith("tfdp: ")]
    assert line == (
        f"tfdp: stopped by {name} after iteration {step}; saved "
        f"{model_dir}/checkpoints/ckpt-{step}; run the same command again to resume"
    )
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))

    lines = resume(mode, model_dir)
    assert any(f"resuming at iteration {step}" in line for line in lines)
    assert_same_run(straight, model_dir)


def save_period(process, model_dir, saves=5, timeout=300):
    """Seconds per save of a run saving at every step, timed over `saves` index updates
    once it has saved at least once; the process must keep running meanwhile."""

    def wait_past(step):
        wait_for(lambda: (latest_step(model_dir) or 0) > step, [process], "a checkpoint", timeout)
        return latest_step(model_dir), time.monotonic()

    first, began = wait_past(latest_step(model_dir) or 0)
    last, ended = wait_past(first + saves - 1)
    return (ended - began) / (last - first)


@pytest.mark.slow
def test_kills_during_checkpoint_writes(straight_run, tmp_path):
    """SIGKILLs at moments spread over a save: saving at every step, nearly all of a
    step's time goes to writing its checkpoint, and kill k of K lands at a random
    point of the k-th K-th of a save's duration after an index update."""
    straight = straight_run("weighted")
    model_dir = str(tmp_path)
    every_step = run_flags("weighted", model_dir, "--checkpoint_every=1")
    seed = random.randrange(2**32)
    rng = random.Random(seed)
    kills = 3
    for k in range(kills):
        process = tfdp(*every_step, wait=False)
        period = save_period(process, model_dir)
        delay = period * (k + rng.random()) / kills
        time.sleep(delay)
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=60)
        # Killed, not ended: it was still saving (600 steps take far longer than this).
        assert process.returncode == -signal.SIGKILL, (seed, process.communicate())
    # The rest of the run saves as the straight one did: what it resumes from is the test.
    lines = resume("weighted", model_dir)
    assert any("resuming at iteration" in line for line in lines), lines
    assert_same_run(straight, model_dir)


def test_leftovers_of_a_torn_save_do_not_break_the_next_start(tmp_path):
    model_dir = str(tmp_path)
    train(toy_config(iterations=40, checkpoint_every=20, model_dir=model_dir))
    # What a save killed half-way leaves: a temporary directory and files of a
    # checkpoint that the index file does not name yet.
    checkpoints = os.path.join(model_dir, "checkpoints")
    os.makedirs(os.path.join(checkpoints, "ckpt-60_temp"))
    with open(os.path.join(checkpoints, "ckpt-60_temp", "part-00000-of-00001.data"), "wb") as f:
        f.write(b"\x00" * 100)
    with open(os.path.join(checkpoints, "ckpt-60.index"), "wb") as f:
        f.write(b"truncated")
    _, lines = train(toy_config(iterations=80, checkpoint_every=20, model_dir=model_dir))
    assert any("resuming at iteration 40" in line for line in lines)
    assert latest_step(model_dir) == 80


def test_incompatible_checkpoint_is_an_error(tmp_path):
    model_dir = str(tmp_path)
    train(toy_config(iterations=5, model_dir=model_dir))
    before = sorted(os.listdir(os.path.join(model_dir, "checkpoints")))

    with pytest.raises(ConfigError) as other:
        train(toy_config(iterations=5, hidden_units=32, model_dir=model_dir))
    assert (other.value.field, other.value.value) == ("model_dir", model_dir)
    assert other.value.reason.startswith("holds checkpoints of another run")
    assert "hidden_units 64 (now 32)" in other.value.reason

    # Without run.json, the checkpoint itself is checked against the model.
    os.remove(os.path.join(model_dir, "run.json"))
    with pytest.raises(ConfigError) as other:
        train(toy_config(iterations=5, hidden_units=32, model_dir=model_dir))
    assert other.value.field == "model_dir" and "does not fit this model" in other.value.reason
    assert "\n" not in other.value.reason
    assert sorted(os.listdir(os.path.join(model_dir, "checkpoints"))) == before


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    model_dir = str(tmp_path)
    with pytest.raises(NonFinite) as stopped:
        train(
            toy_config(learning_rate=1e30, checkpoint_every=1, iterations=30, model_dir=model_dir)
        )
    assert str(stopped.value) == (
        "the loss became non-finite at iteration 1; stopped before saving that "
        f"state; the last good checkpoint is {model_dir}/checkpoints/ckpt-1"
    )
    assert latest_step(model_dir) == 1
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))


# model.keras read by Keras alone, in a process that never imported tfdp.
KERAS_ALONE = (
    "import sys, numpy, keras; "
    "m = keras.models.load_model(sys.argv[1]); "
    "assert 'tfdp' not in sys.modules; "
    "numpy.savez(sys.argv[2], *m.get_weights())"
)


@pytest.mark.slow
def test_export_summaries_and_result(tmp_path, capsys):
    import tensorflow as tf

    model_dir = str(tmp_path / "run")
    saved, lines = train(
        toy_config(
            **TOY_MODES["weighted"],
            iterations=30,
            eval_every=10,
            model_dir=model_dir,
            progress=True,
        )
    )
    assert result(model_dir) == json.loads(json.dumps(saved))
    assert [e["iteration"] for e in saved["evals"]] == [10, 20, 30]
    assert saved["test_accuracy"] == saved["evals"][-1]["test_accuracy"] > 0.9
    assert any(line.startswith("iteration 30, test accuracy") for line in lines)

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

    # The progress line on stderr, rewritten in place, with step, speed and ETA.
    stderr = capsys.readouterr().err
    assert "\rstep 30/30 | loss " in stderr
    assert "images/s | ETA " in stderr

    # model.keras holds the trained weights: the same test accuracy, read by Keras alone.
    out = tmp_path / "weights.npz"
    subprocess.run(
        [sys.executable, "-c", KERAS_ALONE, os.path.join(model_dir, "model.keras"), str(out)],
        check=True,
        capture_output=True,
        env=environment(),
        timeout=300,
    )
    with np.load(out) as arrays:
        weights = [arrays[f"arr_{i}"] for i in range(len(arrays.files))]
    from tfdp.data.mnist import make_toy_data

    test = make_toy_data(0, num_examples=2000, split="test")
    hidden = np.maximum(test.images @ weights[0] + weights[1], 0)
    accuracy = np.mean(np.argmax(hidden @ weights[2] + weights[3], -1) == test.labels)
    assert accuracy == pytest.approx(saved["test_accuracy"], abs=1e-6)
    for x, y in zip(weights, load_weights(model_dir), strict=True):
        np.testing.assert_array_equal(x, y)


def test_a_resumed_run_keeps_its_measured_split(tmp_path):
    model_dir = str(tmp_path)
    settings = dict(
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers="auto",
        rebalance_every=2,
        simulate_slowdown="cpu:1=4",
        model_dir=model_dir,
    )
    first, lines = train(toy_config(**settings, iterations=10))
    assert any(line.startswith("auto powers, each device alone") for line in lines)
    split = first["final_shards"]
    with open(os.path.join(model_dir, "shares.json")) as f:
        saved = json.load(f)
    assert saved["step"] == 10 and saved["shards"] == split

    resumed, lines = train(toy_config(**settings, iterations=14))
    assert any("resuming at iteration 10" in line for line in lines)
    assert not any("auto powers" in line for line in lines)  # not measured again
    assert any(f"shares {split}: the split at iteration 10, from " in line for line in lines)
    assert resumed["shards"] == split
    assert resumed["resumed_shares"]["shards"] == split


def test_an_unreadable_shares_file_is_an_error(tmp_path):
    model_dir = str(tmp_path)
    settings = dict(mode="weighted", devices="cpu:0,cpu:1", powers="auto", model_dir=model_dir)
    train(toy_config(**settings, iterations=4))
    with open(os.path.join(model_dir, "shares.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ConfigError) as refused:
        train(toy_config(**settings, iterations=6))
    assert (refused.value.field, refused.value.value) == ("model_dir", model_dir)
    assert refused.value.reason.startswith(f"{model_dir}/shares.json is unreadable")
    assert refused.value.reason.endswith("delete it to measure the split again")
