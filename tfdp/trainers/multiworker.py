"""Multi-worker training: one process per worker of the cluster in TF_CONFIG.

Every worker runs `tf.distribute.MultiWorkerMirroredStrategy`: one replica
on its CPU (MultiWorkerMirroredStrategy does not use logical CPUs), or one
per local GPU. Per step:
  1. the global batch is split over the workers by `--powers` (or equally);
     each worker reads the same stream of global batches with a plain tf.data
     iterator and cuts its own slice on the host, by the split of that step
     (so the split can change between steps), then one piece per local
     replica;
  2. each replica runs the model's own train_step on its shard, its loss weighed
     by the shard's examples (`steps.DeviceWork`, shards.py);
  3. the optimizer sums the gradients with a collective all-reduce over all
     workers and applies one update (the model's optimizer's) on every worker.
So the update is the one `single` makes on the whole batch. The metrics are
sync-on-read variables: read after the step, they hold the whole cluster's batch.

Rebalancing (`--rebalance_every`): each worker times its own train_step
(`steps.DeviceWork`); the seconds ride with the stop signals in one
all-reduce, so every worker holds every worker's time, runs the same
`balance.Rebalancing` on it and sets the same new split.

Before any collective of training, the workers agree (`exchange.Cluster.agree`): on every
setting that fixes the update and on the initial weights when the trainer is
made (before a restore), on the training data in `split.WorkerSplit.set_up`, the first
place the trainer sees it. A difference stops every worker with ConfigError.

Only the chief (task `chief`, else `worker:0`) writes the model directory;
the cluster itself (TF_CONFIG, joining, failures) is tfdp/cluster.py.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import tensorflow as tf

from tfdp import shards as shards_lib
from tfdp.checkpoints import Checkpointer
from tfdp.cluster import (
    Agreed,
    arrays_digest,
    find_cluster,
    join_cluster,
    settings_to_agree,
)
from tfdp.devices import AUTO, split_batch
from tfdp.errors import ConfigError
from tfdp.exchange import Cluster
from tfdp.replicas import Placement
from tfdp.signals import SIGNALS
from tfdp.split import WorkerSplit
from tfdp.steps import DeviceWork, cut, with_metrics
from tfdp.trainers.base import Trainer


def replica_logs(strategy, model, logs, held):
    """A step's logs from its replicas': the model's metrics read across the replicas
    (the whole batch's), its other logs the mean over the replicas that held examples
    (Keras' fit takes the mean over all of them)."""
    weights = [tf.cast(h, tf.float32) for h in strategy.experimental_local_results(held)]
    count = tf.maximum(tf.add_n(weights), 1.0)

    def mean(value):
        values = strategy.experimental_local_results(value)
        summed = tf.add_n([tf.cast(v, tf.float32) * w for v, w in zip(values, weights)])
        return tf.cast(summed / count, values[0].dtype)

    return with_metrics(model, tf.nest.map_structure(mean, logs))


class MultiWorkerTrainer(Trainer):
    """This worker's part of synchronous training over the whole cluster."""

    unit = "worker(s)"
    Split = WorkerSplit

    def __init__(self, strategy, cluster, model, shards, config, jit_compile=False):
        """
        Args:
          strategy: from `join_cluster`.
          cluster: from `find_cluster`.
          model: the compiled, built Keras model (any kind), the same on every worker:
            trained in place, its variables made again in the strategy's scope.
          shards: examples per worker; they sum to the global batch.
          config: the run's settings; they must be the same on every worker.
          jit_compile: each piece's forward and backward pass is one XLA program.
        """
        import tensorflow as tf

        self.tf = tf
        self.strategy = strategy
        self.workers = list(cluster.workers)
        self.devices = self.workers  # the batch is split over the workers
        self.index = cluster.index
        self.is_chief = cluster.is_chief
        self.shards = list(shards)
        self.global_batch_size = sum(shards)
        self.local_replicas = len(strategy.extended.worker_devices)
        self.exchange = Cluster(strategy, self.workers, self.index)
        # --rebalance_every or a simulated slowdown: each step times this worker
        slowdown = bool(config.simulate_slowdown)
        self.timed = bool(config.rebalance_every) or slowdown
        self.balanced = self.timed or config.powers == AUTO  # the split is saved with a checkpoint
        with tf.device("/cpu:0"):  # the batch is cut on the host
            self.shard_sizes = tf.Variable(self.shards, dtype=tf.int32, trainable=False)
        self.delay = tf.Variable(0.0, dtype=tf.float64, trainable=False) if slowdown else None
        weights = model.get_weights()  # as the user's script made them, before a restore
        self.model = model
        self.placement = Placement(model, strategy=strategy)
        self.placement.enter()
        self.optimizer = model.optimizer
        self.jit_compile = jit_compile
        self.work = DeviceWork(model, 1, jit_compile, self.timed, may_be_empty=True)
        self.probe = DeviceWork(model, 1, jit_compile, True, may_be_empty=True)
        self.compile()
        self._gather = None  # arrays: indices -> their examples (`distribute_indices`)
        self.config = config
        self.exchange.agree([*settings_to_agree(config), initial_weights(config, weights)])

    def distribute(self, dataset):
        """The iterator `train_step` reads: every global batch whole. The step cuts this
        worker's slice (`_own_shards`); the batch's size is the divisor of the loss (an
        epoch's last batch may be partial, and is then split by `steps.partial_shards`).

        A plain tf.data iterator on the host, as the other modes read theirs, not
        tf.distribute's: the per-device iterators of `distribute_datasets_from_function`
        run tf.data's autotuning whatever the dataset's options say, and deleting one
        at the end of a run could wait over a second for its background thread
        (BUILD_NOTES, "How shares are fed").
        """
        self._gather = None
        return iter(dataset)

    def distribute_indices(self, indices, gather):
        """Arrays: the iterator of every global batch's example indices; the step gathers
        only this worker's slice of them (`gather`), so a worker reads its share of each
        batch's examples, not the whole batch."""
        from tfdp.data import prefetched

        self._gather = gather
        return iter(prefetched(indices))

    @property
    def worker_batch(self) -> int:
        """This worker's examples of a full global batch, at the current split."""
        return self.shards[self.index]

    def train_step(self, iterator, steps: int = 1):
        """`steps` updates on the next global batches; returns their logs (over the whole
        cluster's batch) and the workers' seconds (None: the data had ended)."""
        outputs = super().train_step(iterator, steps)
        if outputs is not None:
            self.exchange.saw_step(outputs.pop("signals"))
        return outputs

    def _step(self, batch):
        from tfdp.steps import num_examples

        # `batch`: a global batch, or its example indices (arrays)
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        shards = self._own_shards(batch, examples)
        with shards_lib.handing_over(self.model):
            logs, held, sent = self.strategy.run(self._replica_step, args=(shards, examples))
        # The stop signals and each worker's seconds travel in one all-reduce.
        sent = self.strategy.reduce("SUM", sent, axis=None)
        signals = len(SIGNALS)
        return {
            "logs": replica_logs(self.strategy, self.model, logs, held),
            "signals": sent[:signals],
            "device_seconds": sent[signals:],
        }

    def _own_shards(self, batch, examples):
        """This worker's slice of the whole global `batch` by the split of this step
        (`steps.shard_sizes_for`), cut near-equally over its local replicas: one
        value per local replica."""
        from tfdp.steps import cut, shard_sizes_for

        tf = self.tf
        sizes = shard_sizes_for(examples, self.global_batch_size, self.shard_sizes)
        begin, size = tf.reduce_sum(sizes[: self.index]), sizes[self.index]
        own = tf.nest.map_structure(lambda t: t[begin : begin + size], batch)
        if self._gather is not None:  # indices: read this worker's examples only
            own = self._gather(own)
        replicas = self.local_replicas
        pieces = [own] if replicas == 1 else cut(own, replicas)
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: pieces[context.replica_id_in_sync_group % replicas]
        )

    def _replica_step(self, batch, examples):
        from tfdp.steps import clip_before_all_reduce

        tf = self.tf
        logs, gradients, held, seconds = self.work.train_either(batch, examples, self.delay)
        if gradients:  # (a model without trainable weights has nothing to update)
            gradients = clip_before_all_reduce(self.optimizer, gradients)
            # Inside a replica, the optimizer all-reduces (sums) the gradients over all workers.
            self.optimizer.apply_gradients(zip(gradients, self.work.variables))
        # this worker's seconds at its place (the mean over its local replicas)
        own = tf.one_hot(self.index, len(self.workers), dtype=tf.float64) * seconds
        own = own / self.local_replicas
        sent = [tf.cast(self.exchange.signals_caught, tf.float64), own]
        return logs, held, tf.concat(sent, 0)

    def _test(self, batch):
        """The model's test_step on this worker's slice of an evaluation batch (split as a
        training batch is); the metrics add up every worker's."""
        from tfdp.steps import num_examples

        examples = num_examples(batch)
        saved, self._gather = self._gather, None  # evaluation batches are examples
        try:
            shards = self._own_shards(batch, examples)
        finally:
            self._gather = saved
        logs, held = self.strategy.run(
            lambda shard: (self.work.test(shard, examples), num_examples(shard) > 0),
            args=(shards,),
        )
        return replica_logs(self.strategy, self.model, logs, held)

    def seconds_alone(self, batch, min_seconds: float = 0.5, min_steps: int = 5) -> float:
        """This worker's seconds for its train_step without the update (no all-reduce) on
        `batch`, after tracing and a warm-up step: at least `min_steps` calls and
        `min_seconds`; the model's state as it was before."""
        from tfdp.steps import num_examples

        tf = self.tf
        examples = num_examples(batch)

        def work(shard):
            gradients = self.probe.train(shard, examples)[1]
            # a value that needs every gradient, so none is pruned away
            return tf.add_n([tf.reduce_sum(g) for g in gradients])

        @tf.function(autograph=False)
        def step():
            replicas = self.local_replicas
            pieces = [batch] if replicas == 1 else cut(batch, replicas)
            shards = self.strategy.experimental_distribute_values_from_function(
                lambda context: pieces[context.replica_id_in_sync_group % replicas]
            )
            with shards_lib.handing_over(self.model):
                return self.strategy.experimental_local_results(
                    self.strategy.run(work, args=(shards,))
                )

        with self.untouched():
            for _ in range(2):  # tracing, then a warm step
                [t.numpy() for t in step()]
            steps, start = 0, time.perf_counter()
            while steps < min_steps or time.perf_counter() - start < min_seconds:
                [t.numpy() for t in step()]
                steps += 1
        return (time.perf_counter() - start) / steps

    def measure_powers(self, batch) -> dict:
        """`--powers=auto`: each worker's examples/second; re-splits the global batch by them.

        Every worker times itself (`seconds_alone`) on `batch`, a probe shard of
        global_batch / workers examples. The rates are exchanged with `gather`,
        so every worker computes the same partition.
        """
        from tfdp.steps import num_examples

        rates = self.exchange.gather(int(num_examples(batch)) / self.seconds_alone(batch))
        powers = [round(r / max(rates), 4) for r in rates]
        self.set_shards(split_batch(self.global_batch_size, powers))
        return {"devices": self.workers, "images_per_second": rates, "powers": powers}

    def calibrate_slowdown(self, batch, factors: dict) -> dict:
        """`--simulate_slowdown=worker:I=F`: worker I alone becomes F times slower, by a
        sleep per example after its backward pass. Each worker times itself; every
        worker gets every worker's sleep, for the log. Returns the slowed workers'."""
        from tfdp.steps import num_examples

        factor = factors.get(self.workers[self.index], 1.0)
        own = 0.0
        if factor != 1:
            own = (factor - 1) * self.seconds_alone(batch) / int(num_examples(batch))
        self.delay.assign(own)
        delays = self.exchange.gather(own)
        return {
            worker: {"factor": factors[worker], "sleep_seconds_per_example": delay}
            for worker, delay in zip(self.workers, delays)
            if worker in factors
        }

    def checkpointer(self, config):
        return WorkerCheckpointer(config, self)

    def result_info(self) -> dict:
        """This worker's entries in the result."""
        return {
            "chains": self.chains,
            "worker": self.workers[self.index],
            "chief": self.is_chief,
            "worker_batch": self.worker_batch,
        }


class WorkerCheckpointer(Checkpointer):
    """Checkpoints in a cluster: all workers save, only the chief keeps its files.

    Saving may take part in collectives, so every worker saves; the others
    write to a fresh temporary directory and delete it at once, as
    TensorFlow's multi-worker guide recommends. Every worker restores from
    the chief's directory, so all of them must be able to read `model_dir`.
    """

    def restore(self, log=print) -> int:
        step = super().restore(log)
        steps = [int(s) for s in self.trainer.exchange.gather(step)]
        if len(set(steps)) > 1:
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"the workers found different checkpoints to resume from (steps {steps}); "
                "every worker must read the chief's model_dir (one path on a shared filesystem)",
            )
        return step

    def save(self, step: int) -> str:
        """The path of the run's checkpoint of `step`: the one the chief writes."""
        if self.trainer.is_chief:
            return super().save(step)
        import tensorflow as tf

        self.step.assign(step)
        scratch = tempfile.mkdtemp(prefix=f"tfdp-{self.trainer.workers[self.trainer.index]}-")
        try:
            tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.saved_path = self.path(step)
        return self.saved_path


def build(config, shards, model, jit_compile=False) -> MultiWorkerTrainer:
    """The trainer of `trainers.build_trainer` for mode multiworker."""
    return MultiWorkerTrainer(
        join_cluster(config), find_cluster(config), model, shards, config, jit_compile
    )


def initial_weights(config, weights) -> Agreed:
    """The initial weights, for `agree`: a model function must not depend on the worker."""
    return Agreed(
        "model",
        config.model,
        f"{len(weights)} arrays, digest {arrays_digest(weights)}",
        differs="its initial weights differ between workers",
        needs="every worker must start from the same weights (seed them the same everywhere)",
    )
