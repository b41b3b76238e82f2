"""oneDNN's CPU kernels: tfdp's commands turn them on unless told otherwise, and say so;
importing tfdp as a library changes nothing."""

import os
import platform
import subprocess
import sys

import pytest

X86_64 = platform.machine().lower() in ("x86_64", "amd64")

PROBE = """
import os, sys
{before}
import tfdp
from tfdp import onednn
{enable}
print(os.environ.get("TF_ENABLE_ONEDNN_OPTS"))
{after}
"""


def probe(env_changes, before="", after="", enable="onednn.enable_by_default()"):
    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "TFDP_ONEDNN")}
    env.update(env_changes)
    out = subprocess.run(
        [sys.executable, "-c", PROBE.format(before=before, after=after, enable=enable)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().splitlines()


def test_importing_tfdp_leaves_tensorflow_as_it_is():
    assert probe({}, enable="") == ["None"]


@pytest.mark.skipif(not X86_64, reason="tfdp sets the variable on x86-64 only")
@pytest.mark.parametrize("entry_point", ["tfdp.cli", "tfdp.bench.table", "tfdp.bench.steps"])
def test_the_entry_points_turn_onednn_on(entry_point):
    assert probe({}, enable=f"import {entry_point}") == ["1"]


def test_tensorflows_own_default_can_be_kept():
    assert probe({"TFDP_ONEDNN": "tensorflow"}) == ["None"]


@pytest.mark.skipif(not X86_64, reason="tfdp sets the variable on x86-64 only")
def test_a_child_of_a_tfdp_process_can_still_keep_tensorflows_default():
    after = (
        "env = onednn.tensorflow_default_env(os.environ); "
        "print(env.get('TF_ENABLE_ONEDNN_OPTS'), env['TFDP_ONEDNN'])"
    )
    assert probe({}, after=after) == ["1", "None tensorflow"]


@pytest.mark.slow
def test_nothing_changes_once_tensorflow_is_loaded():
    assert probe({}, before="import tensorflow") == ["None"]


@pytest.mark.parametrize(
    "user_value, expected",
    [
        (None, {"TFDP_ONEDNN": "tensorflow", "PATH": "/bin"}),  # tfdp's own "1" is dropped
        ("1", {"TFDP_ONEDNN": "tensorflow", "PATH": "/bin", "TF_ENABLE_ONEDNN_OPTS": "1"}),
    ],
    ids=["tfdp set it", "the user set it"],
)
def test_tensorflow_default_env_for_a_child_process(monkeypatch, user_value, expected):
    from tfdp import onednn

    monkeypatch.setattr(onednn, "USER_VALUE", user_value)
    env = onednn.tensorflow_default_env(
        {"TF_ENABLE_ONEDNN_OPTS": "1", "TFDP_ONEDNN": "on", "PATH": "/bin"}
    )
    assert env == expected  # the user's own choice applies to every process


# What TensorFlow itself logs at start-up when its runtime loads the oneDNN kernels.
TENSORFLOW_SAYS_ON = "oneDNN custom operations are on"


def run_logged(entry, env_changes):
    """Loads TensorFlow after `entry` (the command's module, or tfdp as a library) with
    oneDNN's variables only as given and TensorFlow's info log on; returns what
    `onednn.enabled()` says (what every result.json records) and whether TensorFlow
    logged its kernels on."""
    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "TFDP_ONEDNN")}
    env.update(env_changes, TF_CPP_MIN_LOG_LEVEL="0")
    code = f"import {entry}, tensorflow; from tfdp import onednn; print(onednn.enabled())"
    process = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600
    )
    assert process.returncode == 0, process.stderr[-3000:]
    recorded = {"True": True, "False": False}[process.stdout.strip().splitlines()[-1]]
    return recorded, TENSORFLOW_SAYS_ON in process.stderr


CLI, LIBRARY = "tfdp.cli", "tfdp"  # the command turns the kernels on when imported
X86_ONLY = pytest.mark.skipif(not X86_64, reason="tfdp sets the variable on x86-64 only")


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry, env_changes, expected",
    [
        (CLI, {"TF_ENABLE_ONEDNN_OPTS": "0"}, False),  # the user's value is kept
        (LIBRARY, {"TF_ENABLE_ONEDNN_OPTS": "0"}, False),
        pytest.param(CLI, {"TF_ENABLE_ONEDNN_OPTS": "1"}, True, marks=X86_ONLY),
        pytest.param(LIBRARY, {"TF_ENABLE_ONEDNN_OPTS": "1"}, True, marks=X86_ONLY),
        pytest.param(CLI, {}, True, marks=X86_ONLY),  # the command turns them on
    ],
    ids=["cli, off", "library, off", "cli, on", "library, on", "cli, unset"],
)
def test_the_result_records_it(entry, env_changes, expected):
    recorded, tensorflow_says_on = run_logged(entry, env_changes)
    assert recorded is expected
    assert tensorflow_says_on is expected


@pytest.mark.slow
@pytest.mark.parametrize(
    "entry, env_changes",
    [(CLI, {"TFDP_ONEDNN": "tensorflow"}), (LIBRARY, {})],
    ids=["cli, TFDP_ONEDNN=tensorflow", "library, unset"],
)
def test_with_tensorflows_default_the_result_agrees_with_tensorflows_log(entry, env_changes):
    # TensorFlow's default depends on the CPU: its own start-up log says which it chose.
    recorded, tensorflow_says_on = run_logged(entry, env_changes)
    assert isinstance(recorded, bool)
    assert recorded is tensorflow_says_on


def test_every_result_holds_what_this_process_runs():
    from helpers import toy_config, train

    from tfdp import onednn

    result, _ = train(toy_config(iterations=1))
    assert result["onednn"] is onednn.enabled() is not None
