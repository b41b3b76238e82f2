"""Every setting of a run, its default, and its validation."""

from __future__ import annotations

import dataclasses
import math

from tfdp.devices import AUTO, checked_max_rows, parse_slowdown
from tfdp.errors import ConfigError

MODES = ("single", "mirrored", "weighted", "multiworker")
MODELS = ("lenet", "toy")
DATASETS = ("mnist", "toy")
INITS = ("tutorial", "keras")
ALL_REDUCES = ("auto", "reduce_to_one", "nccl")
BATCH_STATISTICS = ("whole", "replica")
MIRRORED_INPUTS = ("split", "dataset")
REDUCES = ("device0", "allreduce")
COLLECTIVES = ("auto", "ring", "nccl")
CLUSTERS = ("auto", "tf_config", "slurm")  # where mode multiworker finds its cluster
SLURM_PORT_BASE = 8888  # TensorFlow's SlurmClusterResolver's default
# Keras dtype policies: the compute dtype of the layers; the variables stay float32.
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
# Each model reads one kind of input.
DATASET_OF_MODEL = {"lenet": "mnist", "toy": "toy"}
DEFAULT_ITERATIONS = 50  # the tutorial's run
DEFAULT_BATCH_SIZE = 1024  # the tutorial's, for data tfdp batches itself
# --collective_timeout's range. TensorFlow counts it in whole microseconds (a smaller
# one is no limit) and silently drops one too large for them; below a second it
# aborts healthy all-reduces, which wait for the slowest worker's step.
MIN_COLLECTIVE_TIMEOUT = 1.0
MAX_COLLECTIVE_TIMEOUT = 86400.0  # a day


def setting(default, help: str, *, choices=None, flag: bool = True):
    """A Config field: its default, the one-line help its flag shows (`cli.py` makes the
    flags from these), the values it may take, and whether the command has it as a flag."""
    return dataclasses.field(
        default=default, metadata={"help": help, "choices": choices, "flag": flag}
    )


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run. Defaults reproduce the MXNet tutorial's LeNet run."""

    mode: str = setting(
        "single",
        "single: one device; mirrored: tf.distribute.MirroredStrategy; weighted: the "
        "tutorial's shards split by --powers, summed on device 0; multiworker: one process "
        "per worker of TF_CONFIG.",
        choices=MODES,
    )
    model: str = setting(
        "lenet",
        "lenet (LeNet-5), toy (the tutorial's MLP), or MODULE:FUNCTION: a function of no "
        "arguments, in an importable module or a .py file, that returns a compiled Keras model "
        "(its loss, optimizer and metrics are used), e.g. examples/mnist_cnn.py:make_model.",
    )
    dataset: str | None = setting(
        None,
        "mnist (float32 images 28x28x1 in [0, 1], int32 labels 0-9), toy (the tutorial's "
        "clusters), or MODULE:FUNCTION returning (train, validation): numpy arrays such as "
        "(x, y) or (x, y, sample_weight), or a tf.data.Dataset of such elements (batched or "
        "not; train is streamed), a keras.utils.PyDataset or a generator (train only); "
        "validation may be None; or tfds:NAME, a tensorflow-datasets dataset (its supervised "
        "keys; images scaled to [0, 1]; train streamed, shuffled by a seeded buffer of 4096; "
        "validation its test split, else validation). Default: the model's own (lenet: mnist, "
        "toy: toy, others: mnist).",
    )
    devices: str = setting(
        "",
        "Comma list such as cpu:0,gpu:0,gpu:1, or 'all' (every GPU, else every logical CPU). "
        "Default: single -> the first GPU or the CPU; others -> all.",
    )
    powers: tuple[float, ...] | str = setting(
        (),
        "weighted, multiworker: one relative speed per device (per worker), e.g. 1,5, or auto: "
        "measured at start-up. Default: equal.",
    )
    max_rows: tuple[int, ...] | str = setting(
        (),
        "The most examples each device (multiworker: each worker) takes in one step, e.g. "
        "512,64 for devices of unequal memory, or auto: measured on each GPU (no cap on a "
        "CPU). A global batch beyond their sum runs as micro-steps whose gradients make one "
        "update. Default: no caps.",
    )
    batch_size: int | None = setting(
        None,
        "Global batch size, over all devices. Default: the batches of a dataset that makes "
        f"its own (a batched tf.data.Dataset, a PyDataset, a generator), else {DEFAULT_BATCH_SIZE}.",
    )
    iterations: int | None = setting(
        None, f"Training steps (default {DEFAULT_ITERATIONS}, as the tutorial)."
    )
    epochs: int | None = setting(
        None,
        "Train until this epoch (counted from --initial_epoch) instead of --iterations; an "
        "epoch is a pass over the data, or --steps_per_epoch steps.",
    )
    steps_per_epoch: int | None = setting(
        None,
        "Steps of one epoch; the input goes on where the last epoch stopped. Default: one "
        "pass over the training data.",
    )
    initial_epoch: int = setting(
        0, "The number of the first epoch (Keras fit's initial_epoch); with --epochs."
    )
    shuffle: bool | str = setting(
        True,
        "Each epoch visits the examples in a new order, a function of --seed and the epoch; "
        "--noshuffle keeps their order.",
    )
    drop_remainder: bool = setting(
        False,
        "Leave out each epoch's last, partial batch. Default: train on it, split over the "
        "devices in proportion to their shares.",
    )
    learning_rate: float = setting(
        0.1,
        "Plain SGD learning rate of the built-in models (a MODULE:FUNCTION model brings its "
        "own optimizer).",
    )
    seed: int = setting(0, "Seed of the initial weights and of the batch order.")
    init: str = setting(
        "tutorial",
        "tutorial: weights U(-0.1, 0.1), biases 0; keras: Keras' default initialisers.",
        choices=INITS,
    )
    hidden_units: int = setting(64, "Hidden units of the toy MLP.")
    log_every: int = setting(10, "Log the training batch's accuracy every N iterations (0: never).")
    data_dir: str | None = setting(
        None,
        "tensorflow-datasets data directory (default: TFDS_DATA_DIR or tensorflow-datasets' own).",
    )
    mnist_dir: str | None = setting(
        None,
        "Directory of the four MNIST IDX .gz files; read instead of tensorflow-datasets, "
        "never downloads. Default: $TFDP_MNIST_DIR.",
    )
    eval_every: int = setting(0, "Test-set accuracy every N steps (0: only at the end).")
    eval_steps: int | None = setting(
        None,
        "Each evaluation reads the first N batches of the test data (default: all of it; an "
        "infinite one needs N), as Keras fit's validation_steps.",
    )
    model_dir: str | None = setting(
        None,
        "Checkpoints, TensorBoard logs, model.keras and result.json go here; a re-run with the "
        "same directory resumes from its latest checkpoint.",
    )
    checkpoint_every: int = setting(100, "Steps between checkpoints (and at the end).")
    keep_checkpoints: int = setting(3, "Checkpoints to keep.")
    progress: bool = setting(False, "A live progress line on stderr.", flag=False)
    all_reduce: str = setting(
        "auto",
        "mirrored: auto is MirroredStrategy's own choice (ring all-reduce on CPUs, NCCL on "
        "GPUs, reduction to one device for a mix); reduce_to_one; nccl.",
        choices=ALL_REDUCES,
    )
    mirrored_input: str = setting(
        "split",
        "mirrored: split each global batch on the host (largest remainder), or let "
        "experimental_distribute_dataset split it.",
        choices=MIRRORED_INPUTS,
    )
    reduce: str = setting(
        "device0",
        "weighted: device0 sums the gradients on device 0, updates there and broadcasts the "
        "weights (the tutorial); allreduce gives MirroredStrategy replicas the uneven shards.",
        choices=REDUCES,
    )
    rebalance_every: int = setting(
        0,
        "weighted, multiworker: re-split the batch toward equal device finishing times, from "
        "the per-device times measured over windows of K steps (the first windows of a run: "
        "1, 2, 4, ... steps); 0: never.",
    )
    batch_statistics: str = setting(
        "whole",
        "mirrored, weighted, multiworker: what BatchNormalization normalizes by in training: "
        "whole, the whole global batch's statistics (every mode makes single's update); "
        "replica, each device's shard's own, as TensorFlow's strategies compute them.",
        choices=BATCH_STATISTICS,
    )
    chains: int = setting(
        0,
        "Side-by-side parts each device cuts its shard into, their gradients summed; 0: "
        "tfdp's choice (on CPUs only: the cores each CPU device has, at least 1).",
    )
    simulate_slowdown: str = setting(
        "",
        "For testing balancing on equal devices: DEVICE=FACTOR[,...], e.g. cpu:1=4 makes "
        "cpu:1 4x slower (a sleep per example, which uses no core). Never on by default; runs "
        "say so.",
    )
    collective: str = setting(
        "auto",
        "multiworker: the all-reduce between workers (CommunicationOptions.implementation); "
        "auto lets TensorFlow choose, ring works everywhere, nccl needs GPUs.",
        choices=COLLECTIVES,
    )
    collective_timeout: float = setting(
        0.0,
        "multiworker: seconds one all-reduce may wait for the other workers before the run "
        "stops with an error (0: no limit). Dead or frozen workers are caught without it, by "
        "TensorFlow's heartbeats; each all-reduce then holds a thread for this long.",
    )
    cluster: str = setting(
        "auto",
        "multiworker: where the cluster comes from. tf_config: the TF_CONFIG variable (as "
        "tfdp-launch and Kubernetes' TFJob set it); slurm: the variables srun sets for each "
        "task of a Slurm step, one worker per task; auto: TF_CONFIG if it is set, else Slurm's.",
        choices=CLUSTERS,
    )
    slurm_port_base: int = setting(
        SLURM_PORT_BASE,
        "multiworker on Slurm: the port of the first task on each node; the node's other "
        "tasks take the next ones, as TensorFlow's SlurmClusterResolver counts them.",
    )
    jit_compile: bool = setting(
        False,
        "Compile each device's forward and backward pass with XLA, in every mode (a model of "
        "your own compiled with jit_compile=True gets it without this flag). The host clock of "
        "--powers=auto and --rebalance_every stays outside it.",
    )
    finite_guard: bool = setting(
        True,
        "Stop at the first logged step whose loss is not finite, and never save non-finite "
        "weights; the last good checkpoint stands. --nofinite_guard trains on, as Keras fit "
        "does (tfdp.fit's default; keras.callbacks.TerminateOnNaN stops it).",
    )
    precision: str = setting(
        "float32",
        "Keras dtype policy: layers compute in float16 or bfloat16, variables stay float32; "
        "mixed_float16 adds dynamic loss scaling (keras.optimizers.LossScaleOptimizer). A "
        "model of your own: give a function, tfdp builds it under the policy.",
        choices=PRECISIONS,
    )

    def __post_init__(self):
        if self.dataset is None:
            object.__setattr__(self, "dataset", DATASET_OF_MODEL.get(self.model, "mnist"))
        if isinstance(self.devices, (list, tuple)):  # as the strategies take them
            if not all(isinstance(name, str) and name.strip() for name in self.devices):
                raise ConfigError("devices", list(self.devices), "must be device names")
            object.__setattr__(self, "devices", ",".join(self.devices))
        if not isinstance(self.devices, str):
            raise ConfigError(
                "devices", self.devices, "must be a comma list such as cpu:0,gpu:0 or a list"
            )
        if self.powers != AUTO:
            object.__setattr__(self, "powers", tuple(self.powers))
        if self.max_rows != AUTO and not isinstance(self.max_rows, str):
            object.__setattr__(self, "max_rows", tuple(self.max_rows or ()))
        validate(self)


def _choice(config, field, choices):
    value = getattr(config, field)
    if value not in choices:
        raise ConfigError(field, value, f"must be one of {', '.join(choices)}")


def _positive_int(config, field):
    value = getattr(config, field)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "must be a positive integer")


def validate(config: Config) -> None:
    """Checks each field on its own and against the others; raises ConfigError."""
    _choice(config, "mode", MODES)
    for field, names in (("model", MODELS), ("dataset", DATASETS)):
        value = getattr(config, field)
        if value not in names and not (isinstance(value, str) and ":" in value):
            also = (
                ", MODULE:FUNCTION or tfds:NAME" if field == "dataset" else ", or MODULE:FUNCTION"
            )
            raise ConfigError(field, value, f"must be one of {', '.join(names)}{also}")
    if isinstance(config.dataset, str) and config.dataset.strip() == "tfds:":
        raise ConfigError("dataset", config.dataset, "names no dataset: tfds:NAME, e.g. tfds:mnist")
    _choice(config, "init", INITS)
    _choice(config, "all_reduce", ALL_REDUCES)
    _choice(config, "mirrored_input", MIRRORED_INPUTS)
    _choice(config, "reduce", REDUCES)
    _choice(config, "collective", COLLECTIVES)
    _choice(config, "precision", PRECISIONS)
    for field in ("jit_compile", "finite_guard"):
        if not isinstance(getattr(config, field), bool):
            raise ConfigError(field, getattr(config, field), "must be True or False")
    for field in ("hidden_units", "checkpoint_every", "keep_checkpoints"):
        _positive_int(config, field)
    for field in ("batch_size", "eval_steps"):  # None: the data's own batches; all of it
        if getattr(config, field) is not None:
            _positive_int(config, field)
    log_every = config.log_every
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
        raise ConfigError("log_every", log_every, "must be 0 (never) or more")
    for field in ("iterations", "epochs", "steps_per_epoch"):
        if getattr(config, field) is not None:
            _positive_int(config, field)
    initial = config.initial_epoch
    if isinstance(initial, bool) or not isinstance(initial, int) or initial < 0:
        raise ConfigError("initial_epoch", initial, "must be 0 or more")
    if initial and config.epochs is None:
        raise ConfigError("initial_epoch", initial, "needs epochs: the epoch to train until")
    if config.epochs is not None and config.epochs <= initial:
        raise ConfigError(
            "epochs", config.epochs, f"must be more than initial_epoch={initial}: nothing to train"
        )
    if config.shuffle not in (True, False, "batch"):
        raise ConfigError("shuffle", config.shuffle, "must be True, False or 'batch'")
    if config.iterations is not None and config.epochs is not None:
        raise ConfigError(
            "epochs", config.epochs, f"and iterations={config.iterations} both set; give one"
        )
    if not isinstance(config.drop_remainder, bool):
        raise ConfigError("drop_remainder", config.drop_remainder, "must be True or False")
    if isinstance(config.eval_every, bool) or not isinstance(config.eval_every, int):
        raise ConfigError("eval_every", config.eval_every, "must be an integer")
    if config.eval_every < 0:
        raise ConfigError("eval_every", config.eval_every, "must be 0 (at the end only) or more")
    if (
        config.model in MODELS
        and config.dataset in DATASETS
        and (DATASET_OF_MODEL[config.model] != config.dataset)
    ):
        raise ConfigError(
            "dataset",
            config.dataset,
            f"model {config.model} trains on dataset {DATASET_OF_MODEL[config.model]}",
        )
    lr = config.learning_rate
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ConfigError("learning_rate", lr, "must be a positive finite number")
    if isinstance(config.seed, bool) or not isinstance(config.seed, int) or config.seed < 0:
        raise ConfigError("seed", config.seed, "must be a non-negative integer")
    if isinstance(config.rebalance_every, bool) or not isinstance(config.rebalance_every, int):
        raise ConfigError("rebalance_every", config.rebalance_every, "must be an integer")
    if config.rebalance_every < 0:
        raise ConfigError("rebalance_every", config.rebalance_every, "must be 0 (never) or more")
    if isinstance(config.chains, bool) or not isinstance(config.chains, int) or config.chains < 0:
        raise ConfigError("chains", config.chains, "must be 0 (tfdp's choice) or more")
    if config.chains > 1 and config.mode != "single":
        raise ConfigError(
            "chains", config.chains,
            "applies to mode single (each device of a strategy runs its share in one piece)",
        )
    if config.powers and config.mode not in ("weighted", "multiworker"):
        raise ConfigError(
            "powers",
            config.powers,
            f"applies to modes weighted and multiworker only, not {config.mode}",
        )
    if config.reduce != "device0" and config.mode != "weighted":
        raise ConfigError(
            "reduce", config.reduce, f"applies to mode weighted only, not {config.mode}"
        )
    if config.rebalance_every and config.mode not in ("weighted", "multiworker"):
        raise ConfigError(
            "rebalance_every",
            config.rebalance_every,
            f"applies to modes weighted and multiworker only, not {config.mode}",
        )
    parse_slowdown(config.simulate_slowdown)  # the form; the devices are checked against the run's
    for p in () if config.powers == AUTO else config.powers:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not math.isfinite(p) or p <= 0:
            raise ConfigError(
                "powers", config.powers, f"every power must be a positive finite number, got {p!r}"
            )
    if config.max_rows and config.max_rows != AUTO:
        checked_max_rows(config.max_rows, len(config.max_rows))  # the form; the count is the run's
    _choice(config, "cluster", CLUSTERS)
    base = config.slurm_port_base
    if isinstance(base, bool) or not isinstance(base, int) or not 1 <= base <= 65535:
        raise ConfigError("slurm_port_base", base, "must be a port number, 1 to 65535")
    if config.mode != "multiworker":
        for field, default in (("cluster", "auto"), ("slurm_port_base", SLURM_PORT_BASE)):
            if getattr(config, field) != default:
                raise ConfigError(
                    field,
                    getattr(config, field),
                    f"applies to mode multiworker only, not {config.mode}",
                )
    timeout = config.collective_timeout
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, (int, float))
        or not (timeout == 0 or MIN_COLLECTIVE_TIMEOUT <= timeout <= MAX_COLLECTIVE_TIMEOUT)
    ):
        raise ConfigError(
            "collective_timeout",
            timeout,
            f"must be 0 (no limit) or {MIN_COLLECTIVE_TIMEOUT:g} to {MAX_COLLECTIVE_TIMEOUT:g} "
            "seconds; TensorFlow keeps a thread per all-reduce for the whole timeout, "
            "so keep it short",
        )
