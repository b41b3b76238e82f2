"""What the training loop asks of a trainer, and what the trainers share.

A trainer is one mode: it owns the model copies, the optimizer and the
split of each global batch over its devices (or workers). The loop
(`training.run`) calls only what this class declares; it never asks which
mode it runs, so adding a mode means adding a trainer.
"""

from __future__ import annotations

from tfdp.exchange import LOCAL
from tfdp.split import DeviceSplit


class Trainer:
    """The interface of every mode, with the defaults of a single process.

    Attributes a trainer sets:
      devices: what the batch is split over (device names, or worker names).
      shards: examples of a full global batch on each, in order.
      global_batch_size: examples per step over all of them.
      model, optimizer: the master copy and its compiled optimizer.
      objective: the compiled loss per shard and the metrics.
      chains: side-by-side parts each device cuts its shard into.
      exchange: what the processes of the run tell each other (`exchange.Local`,
        or `exchange.Cluster` in a cluster).
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
    Split = DeviceSplit  # what splits the batch before training (split.py)
    exchange = LOCAL  # what this process tells the others of its run (exchange.py)

    # --- the step (each trainer implements these)

    host_iterator = True  # `distribute` gives a tf.data iterator (its position can be saved)

    def distribute(self, dataset):
        """The iterator `train_step` reads, from a dataset of global batches."""
        raise NotImplementedError

    def distribute_indices(self, indices, gather):
        """The iterator `train_step` reads, from a dataset of global batches of example
        indices into arrays, and `gather` (indices -> their batch). Trainers that read a
        whole global batch gather it here; multiworker gathers only its worker's slice."""
        from tfdp.data import prefetched

        return self.distribute(prefetched(indices.map(gather)))

    def train_step(self, iterator) -> dict:
        """One update on the next global batch. Returns tensors: `loss` (the global
        batch's), `batch` (or `batches`, per shard), `predictions` (per shard) and,
        where devices are timed, `device_seconds`."""
        raise NotImplementedError

    in_step = {}  # name -> fn(outputs): computed inside every compiled step (`compute_in_step`)

    def compute_in_step(self, name: str, fn) -> bool:
        """Has every following step compute `fn(outputs)` inside its compiled call, from
        the step's outputs over the global batch, returned as `outputs[name]`: one call
        per step instead of a second one from the host. Call it before the first step
        (the step is traced once). False where a step's outputs are not the whole
        global batch's (a cluster's, `global_outputs`): compute it from those instead."""
        if self._train_step.experimental_get_tracing_count():
            raise RuntimeError(f"compute_in_step({name!r}) after the step was traced")
        self.in_step = {**self.in_step, name: fn}
        return True

    def _with_in_step(self, outputs: dict) -> dict:
        """A step's outputs, with what `compute_in_step` asked of it (in the step's graph)."""
        for name, fn in self.in_step.items():
            outputs[name] = fn(outputs)
        return outputs

    def predict(self, batch):
        """(summed compiled loss, predictions) of an evaluation batch."""
        raise NotImplementedError

    def get_weights(self) -> list:
        return self.model.get_weights()

    def set_weights(self, weights) -> None:
        raise NotImplementedError

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

    # --- files and the cluster

    def checkpointer(self, config):
        """What saves and restores this trainer in `config.model_dir`."""
        from tfdp.checkpoints import Checkpointer

        return Checkpointer(config, self)

    def result_info(self) -> dict:
        """This trainer's own entries in the result."""
        return {"chains": self.chains}
