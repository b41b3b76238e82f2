"""Every Keras and TensorFlow internal tfdp uses, and the releases it was checked on.

tfdp runs the model's own step under tf.distribute, with uneven shares; for that it
reaches past Keras' and TensorFlow's public APIs in the places below, and nowhere
else (tests/test_layout.py holds that nothing outside this module imports
`keras.src` or `tensorflow.python`). Each entry says what tfdp takes, why, and where
the releases differ. CHECKED is the range the tests run on: the README's test
command on the newest pair, the fast set on the oldest (`.ci/run`). `tfdp/__init__.py`
refuses other releases in one line (`check_versions`).

Everything is imported when first used, so `import tfdp` stays light.
"""

from __future__ import annotations

import contextlib
import functools

# The oldest and the newest releases the tests run on (pyproject.toml allows these).
TENSORFLOW = ((2, 19), (2, 21))  # 2.19.1 and 2.21.0 tested
KERAS = ((3, 10), (3, 15))  # 3.10.0 and 3.15.1 tested
CHECKED = "TensorFlow 2.19-2.21 with Keras 3.10-3.15"
ANY_VERSION = "TFDP_ANY_VERSION"  # set to 1: no check (at one's own risk)
# the distributions TensorFlow comes as
TENSORFLOW_DISTRIBUTIONS = ("tensorflow", "tensorflow-cpu", "tensorflow-macos", "tensorflow-intel")


def installed(distributions) -> str | None:
    """The version of the first of `distributions` installed (None: none is)."""
    from importlib import metadata

    for name in distributions:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return None


def _release(version: str) -> tuple[int, int] | None:
    """(major, minor) of a final release, None for a pre-release or an unreadable one."""
    import re

    match = re.fullmatch(r"(\d+)\.(\d+)(\.\d+)*(\.post\d+)?", version)
    return (int(match[1]), int(match[2])) if match else None


def version_problem(tensorflow: str | None, keras: str | None) -> str | None:
    """One line when the installed TensorFlow or Keras is outside CHECKED (None: within,
    or not installed as a distribution tfdp can read)."""
    bad = []
    for name, version, (low, high) in (
        ("TensorFlow", tensorflow, TENSORFLOW),
        ("Keras", keras, KERAS),
    ):
        release = None if version is None else _release(version)
        if version is not None and (release is None or not low <= release <= high):
            bad.append(f"{name} {version}")
    if not bad:
        return None
    return (
        f"tfdp runs on {CHECKED}, and this environment has {' and '.join(bad)}: "
        f"install releases in that range (pip install 'tensorflow>=2.19,<2.22' "
        f"'keras>=3.10,<3.16'), or set {ANY_VERSION}=1 to try tfdp on these at your own risk"
    )


def is_tfdp_command(argv: list[str], orig_argv: list[str]) -> bool:
    """Whether this process is one of tfdp's commands (tfdp, tfdp-bench, tfdp-launch, or
    `python -m tfdp...`), which say a problem in one line instead of a traceback."""
    import os

    if argv and os.path.basename(argv[0]) in ("tfdp", "tfdp-bench", "tfdp-launch"):
        return True
    if "-m" in orig_argv:
        module = orig_argv[orig_argv.index("-m") + 1 :][:1]
        return bool(module) and module[0].split(".")[0] == "tfdp"
    return False


def check_versions(environ) -> str | None:
    """`version_problem` of what is installed, unless ANY_VERSION is set."""
    if environ.get(ANY_VERSION) == "1":
        return None
    return version_problem(installed(TENSORFLOW_DISTRIBUTIONS), installed(("keras",)))


# -- Keras: the trainer -----------------------------------------------------------------


@functools.cache
def keras_trainer():
    """`keras.src.trainers.trainer.Trainer`: the base of every compiled Keras model (and
    of a layer that is one); tfdp checks a model against it and reads its own
    `train_step`/`test_step` to tell a model's own steps from Keras'.
    Checked: Keras 3.10.0-3.15.1, the same."""
    from keras.src.trainers.trainer import Trainer

    return Trainer


@functools.cache
def tensorflow_trainer():
    """`keras.src.backend.tensorflow.trainer.TensorFlowTrainer`: tfdp wraps its
    `_make_function`, `make_predict_function` and `_maybe_symbolic_build` (which calls
    `_symbolic_build(data_batch=...)`) for models under tfdp's strategy, and reads its
    `train_step`/`test_step`. Checked: Keras 3.10.0-3.15.1, the same signatures."""
    from keras.src.backend.tensorflow.trainer import TensorFlowTrainer

    return TensorFlowTrainer


@functools.cache
def base_optimizer():
    """`keras.src.optimizers.base_optimizer.BaseOptimizer`: tfdp wraps
    `_clip_gradients(self, grads)` so that a clipping optimizer clips the gradient summed
    over the replicas. Checked: Keras 3.10.0-3.15.1, the same signature."""
    from keras.src.optimizers.base_optimizer import BaseOptimizer

    return BaseOptimizer


@functools.cache
def loss_scaling():
    """`keras.src.losses.loss`: tfdp replaces `scale_loss_for_distribution` and
    `unscale_loss_for_distribution` while a piece is traced (each piece's loss weighed
    by its examples, not 1/R). Checked: Keras 3.10.0-3.15.1, both present and called
    as there."""
    from keras.src.losses import loss

    return loss


@functools.cache
def batch_normalization():
    """`keras.layers.BatchNormalization`, whose `_moments(inputs, mask)` tfdp replaces
    under its strategies (the whole batch's statistics). Checked: Keras 3.10.0-3.15.1,
    the same signature; `_reduction_axes`, `axis`, `moving_mean` and `synchronized` read."""
    import keras

    return keras.layers.BatchNormalization


@functools.cache
def keras_layer():
    """`keras.layers.Layer`, whose `add_weight` (every layer's variables; `add_variable`
    is its alias) tfdp checks under its strategies. Checked: Keras 3.10.0-3.15.1."""
    import keras

    return keras.layers.Layer


def reduction_axes(layer) -> list[int]:
    """The axes a BatchNormalization layer reduces over (`_reduction_axes`, set when it is
    built). Checked: Keras 3.10.0-3.15.1."""
    return layer._reduction_axes  # noqa: SLF001


def keras_epsilon() -> float:
    """Keras' fuzz factor (`keras.config.epsilon()`), as its masked moments add it."""
    import keras

    return keras.config.epsilon()


@functools.cache
def mean_metric_wrapper():
    """`keras.src.metrics.reduction_metrics.MeanMetricWrapper`: the compiled metrics
    whose values tfdp weighs by share. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.metrics.reduction_metrics import MeanMetricWrapper

    return MeanMetricWrapper


def stateless_scope(mapping):
    """`keras.src.backend.common.stateless_scope.StatelessScope(state_mapping=...)`: the
    metrics' variables read at other values. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.backend.common.stateless_scope import StatelessScope

    return StatelessScope(state_mapping=mapping)


@functools.cache
def keras_release() -> tuple[int, int]:
    """The installed Keras' (major, minor)."""
    import keras

    return tuple(int(part) for part in keras.__version__.split(".")[:2])


def build_from_spec(model, spec) -> None:
    """`model._symbolic_build(data_batch=spec)` as Keras' own `_maybe_symbolic_build`
    calls it (its errors as they are). Checked: Keras 3.10.0-3.15.1."""
    model._symbolic_build(data_batch=spec)  # noqa: SLF001


def symbolic_build(model, batch) -> None:
    """`model._symbolic_build(data_batch=batch)`: what fit builds before its first step.
    Keras 3.10-3.13 wrap its error in RuntimeError("Unable to automatically build the
    model ..."), where their own fit raises the error itself (a KeyError for a missing
    input); tfdp raises that error, as fit does. Keras 3.14-3.15 raise it as it is."""
    try:
        model._symbolic_build(data_batch=batch)  # noqa: SLF001
    except RuntimeError as error:
        cause = error.__context__
        if str(error).startswith("Unable to automatically build the model") and cause:
            raise cause from None
        raise


def metrics_result_or_logs(model, logs):
    """`model._get_metrics_result_or_logs(logs)`: an epoch's logs as fit hands them to
    `on_epoch_end`. Checked: Keras 3.10.0-3.15.1."""
    return model._get_metrics_result_or_logs(logs)  # noqa: SLF001


def batch_end_index(first: int, last: int) -> int:
    """The index `on_train_batch_end` gets for a call of steps `first`..`last`
    (`steps_per_execution`): Keras 3.11-3.15 pass the last; Keras 3.10 passed the first
    to both batch hooks, and tfdp does as the installed Keras does."""
    return first if keras_release() < (3, 11) else last


# -- Keras: data, as fit takes it ---------------------------------------------------------


@functools.cache
def data_adapter_utils():
    """`keras.src.trainers.data_adapters.data_adapter_utils`: `unpack_x_y_sample_weight`,
    `get_tensor_spec`, `class_weight_to_sample_weights`, `scipy_sparse_to_tf_sparse`, so
    that tfdp reads data as `fit` reads it. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.trainers.data_adapters import data_adapter_utils

    return data_adapter_utils


def train_validation_split(arrays, validation_split):
    """`keras.src.trainers.data_adapters.array_slicing.train_validation_split`: fit's
    `validation_split`. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.trainers.data_adapters import array_slicing

    return array_slicing.train_validation_split(arrays, validation_split=validation_split)


def class_weight_map_fn(class_weight):
    """`keras.src.trainers.data_adapters.tf_dataset_adapter.make_class_weight_map_fn`:
    fit's `class_weight` on a tf.data pipeline. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.trainers.data_adapters.tf_dataset_adapter import make_class_weight_map_fn

    return make_class_weight_map_fn(class_weight)


def lists_to_tuples(data):
    """`keras.src.tree.lists_to_tuples`: lists read as Keras reads them (tf.data takes a
    list for one tensor). Checked: Keras 3.10.0-3.15.1."""
    from keras.src import tree

    return tree.lists_to_tuples(data)


def debug_limits() -> tuple[int | None, int | None]:
    """(`max_epochs()`, `max_steps_per_epoch()`) of `keras.src.backend.config`: Keras'
    debugging caps, which fit honours. Checked: Keras 3.10.0-3.15.1."""
    from keras.src.backend import config

    return config.max_epochs(), config.max_steps_per_epoch()


def pythonify_logs(logs):
    """`keras.src.utils.python_utils.pythonify_logs`: logs as callbacks get them.
    Checked: Keras 3.10.0-3.15.1."""
    from keras.src.utils.python_utils import pythonify_logs

    return pythonify_logs(logs)


def keras_tensor(shape, dtype):
    """`keras.src.backend.KerasTensor`: a symbolic batch, to check data against a
    model without running it. Checked: Keras 3.10.0-3.15.1."""
    from keras.src import backend

    return backend.KerasTensor(shape, dtype)


def compute_output_spec(fn, *args, **kwargs):
    """`keras.src.backend.compute_output_spec`: `fn` traced on symbolic tensors.
    Checked: Keras 3.10.0-3.15.1."""
    from keras.src import backend

    return backend.compute_output_spec(fn, *args, **kwargs)


def compute_loss_of(model):
    """`model._compute_loss`: the compiled loss as `train_step` calls it, with the
    model's own `compute_loss`. Checked: Keras 3.10.0-3.15.1."""
    return model._compute_loss  # noqa: SLF001


# -- Keras: private attributes of its objects ----------------------------------------------
# Each read or set in one place (tfdp/engine/placement.py, strategy.py, shards.py).
# Checked: Keras 3.10.0-3.15.1, all present with the same meaning.


def callback_history(callbacks):
    """The `History` a `CallbackList` made with `add_history=True` (`_history`).
    Checked: Keras 3.10.0-3.15.1."""
    return callbacks._history  # noqa: SLF001


def layers_of(model):
    """`model._flatten_layers(include_self=True)`: every layer, nested ones too."""
    return model._flatten_layers(include_self=True)  # noqa: SLF001


def variable_value(variable):
    """A Keras variable's backing value (`_value`)."""
    return variable._value  # noqa: SLF001


def set_variable_value(variable, value) -> None:
    variable._value = value  # noqa: SLF001


def make_variable_again(variable, value) -> None:
    """Keras' own way to make a variable's value, as it does on creation: in the current
    strategy's scope (`_value = None`, then `_initialize(value)`)."""
    variable._value = None  # noqa: SLF001
    variable._initialize(value)  # noqa: SLF001


def model_strategy(model):
    """The strategy a model was made under (`_distribute_strategy`; None: none)."""
    return getattr(model, "_distribute_strategy", None)


def set_model_strategy(model, strategy) -> None:
    model._distribute_strategy = strategy  # noqa: SLF001


def optimizer_strategy(optimizer):
    """The strategy an optimizer applies under (`_distribution_strategy`)."""
    return optimizer._distribution_strategy  # noqa: SLF001


def set_optimizer_strategy(optimizer, strategy) -> None:
    optimizer._distribution_strategy = strategy  # noqa: SLF001


def optimizer_key(optimizer, variable):
    """The key an optimizer files a variable's slots under (`_var_key`)."""
    return optimizer._var_key(variable)  # noqa: SLF001


def rekey_optimizer(optimizer, new: dict) -> None:
    """An optimizer's tables keyed by a variable's old key (`_var_key`), keyed by its new
    one: `_trainable_variables_indices`, a MultiOptimizer's `_var_to_optimizer_idx`, the
    keys excluded from weight decay (`_exclude_from_weight_decay`, its cache forgotten)."""
    for name in ("_trainable_variables_indices", "_var_to_optimizer_idx"):
        table = getattr(optimizer, name, None)
        if table:
            setattr(optimizer, name, {new.get(key, key): index for key, index in table.items()})
    excluded = getattr(optimizer, "_exclude_from_weight_decay", None)
    if excluded:
        optimizer._exclude_from_weight_decay = {new.get(k, k) for k in excluded}  # noqa: SLF001
    optimizer._exclude_from_weight_decay_cache = {}  # noqa: SLF001


def optimizer_variables(optimizer):
    """The variables an optimizer was built for (`_trainable_variables`)."""
    return optimizer._trainable_variables  # noqa: SLF001


def inner_optimizers(optimizer) -> list:
    """A MultiOptimizer's optimizers (`_inner_optimizers`; none elsewhere)."""
    return list(getattr(optimizer, "_inner_optimizers", None) or [])


def compile_loss(model):
    """The model's compiled loss (`_compile_loss`, None before compile), whose `metrics`
    are the loss trackers of each output."""
    return getattr(model, "_compile_loss", None)


def learning_rate_of(optimizer):
    """What an optimizer holds as its rate (`_learning_rate`): a variable or a schedule."""
    return getattr(optimizer, "_learning_rate", None)


def initial_epoch(model):
    """`_initial_epoch`, which a callback sets in on_train_begin (BackupAndRestore) for
    fit to start at (None: not set)."""
    return getattr(model, "_initial_epoch", None)


def set_jit_compile(model, value: bool) -> None:
    """`_jit_compile`, as Keras reads it while it builds a step function."""
    model._jit_compile = value  # noqa: SLF001


# -- TensorFlow -------------------------------------------------------------------------


@functools.cache
def values_util():
    """`tensorflow.python.distribute.values_util`: tfdp wraps `on_write_assign`, how a
    replica's assignment to an ON_WRITE variable (moving statistics) is aggregated.
    Checked: TensorFlow 2.19.1-2.21.0, the same signature."""
    from tensorflow.python.distribute import values_util

    return values_util


def replacement_targets() -> dict:
    """Every function tfdp replaces by attribute (engine/patches.py installs the
    replacements, once per process), by name: (what holds it, the attribute). What each
    owner is, and why tfdp takes it, is said where it is imported above.
    `tf.nn.compute_average_loss` is replaced wherever TensorFlow holds it
    (`replace_everywhere`)."""
    trainer, optimizer, losses = tensorflow_trainer(), base_optimizer(), loss_scaling()
    return {
        "scale_loss_for_distribution": (losses, "scale_loss_for_distribution"),
        "unscale_loss_for_distribution": (losses, "unscale_loss_for_distribution"),
        "on_write_assign": (values_util(), "on_write_assign"),
        "clip_gradients": (optimizer, "_clip_gradients"),
        "add_variable": (optimizer, "add_variable"),
        "add_weight": (keras_layer(), "add_weight"),
        "make_function": (trainer, "_make_function"),
        "make_predict_function": (trainer, "make_predict_function"),
        "maybe_symbolic_build": (trainer, "_maybe_symbolic_build"),
        "moments": (batch_normalization(), "_moments"),
    }


def replace(name: str, replacement):
    """`replacement` in place of the target `name` (`replacement_targets`); returns what
    was there."""
    owner, attribute = replacement_targets()[name]
    original = getattr(owner, attribute)
    setattr(owner, attribute, replacement)
    return original


_KEY_BASES = [0]


def next_collective_key_base() -> int:
    """A range of collective keys of its own for each strategy made in this process.

    Every MirroredStrategy numbers its collective groups from the same start, so two
    strategies in one process collide ("Shape mismatch in the collective instance 100",
    or "joining a group with size 4, but that group has size 2"), after which every
    collective of the process is aborted (`set_collective_key_base`)."""
    _KEY_BASES[0] += 1
    return 100_000 * _KEY_BASES[0]


def set_collective_key_base(strategy, base: int) -> None:
    """Where a MirroredStrategy (an instance before its `__init__`, or the class) numbers
    its collective groups from: TensorFlow reads `_collective_key_base` when it builds the
    strategy's collective ops. Checked: TensorFlow 2.19.1-2.21.0."""
    strategy._collective_key_base = base  # noqa: SLF001


def autograph_convert(fn):
    """`fn` converted as tf.distribute converts a replica function
    (`autograph.tf_convert` with `ag_ctx.control_status_ctx()`).
    Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph

    return autograph.tf_convert(fn, ag_ctx.control_status_ctx(), convert_by_default=False)


def replace_everywhere(original, replacement) -> None:
    """`replacement` wherever TensorFlow's modules hold `original` under its name (the
    public API's modules, `tf.nn` and `tf.compat.v2.nn` among them, and the module that
    defines it): a caller that looks the function up when it calls it gets the
    replacement. Checked: TensorFlow 2.19.1-2.21.0."""
    import sys

    name = original.__name__
    for module_name, module in list(sys.modules.items()):
        if module is None or not module_name.startswith("tensorflow"):
            continue
        if getattr(module, name, None) is original:
            setattr(module, name, replacement)


def clone_function(function, python_function):
    """A `tf.function` with `function`'s settings (input signature, XLA, ...) around
    `python_function`, as tf.distribute lifts a tf.function over the replicas
    (`Function._clone`, `mirrored_run.call_for_each_replica`).
    Checked: TensorFlow 2.19.1-2.21.0."""
    return function._clone(python_function=python_function)  # noqa: SLF001


def as_the_function_converts(function):
    """A `tf.function`'s Python function, converted by AutoGraph where the tf.function
    converts it (`_autograph`, True unless `autograph=False`), as tf.distribute converts
    the function it lifts. Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.autograph.core import ag_ctx
    from tensorflow.python.autograph.impl import api as autograph

    python_function = function.python_function
    if not getattr(function, "_autograph", True):
        return python_function
    return autograph.tf_convert(python_function, ag_ctx.ControlStatusCtx(ag_ctx.Status.ENABLED))


def function_jit_compile(function) -> bool:
    """Whether a `tf.function` compiles with XLA (`_jit_compile`).
    Checked: TensorFlow 2.19.1-2.21.0."""
    return bool(getattr(function, "_jit_compile", False))


@functools.cache
def mirrored_type():
    """`tensorflow.python.distribute.values.Mirrored`: a value the same on every replica
    (not a batch). Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.distribute import values

    return values.Mirrored


def distribute_without_rebatching(strategy, dataset, options):
    """TensorFlow's own DistributedDataset of `dataset` over `strategy`'s input workers,
    each element one replica's piece, in turn (`input_util.get_distributed_dataset` with
    no rebatching; `_input_workers_with_options`, as MirroredStrategy's own
    `experimental_distribute_dataset` makes it). Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.distribute import input_util

    workers = strategy.extended._input_workers_with_options(options)  # noqa: SLF001
    return input_util.get_distributed_dataset(
        dataset, workers, strategy, num_replicas_in_sync=None, options=options
    )


@contextlib.contextmanager
def outside_strategy_scopes():
    """Inside: the default graph's `_distribution_strategy_stack` and
    `_variable_creator_stack` (`tensorflow.python.framework.ops`), which a strategy's
    scope pushes onto, set aside: no scope the caller entered is current.
    Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.framework import ops

    graph = ops.get_default_graph()
    strategies = graph._distribution_strategy_stack  # noqa: SLF001
    creators = graph._variable_creator_stack  # noqa: SLF001
    graph._distribution_strategy_stack = []  # noqa: SLF001
    graph._variable_creator_stack = []  # noqa: SLF001
    try:
        yield
    finally:
        graph._distribution_strategy_stack = strategies  # noqa: SLF001
        graph._variable_creator_stack = creators  # noqa: SLF001


@functools.cache
def none_tensor_spec():
    """`tensorflow.python.framework.none_tensor.NoneTensorSpec`: the spec of an optional
    input given None. Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.framework.none_tensor import NoneTensorSpec

    return NoneTensorSpec


@functools.cache
def checkpoint_state():
    """`tensorflow.python.training.checkpoint_state_pb2.CheckpointState`: the
    `checkpoint` index file's format. Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

    return CheckpointState


@functools.cache
def slurm_lists():
    """(`expand_hostlist`, `expand_tasks_per_node`) of TensorFlow's
    `SlurmClusterResolver` module: a step's node list and task counts.
    Checked: TensorFlow 2.19.1-2.21.0."""
    from tensorflow.python.distribute.cluster_resolver import slurm_cluster_resolver as slurm

    return slurm.expand_hostlist, slurm.expand_tasks_per_node


def onednn_enabled() -> bool | None:
    """`tensorflow.python.util._pywrap_util_port.IsMklEnabled()` (None: a build without
    it). Checked: TensorFlow 2.19.1-2.21.0."""
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def dataset_inputs(dataset):
    """The datasets a tf.data dataset reads from (`_inputs()`).
    Checked: TensorFlow 2.19.1-2.21.0."""
    return dataset._inputs()  # noqa: SLF001


def dataset_files(dataset):
    """The file names a TFRecordDataset reads (`_filenames`, a tensor or a dataset; None:
    not a reader of files). Checked: TensorFlow 2.19.1-2.21.0."""
    return getattr(dataset, "_filenames", None)


def dataset_compression(dataset):
    """A TFRecordDataset's `_compression_type` (None: not known)."""
    return getattr(dataset, "_compression_type", None)


def dataset_map_function(dataset):
    """The function of a map or interleave dataset (`_map_func`; None: none)."""
    return getattr(dataset, "_map_func", None)


def batching(dataset) -> tuple:
    """(`_batch_size`, `_drop_remainder`) of a batching dataset (None, False: not known).
    Checked: TensorFlow 2.19.1-2.21.0."""
    return getattr(dataset, "_batch_size", None), getattr(dataset, "_drop_remainder", False)


def original_dataset(distributed):
    """The tf.data dataset a tf.distribute DistributedDataset was made from
    (`_original_dataset`; None: not known). Checked: TensorFlow 2.19.1-2.21.0."""
    return getattr(distributed, "_original_dataset", None)


def distributed_dataset(iterator):
    """The DistributedDataset a distributed iterator reads (`_distributed_dataset`; None:
    not known), as Keras' trainer reads it. Checked: TensorFlow 2.19.1-2.21.0."""
    return getattr(iterator, "_distributed_dataset", None)


def device_memory_limit(device: str) -> int | None:
    """The bytes TensorFlow's allocator may use on `device` (a GPU), from its device list
    (`device_lib`: TensorFlow's public API reads a GPU's peak, not its limit)."""
    import tensorflow as tf
    from tensorflow.python.client import device_lib

    wanted = tf.DeviceSpec.from_string(device)
    for attributes in device_lib.list_local_devices():
        spec = tf.DeviceSpec.from_string(attributes.name)
        if (spec.device_type, spec.device_index) == (wanted.device_type, wanted.device_index):
            return int(attributes.memory_limit)
    return None
