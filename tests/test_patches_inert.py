"""What tfdp's strategy replaces process-wide (Keras' loss scaling, `tf.nn.compute_average_loss`,
`values_util.on_write_assign`, the optimizer's `_clip_gradients` and `add_variable`, Keras'
`_make_function`, `make_predict_function` and `_maybe_symbolic_build`, BatchNormalization's
`_moments`, `Layer.add_weight`) is inert outside its replicas: once a tfdp strategy has trained
in this process, a plain Keras model trains to the same numbers as in a fresh process that
never imported tfdp, with `model.fit` alone and under TensorFlow's own MirroredStrategy on two
logical CPUs.

The run is SCRIPT's `train`, imported here and run as a script in the fresh process.
"""

import importlib.util
import json
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf
from helpers import NUM_LOGICAL_CPUS, environment
from test_strategy import DEVICES, tensorflows_strategy

import tfdp
from tfdp import internals

# A plain Keras run through every replaced path: Dense layers, BatchNormalization (its
# moments and moving statistics), a kernel regularizer (a loss Keras scales for the
# replicas), SGD with momentum (its variables made by add_variable) that clips by norm,
# steps_per_execution, fit, evaluate and predict.
SCRIPT = '''
import contextlib
import json
import os
import sys

import numpy as np

DEVICES = ["/cpu:0", "/cpu:1"]


def replaced():
    """Where each function tfdp replaces comes from now: {name: "module.qualname"}."""
    import tensorflow as tf
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer
    from keras.src.layers import BatchNormalization, Layer
    from keras.src.losses import loss
    from keras.src.optimizers.base_optimizer import BaseOptimizer
    from tensorflow.python.distribute import values_util

    functions = {
        "tf.nn.compute_average_loss": tf.nn.compute_average_loss,
        "loss.scale_loss_for_distribution": loss.scale_loss_for_distribution,
        "loss.unscale_loss_for_distribution": loss.unscale_loss_for_distribution,
        "values_util.on_write_assign": values_util.on_write_assign,
        "BaseOptimizer._clip_gradients": BaseOptimizer._clip_gradients,
        "BaseOptimizer.add_variable": BaseOptimizer.add_variable,
        "TensorFlowTrainer._make_function": TensorFlowTrainer._make_function,
        "TensorFlowTrainer.make_predict_function": TensorFlowTrainer.make_predict_function,
        "TensorFlowTrainer._maybe_symbolic_build": TensorFlowTrainer._maybe_symbolic_build,
        "BatchNormalization._moments": BatchNormalization._moments,
        "Layer.add_weight": Layer.add_weight,
    }
    return {name: where(f) for name, f in functions.items()}


def where(function):
    return f"{function.__module__}.{function.__qualname__}"


def data():
    rng = np.random.default_rng(5)
    x = rng.normal(size=(128, 6)).astype(np.float32)
    y = ((x[:, 0] + x[:, 1] > 0).astype(np.int32) + (x[:, 2] > 0.5)).astype(np.int32)
    return x, y


def train(strategy=None, steps_per_execution=2):
    """The run's numbers: {name: array}."""
    import keras

    keras.utils.set_random_seed(7)
    x, y = data()
    with strategy.scope() if strategy else contextlib.nullcontext():
        inputs = keras.Input((6,))
        hidden = keras.layers.Dense(16, kernel_regularizer=keras.regularizers.L2(0.01))(inputs)
        hidden = keras.layers.Activation("relu")(keras.layers.BatchNormalization()(hidden))
        model = keras.Model(inputs, keras.layers.Dense(3)(hidden))
        model.compile(
            # clips the kernels' gradients (norms 0.25-0.56 here), not the others'
            optimizer=keras.optimizers.SGD(0.1, momentum=0.9, clipnorm=0.3),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            steps_per_execution=steps_per_execution,
        )
    history = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, verbose=0)
    numbers = {f"weight {i}": w for i, w in enumerate(model.get_weights())}
    numbers["loss"] = np.array(history.history["loss"])
    numbers["evaluated"] = np.array(model.evaluate(x, y, batch_size=32, verbose=0))
    numbers["predicted"] = model.predict(x, batch_size=32, verbose=0)
    # and the functions Keras made for them: Keras' own whether or not tfdp is imported
    made = [model.train_function, model.test_function, model.predict_function]
    numbers["functions"] = np.array([where(function) for function in made])
    return numbers


def runs(mirrored_strategy):
    """The plain run, and the run under TensorFlow's MirroredStrategy on DEVICES.
    TensorFlow's strategy takes one step per execution: Keras' multi-step loop fails in it
    ("You must feed a value for placeholder tensor", keras-team/keras#19246), in a process
    without tfdp too."""
    return {"plain": train(), "mirrored": train(mirrored_strategy, steps_per_execution=1)}


if __name__ == "__main__":  # a fresh process, set up as conftest.py sets up the tests' own
    out, logical_cpus = sys.argv[1], int(sys.argv[2])
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(
        cpu, [tf.config.LogicalDeviceConfiguration()] * logical_cpus
    )
    tf.config.threading.set_inter_op_parallelism_threads((os.cpu_count() or 1) + 1)
    done = runs(tf.distribute.MirroredStrategy(DEVICES))
    assert "tfdp" not in sys.modules, "the fresh process imported tfdp"
    np.savez(out + ".npz", **{f"{run}/{k}": v for run, got in done.items() for k, v in got.items()})
    with open(out + ".json", "w") as f:
        json.dump({
            "tfdp imported": "tfdp" in sys.modules,
            "replaced": replaced(),
            "logical cpus": len(tf.config.list_logical_devices("CPU")),
            "inter-op threads": tf.config.threading.get_inter_op_parallelism_threads(),
        }, f)
'''


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("inert") / "plain_keras.py"
    path.write_text(SCRIPT)
    spec = importlib.util.spec_from_file_location("plain_keras", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.DEVICES == DEVICES
    return module, path


@pytest.fixture(scope="module")
def here(script):
    """The runs in this process, after tfdp's strategy (whole-batch and per-replica
    statistics, uneven shares) trained the same model through its replicas."""
    plain_keras, _ = script
    for statistics in ("whole", "replica"):
        made = tfdp.MirroredStrategy(DEVICES, powers=[1, 3], batch_statistics=statistics)
        plain_keras.train(made)
    return {
        "replaced": plain_keras.replaced(),
        "runs": plain_keras.runs(tensorflows_strategy()),
        "logical cpus": len(tf.config.list_logical_devices("CPU")),
        "inter-op threads": tf.config.threading.get_inter_op_parallelism_threads(),
    }


@pytest.fixture(scope="module")
def fresh(script, tmp_path_factory):
    """The runs in a fresh process that never imports tfdp."""
    _, path = script
    out = str(tmp_path_factory.mktemp("fresh") / "fresh")
    done = subprocess.run(
        [sys.executable, str(path), out, str(NUM_LOGICAL_CPUS)],
        check=False,
        capture_output=True,
        text=True,
        env=environment(),
        cwd=path.parent,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    with open(out + ".json") as f:
        seen = json.load(f)
    runs = {}
    with np.load(out + ".npz") as arrays:
        for key in arrays.files:
            run, name = key.split("/")
            runs.setdefault(run, {})[name] = arrays[key]
    return dict(seen, runs=runs)


@pytest.mark.slow
def test_the_replacements_are_in_place_here_and_not_in_the_fresh_process(here, fresh):
    """Not vacuous: this process runs tfdp's functions, the fresh one Keras' and TensorFlow's,
    on the same devices."""
    assert fresh["tfdp imported"] is False
    assert here["replaced"].keys() == fresh["replaced"].keys()
    # every function tfdp replaces is one of these (tf.nn's is replaced wherever TF holds it)
    targets = {attribute for _, attribute in internals.replacement_targets().values()}
    assert targets | {"compute_average_loss"} == {n.rsplit(".")[-1] for n in here["replaced"]}
    not_replaced = [name for name, at in here["replaced"].items() if not at.startswith("tfdp.")]
    assert not not_replaced, f"tfdp did not replace {not_replaced}: {here['replaced']}"
    assert not [at for at in fresh["replaced"].values() if at.startswith("tfdp")]
    assert here["logical cpus"] == fresh["logical cpus"] == NUM_LOGICAL_CPUS
    assert here["inter-op threads"] == fresh["inter-op threads"]


@pytest.mark.slow
@pytest.mark.parametrize("run", ["plain", "mirrored"])
def test_keras_trains_as_in_a_process_without_tfdp(run, here, fresh):
    """Weights (moving statistics and all), the loss of each epoch, evaluate's and predict's
    numbers, bit for bit (as one process trains the same run twice; with two replicas,
    TensorFlow's all-reduce sums two values, the same in either order), and the same train,
    test and predict functions (Keras', not tfdp's)."""
    got, want = here["runs"][run], fresh["runs"][run]
    assert got.keys() == want.keys()
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=f"{run}: {name}")
