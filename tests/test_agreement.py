"""Mode multiworker: the workers agree on their settings, initial weights and data.

The digest comparison is tested directly; the CLI tests start two workers by
hand (as a user would, one TF_CONFIG each) that differ in one thing, and
expect both to stop with exit status 2 and a line naming it. Every wait has a
timeout: a hang fails the test.
"""

import dataclasses
import hashlib
import json
import subprocess
import sys

import pytest
from helpers import ROOT, environment, own_stderr_lines, refusal, run_together

from tfdp.cluster.agreement import (
    AGREED_FIELDS,
    LOCAL_FIELDS,
    Agreed,
    digest,
    disagreement,
    first_difference,
    settings_to_agree,
)
from tfdp.cluster.workers import free_ports, tf_configs
from tfdp.cluster.spec import read_cluster
from tfdp.config import Config
from tfdp.errors import ConfigError

WORKERS = ("worker:0", "worker:1")
TOY = ["--model=toy", "--batch_size=256", "--progress=never"]


def worker_environment(tf_config):
    """A worker's environment; the workers run in a scratch directory, so this
    checkout's tfdp is put on the path."""
    return environment(TF_CONFIG=tf_config, PYTHONPATH=ROOT)


def test_every_setting_is_agreed_but_the_local_ones():
    names = {field.name for field in dataclasses.fields(Config)}
    assert set(LOCAL_FIELDS) == {
        "progress",
        "data_dir",
        "mnist_dir",
        "keep_checkpoints",
        "collective_timeout",
    }
    assert set(AGREED_FIELDS) == names - set(LOCAL_FIELDS)
    for field in ("learning_rate", "seed", "log_every", "checkpoint_every", "model_dir"):
        assert field in AGREED_FIELDS


def test_digests_are_48_bit_hashes_of_the_text():
    expected = int.from_bytes(hashlib.blake2b(b"0.1", digest_size=6).digest(), "big")
    assert digest("0.1") == expected < 2**48
    assert digest("0.1") != digest("0.10")


def test_the_first_differing_setting_is_named_with_every_workers_value():
    mine = settings_to_agree(Config(mode="multiworker", model="toy", learning_rate=0.1))
    theirs = settings_to_agree(
        Config(mode="multiworker", model="toy", learning_rate=0.05, log_every=5)
    )
    rows = [[digest(item.text) for item in items] for items in (mine, theirs)]
    differing = first_difference(rows)
    assert mine[differing].field == "learning_rate"  # log_every comes later
    error = disagreement(mine[differing], WORKERS, ["0.1", "0.05"])
    assert str(error) == (
        "learning_rate=0.1: differs between workers (worker:0 0.1, worker:1 0.05); "
        "every worker needs the same settings"
    )


def test_workers_that_agree_have_no_difference():
    items = settings_to_agree(Config(mode="multiworker", model="toy"))
    row = [digest(item.text) for item in items]
    assert first_difference([row, list(row)]) is None
    local = settings_to_agree(Config(mode="multiworker", model="toy", keep_checkpoints=9))
    assert first_difference([row, [digest(item.text) for item in local]]) is None


def test_a_difference_in_the_last_column_is_found():
    assert first_difference([[1, 2, 3], [1, 2, 4], [1, 2, 3]]) == 2
    item = Agreed("model", "m.py:f", "2 arrays, digest aa", differs="its weights differ")
    assert str(disagreement(item, WORKERS, ["2 arrays, digest aa", "2 arrays, digest bb"])) == (
        "model='m.py:f': its weights differ (worker:0 2 arrays, digest aa, "
        "worker:1 2 arrays, digest bb); every worker needs the same settings"
    )


@pytest.mark.parametrize("address", ["127.0.0.1:99999", "127.0.0.1:0", ":0", "127.0.0.1:65536"])
def test_ports_outside_1_to_65535_are_refused(address):
    text = json.dumps({"cluster": {"worker": [address]}, "task": {"type": "worker", "index": 0}})
    with pytest.raises(ConfigError) as info:
        read_cluster(text)
    assert info.value.field == "TF_CONFIG"
    assert info.value.reason == (
        f'job "worker" must be a list of host:port addresses (ports 1 to 65535), not {address!r}'
    )


def test_the_highest_port_is_accepted():
    text = json.dumps(
        {"cluster": {"worker": ["127.0.0.1:65535"]}, "task": {"type": "worker", "index": 0}}
    )
    assert read_cluster(text).addresses == ("127.0.0.1:65535",)


def run_alone(tf_config, cwd):
    """One toy `tfdp --mode=multiworker` process with `tf_config`, run to its end."""
    return subprocess.run(
        [sys.executable, "-m", "tfdp", "--mode=multiworker", "--model=toy"],
        capture_output=True,
        text=True,
        env=worker_environment(tf_config),
        cwd=cwd,
        timeout=120,
    )


def test_a_port_out_of_range_is_one_error_line(tmp_path, monkeypatch):
    tf_config = json.dumps(
        {"cluster": {"worker": ["localhost:99999"]}, "task": {"type": "worker", "index": 0}}
    )
    monkeypatch.setenv("TF_CONFIG", tf_config)
    monkeypatch.chdir(tmp_path)
    _, line = refusal("--mode=multiworker", "--model=toy")
    reason = "must be a list of host:port addresses (ports 1 to 65535), not 'localhost:99999'"
    assert line == f'tfdp: error: TF_CONFIG={tf_config}: job "worker" {reason}'
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_port_in_use_is_one_error_line(tmp_path):
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        address = f"127.0.0.1:{taken.getsockname()[1]}"
        tf_config = json.dumps(
            {
                "cluster": {"worker": [address, "127.0.0.1:1"]},
                "task": {"type": "worker", "index": 0},
            }
        )
        process = run_alone(tf_config, tmp_path)
    assert process.returncode == 2
    assert own_stderr_lines(process) == [
        f"tfdp: error: TF_CONFIG={address}: Could not start gRPC server on {address} for "
        "worker:0: the port is in use by another process; give a free port"
    ]


def run_workers(*flags_per_worker, cwd, timeout=300):
    """Starts one `tfdp --mode=multiworker` per entry of `flags_per_worker` on loopback,
    each with its TF_CONFIG, and waits for all; returns (exit status, stderr lines)."""
    configs = tf_configs(free_ports(len(flags_per_worker)))
    command = [sys.executable, "-m", "tfdp", "--mode=multiworker", "--progress=never"]
    ran = run_together(
        [[*command, *flags] for flags in flags_per_worker],
        [worker_environment(tf_config) for tf_config in configs],
        cwd=cwd,
        timeout=timeout,
    )
    return [
        (status, own_stderr_lines(subprocess.CompletedProcess([], 0, out, err)))
        for status, out, err in ran
    ]


@pytest.mark.slow
def test_workers_with_different_learning_rates_both_stop(tmp_path):
    common = [*TOY, "--iterations=5"]
    ran = run_workers(
        [*common, "--learning_rate=0.1"], [*common, "--learning_rate=0.05"], cwd=tmp_path
    )
    held = "(worker:0 0.1, worker:1 0.05); every worker needs the same settings"
    assert ran == [
        (2, [f"tfdp: error: --learning_rate=0.1: differs between workers {held}"]),
        (2, [f"tfdp: error: --learning_rate=0.05: differs between workers {held}"]),
    ]


USER_SOURCE = """
import json
import os

import keras
import numpy as np


def worker():
    return json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def model(seed=7):
    keras.utils.set_random_seed(seed)
    inputs = keras.Input((4,))
    m = keras.Model(inputs, keras.layers.Dense(3)(inputs))
    m.compile(optimizer=keras.optimizers.SGD(0.1),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return m


def model_by_worker():
    return model(seed=7 + worker())


def data(shift=0.0):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 4)).astype(np.float32)
    y = rng.integers(0, 3, 200).astype(np.int32)
    return (x + shift, y), (x, y)


def data_by_worker():
    return data(shift=worker())
"""


@pytest.fixture
def source(tmp_path):
    path = tmp_path / "user.py"
    path.write_text(USER_SOURCE)
    return path


def user_run(source, model, dataset):
    return [f"--model={source}:{model}", f"--dataset={source}:{dataset}", "--batch_size=50"]


@pytest.mark.slow
def test_workers_that_agree_train(source, tmp_path):
    # The control of the two tests below: the same file, the same model and data.
    flags = [*user_run(source, "model", "data"), "--iterations=2"]
    ran = run_workers(flags, flags, cwd=tmp_path)
    assert [status for status, _ in ran] == [0, 0], ran


@pytest.mark.slow
def test_workers_with_different_initial_weights_both_stop(source, tmp_path):
    flags = [*user_run(source, "model_by_worker", "data"), "--iterations=2"]
    ran = run_workers(flags, flags, cwd=tmp_path)
    for status, lines in ran:
        assert status == 2, ran
        [line] = lines
        assert line.startswith(
            f"tfdp: error: --model={source}:model_by_worker: its initial weights differ "
            "between workers (worker:0 2 arrays, digest "
        ), line
        assert ", worker:1 2 arrays, digest " in line
        assert line.endswith(
            "every worker must start from the same weights (seed them the same everywhere)"
        )
    digests = ran[0][1][0].split("digest ")[1:]
    assert digests[0].split(",")[0] != digests[1].split(")")[0]


@pytest.mark.slow
def test_workers_with_different_data_both_stop(source, tmp_path):
    flags = [*user_run(source, "model", "data_by_worker"), "--iterations=2"]
    ran = run_workers(flags, flags, cwd=tmp_path)
    for status, lines in ran:
        assert status == 2, ran
        [line] = lines
        assert line.startswith(
            f"tfdp: error: --dataset={source}:data_by_worker: the training data differs "
            "between workers (worker:0 200 examples, digest "
        ), line
        assert line.endswith("every worker must read the same data")
