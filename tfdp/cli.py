"""tfdp: data-parallel training over unequal devices (GPUs, CPUs, several machines).

Examples:

  tfdp --mode=mirrored --logical_cpus=4 --devices=all
  tfdp --mode=weighted --model=toy --logical_cpus=2 --devices=cpu:0,cpu:1 --powers=1,5 --batch_size=100
  tfdp --model=examples/mnist_cnn.py:make_model --mode=weighted --powers=auto --epochs=1
"""

# absl flags -> Config -> train -> result JSON; the only module that reads FLAGS.

from __future__ import annotations

import json
import os
import sys

# Before TensorFlow is first imported: keep its C++ start-up chatter out of the run's output,
# and turn on oneDNN's CPU kernels where TensorFlow leaves them off (onednn.py).
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdp import onednn  # noqa: E402

onednn.enable_by_default()

from absl import app, flags, logging  # noqa: E402

from tfdp.config import (  # noqa: E402
    ALL_REDUCES,
    AUTO,
    COLLECTIVES,
    DEFAULT_ITERATIONS,
    INITS,
    MIRRORED_INPUTS,
    MODES,
    PRECISIONS,
    REDUCES,
    Config,
)
from tfdp.devices import (  # noqa: E402
    check_intra_op_threads,
    check_logical_devices,
    configure_logical_devices,
    default_intra_op_threads,
    parse_slowdown,
    reserve_sleeping_threads,
    set_intra_op_threads,
)
from tfdp.checkpoints import StorageError, write_atomically  # noqa: E402
from tfdp.errors import ConfigError  # noqa: E402
from tfdp.signals import Stopped  # noqa: E402

FLAGS = flags.FLAGS
_DEFAULTS = Config()

flags.DEFINE_enum(
    "mode",
    _DEFAULTS.mode,
    MODES,
    "single: one device; mirrored: tf.distribute.MirroredStrategy; "
    "weighted: the tutorial's shards split by --powers, summed on device 0.",
)
flags.DEFINE_string(
    "model",
    _DEFAULTS.model,
    "lenet (LeNet-5), toy (the tutorial's MLP), or MODULE:FUNCTION: a function of no "
    "arguments, in an importable module or a .py file, that returns a compiled Keras model "
    "(its loss, optimizer and metrics are used), e.g. examples/mnist_cnn.py:make_model.",
)
flags.DEFINE_string(
    "dataset",
    None,
    "mnist (float32 images 28x28x1 in [0, 1], int32 labels 0-9), toy (the tutorial's "
    "clusters), or MODULE:FUNCTION returning (train, validation), each numpy arrays such as "
    "(x, y) or (x, y, sample_weight) or an unbatched tf.data.Dataset of such elements; "
    "validation may be None. Default: the model's own (lenet: mnist, toy: toy, others: mnist).",
)
flags.DEFINE_string(
    "devices",
    _DEFAULTS.devices,
    "Comma list such as cpu:0,gpu:0,gpu:1, or 'all' (every GPU, else every "
    "logical CPU). Default: single -> the first GPU or the CPU; others -> all.",
)
flags.DEFINE_list(
    "powers",
    [],
    "weighted: one relative speed per device, e.g. 1,5, or auto: measured on each device "
    "at start-up. Default: equal.",
)
flags.DEFINE_integer(
    "logical_cpus", 0, "Split the host CPU into N logical devices (0: keep it whole)."
)
flags.DEFINE_integer(
    "logical_gpus",
    0,
    "Split GPU 0 into N logical devices of --logical_gpu_memory MB each (0: keep GPUs as they "
    "are). Replaces --gpu_memory_growth, which TensorFlow ignores once a GPU is split.",
)
flags.DEFINE_integer(
    "logical_gpu_memory", 1024, "Memory of each logical GPU of --logical_gpus, in MB (> 0)."
)
flags.DEFINE_bool(
    "gpu_memory_growth",
    None,
    "Every GPU takes memory as it needs it, instead of all of it at start-up. Default: on, "
    "unless --logical_gpus is given (the two cannot be combined).",
)
flags.DEFINE_integer(
    "intra_op_threads",
    None,
    "Threads one CPU kernel may use; 0: TensorFlow's default, every core. Default: 1 when each "
    "batch is split evenly over more logical CPUs than there are cores, else 0.",
)
flags.DEFINE_integer(
    "chains",
    _DEFAULTS.chains,
    "Side-by-side parts each device cuts its shard into, their gradients summed; 0: tfdp's "
    "choice (on CPUs only: the cores each CPU device has, at least 1).",
)
flags.DEFINE_integer("batch_size", _DEFAULTS.batch_size, "Global batch size, over all devices.")
flags.DEFINE_integer(
    "iterations", None, f"Training steps (default {DEFAULT_ITERATIONS}, as the tutorial)."
)
flags.DEFINE_integer("epochs", None, "Train for this many epochs instead of --iterations.")
flags.DEFINE_bool(
    "drop_remainder",
    _DEFAULTS.drop_remainder,
    "Leave out each epoch's last, partial batch. Default: train on it, split over the devices "
    "in proportion to their shares.",
)
flags.DEFINE_integer(
    "eval_every", _DEFAULTS.eval_every, "Test-set accuracy every N steps (0: only at the end)."
)
flags.DEFINE_string(
    "model_dir",
    None,
    "Checkpoints, TensorBoard logs, model.keras and result.json go here; a re-run with the "
    "same directory resumes from its latest checkpoint.",
)
flags.DEFINE_integer(
    "checkpoint_every", _DEFAULTS.checkpoint_every, "Steps between checkpoints (and at the end)."
)
flags.DEFINE_integer("keep_checkpoints", _DEFAULTS.keep_checkpoints, "Checkpoints to keep.")
flags.DEFINE_enum(
    "all_reduce",
    _DEFAULTS.all_reduce,
    ALL_REDUCES,
    "mirrored: auto is MirroredStrategy's own choice (ring all-reduce on CPUs, NCCL on GPUs, "
    "reduction to one device for a mix); reduce_to_one; nccl.",
)
flags.DEFINE_enum(
    "mirrored_input",
    _DEFAULTS.mirrored_input,
    MIRRORED_INPUTS,
    "mirrored: split each global batch on the host (largest remainder), or let "
    "experimental_distribute_dataset split it.",
)
flags.DEFINE_enum(
    "reduce",
    _DEFAULTS.reduce,
    REDUCES,
    "weighted: device0 sums the gradients on device 0, updates there and broadcasts the "
    "weights (the tutorial); allreduce gives MirroredStrategy replicas the uneven shards.",
)
flags.DEFINE_integer(
    "rebalance_every",
    _DEFAULTS.rebalance_every,
    "weighted: re-split the batch toward equal device finishing times, from the per-device "
    "times measured over windows of K steps (the first windows of a run: 1, 2, 4, ... "
    "steps); 0: never.",
)
flags.DEFINE_bool(
    "jit_compile",
    _DEFAULTS.jit_compile,
    "Compile each device's forward and backward pass with XLA, in every mode (built-in "
    "models). The host clock of --powers=auto and --rebalance_every stays outside it.",
)
flags.DEFINE_enum(
    "precision",
    _DEFAULTS.precision,
    PRECISIONS,
    "Keras dtype policy of the built-in models: their layers compute in float16 or bfloat16, "
    "their variables stay float32; mixed_float16 adds dynamic loss scaling "
    "(keras.optimizers.LossScaleOptimizer).",
)
flags.DEFINE_string(
    "simulate_slowdown",
    _DEFAULTS.simulate_slowdown,
    "For testing balancing on equal devices: DEVICE=FACTOR[,...], e.g. cpu:1=4 makes cpu:1 "
    "4x slower (a sleep per example, which uses no core). Never on by default; runs say so.",
)
flags.DEFINE_enum(
    "progress",
    "auto",
    ["auto", "always", "never"],
    "Live progress line on stderr (auto: on a terminal).",
)
flags.DEFINE_float(
    "learning_rate",
    _DEFAULTS.learning_rate,
    "Plain SGD learning rate of the built-in models (a MODULE:FUNCTION model brings its own "
    "optimizer).",
)
flags.DEFINE_integer("seed", _DEFAULTS.seed, "Seed of the initial weights and of the batch order.")
flags.DEFINE_enum(
    "init",
    _DEFAULTS.init,
    INITS,
    "tutorial: weights U(-0.1, 0.1), biases 0; keras: Keras' default initialisers.",
)
flags.DEFINE_integer("hidden_units", _DEFAULTS.hidden_units, "Hidden units of the toy MLP.")
flags.DEFINE_integer("log_every", _DEFAULTS.log_every, "Log the accuracy every N iterations.")
flags.DEFINE_string(
    "data_dir",
    None,
    "tensorflow-datasets data directory (default: TFDS_DATA_DIR or tensorflow-datasets' own).",
)
flags.DEFINE_string(
    "mnist_dir",
    None,
    "Directory of the four MNIST IDX .gz files; read instead "
    "of tensorflow-datasets, never downloads. Default: $TFDP_MNIST_DIR.",
)
flags.DEFINE_string("result_json", None, "Write the run's result here as JSON.")
flags.DEFINE_enum(
    "collective",
    _DEFAULTS.collective,
    COLLECTIVES,
    "multiworker: the all-reduce between workers (CommunicationOptions.implementation); "
    "auto lets TensorFlow choose, ring works everywhere, nccl needs GPUs.",
)
flags.DEFINE_float(
    "collective_timeout",
    _DEFAULTS.collective_timeout,
    "multiworker: seconds one all-reduce may wait for the other workers before the run stops "
    "with an error (0: no limit). Dead or frozen workers are caught without it, by "
    "TensorFlow's heartbeats; each all-reduce then holds a thread for this long.",
)


def _fail(message: str, status: int = 2) -> None:
    """One line on stderr and an exit status (2: usage, as absl's); no traceback."""
    print(f"tfdp: error: {message}", file=sys.stderr)
    # What TensorFlow logs while tearing down a refused run is noise after this line.
    logging.set_verbosity(logging.FATAL)
    sys.exit(status)


ARGUMENTS = "arguments"  # what absl leaves after the flags: tfdp takes none


def _flag_text(field: str, value) -> str:
    """`--field=value` as the user typed it where the field is a flag."""
    if field == ARGUMENTS:
        return f"unexpected arguments {value}"
    if field in FLAGS:
        return FLAGS[field].serialize() or f"--{field}="
    return f"{field}={value}"


def _powers_from_flag(values: list[str]) -> tuple[float, ...] | str:
    if values == [AUTO]:
        return AUTO
    try:
        return tuple(float(v) for v in values)
    except ValueError:
        raise ConfigError("powers", values, "must be numbers, e.g. 1,5") from None


def config_from_flags() -> Config:
    """The run's Config; raises ConfigError naming the bad flag."""
    return Config(
        mode=FLAGS.mode,
        model=FLAGS.model,
        dataset=FLAGS.dataset,
        devices=FLAGS.devices,
        powers=_powers_from_flag(FLAGS.powers),
        batch_size=FLAGS.batch_size,
        iterations=FLAGS.iterations,
        learning_rate=FLAGS.learning_rate,
        seed=FLAGS.seed,
        init=FLAGS.init,
        hidden_units=FLAGS.hidden_units,
        log_every=FLAGS.log_every,
        data_dir=FLAGS.data_dir,
        mnist_dir=FLAGS.mnist_dir,
        epochs=FLAGS.epochs,
        drop_remainder=FLAGS.drop_remainder,
        eval_every=FLAGS.eval_every,
        model_dir=FLAGS.model_dir,
        checkpoint_every=FLAGS.checkpoint_every,
        keep_checkpoints=FLAGS.keep_checkpoints,
        all_reduce=FLAGS.all_reduce,
        mirrored_input=FLAGS.mirrored_input,
        reduce=FLAGS.reduce,
        rebalance_every=FLAGS.rebalance_every,
        simulate_slowdown=FLAGS.simulate_slowdown,
        chains=FLAGS.chains,
        collective=FLAGS.collective,
        collective_timeout=FLAGS.collective_timeout,
        jit_compile=FLAGS.jit_compile,
        precision=FLAGS.precision,
        progress={"always": True, "never": False}.get(FLAGS.progress, sys.stderr.isatty()),
    )


def check_writable(field: str, path: str | None) -> None:
    """Fails early when an output file could not be written at the end."""
    if path is None:
        return
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(parent) or not os.access(parent, os.W_OK):
        raise ConfigError(field, path, "is not a writable file path")


def error_line(error: ConfigError) -> str:
    """What the command prints for `error`: the flag as typed, and what is wrong with it."""
    return f"{_flag_text(error.field, error.value)}: {error.reason}"


def checked_config(argv: list[str]) -> Config:
    """The run's Config from the parsed flags (`argv`: what absl left of the command
    line), after every check of the command line that needs no TensorFlow (the process
    flags' too); raises ConfigError naming the flag."""
    if len(argv) > 1:
        raise ConfigError(ARGUMENTS, " ".join(argv[1:]), "flags take the form --name=value")
    config = config_from_flags()
    check_writable("result_json", FLAGS.result_json)
    if FLAGS.intra_op_threads is not None:
        check_intra_op_threads(FLAGS.intra_op_threads)
    if config.mode == "multiworker":
        from tfdp.cluster import read_cluster

        read_cluster()  # a missing or malformed TF_CONFIG fails here, before TensorFlow starts
        if FLAGS.logical_cpus:
            raise ConfigError(
                "logical_cpus",
                FLAGS.logical_cpus,
                "MultiWorkerMirroredStrategy runs one replica per worker on the CPU and does not "
                "use logical CPUs; start more workers instead (tfdp-launch --workers=N)",
            )
    check_logical_devices(
        FLAGS.logical_cpus,
        FLAGS.logical_gpus,
        FLAGS.logical_gpu_memory,
        memory_growth=FLAGS.gpu_memory_growth,
    )
    return config


def set_up_process(config: Config) -> None:
    """This process's threads and logical devices: before TensorFlow initialises its runtime."""
    reserve_sleeping_threads(len(parse_slowdown(config.simulate_slowdown)))
    configure_logical_devices(
        FLAGS.logical_cpus,
        FLAGS.logical_gpus,
        FLAGS.logical_gpu_memory,
        memory_growth=FLAGS.gpu_memory_growth,
    )
    set_intra_op_threads(_intra_op_threads(config))


def main(argv: list[str]) -> None:
    if not FLAGS["verbosity"].present:
        # tf.distribute logs every all-reduce it builds at INFO; the run's own output is enough.
        logging.set_verbosity(logging.WARNING)
    try:
        config = checked_config(argv)
        set_up_process(config)
        from tfdp import training  # imports TensorFlow: after the checks that need none

        plan = training.prepare(config)
    except ConfigError as error:
        _fail(error_line(error))
    try:
        result = training.run(plan)
    except ConfigError as error:  # a checkpoint that does not fit, found when restoring
        _fail(error_line(error))
    except training.NonFinite as error:
        _fail(str(error), status=1)
    except Stopped as error:  # SIGTERM or Ctrl-C, after saving the step
        print(f"tfdp: {error}", file=sys.stderr)
        sys.exit(error.exit_status)
    except StorageError as error:  # a full disk, a read-only directory: the last save stands
        _fail(str(error), status=1)
    except Exception as error:  # a worker of the cluster died or stopped responding
        from tfdp import cluster

        if config.mode != "multiworker" or not cluster.is_cluster_error(error):
            raise
        _fail(cluster.describe_failure(error, config), status=1)
    if FLAGS.result_json and result.get("chief", True):  # multiworker: the chief writes it
        try:
            write_atomically(FLAGS.result_json, json.dumps(result, indent=2) + "\n")
        except StorageError as error:
            _fail(str(error), status=1)


def _intra_op_threads(config: Config) -> int:
    """`--intra_op_threads`, or tfdp's choice for the run when it is not given."""
    if FLAGS.intra_op_threads is not None:
        return FLAGS.intra_op_threads
    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))
    return default_intra_op_threads(config, FLAGS.logical_cpus, gpus, os.cpu_count() or 1)


HELP_ARGUMENTS = ("--help", "-h", "--helpshort", "-?")

# --help's order: what a first run needs first; flags not named here come last, under "other".
HELP_GROUPS = (
    ("what to train on", "mode devices powers batch_size logical_cpus logical_gpus"),
    (
        "the model and data",
        "model dataset mnist_dir data_dir iterations epochs learning_rate "
        "seed init hidden_units drop_remainder",
    ),
    (
        "long runs",
        "model_dir checkpoint_every keep_checkpoints eval_every result_json log_every progress",
    ),
    ("unequal devices", "rebalance_every reduce simulate_slowdown"),
    ("multiworker", "collective collective_timeout"),
    (
        "tuning",
        "chains intra_op_threads all_reduce mirrored_input jit_compile precision "
        "gpu_memory_growth logical_gpu_memory",
    ),
)


def _help_text() -> str:
    """tfdp's flags with their help, grouped (absl's module_help sorts them by name)."""
    own = {flag.name: flag for flag in FLAGS.get_flags_for_module(__name__)}
    groups = [
        (title, [own.pop(n) for n in names.split() if n in own]) for title, names in HELP_GROUPS
    ]
    lines = [(__doc__ or "").strip(), "", "flags (all: --helpfull):"]
    for title, group in groups + [("other", sorted(own.values(), key=lambda f: f.name))]:
        if group:
            lines += ["", f"{title}:"]
        for flag in group:
            name = f"--[no]{flag.name}" if flag.boolean else f"--{flag.name}"
            given = flag.default not in (None, "", [])
            text = f"{name}: {flag.help}" + (f" (default: {flag.default_as_str})" if given else "")
            lines.append(flags.text_wrap(text, indent="      ", firstline_indent="  "))
    return "\n".join(lines)


def _parse_flags(argv: list[str]) -> list[str]:
    if any(argument in HELP_ARGUMENTS for argument in argv[1:]):
        # absl's --help lists only __main__'s key flags, which a console script has none of.
        print(_help_text())
        sys.exit(0)
    try:
        return FLAGS(argv)
    except flags.Error as error:  # unknown flag, bad enum or number: absl names the flag
        _fail(str(error))


def run() -> None:
    """Console-script entry point."""
    app.run(main, flags_parser=_parse_flags)


if __name__ == "__main__":
    run()
