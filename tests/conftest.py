"""Four logical CPUs stand in for four GPUs in every test of this process.

They must exist before TensorFlow initialises its runtime, so this runs at
collection time, before any test module touches TensorFlow. Tests that need
another device layout run the CLI in a subprocess.
"""

import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import pytest  # noqa: E402

from tfdp import onednn  # noqa: E402
from tfdp.devices import configure_logical_devices  # noqa: E402

onednn.enable_by_default()  # as the tfdp command does: the tests run its kernels
NUM_LOGICAL_CPUS = 4
configure_logical_devices(logical_cpus=NUM_LOGICAL_CPUS)

CPUS = [f"/device:CPU:{i}" for i in range(NUM_LOGICAL_CPUS)]


@pytest.fixture(scope="session")
def mnist_dir():
    """The real MNIST IDX files, from TFDP_MNIST_DIR; failing loudly when it is unset."""
    directory = os.environ.get("TFDP_MNIST_DIR")
    if not directory:
        pytest.fail(
            "set TFDP_MNIST_DIR to the directory of the four MNIST IDX .gz files "
            "(or deselect these tests with -m 'not mnist')"
        )
    return directory


# Lines TensorFlow's native runtime prints at start-up, whatever the log level.
NATIVE_PREFIXES = ("WARNING: All log messages before absl", "I0000", "W0000", "E0000")


def tfdp(*args, cwd=None, wait=True):
    """Runs the `tfdp` command in a fresh process (its own device set-up)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFDP_MNIST_DIR", None)  # every run here names its data explicitly
    command = [sys.executable, "-m", "tfdp", *args]
    if not wait:
        return subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(command, capture_output=True, text=True, env=env, cwd=cwd, timeout=900)


def own_stderr_lines(process):
    """stderr without TensorFlow's native start-up lines."""
    return [
        line
        for line in process.stderr.splitlines()
        if line.strip() and not line.startswith(NATIVE_PREFIXES)
    ]
