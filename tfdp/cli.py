"""tfdp: data-parallel training over unequal devices (GPUs, CPUs, several machines).

Examples:

  tfdp --mode=mirrored --logical_cpus=4 --devices=all
  tfdp --mode=weighted --model=toy --logical_cpus=2 --devices=cpu:0,cpu:1 --powers=1,5 --batch_size=100
  tfdp --model=examples/mnist_cnn.py:make_model --mode=weighted --powers=auto --epochs=1
"""

# absl flags -> Config -> train -> result JSON; the only module that reads FLAGS.

from __future__ import annotations

import dataclasses
import json
import os
import sys

# Before TensorFlow is first imported: keep its C++ start-up chatter out of the run's output
# (the level hides its later INFO lines; chatter.py the lines written before absl's logging
# is set up), and turn on oneDNN's CPU kernels where TensorFlow leaves them off (onednn.py).
from tfdp import chatter  # noqa: E402  (reads whether the user set TF_CPP_MIN_LOG_LEVEL)

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from tfdp import onednn  # noqa: E402

onednn.enable_by_default()

from absl import app, flags, logging  # noqa: E402

from tfdp.cluster.workers import LOST_CLUSTER  # noqa: E402
from tfdp.config import AUTO, Config  # noqa: E402
from tfdp.devices import (  # noqa: E402
    check_intra_op_threads,
    check_logical_devices,
    configure_logical_devices,
    default_intra_op_threads,
    parse_slowdown,
    reserve_sleeping_threads,
    set_intra_op_threads,
)
from tfdp.errors import ConfigError, DataError  # noqa: E402
from tfdp.run.signals import Stopped  # noqa: E402
from tfdp.storage import StorageError, write_atomically  # noqa: E402

FLAGS = flags.FLAGS


def define_config_flags() -> None:
    """One flag per Config field, with the field's default, help and choices."""
    for field in dataclasses.fields(Config):
        meta = field.metadata
        if not meta.get("flag", True):
            continue
        default = field.default
        if meta.get("choices"):
            flags.DEFINE_enum(field.name, default, list(meta["choices"]), meta["help"])
        elif field.name in ("powers", "max_rows"):
            flags.DEFINE_list(field.name, list(default), meta["help"])
        elif field.type.startswith("bool"):
            flags.DEFINE_bool(field.name, default, meta["help"])
        elif field.type.startswith("int"):
            flags.DEFINE_integer(field.name, default, meta["help"])
        elif field.type.startswith("float"):
            flags.DEFINE_float(field.name, default, meta["help"])
        else:
            flags.DEFINE_string(field.name, default, meta["help"])


define_config_flags()
# The process's own flags: the device set-up and threads, made before TensorFlow starts,
# and where the result and the progress line go.
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
flags.DEFINE_enum(
    "progress",
    "auto",
    ["auto", "always", "never"],
    "Live progress line on stderr (auto: on a terminal).",
)
flags.DEFINE_string("result_json", None, "Write the run's result here as JSON.")


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
        if FLAGS[field].value is None:
            return f"--{field} (not given)"
        return FLAGS[field].serialize() or f"--{field}="
    return f"{field}={value}"


def _from_flag(field: str, values: list[str], number, example: str):
    """A list flag of numbers (`number` converts each), or auto."""
    if values == [AUTO]:
        return AUTO
    try:
        return tuple(number(v) for v in values)
    except ValueError:
        raise ConfigError(field, values, f"must be numbers, e.g. {example}") from None


def config_from_flags() -> Config:
    """The run's Config; raises ConfigError naming the bad flag."""
    values = {
        field.name: FLAGS[field.name].value
        for field in dataclasses.fields(Config)
        if field.metadata.get("flag", True)
    }
    values["powers"] = _from_flag("powers", values["powers"], float, "1,5")
    values["max_rows"] = _from_flag("max_rows", values["max_rows"], int, "512,64 (whole examples)")
    values["progress"] = {"always": True, "never": False}.get(FLAGS.progress, sys.stderr.isatty())
    return Config(**values)


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
        from tfdp.cluster.spec import find_cluster

        find_cluster(config)  # a missing or malformed cluster fails here, before TensorFlow starts
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
        with chatter.filtered_stderr():  # TensorFlow starts up in here
            set_up_process(config)
            from tfdp.run import training  # imports TensorFlow: after the checks that need none

            plan = training.prepare(config)
    except ConfigError as error:
        _fail(error_line(error))
    try:
        result = training.run(plan)
    except ConfigError as error:  # a checkpoint that does not fit, found when restoring
        _fail(error_line(error))
    except (training.NonFinite, DataError) as error:
        _fail(str(error), status=1)
    except Stopped as error:  # SIGTERM or Ctrl-C, after saving the step
        print(f"tfdp: {error}", file=sys.stderr)
        sys.exit(error.exit_status)
    except StorageError as error:  # a full disk, a read-only directory: the last save stands
        _fail(str(error), status=1)
    except Exception as error:  # a worker of the cluster died or stopped responding
        from tfdp.cluster import spec as cluster

        if config.mode != "multiworker" or not cluster.is_cluster_error(error):
            raise
        _fail(cluster.describe_failure(error, config), status=LOST_CLUSTER)
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
    ("what to train on", "mode devices powers batch_size max_rows logical_cpus logical_gpus"),
    (
        "the model and data",
        "model dataset mnist_dir data_dir iterations epochs steps_per_epoch initial_epoch "
        "learning_rate seed init hidden_units shuffle drop_remainder",
    ),
    (
        "long runs",
        "model_dir checkpoint_every keep_checkpoints eval_every eval_steps result_json log_every progress",
    ),
    ("unequal devices", "rebalance_every reduce simulate_slowdown"),
    ("multiworker", "cluster slurm_port_base collective collective_timeout"),
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
