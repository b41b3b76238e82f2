"""What measures and sets a run's split before and during training, through a trainer's
probes (`trainer.Probes`).

`DeviceBalancer` over one process's devices: a simulated slowdown calibrated,
`--powers=auto` measured alone and then under load, and the rebalancing that carries on
from there. `WorkerBalancer` over the workers of a cluster, who agree on the training
data first. A trainer names its kind (`Trainer.balancer`).
"""

from __future__ import annotations

from tfdp import balance
from tfdp.balance import leaving, memory
from tfdp.cluster.agreement import Agreed, arrays_digest
from tfdp.devices import AUTO, parse_slowdown, short_name


class DeviceBalancer:
    """Measures and sets the split over the devices of one process (modes single,
    mirrored, weighted), through a trainer's probes (`trainer.Probes`) and the split
    they time (`probes.split`)."""

    def __init__(self, probes):
        self.probes = probes

    def set_up(self, config, train_data, log, measure=True):
        """The simulated slowdown and auto powers, before training (`balance`): the
        slowdown is calibrated in a step at the even split, all devices at once; auto
        powers time each device alone, then all of them at once
        (`balance.settle_under_load`).

        With `measure` False, auto powers are not measured (a resumed run has its
        split). Returns what was set up, for the result, and the probe under load
        (None without auto powers), from which rebalancing carries on.
        """
        probes = self.probes
        info = {"simulated_slowdown": None, "auto_powers": None, "measured_max_rows": None}
        if config.max_rows == AUTO:  # first: every later probe stays within the caps
            caps = memory.measure(
                probes, lambda n: timing_examples(train_data, n, log), config.batch_size, log
            )
            if caps is not None:
                probes.split.cap(caps, config.batch_size)
                info["measured_max_rows"] = caps
        slowdown = parse_slowdown(config.simulate_slowdown)
        measure = measure and config.powers == AUTO
        if not slowdown and not measure:
            return info, None
        whole = timing_examples(train_data, probes.split.global_batch_size, log)  # a global batch
        names = [short_name(d) for d in probes.split.devices]
        if slowdown:
            factors = [slowdown.get(d, 1.0) for d in probes.split.devices]
            delays = balance.calibrate_slowdown(probes, whole, factors)
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
        probe = max(1, probes.split.global_batch_size // len(probes.split.devices))  # an even share
        caps = probes.split.max_rows
        if caps:  # each device alone within its cap
            probe = min(probe, min(c for c in caps if c > 0))
        rates = balance.measure_powers(probes, timing_examples(train_data, probe, log))
        alone = balance.whole_shares(probes.split.global_batch_size, rates, caps)
        log(
            f"auto powers, each device alone on {probe} examples: "
            + ", ".join(f"{name} {r:.0f} images/s" for name, r in zip(names, rates))
            + f"; shares {alone}"
        )
        probes.split.set(alone)
        settled = balance.settle_under_load(probes, whole, log)
        shards = list(probes.split.shards)
        steps = balance.PROBE_WINDOW * balance.PROBE_WINDOWS
        log(
            f"auto powers, all devices at once on {probes.split.global_batch_size} examples for "
            f"{steps} probe steps: shares {alone}"
            + (f" -> {shards}" if shards != alone else " kept")
        )
        tried = []
        if probes.may_leave_out:  # a device that only slows the step gets no rows
            tried, settled.left_out = leaving.leave_out(probes, whole, log)
            if settled.left_out:  # (its steps were at the split with the device)
                settled.split_steps, settled.last_move = [], None
                shards = list(probes.split.shards)
        info["auto_powers"] = {
            "devices": names,
            "images_per_second": rates,
            "probe_examples": probe,
            "shards_alone": alone,
            "probe_resplits": settled.resplits,
            "left_out": tried,
            "powers": [s / min(s for s in shards if s > 0) for s in shards],
        }
        return info, settled

    def rebalancing(self, every: int, log, probe=None):
        """What re-splits the batch from the step times (`balance.Rebalancing`); None
        when the steps are not timed."""
        probes = self.probes
        if not probes.timed:
            return None
        rebalancing = balance.Rebalancing(probes, every, log)
        if probe:
            rebalancing.carry_over(probe)
        return rebalancing


class WorkerBalancer(DeviceBalancer):
    """Measures and sets the split over the workers of a cluster (mode multiworker)."""

    def set_up(self, config, train_data, log, measure=True):
        """The workers agree on the training data (the first place the trainer sees it);
        the simulated slowdown is calibrated; `--powers=auto`: every worker measures
        itself and all get the same split."""
        probes = self.probes
        probes.exchange.agree([training_data(config, train_data)])
        info = {"simulated_slowdown": None, "auto_powers": None, "measured_max_rows": None}
        factors = parse_slowdown(config.simulate_slowdown)
        measure = measure and config.powers == AUTO
        if not factors and not measure:
            return info, None
        probe = max(1, probes.split.global_batch_size // len(probes.workers))
        if probes.split.max_rows:  # each worker alone within its cap
            probe = min(probe, min(c for c in probes.split.max_rows if c > 0))
        probe = timing_examples(train_data, probe, log)
        if factors:
            slowed = probes.calibrate_slowdown(probe, factors)
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
        auto = probes.measure_powers(probe)
        rates = ", ".join(
            f"{w} {r:.0f}" for w, r in zip(auto["devices"], auto["images_per_second"])
        )
        log(f"auto powers: measured images/sec {rates}; powers {auto['powers']}")
        info["auto_powers"] = auto
        return info, None


def timing_examples(train_data, count: int, log):
    """`count` examples of the training data to time the devices on (said in a line where
    that reads a pipeline ahead: `Stream.examples_to_time`)."""
    return train_data.examples_to_time(count, log)


def training_data(config, data) -> Agreed:
    """The training data, for `agree`, named by the setting that chose it."""
    field, value = "dataset", config.dataset
    if config.dataset == "mnist" and (config.mnist_dir or config.data_dir):
        field = "mnist_dir" if config.mnist_dir else "data_dir"
        value = getattr(config, field)
    text, leaves = data.identity()
    return Agreed(
        field,
        value,
        f"{text} digest {arrays_digest(leaves)}",
        differs="the training data differs between workers",
        needs="every worker must read the same data",
    )
