"""Modes mirrored and weighted on one machine: the model's own steps under tfdp's strategy.

The model's variables are made again in the scope of a `tfdp.MirroredStrategy`
(`replicas.Placement`) whose replicas take the run's shares of each global batch
(even in mode mirrored). A step is Keras' own: `strategy.run(model.train_step)` on
each replica's piece. The strategy weighs each piece's loss by its share, sums the
gradients (all-reduce, or on device 0 and back: the tutorial's reduction) in the
model's optimizer, combines moving statistics by share, and reads the logs as the
whole batch gives them; what the model's step does with `training=False`, its own
trackers or its optimizer is what Keras does with it.

Each global batch is cut on the host (the run's split, `shard_sizes_for`), so its
input position can be saved.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.replicas import Placement
from tfdp.steps import DeviceWork, num_examples, shard_sizes_for, split
from tfdp.strategy import MirroredStrategy
from tfdp.trainers.base import Trainer


def cross_device_ops_for(all_reduce: str, devices):
    """The cross-device ops for `all_reduce`; None lets MirroredStrategy choose.

    auto is MirroredStrategy's own choice: ring all-reduce with collective ops
    on CPUs, NCCL on GPUs, reduction to one device for a CPU+GPU mix.
    """
    if all_reduce == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
    if all_reduce == "nccl":
        return tf.distribute.NcclAllReduce()
    return None  # auto


def local_strategy(devices, shards, reduce="allreduce", all_reduce="auto") -> MirroredStrategy:
    """tfdp's strategy over `devices` of this machine, cutting batches by `shards`.

    reduce: "allreduce", or "device0" (the gradients summed on device 0 and sent back).
    all_reduce: with reduce="allreduce", see `cross_device_ops_for`.
    """
    cross_device_ops = None if reduce == "device0" else cross_device_ops_for(all_reduce, devices)
    # The shares cut a dataset (input "dataset"); a batch smaller than the devices
    # leaves a replica none, which even shares give too.
    powers = list(shards) if min(shards) > 0 else None
    return MirroredStrategy(list(devices), powers=powers, reduce=reduce, cross_device_ops=cross_device_ops)


class KerasStepTrainer(Trainer):
    """Synchronous replicas of one Keras model, each running the model's own step on its
    piece of every global batch."""

    def __init__(
        self,
        model,
        strategy,
        devices,
        shards,
        input="split",
        balanced=False,
        slowdown=False,
        timed=True,
        jit_compile=False,
    ):
        """
        Args:
          model: a compiled, built Keras model (any kind): it is trained in place, its
            variables mirrored over the strategy's replicas while the trainer is open.
          strategy: tfdp's strategy of the mode (`local_strategy`, or a
            `tfdp.MultiWorkerMirroredStrategy`).
          devices: what the batch is split over: the devices of one machine, one replica
            each, or the workers of a cluster.
          shards: examples of a full global batch on each of `devices`.
          input: "split": each global batch is cut on the host by `shards`; "dataset": the
            strategy cuts a dataset of global batches itself (its iterator cannot be saved).
          balanced: the split is the run's own (mode weighted): it may be measured,
            rebalanced and saved with a checkpoint.
          slowdown: build the simulated slowdown in (seconds set by `set_delays`).
          timed: read each replica's seconds in every step (auto powers, rebalancing).
          jit_compile: the model asks for XLA; the step is compiled with it where every
            replica is a GPU (one XLA program cannot span CPU devices).
        """
        self.devices = list(devices)
        self.shards = list(shards)
        self.global_batch_size = sum(shards)
        self.balanced = balanced
        self.timed = timed or slowdown
        self.input = input
        self.strategy = strategy
        self.strategy.warn_notes = False  # the run says them (`notes`)
        if self.timed:
            replicas = strategy.num_replicas_in_sync
            self.strategy.report_seconds([0.0] * replicas if slowdown else None)
        with tf.device("/cpu:0"):  # the batch is cut on the host
            self.shard_sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
        self.model = model
        self.placement = Placement(model, strategy=self.strategy)
        self.placement.enter()
        self.optimizer = model.optimizer
        self.jit_compile = bool(jit_compile and self.strategy.compiles_with_xla)
        self._notes = []
        if jit_compile and not self.jit_compile:
            self._notes.append(
                "jit_compile: the step runs without XLA: one XLA program cannot span the "
                f"devices {', '.join(strategy.extended.worker_devices)} and their all-reduce"
            )
        # probes time each replica's forward and backward pass without the update
        self.probe = DeviceWork(model, 1, False, True, may_be_empty=True)
        self._replicas_train = self._train_replicas
        if self.jit_compile and not model.run_eagerly:  # the replicas' step, one XLA program
            self._replicas_train = tf.function(self._train_replicas, jit_compile=True, autograph=False)
        self.compile()
        self._seconds_alone = tf.function(self._alone, autograph=False)
        self._seconds_together = tf.function(self._together, autograph=False)

    def describe(self) -> str:
        if not self.balanced:
            return ""
        if getattr(self.strategy, "reduce_to", None) == "device0":
            return "; gradients summed on device0 and sent back"
        return "; gradients summed by allreduce"

    def notes(self) -> list[str]:
        return [*self._notes, *self.strategy.notes]

    @property
    def host_iterator(self) -> bool:
        return self.input == "split"  # else tf.distribute's, which cannot be saved

    def distribute(self, dataset):
        """The iterator `train_step` reads."""
        if self.input == "split":
            return iter(dataset)
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    # --- the step: Keras' own, on every replica's piece

    def _step(self, batch):
        logs = self._replicas_train(self._pieces(batch))
        return {"logs": logs, "device_seconds": self._seconds()}

    def _seconds(self):
        """Each device's seconds in the step just run (zeros where not timed)."""
        if not self.timed:
            return tf.zeros([len(self.devices)], tf.float64)
        return self.strategy.last_seconds

    def _train_replicas(self, pieces):
        return self._first(self.strategy.run(self.model.train_step, args=(pieces,)))

    def _test(self, batch):
        logs = self.strategy.run(self.model.test_step, args=(self._pieces(batch),))
        return self._first(logs)

    def _pieces(self, batch):
        """A global batch on the host -> one piece per replica, of the run's split."""
        if self.input != "split":
            return batch  # the strategy's iterator cut it
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        return self._split(batch, sizes)

    def _split(self, batch, sizes):
        pieces = split(batch, sizes, len(self.devices))
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: pieces[context.replica_id_in_sync_group]
        )

    def _first(self, logs):
        """The step's logs: every replica holds the whole batch's (the strategy reads them so)."""
        return tf.nest.map_structure(
            lambda value: self.strategy.experimental_local_results(value)[0], logs
        )

    # --- the split and its measurement

    def set_shards(self, shards) -> None:
        if self.input != "split":
            raise ValueError("shards can only be set with input='split'")
        super().set_shards(shards)

    def set_delays(self, delays) -> None:
        """Simulated slowdown: seconds of sleep per example, per replica."""
        self.strategy.set_sleep_per_example(delays)

    def _delay(self):
        sleep = self.strategy.sleep_per_example
        if sleep is None:
            return None
        return tf.gather(sleep, tf.distribute.get_replica_context().replica_id_in_sync_group)

    def _together(self, batch):
        return self._timed(batch, tf.convert_to_tensor(self.shard_sizes))

    def _alone(self, batch, index):
        # The other replicas get empty pieces: the same program, no work.
        sizes = [0] * len(self.devices)
        sizes[index] = num_examples(batch)
        return self._timed(batch, tf.stack(sizes))[index]

    def _timed(self, batch, sizes):
        """Each replica's seconds for its train_step on its piece, without the update."""
        from tfdp import shards as shards_lib

        examples = num_examples(batch)

        def seconds(piece):
            return self.probe.train(piece, examples, self._delay())[3]

        with shards_lib.handing_over(self.model):
            per_replica = self.strategy.run(seconds, args=(self._split(batch, sizes),))
        return tf.stack(self.strategy.experimental_local_results(per_replica))
