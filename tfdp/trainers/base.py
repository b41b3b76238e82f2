"""What the training loop asks of a trainer, and what the trainers share.

A trainer is one mode: it owns the model copies, the optimizer and the
split of each global batch over its devices (or workers). The loop
(`training.run`) calls only what this class declares; it never asks which
mode it runs, so adding a mode means adding a trainer.
"""

from __future__ import annotations

from tfdp import balance
from tfdp import data as data_lib
from tfdp.devices import AUTO, parse_slowdown, short_name


class Trainer:
    """The interface of every mode, with the defaults of a single process.

    Attributes a trainer sets:
      devices: what the batch is split over (device names, or worker names).
      shards: examples of a full global batch on each, in order.
      global_batch_size: examples per step over all of them.
      model, optimizer: the master copy and its compiled optimizer.
      objective: the compiled loss per shard and the metrics.
      chains: side-by-side parts each device cuts its shard into.
      balanced: the split is the run's own (mode weighted): it may be measured,
        rebalanced, and saved with a checkpoint.
      timed: each step reads every device's seconds from the host clock; only
        when something reads them (auto powers, rebalancing, the simulated
        slowdown), since on a GPU the clock syncs the device with the host.
    """

    unit = "device(s)"  # what `devices` are, for the banner
    is_chief = True  # this process writes the run's files
    chains = 1
    balanced = False
    timed = True  # each step reads each device's seconds (`device_seconds`)

    # --- the step (each trainer implements these)

    def distribute(self, dataset):
        """The iterator `train_step` reads, from a dataset of global batches."""
        raise NotImplementedError

    def train_step(self, iterator) -> dict:
        """One update on the next global batch. Returns tensors: `loss` (the global
        batch's), `batch` (or `batches`, per shard), `predictions` (per shard) and,
        where devices are timed, `device_seconds`."""
        raise NotImplementedError

    def predict(self, batch):
        """(summed compiled loss, predictions) of an evaluation batch."""
        raise NotImplementedError

    def get_weights(self) -> list:
        return self.model.get_weights()

    def set_weights(self, weights) -> None:
        raise NotImplementedError

    def sync_copies(self) -> None:
        """After a restore: every copy holds the master's weights."""

    def global_outputs(self, metrics: dict) -> dict:
        """A step's outputs over the whole global batch (they already are, in one process)."""
        return metrics

    # --- the split

    def set_shards(self, shards) -> None:
        """Splits the following batches as `shards` (same global batch)."""
        if sum(shards) != self.global_batch_size or len(shards) != len(self.devices):
            raise ValueError(f"shards {shards} do not split {self.global_batch_size} examples")
        self.shards = list(shards)
        self.shard_sizes.assign(shards)

    def set_delays(self, delays) -> None:
        """Simulated slowdown: seconds of sleep per example, per device."""
        self.delays.assign(delays)

    def seconds_alone(self, batch, index: int) -> float:
        """Device `index`'s seconds for forward and backward on `batch`, the others idle."""
        return float(self._seconds_alone(batch, index))

    def seconds_together(self, batch):
        """Each device's seconds for forward and backward on its shard of the global
        batch, all devices at once as in a step, without an update."""
        return self._seconds_together(batch)

    def describe(self) -> str:
        """What the banner adds about this mode's reduction."""
        return ""

    def set_up_split(self, config, train_data, log, measure=True):
        """The simulated slowdown and auto powers, before training (`balance`): the
        slowdown is calibrated on each device alone; auto powers time each device
        alone, then all of them at once (`balance.settle_under_load`).

        With `measure` False, auto powers are not measured (a resumed run has its
        split). Returns what was set up, for the result, and the probe under load
        (None without auto powers), from which rebalancing carries on.
        """
        info = {"simulated_slowdown": None, "auto_powers": None}
        slowdown = parse_slowdown(config.simulate_slowdown)
        measure = measure and config.powers == AUTO
        if not slowdown and not measure:
            return info, None
        probe = max(1, self.global_batch_size // len(self.devices))  # an even share
        batch = data_lib.first_examples(train_data, probe)
        names = [short_name(d) for d in self.devices]
        if slowdown:
            factors = [slowdown.get(d, 1.0) for d in self.devices]
            delays = balance.calibrate_slowdown(self, batch, factors)
            slowed = [(n, f, d) for n, f, d in zip(names, factors, delays) if f != 1]
            info["simulated_slowdown"] = {
                name: {"factor": f, "sleep_seconds_per_example": d} for name, f, d in slowed
            }
            log(
                "SIMULATED SLOWDOWN (for testing; not this machine's speed): "
                + ", ".join(
                    f"{name} {f:g}x slower alone (sleeps {d * 1e3:.3f} ms per example)"
                    for name, f, d in slowed
                )
            )
        if not measure:
            return info, None
        rates = balance.measure_powers(self, batch)
        alone = balance.whole_shares(self.global_batch_size, rates)
        log(
            f"auto powers, each device alone on {probe} examples: "
            + ", ".join(f"{name} {r:.0f} images/s" for name, r in zip(names, rates))
            + f"; shares {alone}"
        )
        self.set_shards(alone)
        batch = data_lib.first_examples(train_data, self.global_batch_size)
        settled = balance.settle_under_load(self, batch, log)
        shards = list(self.shards)
        steps = balance.PROBE_WINDOW * balance.PROBE_WINDOWS
        log(
            f"auto powers, all devices at once on {self.global_batch_size} examples for "
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
        if not self.timed:
            return None
        rebalancing = balance.Rebalancing(self, every, log)
        if probe:
            rebalancing.carry_over(probe)
        return rebalancing

    # --- files and the cluster

    def checkpointer(self, config):
        """What saves and restores this trainer in `config.model_dir`."""
        from tfdp.checkpoints import Checkpointer

        return Checkpointer(config, self)

    def result_info(self) -> dict:
        """This trainer's own entries in the result."""
        return {"chains": self.chains}

    def agree_to_stop(self, signum: int) -> int:
        """The signal to stop on after this step (0: go on), given this process's
        (`signals.StopSignals`); in a cluster, every worker's answer is the same."""
        return signum

    def finish(self) -> None:
        """After the run's files are written."""
