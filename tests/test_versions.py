"""The TensorFlow and Keras releases tfdp runs on, and one line outside them.

The check reads the installed distributions' versions (importlib.metadata), not
TensorFlow itself: a fake `keras` distribution put first on the path stands in for
another release, in a process of its own that never imports TensorFlow.
"""

import subprocess
import sys

import pytest

from tfdp import internals

RANGE = "tfdp runs on TensorFlow 2.19-2.21 with Keras 3.10-3.15"


@pytest.mark.parametrize(
    "tensorflow, keras",
    [
        ("2.19.0", "3.10.0"),
        ("2.19.1", "3.12.4"),
        ("2.21.0", "3.15.1"),
        ("2.20.0.post1", "3.11.3"),
        (None, None),
    ],  # fmt: skip
)
def test_releases_in_the_range_pass(tensorflow, keras):
    assert internals.version_problem(tensorflow, keras) is None


@pytest.mark.parametrize(
    "tensorflow, keras, named",
    [
        ("2.18.1", "3.10.0", "TensorFlow 2.18.1"),
        ("2.22.0", "3.15.1", "TensorFlow 2.22.0"),
        ("2.22.0rc1", "3.15.1", "TensorFlow 2.22.0rc1"),  # a pre-release is not the release
        ("2.21.0", "3.9.2", "Keras 3.9.2"),
        ("2.21.0", "3.16.0", "Keras 3.16.0"),
        ("2.16.2", "2.15.0", "TensorFlow 2.16.2 and Keras 2.15.0"),
    ],
)
def test_releases_outside_are_named_with_the_range(tensorflow, keras, named):
    problem = internals.version_problem(tensorflow, keras)
    assert problem.startswith(f"{RANGE}, and this environment has {named}: install releases")
    assert "\n" not in problem and problem.endswith(
        "set TFDP_ANY_VERSION=1 to try tfdp on these at your own risk"
    )


def test_the_commands_are_told_apart_from_a_library_user():
    assert internals.is_tfdp_command(
        ["/venv/bin/tfdp-launch"], ["python3", "/venv/bin/tfdp-launch"]
    )
    assert internals.is_tfdp_command(
        ["-m"], ["python3", "-m", "tfdp.cluster.launch", "--workers=2"]
    )
    assert not internals.is_tfdp_command(["-m"], ["python3", "-m", "pytest"])
    assert not internals.is_tfdp_command(["train.py"], ["python3", "train.py"])


@pytest.fixture
def old_keras(tmp_path):
    """A directory that, first on the path, makes `keras` look like release 3.8.0."""
    info = tmp_path / "keras-3.8.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: keras\nVersion: 3.8.0\n")
    return tmp_path


def run(args, path, **env):
    import os

    environ = {k: v for k, v in os.environ.items() if k != "TFDP_ANY_VERSION"}
    environ["PYTHONPATH"] = os.pathsep.join([str(path), environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=120, env={**environ, **env}
    )


def test_a_command_outside_the_range_says_so_in_one_line(old_keras):
    process = run(["-m", "tfdp", "--mode=single"], old_keras)
    assert process.returncode == 2
    assert process.stderr.splitlines() == [
        f"tfdp: error: {RANGE}, and this environment has Keras 3.8.0: install releases in that "
        "range (pip install 'tensorflow>=2.19,<2.22' 'keras>=3.10,<3.16'), or set "
        "TFDP_ANY_VERSION=1 to try tfdp on these at your own risk"
    ]


def test_an_import_outside_the_range_is_an_import_error_naming_it(old_keras):
    script = "try:\n    import tfdp\nexcept ImportError as e:\n    print(e)\nelse:\n    print('imported')"
    refused = run(["-c", script], old_keras)
    assert refused.stdout.startswith(f"{RANGE}, and this environment has Keras 3.8.0")
    allowed = run(["-c", script], old_keras, TFDP_ANY_VERSION="1")
    assert allowed.stdout == "imported\n"
