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
def test_enable_by_default_turns_onednn_on():
    lines = probe({}, after="import tensorflow; print(onednn.enabled())")
    assert lines == ["1", "True"]


@pytest.mark.skipif(not X86_64, reason="tfdp sets the variable on x86-64 only")
@pytest.mark.parametrize("entry_point", ["tfdp.cli", "tfdp.bench.table", "tfdp.bench.steps"])
def test_the_entry_points_turn_onednn_on(entry_point):
    assert probe({}, enable=f"import {entry_point}") == ["1"]


def test_a_value_the_user_set_is_kept():
    lines = probe({"TF_ENABLE_ONEDNN_OPTS": "0"}, after="print(onednn.enabled())")
    assert lines == ["0", "False"]


def test_tensorflows_own_default_can_be_kept():
    assert probe({"TFDP_ONEDNN": "tensorflow"}) == ["None"]


@pytest.mark.skipif(not X86_64, reason="tfdp sets the variable on x86-64 only")
def test_a_child_of_a_tfdp_process_can_still_keep_tensorflows_default():
    after = (
        "env = onednn.tensorflow_default_env(os.environ); "
        "print(env.get('TF_ENABLE_ONEDNN_OPTS'), env['TFDP_ONEDNN'])"
    )
    assert probe({}, after=after) == ["1", "None tensorflow"]


def test_nothing_changes_once_tensorflow_is_loaded():
    assert probe({}, before="import tensorflow") == ["None"]


def test_tensorflow_default_env_for_a_child_process():
    from tfdp import onednn

    env = onednn.tensorflow_default_env(
        {"TF_ENABLE_ONEDNN_OPTS": "1", "TFDP_ONEDNN": "on", "PATH": "/bin"}
    )
    expected = {"TFDP_ONEDNN": "tensorflow", "PATH": "/bin"}
    if onednn.USER_VALUE is not None:  # the user's own choice applies to every process
        expected["TF_ENABLE_ONEDNN_OPTS"] = "1"
    assert env == expected


def test_the_result_records_it():
    from tfdp import Config, onednn, train

    result = train(
        Config(mode="single", devices="cpu:0", model="toy", iterations=2),
        log=lambda line: None,
    )
    assert result["onednn"] is onednn.enabled()
    if X86_64 and onednn.USER_VALUE is None:
        assert result["onednn"] is True
