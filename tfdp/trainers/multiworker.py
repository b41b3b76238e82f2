"""Multi-worker training: one process per worker of the cluster in TF_CONFIG.

Every worker runs `tf.distribute.MultiWorkerMirroredStrategy`: one replica
on its CPU (MultiWorkerMirroredStrategy does not use logical CPUs), or one
per local GPU. Per step:
  1. the global batch is split over the workers by `--powers` (or equally);
     each worker reads the same stream of global batches and keeps its own
     slice, fed through `distribute_datasets_from_function`;
  2. each replica runs forward and backward on its shard, with the loss
     divided by the global batch;
  3. the optimizer sums the gradients with a collective all-reduce over all
     workers and applies one update (the compiled optimizer's) on every worker.
So the update is the one `single` makes on the whole batch.

Before any collective of training, the workers agree (`agree`): on every
setting that fixes the update and on the initial weights when the trainer is
made (before a restore), on the training data in `set_up_split`, the first
place the trainer sees it. A difference stops every worker with ConfigError.

Only the chief (task `chief`, else `worker:0`) writes the model directory;
the cluster itself (TF_CONFIG, joining, failures) is tfdp/cluster.py.
"""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np

from tfdp import data as data_lib
from tfdp.checkpoints import Checkpointer
from tfdp.cluster import (
    Agreed,
    arrays_digest,
    digest,
    disagreement,
    first_difference,
    join_cluster,
    read_cluster,
    settings_to_agree,
)
from tfdp.devices import split_batch
from tfdp.errors import ConfigError
from tfdp.signals import SIGNALS
from tfdp.trainers.base import Trainer


class MultiWorkerTrainer(Trainer):
    """This worker's part of synchronous training over the whole cluster."""

    unit = "worker(s)"
    timed = False  # the split across workers is set once

    def __init__(self, strategy, cluster, spec, shards, config):
        """
        Args:
          strategy: from `join_cluster`.
          cluster: from `read_cluster`.
          spec: the model (`models.ModelSpec`); its factory is called in the
            strategy's scope; its weights must be the same on every worker.
          shards: examples per worker; they sum to the global batch.
          config: the run's settings; they must be the same on every worker.
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
        self.spec = spec
        self.objective = spec.objective
        self.worker_batch = None  # examples per step this worker's input yields, once distributed
        # which of SIGNALS this worker caught, sent with the next step's loss (agree_to_stop)
        self.signals_caught = tf.Variable([0.0] * len(SIGNALS), trainable=False)
        self.signals_seen = tf.zeros(len(SIGNALS))
        with strategy.scope():
            self.model = spec.make()
            self.model.set_weights(spec.weights)
            self.optimizer = self.model.optimizer
            self.optimizer.build(self.model.trainable_variables)
        self._train_step = tf.function(self._step)
        self._predict_step = tf.function(self._predict, reduce_retracing=True)
        self._sum = tf.function(lambda values: strategy.reduce("SUM", values, axis=None))
        self._all_gather = tf.function(self._gather_slices, reduce_retracing=True)
        self.config = config
        self.agree([*settings_to_agree(config), initial_weights(config, spec.weights)])

    def distribute(self, dataset):
        """The iterator `train_step` reads: this worker's slice of every global batch, with
        the global batch's size (the divisor of the loss; an epoch's last batch may be
        partial, and is then split by `steps.partial_shards`)."""
        from tfdp.objective import num_examples
        from tfdp.steps import shard_sizes_for

        shards, replicas, tf = self.shards, self.local_replicas, self.tf
        global_batch = self.global_batch_size

        def worker_dataset(context):
            worker = context.input_pipeline_id

            def own_slice(*batch):
                batch = batch if len(batch) > 1 else batch[0]
                examples = num_examples(batch)
                sizes = shard_sizes_for(examples, global_batch, shards)
                begin, size = tf.reduce_sum(sizes[:worker]), sizes[worker]
                return tf.nest.map_structure(lambda t: t[begin : begin + size], batch), examples

            own = dataset.map(own_slice)
            # what this worker's input yields (None: it varies at the end of an epoch)
            self.worker_batch = tf.nest.flatten(own.element_spec)[0].shape[0] or shards[worker]
            return own if replicas == 1 else _per_replica(own, replicas)

        return iter(self.strategy.distribute_datasets_from_function(worker_dataset))

    def train_step(self, iterator):
        """One update on the next global batch; returns the loss summed over the cluster
        and this worker's outputs."""
        metrics = self._train_step(iterator)
        self.signals_seen = metrics.pop("signals")
        return metrics

    def _step(self, iterator):
        batch, examples = next(iterator)
        loss, predictions = self.strategy.run(self._replica_step, args=(batch, examples))
        # The loss and the stop signals travel in one all-reduce.
        summed = self.strategy.reduce("SUM", loss, axis=None)
        local = self.strategy.experimental_local_results
        return {
            "loss": summed[0],
            "signals": summed[1:],
            "batches": local(batch),
            "predictions": local(predictions),
        }

    def _replica_step(self, batch, examples):
        from tfdp.steps import clip_before_all_reduce, replica_gradients

        gradients, loss, predictions = replica_gradients(
            self.model, self.objective, batch, examples, jit_compile=self.spec.jit_compile
        )
        gradients = clip_before_all_reduce(self.optimizer, gradients)
        # Inside a replica, the optimizer all-reduces (sums) the gradients over all workers.
        self.optimizer.apply_gradients(zip(gradients, self.model.trainable_variables))
        return self.tf.concat([[loss], self.signals_caught], 0), predictions

    def global_outputs(self, metrics) -> dict:
        """A step's `metrics` with every worker's slices of the batch and outputs joined
        in worker order: the global batch's (one all-gather; every worker must call it
        on the same steps, as the loop does on logged steps)."""
        from tfdp.objective import concat

        joined = self._all_gather((concat(metrics["batches"]), concat(metrics["predictions"])))
        batch, predictions = joined
        return {**metrics, "batches": (batch,), "predictions": (predictions,)}

    def _gather_slices(self, local):
        # One replica per worker on CPUs; with several local GPUs, the first local
        # replica carries the worker's slice and the others an empty one.
        def value(context):
            first = context.replica_id_in_sync_group % self.local_replicas == 0
            return self.tf.nest.map_structure(lambda t: t if first else t[:0], local)

        per_replica = self.strategy.experimental_distribute_values_from_function(value)
        return self.tf.nest.map_structure(lambda v: self.strategy.gather(v, axis=0), per_replica)

    def predict(self, batch):
        """The outputs and summed loss of an evaluation batch, computed by this worker
        alone (every worker holds the same weights, and reads the same answer)."""
        return self._predict_step(batch)

    def _predict(self, batch):
        return self.objective.summed_loss(self.model, batch)

    def gather(self, value: float) -> list[float]:
        """Every worker's `value`, in worker order, on every worker: one all-reduce."""
        return self.exchange([value])[:, 0].tolist()

    def exchange(self, vector) -> np.ndarray:
        """Every worker's `vector` (as long on every worker) as rows in worker order, on
        every worker: one all-reduce of a matrix that is zero outside this worker's row."""
        rows = np.zeros((len(self.workers), len(vector)))
        rows[self.index] = vector

        def contribution(context):
            first_local = context.replica_id_in_sync_group % self.local_replicas == 0
            return self.tf.constant(rows if first_local else 0 * rows, self.tf.float64)

        values = self.strategy.experimental_distribute_values_from_function(contribution)
        return self._sum(values).numpy()

    def exchange_text(self, text: str) -> list[str]:
        """Every worker's `text`, in worker order: their lengths, then their bytes."""
        data = text.encode()
        lengths = [int(n) for n in self.gather(len(data))]
        rows = self.exchange(list(data.ljust(max(lengths), b"\0")))
        return [bytes(int(b) for b in row[:n]).decode() for row, n in zip(rows, lengths)]

    def agree(self, items: list[Agreed]) -> None:
        """Raises ConfigError on every worker, naming the first of `items` that differs
        between the workers and each worker's copy. One all-reduce of digests (48 bits:
        exact in float64); two more for the texts of a difference."""
        rows = self.exchange([digest(item.text) for item in items])
        differing = first_difference(rows.tolist())
        if differing is not None:
            item = items[differing]
            raise disagreement(item, self.workers, self.exchange_text(item.text))

    def measure_powers(self, batch, min_seconds: float = 0.5, min_steps: int = 5) -> dict:
        """`--powers=auto`: each worker's examples/second; re-splits the global batch by them.

        Every worker times forward and backward (no all-reduce) on `batch`, a
        probe shard of global_batch / workers examples, after tracing and a
        warm-up step, on a local model copy. The rates are exchanged with
        `gather`, so every worker computes the same partition.
        """
        from tfdp.objective import num_examples
        from tfdp.steps import replica_gradients

        tf = self.tf
        probe = int(num_examples(batch))
        model = self.spec.make()
        model.set_weights(self.spec.weights)
        step = tf.function(
            lambda: replica_gradients(model, self.objective, batch, self.global_batch_size)[0][-1]
        )
        for _ in range(2):  # tracing, then a warm step
            step().numpy()
        steps, start = 0, time.perf_counter()
        while steps < min_steps or time.perf_counter() - start < min_seconds:
            step().numpy()
            steps += 1
        rate = probe * steps / (time.perf_counter() - start)
        rates = self.gather(rate)
        powers = [round(r / max(rates), 4) for r in rates]
        self.shards = split_batch(self.global_batch_size, powers)
        return {"devices": self.workers, "images_per_second": rates, "powers": powers}

    def set_up_split(self, config, train_data, log, measure=True):
        """The workers agree on the training data (the first place the trainer sees it);
        `--powers=auto`: every worker measures itself and all get the same split."""
        from tfdp.devices import AUTO

        self.agree([training_data(config, train_data)])
        info = {"simulated_slowdown": None, "auto_powers": None}
        if not measure or config.powers != AUTO:
            return info, None
        probe = max(1, self.global_batch_size // len(self.workers))
        auto = self.measure_powers(data_lib.first_examples(train_data, probe))
        rates = ", ".join(
            f"{w} {r:.0f}" for w, r in zip(auto["devices"], auto["images_per_second"])
        )
        log(f"auto powers: measured images/sec {rates}; powers {auto['powers']}")
        info["auto_powers"] = auto
        return info, None

    def rebalancing(self, every, log, probe=None):
        """None: the split across workers is set once (the step is not timed)."""
        return None

    def checkpointer(self, config):
        return WorkerCheckpointer(config, self)

    def agree_to_stop(self, signum: int) -> int:
        """The signal a worker had caught when the last step started, or 0; the same on
        every worker, so that all of them stop after the same step and save it.

        This worker's `signum` rides with the next step's loss (`_step`): no
        collective of its own. A signal is so acted on one step after it came.
        """
        self.signals_caught.assign([float(signum == s) for s in SIGNALS])
        counts = self.signals_seen.numpy()
        return next((s for s, count in zip(SIGNALS, counts) if count > 0), 0)

    def finish(self) -> None:
        self.gather(0)  # a barrier: the workers leave together, after the chief's writes

    def result_info(self) -> dict:
        """This worker's entries in the result."""
        return {
            "chains": self.chains,
            "worker": self.workers[self.index],
            "chief": self.is_chief,
            "worker_batch": self.worker_batch,
        }

    def sync_copies(self):
        """Nothing to do: the all-reduce keeps every worker's variables equal."""

    def set_weights(self, weights) -> None:
        with self.strategy.scope():
            self.model.set_weights(weights)


def _per_replica(dataset, replicas):
    """Each (slice, examples) element cut into `replicas` near-equal consecutive pieces,
    one per local device, each with the global batch's size."""
    import tensorflow as tf

    from tfdp.objective import num_examples

    def pieces(batch, examples):
        n = num_examples(batch)
        sizes = n // replicas + tf.cast(tf.range(replicas) < n % replicas, tf.int32)
        bounds = tf.concat([[0], tf.cumsum(sizes)], 0)
        return tf.data.Dataset.range(replicas).map(
            lambda j: (
                tf.nest.map_structure(lambda t: t[bounds[j] : bounds[j + 1]], batch),
                examples,
            )
        )

    return dataset.flat_map(pieces)


class WorkerCheckpointer(Checkpointer):
    """Checkpoints in a cluster: all workers save, only the chief keeps its files.

    Saving may take part in collectives, so every worker saves; the others
    write to a fresh temporary directory and delete it at once, as
    TensorFlow's multi-worker guide recommends. Every worker restores from
    the chief's directory, so all of them must be able to read `model_dir`.
    """

    def restore(self, log=print) -> int:
        step = super().restore(log)
        steps = [int(s) for s in self.trainer.gather(step)]
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
        return self.path(step)


def build(config, shards, spec) -> MultiWorkerTrainer:
    """The trainer of `trainers.build_trainer` for mode multiworker."""
    return MultiWorkerTrainer(join_cluster(config), read_cluster(), spec, shards, config)


def initial_weights(config, weights) -> Agreed:
    """The initial weights, for `agree`: a model function must not depend on the worker."""
    return Agreed(
        "model",
        config.model,
        f"{len(weights)} arrays, digest {arrays_digest(weights)}",
        differs="its initial weights differ between workers",
        needs="every worker must start from the same weights (seed them the same everywhere)",
    )


def training_data(config, data) -> Agreed:
    """The training data, for `agree`, named by the setting that chose it."""
    import tensorflow as tf

    field, value = "dataset", config.dataset
    if config.dataset == "mnist" and (config.mnist_dir or config.data_dir):
        field = "mnist_dir" if config.mnist_dir else "data_dir"
        value = getattr(config, field)
    leaves = [data.images, data.labels] if isinstance(data, data_lib.Arrays) else data
    return Agreed(
        field,
        value,
        f"{data_lib.size(data)} examples, digest {arrays_digest(tf.nest.flatten(leaves))}",
        differs="the training data differs between workers",
        needs="every worker must read the same data",
    )
