"""Every setting of a run, its default, and its validation."""

from __future__ import annotations

import dataclasses
import math

from tfdp.devices import AUTO, parse_slowdown
from tfdp.errors import ConfigError

MODES = ("single", "mirrored", "weighted", "multiworker")
MODELS = ("lenet", "toy")
DATASETS = ("mnist", "toy")
INITS = ("tutorial", "keras")
ALL_REDUCES = ("auto", "reduce_to_one", "nccl")
MIRRORED_INPUTS = ("split", "dataset")
REDUCES = ("device0", "allreduce")
COLLECTIVES = ("auto", "ring", "nccl")
# Keras dtype policies: the compute dtype of the layers; the variables stay float32.
PRECISIONS = ("float32", "mixed_bfloat16", "mixed_float16")
# Each model reads one kind of input.
DATASET_OF_MODEL = {"lenet": "mnist", "toy": "toy"}
DEFAULT_ITERATIONS = 50  # the tutorial's run
# --collective_timeout's range. TensorFlow counts it in whole microseconds (a smaller
# one is no limit) and silently drops one too large for them; below a second it
# aborts healthy all-reduces, which wait for the slowest worker's step.
MIN_COLLECTIVE_TIMEOUT = 1.0
MAX_COLLECTIVE_TIMEOUT = 86400.0  # a day


@dataclasses.dataclass(frozen=True)
class Config:
    """One training run. Defaults reproduce the MXNet tutorial's LeNet run."""

    mode: str = "single"  # single | mirrored | weighted | multiworker
    model: str = "lenet"  # lenet | toy | MODULE:FUNCTION returning a compiled Keras model
    # mnist | toy | MODULE:FUNCTION returning (train, validation); None: the model's own
    # (lenet: mnist, toy: toy, a MODULE:FUNCTION model: mnist)
    dataset: str | None = None
    devices: str = ""  # comma list or 'all'; '': single -> first device, others -> all
    powers: (
        tuple[float, ...] | str
    ) = ()  # weighted: one relative speed per device; (): equal; "auto": measured
    batch_size: int = 1024  # global batch, as in the tutorial's LeNet run
    iterations: int | None = None  # training steps; None: `epochs` if set, else the tutorial's 50
    epochs: int | None = None  # train for whole epochs instead of `iterations`
    drop_remainder: bool = False  # leave out each epoch's last, partial batch
    learning_rate: float = 0.1  # the tutorial's plain SGD step
    seed: int = 0  # initial weights and batch order, identical in every mode
    init: str = "tutorial"  # tutorial: U(-0.1, 0.1) weights, zero biases; keras: Keras defaults
    hidden_units: int = 64  # the toy MLP's hidden layer
    log_every: int = 10  # the tutorial logs every 10 iterations
    data_dir: str | None = None  # tensorflow-datasets directory (else TFDS_DATA_DIR or its default)
    mnist_dir: str | None = None  # local IDX files (else TFDP_MNIST_DIR); never downloads
    eval_every: int = 0  # test-set accuracy every N steps; 0: at the end only (always at the end)
    model_dir: str | None = None  # checkpoints, TensorBoard logs, model.keras, result.json
    checkpoint_every: int = 100  # steps between checkpoints (and one at the end)
    keep_checkpoints: int = 3  # the newest few are kept
    progress: bool = False  # a live progress line on stderr
    all_reduce: str = "auto"  # mirrored: auto (MirroredStrategy's choice) | reduce_to_one | nccl
    mirrored_input: str = (
        "split"  # mirrored: split on the host | dataset (experimental_distribute_dataset)
    )
    # weighted: device0 sums gradients on device 0 and broadcasts (the tutorial);
    # allreduce gives MirroredStrategy replicas the uneven shards
    reduce: str = "device0"
    rebalance_every: int = (
        0  # weighted: re-split the batch by times measured over windows of K steps; 0: never
    )
    chains: int = 0  # side-by-side parts each device cuts its shard into; 0: devices.default_chains
    simulate_slowdown: str = ""  # testing only: 'cpu:1=4' makes cpu:1 4x slower (sleeps)
    collective: str = (
        "auto"  # multiworker: auto | ring | nccl (CommunicationOptions.implementation)
    )
    collective_timeout: float = 0.0  # multiworker: seconds an all-reduce may wait; 0: no limit
    jit_compile: bool = False  # XLA compiles each device's forward and backward
    # the built-in models' Keras dtype policy; mixed_float16 adds loss scaling
    precision: str = "float32"

    def __post_init__(self):
        if self.dataset is None:
            object.__setattr__(self, "dataset", DATASET_OF_MODEL.get(self.model, "mnist"))
        if self.powers != AUTO:
            object.__setattr__(self, "powers", tuple(self.powers))
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
            raise ConfigError(
                field, value, f"must be one of {', '.join(names)}, or MODULE:FUNCTION"
            )
    _choice(config, "init", INITS)
    _choice(config, "all_reduce", ALL_REDUCES)
    _choice(config, "mirrored_input", MIRRORED_INPUTS)
    _choice(config, "reduce", REDUCES)
    _choice(config, "collective", COLLECTIVES)
    _choice(config, "precision", PRECISIONS)
    if not isinstance(config.jit_compile, bool):
        raise ConfigError("jit_compile", config.jit_compile, "must be True or False")
    for field in (
        "batch_size",
        "log_every",
        "hidden_units",
        "checkpoint_every",
        "keep_checkpoints",
    ):
        _positive_int(config, field)
    for field in ("iterations", "epochs"):
        if getattr(config, field) is not None:
            _positive_int(config, field)
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
    if config.chains and config.mode == "multiworker":
        raise ConfigError("chains", config.chains, "applies to modes single, mirrored and weighted")
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
