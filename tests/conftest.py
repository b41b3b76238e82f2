"""Four logical CPUs stand in for four GPUs in every test of this process.

They must exist before TensorFlow initialises its runtime, so this runs at
collection time, before any test module touches TensorFlow. Tests that need
another device layout run the CLI in a subprocess. The helpers several modules
share are in helpers.py; the fixtures are here.
"""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# A test's cluster is the one it sets up, not the Slurm allocation the suite may run in.
for name in [name for name in os.environ if name.startswith("SLURM")]:
    del os.environ[name]

import pytest
from helpers import NUM_LOGICAL_CPUS, WITHOUT_PLOTTING, python_path, random_images

from tfdp import onednn
from tfdp.devices import configure_logical_devices, reserve_sleeping_threads

# Keras imports matplotlib and IPython at start-up wherever they are installed: about half
# a second of a core in each of the ~150 TensorFlow processes the tests start (BUILD_NOTES,
# "Two test processes, and how long the tests take"). The processes the tests start (and,
# under xdist, the test processes) find neither, as after `pip install tfdp`; a command
# that draws a chart is given matplotlib back (helpers.plotting_environment).
os.environ["PYTHONPATH"] = os.pathsep.join([WITHOUT_PLOTTING, *python_path()])

onednn.enable_by_default()  # as the tfdp command does: the tests run its kernels
configure_logical_devices(logical_cpus=NUM_LOGICAL_CPUS)
# As the tfdp command does for a run with a simulated slowdown: a sleeping device holds an
# inter-op thread, and a spare one keeps the other devices' ops from queueing behind it.
reserve_sleeping_threads(1)


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


@pytest.fixture(scope="session")
def images():
    """600 random MNIST-shaped examples: six batches of 100."""
    return random_images(600)


def pytest_collection_modifyitems(items):
    """The modules with the most slow tests first, each module's tests in their order: with
    a module per test process (`--dist=loadfile`), the long ones start at once and the
    short ones fill in around them."""
    slow, first_seen = {}, {}
    for index, item in enumerate(items):
        module = item.nodeid.split("::")[0]
        first_seen.setdefault(module, index)
        slow[module] = slow.get(module, 0) + (item.get_closest_marker("slow") is not None)
    items.sort(key=lambda item: (-slow[m := item.nodeid.split("::")[0]], first_seen[m]))
