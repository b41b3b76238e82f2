"""What several test modules share: the device names, running tfdp in-process and as a
command, and reading what a run left in its model directory.

A test starts a process only where the process is what it tests (signals, kills, the
lock, exit statuses, clusters, the launcher, writes to stdout); everything else runs
`tfdp.train` in this process, on the logical CPUs conftest.py made.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import signal
import struct
import subprocess
import sys
import time

import numpy as np
import pytest

NUM_LOGICAL_CPUS = 4  # made by conftest.py before TensorFlow starts
CPUS = [f"/device:CPU:{i}" for i in range(NUM_LOGICAL_CPUS)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Put first on the PYTHONPATH of the processes the tests start (conftest.py): there,
# `import matplotlib` and `import IPython` fail as where they are not installed.
WITHOUT_PLOTTING = os.path.join(ROOT, "tests", "without_plotting")

# Lines TensorFlow's native runtime prints at start-up, whatever the log level.
NATIVE_PREFIXES = ("WARNING: All log messages before absl", "I0000", "W0000", "E0000")

# The toy runs of the tests: the tutorial's MLP, batch 100 (two logical CPUs where a
# mode takes several devices).
TOY = ["--model=toy", "--logical_cpus=2", "--batch_size=100", "--progress=never"]
TOY_MODES = {
    "single": {"mode": "single"},
    "mirrored": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
    "weighted": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
}
TOY_MODE_FLAGS = {
    "single": ["--mode=single"],
    "mirrored": ["--mode=mirrored"],
    "weighted": ["--mode=weighted", "--powers=1,3"],
}


# ---------------------------------------------------------------- in this process


def toy_config(**changes):
    """The Config of the toy runs (TOY's flags), with `changes`."""
    from tfdp import Config

    return Config(**{"model": "toy", "batch_size": 100, **changes})


def train(config):
    """`tfdp.train(config)` in this process: (result, the lines it logged)."""
    import tfdp

    lines = []
    result = tfdp.train(config, log=lines.append)
    return result, lines


def train_steps(config, devices, data, steps, model=None):
    """A trainer of `config` on `devices` after `steps` steps on `data`'s stream of
    batches (seed and batch size of `config`), and the last step's metrics (its batch's:
    the model's metrics are reset before each step)."""
    from tfdp.data.arrays import train_dataset
    from tfdp.engine.modes import build_trainer
    from tfdp.run.hooks.report import floats
    from tfdp.run.training import partition

    trainer = build_trainer(config, devices, partition(config, devices), model)
    iterator = trainer.distribute(train_dataset(data, config.batch_size, config.seed))
    for _ in range(steps):
        trainer.model.reset_metrics()
        outputs = trainer.train_step(iterator)
    return trainer, floats(outputs["logs"])


def random_images(count, seed=0):
    """MNIST-shaped uint8 images and int32 labels."""
    from tfdp.data.arrays import Arrays

    rng = np.random.default_rng(seed)
    return Arrays(
        rng.integers(0, 256, (count, 28, 28, 1), dtype=np.uint8),
        rng.integers(0, 10, count).astype(np.int32),
    )


def write_idx(path, array, magic=None, extra=b"", cut=0):
    """Writes `array` as a gzip IDX file (uint8 data; `magic` by default from its rank);
    `extra` appends bytes, `cut` drops trailing ones. Returns the path."""
    array = np.asarray(array)
    magic = 0x0800 + array.ndim if magic is None else magic
    raw = struct.pack(">I", magic) + struct.pack(f">{array.ndim}I", *array.shape)
    raw += array.astype(np.uint8).tobytes() + extra
    with gzip.open(path, "wb") as f:
        f.write(raw[: len(raw) - cut])
    return str(path)


def write_mnist_dir(directory, num_train=50, num_test=20, seed=0):
    """The four MNIST IDX files with random content; returns {split: (images, labels)}."""
    from tfdp.data.mnist import IDX_FILES

    rng = np.random.default_rng(seed)
    contents = {}
    for split, n in (("train", num_train), ("test", num_test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=n, dtype=np.uint8)
        images_file, labels_file = IDX_FILES[split]
        write_idx(os.path.join(directory, images_file), images)
        write_idx(os.path.join(directory, labels_file), labels)
        contents[split] = (images, labels)
    return contents


# ---------------------------------------------------------------- a run's directory


def latest_step(model_dir):
    """The step of the checkpoint the index file points at, or None."""
    index = os.path.join(model_dir, "checkpoints", "checkpoint")
    try:
        with open(index) as f:
            first = f.readline()
    except FileNotFoundError:
        return None
    return int(first.rsplit("ckpt-", 1)[1].strip().strip('"'))


def result(model_dir):
    with open(os.path.join(model_dir, "result.json")) as f:
        return json.load(f)


def load_weights(model_dir):
    """The weights of the run's model.keras, as Keras loads it."""
    import keras

    return keras.models.load_model(os.path.join(model_dir, "model.keras")).get_weights()


def assert_same_run(straight, resumed, rtol=1e-6, atol=1e-7):
    """The resumed run ends with the straight run's weights and logs its numbers from
    where it resumed."""
    for x, y in zip(load_weights(straight), load_weights(resumed), strict=True):
        np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    assert result(straight)["iterations"] == result(resumed)["iterations"]
    logged = {entry["iteration"]: entry for entry in result(straight)["log"]}
    assert result(resumed)["log"], "the resumed run logged nothing"
    for entry in result(resumed)["log"]:
        assert entry == pytest.approx(logged[entry["iteration"]], rel=1e-5)
    assert result(resumed)["test_accuracy"] == result(straight)["test_accuracy"]


@contextlib.contextmanager
def tmpfs(directory, options):
    """A tmpfs mounted at `directory` for the block; skips the test where mounting fails."""
    os.makedirs(directory, exist_ok=True)
    mount = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(directory)],
        check=False,
        capture_output=True,
        text=True,
    )
    if mount.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mount.stderr.strip() or mount.returncode})")
    try:
        yield str(directory)
    finally:
        unmount = subprocess.run(["umount", str(directory)], check=False, capture_output=True)
        if unmount.returncode != 0:
            subprocess.run(["umount", "-l", str(directory)], check=True)


# ---------------------------------------------------------------- processes


def environment(**extra):
    """The environment of a command the tests start: no MNIST directory and no cluster
    (TF_CONFIG, a Slurm step's variables) unless given, and TensorFlow's C++ log at warnings."""
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TFDP_MNIST_DIR", "TF_CONFIG") and not k.startswith("SLURM")
    }
    return dict(env, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def tfdp(*args, cwd=None, wait=True, env=None, timeout=900):
    """Runs the `tfdp` command in a fresh process (its own device set-up)."""
    command = [sys.executable, "-m", "tfdp", *args]
    env = env or environment()
    if not wait:
        return subprocess.Popen(
            command, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
    return subprocess.run(
        command, capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout
    )


def python_path():
    """The entries of this process's PYTHONPATH but WITHOUT_PLOTTING."""
    path = os.environ.get("PYTHONPATH", "").split(os.pathsep)
    return [entry for entry in path if entry and entry != WITHOUT_PLOTTING]


def plotting_environment():
    """This process's environment with matplotlib importable again: for a command that
    draws a chart."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(python_path())}


def own_stderr_lines(process):
    """stderr without TensorFlow's native start-up lines."""
    return [
        line
        for line in process.stderr.splitlines()
        if line.strip() and not line.startswith(NATIVE_PREFIXES)
    ]


def launch(*args, workers=2, env=None, timeout=240, cwd=None):
    """Runs `tfdp-launch` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "tfdp.cluster.launch", f"--workers={workers}", *args],
        capture_output=True,
        text=True,
        env=env or environment(),
        timeout=timeout,
        cwd=cwd,
    )


def worker_lines(output, worker):
    """The lines `tfdp-launch` printed for one worker, without their prefix."""
    prefix = f"[worker {worker}] "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


def run_together(commands, envs, cwd=None, timeout=600):
    """Starts one process per command, each with its environment, and waits for all (any
    left at the end is killed): [(exit status, stdout, stderr)] in order."""
    processes = [
        subprocess.Popen(
            command,
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for command, env in zip(commands, envs)
    ]
    try:
        outputs = [process.communicate(timeout=timeout) for process in processes]
    finally:
        for process in processes:
            process.kill()
            process.wait()
    return [(p.returncode, out, err) for p, (out, err) in zip(processes, outputs)]


def start_workers(args, tf_configs, cwd=None, env=None):
    """`tfdp --mode=multiworker` started by hand, one process per TF_CONFIG."""
    return [
        subprocess.Popen(
            [sys.executable, "-m", "tfdp", "--mode=multiworker", *args],
            env=environment(TF_CONFIG=tf_config, **(env or {})),
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tf_config in tf_configs
    ]


def wait_for(ready, processes, what, timeout=300):
    """Polls `ready()` until it holds; fails if one of `processes` ended first."""
    deadline = time.monotonic() + timeout
    while not ready():
        for process in processes:
            assert process.poll() is None, f"ended before {what}: {process.communicate()}"
        assert time.monotonic() < deadline, f"no {what} in {timeout} s"
        time.sleep(0.02)


def kill_when(process, ready, timeout=300):
    """SIGKILLs `process` as soon as `ready()` holds; fails if it ended first."""
    wait_for(ready, [process], "the kill", timeout)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL


def refusal(*args):
    """Why `tfdp ARGS` would refuse to train, found in this process: (the error, the line
    the command prints for it), or (None, None) when it would train.

    The flags are parsed as the command parses them, then checked as it checks them
    (`cli.checked_config`, the GPU set-up, `training.prepare`), on this process's four
    logical CPUs: `--logical_cpus` is checked but not applied.
    """
    from absl import flags

    from tfdp import cli
    from tfdp.devices import configure_logical_devices
    from tfdp.errors import ConfigError
    from tfdp.run import training

    try:
        config = cli.checked_config(cli.FLAGS(["tfdp", *args]))
        configure_logical_devices(
            0,  # the CPUs of this process are set up already
            cli.FLAGS.logical_gpus,
            cli.FLAGS.logical_gpu_memory,
            memory_growth=cli.FLAGS.gpu_memory_growth,
        )
        training.prepare(config)
    except flags.Error as error:
        return error, f"tfdp: error: {error}"
    except ConfigError as error:
        return error, f"tfdp: error: {cli.error_line(error)}"
    finally:
        cli.FLAGS.unparse_flags()
    return None, None


def cli_in_process(*args):
    """`tfdp ARGS` run by the command's own main function in this process; returns its
    exit status (0 when main returns). ARGS may set up nothing process-wide: no
    `--logical_cpus`, and `--intra_op_threads=0` where tfdp would choose the threads."""
    from tfdp import cli

    try:
        cli.main(cli.FLAGS(["tfdp", *args]))
    except SystemExit as exit:
        return exit.code
    finally:
        cli.FLAGS.unparse_flags()
    return 0


def with_an_optional_input(features=4, classes=3):
    """A classifier of inputs {"x", "o"}, "o" optional (given None, left out)."""
    import keras

    keras.utils.set_random_seed(2)
    x = keras.Input((features,), name="x")
    o = keras.Input((features,), name="o", optional=True)

    class AddIfGiven(keras.layers.Layer):
        def call(self, x, o=None):
            return x if o is None else x + o

    hidden = keras.layers.Dense(8, activation="tanh")(AddIfGiven()(x, o))
    model = keras.Model({"x": x, "o": o}, keras.layers.Dense(classes)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model
