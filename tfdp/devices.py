"""Devices: names, logical-device set-up, and the weighted split of a batch."""

from __future__ import annotations

import fractions
import math
import re
from typing import Sequence

from tfdp.errors import ConfigError

AUTO = "auto"  # powers measured on the devices at start-up
_DEVICE_RE = re.compile(r"^/?(?:device:)?(cpu|gpu)(?::(\d+))?$", re.IGNORECASE)
_WORKER_RE = re.compile(r"^(chief|worker):\d+$")


def split_batch(
    global_batch: int, powers: Sequence[float], few: bool = False, max_rows=None
) -> list[int]:
    """Splits `global_batch` examples across devices in proportion to `powers`.

    Largest-remainder rounding: every device first gets the floor of its exact
    share, then the examples still missing go one each to the devices with the
    largest fractional parts (ties to the earlier device). The shares sum to
    `global_batch` exactly and each is within 1 of proportional, which the
    MXNet tutorial's `int(round(...))` does not guarantee (100 over [1, 1, 1]
    gives it 99).

    Args:
        global_batch: examples in one global mini-batch.
        powers: one positive, finite relative speed per device.
        few: a batch with fewer examples than devices is split too (some devices
            get none, as tf.distribute leaves a replica without examples).
        max_rows: the most examples each device takes (None: no limit). The split
            follows the powers up to each cap; what a capped device cannot take goes
            to the others by their powers (`capped_split`).

    Returns:
        The number of examples for each device, in the order of `powers`.

    Raises:
        ConfigError: on empty, zero, negative or non-finite powers, or when some
            device would get no example (unless `few` and the batch is smaller than
            the devices).
    """
    powers = list(powers)
    if not powers:
        raise ConfigError("powers", powers, "needs one power per device, got none")
    for p in powers:
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise ConfigError("powers", powers, f"{p!r} is not a number")
        if not math.isfinite(p) or p <= 0:
            raise ConfigError(
                "powers", powers, f"every power must be a positive finite number, got {p}"
            )
    if isinstance(global_batch, bool) or not isinstance(global_batch, int):
        raise ConfigError("global_batch", global_batch, "must be an integer")
    few = few and global_batch < len(powers)
    if global_batch < len(powers) and not few:
        raise ConfigError(
            "global_batch",
            global_batch,
            f"is smaller than the number of devices ({len(powers)}); every device "
            "needs at least one example",
        )
    if max_rows is not None:
        max_rows = checked_max_rows(max_rows, len(powers))
        if global_batch > sum(max_rows):
            raise ConfigError(
                "max_rows", list(max_rows),
                f"holds {sum(max_rows)} examples in a step, fewer than the batch of {global_batch}",
            )
    shares = capped_split(global_batch, powers, max_rows)
    starved = [i for i, s in enumerate(shares) if s == 0 and (max_rows is None or max_rows[i])]
    if starved and not few:
        starved = starved[0]
        raise ConfigError(
            "powers",
            powers,
            f"device {starved} would get 0 of {global_batch} examples; raise its "
            "power or the batch size",
        )
    return shares


def capped_split(total: int, weights: Sequence[float], max_rows=None) -> list[int]:
    """`total` examples over weights, each device within its cap (None: no caps), by
    largest remainder: the rule of engine/pieces.py's `piece_sizes`, on the host.

    Capped water-filling: the uncapped devices share what the capped ones leave by
    their weights; a device whose share would pass its cap takes its cap and leaves
    the sharing, until no share passes its cap. Needs `total` <= the caps' sum.
    """
    count = len(weights)
    caps = [math.inf] * count if max_rows is None else list(max_rows)
    capped = [False] * count
    for _ in range(count + 1):
        held = sum(c for c, fixed in zip(caps, capped) if fixed)
        free = [0 if fixed else w for w, fixed in zip(weights, capped)]
        shares = _largest_remainder(max(total - held, 0), free)
        over = [not fixed and s > c for s, c, fixed in zip(shares, caps, capped)]
        if not any(over):
            break
        capped = [a or b for a, b in zip(capped, over)]
    return [c if fixed else s for s, c, fixed in zip(shares, caps, capped)]


def _largest_remainder(total: int, weights: Sequence[float]) -> list[int]:
    """Floors of the exact shares, then one more to the largest remainders (ties to the
    earlier), in exact rational arithmetic, so that ties are real ties, not float noise."""
    weight = sum(map(fractions.Fraction, weights))
    if weight == 0:
        return [0] * len(weights)
    exact = [fractions.Fraction(total) * fractions.Fraction(w) / weight for w in weights]
    shares = [math.floor(e) for e in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (shares[i] - exact[i], i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def checked_max_rows(max_rows, count: int) -> tuple[int, ...]:
    """`max_rows` as whole numbers of examples, one per device (or worker), at least one
    example in all; else a ConfigError naming max_rows and its value."""
    if isinstance(max_rows, str) or not hasattr(max_rows, "__len__"):
        raise ConfigError(
            "max_rows", max_rows, "must be one whole number of examples per device, or 'auto'"
        )
    caps = list(max_rows)
    if len(caps) != count:
        raise ConfigError("max_rows", caps, f"needs one cap per device ({count}), got {len(caps)}")
    for cap in caps:
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap != int(cap) or cap < 0:
            raise ConfigError("max_rows", caps, f"{cap!r} is not a whole number of examples >= 0")
    if sum(caps) < 1:
        raise ConfigError("max_rows", caps, "hold no example in all: give at least one")
    return tuple(int(c) for c in caps)


def given_max_rows(max_rows, count: int) -> tuple[int, ...] | None:
    """The caps a setting gives, one per device (mode multiworker: per worker); None for
    none, or for caps measured (`max_rows="auto"`)."""
    if max_rows in ((), None, AUTO):
        return None
    return checked_max_rows(max_rows, count)


def micro_step_rows(global_batch: int, max_rows) -> int:
    """The examples of an update's largest micro-step (`micro_steps`)."""
    return -(-global_batch // micro_steps(global_batch, max_rows))


def micro_steps(global_batch: int, max_rows) -> int:
    """The micro-steps of one update: 1 where the caps hold the global batch (or there are
    none), else the fewest whose near-equal parts the caps hold."""
    if not max_rows:
        return 1
    return max(1, -(-global_batch // sum(max_rows)))


def even_split(global_batch: int, num_replicas: int) -> list[int]:
    """How tf.distribute splits a global batch over replicas.

    `experimental_distribute_dataset` rebatches to ceil(batch / replicas) per
    replica, the last replicas taking what is left: 100 over 3 gives
    [34, 34, 32]. Summing per-example losses over the global batch keeps the
    update exact for uneven splits too.
    """
    per_replica = -(-global_batch // num_replicas)
    return [max(0, min(per_replica, global_batch - i * per_replica)) for i in range(num_replicas)]


def parse_slowdown(spec: str) -> dict[str, float]:
    """'cpu:1=4,cpu:2=2' -> {'/device:CPU:1': 4.0, '/device:CPU:2': 2.0}; 'worker:1=4'
    (mode multiworker) -> {'worker:1': 4.0}.

    Raises:
        ConfigError: (field simulate_slowdown) on a malformed item, a device named
            twice or a factor that is not a finite number of at least 1.
    """
    slowdown = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        device, _, factor = item.partition("=")
        try:
            # a worker of mode multiworker (worker:1, chief:0), else a device
            name = device.strip() if _WORKER_RE.match(device.strip()) else canonical_name(device)
            value = float(factor)
        except (ConfigError, ValueError):
            raise ConfigError(
                "simulate_slowdown", spec, f"{item!r} is not DEVICE=FACTOR, e.g. cpu:1=4"
            ) from None
        if not math.isfinite(value) or value < 1:
            raise ConfigError(
                "simulate_slowdown", spec, f"factor {factor} of {device} must be a number >= 1"
            )
        if name in slowdown:
            raise ConfigError("simulate_slowdown", spec, f"names {device} more than once")
        slowdown[name] = value
    return slowdown


def canonical_name(spec: str) -> str:
    """'cpu:0', '/GPU:1', '/device:CPU:0', 'gpu' -> '/device:GPU:0' form."""
    match = _DEVICE_RE.match(spec.strip())
    if not match:
        raise ConfigError(
            "devices", spec, "is not a device name; use cpu:N or gpu:N, e.g. cpu:0,gpu:0"
        )
    kind, index = match.group(1).upper(), int(match.group(2) or 0)
    return f"/device:{kind}:{index}"


def short_name(device: str) -> str:
    """'/device:GPU:0' -> 'GPU:0', for printing."""
    return device.rsplit("device:", 1)[-1]


def parse_devices(spec: str, available: Sequence[str]) -> list[str]:
    """Resolves a `--devices` value against the devices that exist.

    Args:
        spec: comma list such as 'cpu:0,gpu:0,gpu:1', or 'all' for every GPU (every
            logical CPU where there is no GPU).
        available: canonical names of the devices that exist.

    Returns:
        Canonical device names, in the order given.

    Raises:
        ConfigError: malformed names, duplicates, or devices that do not exist
            (the message lists the ones that do).
    """
    spec = spec.strip()
    if spec.lower() == "all":
        gpus = [d for d in available if ":GPU:" in d]
        return gpus or [d for d in available if ":CPU:" in d]
    items = [item for item in spec.split(",")]
    if not spec or any(not item.strip() for item in items):
        raise ConfigError("devices", spec, "needs a comma list such as cpu:0,gpu:0, or all")
    devices = [canonical_name(item) for item in items]
    duplicates = sorted({short_name(d) for d in devices if devices.count(d) > 1})
    if duplicates:
        raise ConfigError("devices", spec, f"names {', '.join(duplicates)} more than once")
    missing = [short_name(d) for d in devices if d not in available]
    if missing:
        raise ConfigError(
            "devices",
            spec,
            f"{', '.join(missing)} does not exist here; the devices are "
            f"{', '.join(short_name(d) for d in available)}",
        )
    return devices


def available_devices() -> list[str]:
    """Canonical names of the logical GPUs and CPUs TensorFlow can use, GPUs first."""
    import tensorflow as tf

    return gpus_first(
        _canonical_logical_name(d.name)
        for kind in ("CPU", "GPU")
        for d in tf.config.list_logical_devices(kind)
    )


def gpus_first(devices) -> list[str]:
    """The GPUs in the order given, then the other devices in the order given.

    The default order of devices: device 0 of a weighted run holds the master
    weights and applies the update, which belongs on a GPU when there is one.
    """
    devices = list(devices)
    return [d for d in devices if ":GPU:" in d] + [d for d in devices if ":GPU:" not in d]


def master_on_cpu(devices: Sequence[str]) -> str | None:
    """A sentence for a weighted run whose device 0 is a CPU while a GPU takes part; else None.

    Device 0 receives every other device's gradients, sums them and sends the sum
    back (the strategy's reduce="device0", engine/strategy.py): on a CPU, the GPU waits
    for it at every step.
    """
    if not devices or ":CPU:" not in devices[0] or not any(":GPU:" in d for d in devices):
        return None
    reordered = ",".join(short_name(d).lower() for d in gpus_first(devices))
    return (
        f"device 0 is {short_name(devices[0])}, so the gradients are summed on the CPU "
        f"while a GPU takes part; put the GPU first, e.g. --devices={reordered}"
    )


def _canonical_logical_name(name: str) -> str:
    # '/job:localhost/replica:0/task:0/device:CPU:0' -> '/device:CPU:0'
    return "/device:" + name.rsplit("device:", 1)[-1]


def default_intra_op_threads(config, logical_cpus: int, gpus: int, cores: int) -> int:
    """The threads one CPU kernel may use that tfdp picks for a run; 0: TensorFlow's default.

    1 when every global batch is split evenly over CPU devices (`single`,
    `mirrored`, or `weighted` with equal, fixed powers) and independent
    chains of kernels already keep every core busy: there are more devices
    than cores, or mode single cuts its batch into several chains
    (`default_chains`). A kernel that also splits its own work over all
    cores then only adds hand-offs between threads. Otherwise 0,
    TensorFlow's default, under which a kernel may use every core: a CPU
    beside a GPU needs them, and so does a device with the larger share of
    an uneven split.

    Args:
        config: the run's Config.
        logical_cpus: the `--logical_cpus` the run asked for (0: the CPU whole).
        gpus: how many GPUs the machine has.
        cores: how many cores the machine has.
    """
    even = config.mode in ("single", "mirrored") or (
        config.mode == "weighted"
        and config.powers != AUTO
        and len(set(config.powers)) <= 1
        and not config.rebalance_every
        and not config.simulate_slowdown
    )
    if not even:
        return 0
    spec = config.devices.strip()
    if config.mode == "single" and not spec:
        cpus = 0 if gpus else 1
    elif not spec or spec.lower() == "all":
        cpus = 0 if gpus else max(logical_cpus, 1)
    else:
        devices = [canonical_name(item) for item in spec.split(",")]
        cpus = len(devices) if all(":CPU:" in d for d in devices) else 0
    if not cpus:
        return 0
    # tfdp cuts the batch into chains only in mode single, and by default only for its
    # built-in models (see modes.build_trainer): a model of the user's is not known
    # before TensorFlow starts.
    built_in = config.model in ("lenet", "toy")
    chains = 1
    if config.mode == "single":
        chains = config.chains or (max(1, cores // cpus) if built_in else 1)
    return 1 if cpus > cores or chains > 1 else 0


def default_chains(devices: list[str], cores: int) -> int:
    """How many side-by-side parts mode single cuts its batch into, when not chosen.

    On CPUs only: the machine's cores over the CPU devices, at least 1. A lone
    CPU device on 2 cores runs its shard as 2 independent chains of
    one-threaded kernels (with `default_intra_op_threads`), which fills both
    cores better than one chain of kernels that each split their work over
    both. With a GPU in the run: 1.
    """
    if any(":CPU:" not in d for d in devices):
        return 1
    return max(1, cores // len(devices))


def check_intra_op_threads(threads: int) -> None:
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
        raise ConfigError("intra_op_threads", threads, "must be 0 (TensorFlow's default) or more")


def set_intra_op_threads(threads: int) -> None:
    """Lets each CPU kernel use `threads` threads (0: TensorFlow's default, every core).

    Must run before TensorFlow initialises its runtime.
    """
    check_intra_op_threads(threads)
    if threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)


def reserve_sleeping_threads(count: int) -> None:
    """Gives TensorFlow's inter-op thread pool `count` threads more than it has cores.

    A simulated slowdown sleeps inside an op, holding one inter-op thread for
    the length of the sleep; without a spare thread, the other devices' ops
    can queue behind it and the slowdown leaks onto them. Must run before
    TensorFlow initialises its runtime.
    """
    if not count:
        return
    import os

    import tensorflow as tf

    tf.config.threading.set_inter_op_parallelism_threads((os.cpu_count() or 1) + count)


def check_logical_devices(
    logical_cpus: int = 0,
    logical_gpus: int = 0,
    gpu_memory_mb: int = 1024,
    memory_growth: bool | None = None,
) -> None:
    """The checks of `configure_logical_devices` that need no TensorFlow; raises ConfigError."""
    if logical_cpus < 0:
        raise ConfigError("logical_cpus", logical_cpus, "must be 0 (keep the CPU whole) or more")
    if logical_gpus < 0:
        raise ConfigError("logical_gpus", logical_gpus, "must be 0 (keep GPUs as they are) or more")
    if isinstance(gpu_memory_mb, bool) or not isinstance(gpu_memory_mb, int) or gpu_memory_mb < 1:
        raise ConfigError(
            "logical_gpu_memory",
            gpu_memory_mb,
            "must be a positive whole number of MB, the memory of each logical GPU",
        )
    if memory_growth and logical_gpus:
        raise ConfigError(
            "gpu_memory_growth",
            memory_growth,
            f"cannot be combined with --logical_gpus={logical_gpus}: TensorFlow gives logical "
            "GPUs fixed memory (--logical_gpu_memory) and then ignores memory growth; "
            "leave out one of the two",
        )


def configure_logical_devices(
    logical_cpus: int = 0,
    logical_gpus: int = 0,
    gpu_memory_mb: int = 1024,
    memory_growth: bool | None = None,
) -> None:
    """Sets up the GPUs' memory, and splits the host CPU (and GPU 0) into logical devices.

    Must run before TensorFlow initialises its runtime, i.e. before the first op
    or device listing of the process. Calling it again with the same numbers is
    harmless; asking for other numbers afterwards is an error, since TensorFlow
    cannot change logical devices once started.

    Memory growth and logical GPUs exclude each other: TensorFlow refuses memory
    growth on a GPU cut into logical devices, and once any GPU is cut it ignores
    memory growth on every GPU. So logical GPUs take precedence over memory
    growth left at its default, and asking for both is an error.

    Args:
        logical_cpus: 0 keeps the CPU whole, N > 0 makes CPU:0..CPU:N-1.
        logical_gpus: 0 keeps GPUs as they are, N > 0 splits GPU 0 into N.
        gpu_memory_mb: memory of each logical GPU, in MB (`--logical_gpu_memory`).
        memory_growth: every physical GPU takes memory as it needs it instead of
            all of it at start-up (`--gpu_memory_growth`); None: on, unless
            `logical_gpus` is set.

    Raises:
        ConfigError: a negative count, a memory size that is not a positive
            whole number of MB, memory growth asked for with logical GPUs,
            logical GPUs without a GPU, or logical devices TensorFlow already
            started without.
    """
    check_logical_devices(logical_cpus, logical_gpus, gpu_memory_mb, memory_growth)
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if logical_gpus and not gpus:
        raise ConfigError("logical_gpus", logical_gpus, "needs a GPU, and this machine has none")
    for gpu in gpus if memory_growth or (memory_growth is None and not logical_gpus) else ():
        try:
            tf.config.experimental.set_memory_growth(gpu, True)
        except RuntimeError as error:  # TensorFlow has already started, without it
            if memory_growth is None:
                break  # not asked for: TensorFlow keeps the memory set-up it started with
            raise ConfigError(
                "gpu_memory_growth",
                True,
                "TensorFlow has already started with memory growth off; it can only be set "
                "before TensorFlow initialises",
            ) from error
    if logical_cpus:
        cpu = tf.config.list_physical_devices("CPU")[0]
        _set_logical(
            tf,
            cpu,
            [tf.config.LogicalDeviceConfiguration()] * logical_cpus,
            "logical_cpus",
            logical_cpus,
            "CPU",
        )
    if logical_gpus:
        config = tf.config.LogicalDeviceConfiguration(memory_limit=gpu_memory_mb)
        _set_logical(tf, gpus[0], [config] * logical_gpus, "logical_gpus", logical_gpus, "GPU")


def _set_logical(tf, physical, configs, field, count, kind):
    try:
        tf.config.set_logical_device_configuration(physical, configs)
    except RuntimeError as error:
        existing = len(tf.config.list_logical_devices(kind))
        if existing != count:
            raise ConfigError(
                field,
                count,
                f"TensorFlow has already started with {existing} logical {kind}(s); "
                "logical devices can only be set once per process, before TensorFlow "
                "initialises",
            ) from error
