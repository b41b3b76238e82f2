"""How each global batch is split: the split itself (`Split`), and what measures and sets
it before and during training.

`Split` is one object: the shares the step cuts by, what balancing sets, and what a
checkpoint saves. `DeviceBalancer` measures and sets it over one process's devices (a
simulated slowdown calibrated, `--powers=auto` measured, the rebalancing that carries
on from there); `WorkerBalancer` over the workers of a cluster, who agree on the
training data first. A trainer names its kind (`Trainer.Balancer`).
"""

from __future__ import annotations

from tfdp import balance
from tfdp.cluster import Agreed, arrays_digest
from tfdp.devices import AUTO, parse_slowdown, short_name


class Split:
    """The split of every global batch over `devices`.

    Attributes:
      devices: what the batch is split over (device names, or worker names).
      shards: examples of a full global batch on each, in order.
      global_batch_size: their sum.
      sizes: `shards` in a tf.Variable on the host, which the step reads: a re-split is
        one assign, with no new tracing.
      balanced: the split is the run's own (mode weighted, a measured cluster split): it
        may be measured and rebalanced, and a checkpoint saves it (`saved`).
      fixed: a strategy cuts the batches itself (mirrored's `input="dataset"`): the
        split cannot be set.
      unit: what the devices are ("device(s)", "worker(s)"), for the banner.
    """

    def __init__(self, devices, shards, balanced=False, fixed=False, unit="device(s)"):
        self.devices = list(devices)
        self.shards = list(shards)
        self.global_batch_size = sum(shards)
        self.balanced = balanced
        self.fixed = fixed
        self.unit = unit
        self._sizes = None

    @property
    def sizes(self):
        """The variable the step cuts by (made on first use: the balancing's arithmetic
        runs without TensorFlow)."""
        if self._sizes is None:
            import tensorflow as tf

            with tf.init_scope(), tf.device("/cpu:0"):  # the batch is cut on the host
                self._sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
        return self._sizes

    def set(self, shards) -> None:
        """Splits the following batches as `shards` (the same global batch)."""
        if self.fixed:
            raise ValueError("the split cannot be set: the strategy cuts the batches itself")
        if sum(shards) != self.global_batch_size or len(shards) != len(self.devices):
            raise ValueError(f"shards {shards} do not split {self.global_batch_size} examples")
        self.shards = list(shards)
        if self._sizes is not None:
            self._sizes.assign(shards)

    def saved(self, step: int) -> dict | None:
        """What a checkpoint of `step` saves of the split: the run's own split, None for
        one fixed by the mode (any split makes the same update)."""
        if not self.balanced:
            return None
        return {"step": step, "devices": self.devices, "shards": self.shards}

    def takes(self, saved: dict) -> bool:
        """Whether a split a checkpoint saved (`saved`) applies here: the same devices and
        global batch."""
        return saved["devices"] == self.devices and sum(saved["shards"]) == self.global_batch_size


class DeviceBalancer:
    """Measures and sets the split over the devices of one process (modes single,
    mirrored, weighted), through the trainer's probes and its `split`."""

    def __init__(self, trainer):
        self.trainer = trainer

    def set_up(self, config, train_data, log, measure=True):
        """The simulated slowdown and auto powers, before training (`balance`): the
        slowdown is calibrated in a step at the even split, all devices at once; auto
        powers time each device alone, then all of them at once
        (`balance.settle_under_load`).

        With `measure` False, auto powers are not measured (a resumed run has its
        split). Returns what was set up, for the result, and the probe under load
        (None without auto powers), from which rebalancing carries on.
        """
        trainer = self.trainer
        info = {"simulated_slowdown": None, "auto_powers": None}
        slowdown = parse_slowdown(config.simulate_slowdown)
        measure = measure and config.powers == AUTO
        if not slowdown and not measure:
            return info, None
        whole = timing_examples(train_data, trainer.split.global_batch_size, log)  # a global batch
        names = [short_name(d) for d in trainer.split.devices]
        if slowdown:
            factors = [slowdown.get(d, 1.0) for d in trainer.split.devices]
            delays = balance.calibrate_slowdown(trainer, whole, factors)
            slowed = [(n, f, d) for n, f, d in zip(names, factors, delays) if f != 1]
            info["simulated_slowdown"] = {
                name: {"factor": f, "sleep_seconds_per_example": d} for name, f, d in slowed
            }
            log(
                "SIMULATED SLOWDOWN (for testing; not this machine's speed): "
                + ", ".join(
                    f"{name} {f:g}x slower at the even split (sleeps {d * 1e3:.3f} ms per example)"
                    for name, f, d in slowed
                )
            )
        if not measure:
            return info, None
        probe = max(1, trainer.split.global_batch_size // len(trainer.split.devices))  # an even share
        rates = balance.measure_powers(trainer, timing_examples(train_data, probe, log))
        alone = balance.whole_shares(trainer.split.global_batch_size, rates)
        log(
            f"auto powers, each device alone on {probe} examples: "
            + ", ".join(f"{name} {r:.0f} images/s" for name, r in zip(names, rates))
            + f"; shares {alone}"
        )
        trainer.split.set(alone)
        settled = balance.settle_under_load(trainer, whole, log)
        shards = list(trainer.split.shards)
        steps = balance.PROBE_WINDOW * balance.PROBE_WINDOWS
        log(
            f"auto powers, all devices at once on {trainer.split.global_batch_size} examples for "
            f"{steps} probe steps: shares {alone}"
            + (f" -> {shards}" if shards != alone else " kept")
        )
        info["auto_powers"] = {
            "devices": names,
            "images_per_second": rates,
            "probe_examples": probe,
            "shards_alone": alone,
            "probe_resplits": settled.resplits,
            "powers": [s / min(shards) for s in shards],
        }
        return info, settled

    def rebalancing(self, every: int, log, probe=None):
        """What re-splits the batch from the step times (`balance.Rebalancing`); None
        when the steps are not timed."""
        trainer = self.trainer
        if not trainer.timed:
            return None
        rebalancing = balance.Rebalancing(trainer, every, log)
        if probe:
            rebalancing.carry_over(probe)
        return rebalancing


class WorkerBalancer(DeviceBalancer):
    """Measures and sets the split over the workers of a cluster (mode multiworker)."""

    def set_up(self, config, train_data, log, measure=True):
        """The workers agree on the training data (the first place the trainer sees it);
        the simulated slowdown is calibrated; `--powers=auto`: every worker measures
        itself and all get the same split."""
        trainer = self.trainer
        trainer.exchange.agree([training_data(config, train_data)])
        info = {"simulated_slowdown": None, "auto_powers": None}
        factors = parse_slowdown(config.simulate_slowdown)
        measure = measure and config.powers == AUTO
        if not factors and not measure:
            return info, None
        probe = timing_examples(
            train_data, max(1, trainer.split.global_batch_size // len(trainer.workers)), log
        )
        if factors:
            slowed = trainer.calibrate_slowdown(probe, factors)
            info["simulated_slowdown"] = slowed
            log(
                "SIMULATED SLOWDOWN (for testing; not this machine's speed): "
                + ", ".join(
                    f"{worker} {s['factor']:g}x slower alone "
                    f"(sleeps {s['sleep_seconds_per_example'] * 1e3:.3f} ms per example)"
                    for worker, s in slowed.items()
                )
            )
        if not measure:
            return info, None
        auto = trainer.measure_powers(probe)
        rates = ", ".join(
            f"{w} {r:.0f}" for w, r in zip(auto["devices"], auto["images_per_second"])
        )
        log(f"auto powers: measured images/sec {rates}; powers {auto['powers']}")
        info["auto_powers"] = auto
        return info, None


def timing_examples(train_data, count: int, log):
    """`count` examples of the training data to time the devices on (said in a line where
    that reads a pipeline ahead: `Stream.examples_to_time`)."""
    from tfdp import data as data_lib

    if not data_lib.is_stream(train_data):
        return data_lib.first_examples(train_data, count)
    return train_data.examples_to_time(count, log)


def training_data(config, data) -> Agreed:
    """The training data, for `agree`, named by the setting that chose it."""
    import tensorflow as tf

    from tfdp import data as data_lib

    field, value = "dataset", config.dataset
    if config.dataset == "mnist" and (config.mnist_dir or config.data_dir):
        field = "mnist_dir" if config.mnist_dir else "data_dir"
        value = getattr(config, field)
    if data_lib.is_stream(data):  # a pipeline: its source and first batch
        text = f"a {data.source} of batches of {data.batch_size}, a sample's digest "
        leaves = data.sample
    else:
        leaves = [data.images, data.labels] if isinstance(data, data_lib.Arrays) else data
        text = f"{data_lib.size(data)} examples, digest "
    return Agreed(
        field,
        value,
        text + arrays_digest(tf.nest.flatten(leaves)),
        differs="the training data differs between workers",
        needs="every worker must read the same data",
    )
