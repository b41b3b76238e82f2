"""Multi-worker training: one process per worker of the cluster in TF_CONFIG.

Every worker runs `tfdp.MultiWorkerMirroredStrategy`: one replica on its CPU
(MultiWorkerMirroredStrategy does not use logical CPUs), or one per local GPU.
Per step:
  1. the global batch is split over the workers by `--powers` (or equally);
     each worker reads the same stream of global batches with a plain tf.data
     iterator and cuts its own slice on the host, by the split of that step
     (so the split can change between steps), then one piece per local
     replica;
  2. each replica runs the model's own step (`strategy.run(model.train_step)`, as
     in every mode: `trainer.Trainer`); the strategy weighs each
     piece's loss by its examples, the optimizer all-reduces the gradients over all
     workers and applies one update on every worker, and the logs are the whole
     cluster's batch's.
So the update is the one `single` makes on the whole batch.

Rebalancing (`--rebalance_every`): the strategy times each replica's step; the
seconds travel in the strategy's all-reduce, so every worker holds every worker's
time, runs the same `balance.Rebalancing` on it and sets the same new split. A
caught stop signal rides in the all-reduce that counts the batch's rows
(`send_along`): no collective of its own.

Before any collective of training, the workers agree (`exchange.Cluster.agree`): on every
setting that fixes the update and on the initial weights when the trainer is
made (before a restore), on the training data in `balancers.WorkerBalancer.set_up`, the first
place the trainer sees it. A difference stops every worker with ConfigError.

Only the chief (task `chief`, else `worker:0`) writes the model directory;
the cluster itself (TF_CONFIG, joining, failures) is tfdp/cluster/.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf

from tfdp.balance.balancers import WorkerBalancer
from tfdp.cluster.agreement import Agreed, arrays_digest, settings_to_agree
from tfdp.cluster.exchange import Cluster
from tfdp.cluster.spec import find_cluster
from tfdp.devices import AUTO, split_batch
from tfdp.engine import shards as shards_lib
from tfdp.engine.cluster_strategy import join_cluster
from tfdp.engine.pieces import cut_evenly, num_examples, piece_sizes
from tfdp.engine.trainer import Probes, Trainer


class WorkerProbes(Probes):
    """The probes of a worker (`Probes`), each worker timing itself and the cluster
    sharing the results (`exchange`), so that every worker sets the same split."""

    def __init__(self, trainer):
        super().__init__(trainer)
        self.workers, self.exchange = trainer.workers, trainer.exchange

    def own_seconds(self, batch, min_seconds: float = 0.5, min_steps: int = 5) -> float:
        """This worker's seconds for its train_step without the update (no all-reduce) on
        `batch`, after tracing and a warm-up step: at least `min_steps` calls and
        `min_seconds`; the model's state as it was before."""
        trainer, examples = self._trainer, num_examples(batch)

        def work(shard):
            gradients = self._work.train(shard, examples)[1]
            # a value that needs every gradient, so none is pruned away
            return tf.add_n([tf.reduce_sum(g) for g in gradients])

        @tf.function(autograph=False)
        def step():
            with shards_lib.handing_over(trainer.model):
                return trainer.strategy.experimental_local_results(
                    trainer.strategy.run_unweighed(work, args=(trainer.local_pieces(batch),))
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

        Every worker times itself (`own_seconds`) on `batch`, a probe shard of
        global_batch / workers examples. The rates are exchanged with `gather`,
        so every worker computes the same partition.
        """
        rates = self.exchange.gather(int(num_examples(batch)) / self.own_seconds(batch))
        powers = [round(r / max(rates), 4) for r in rates]
        self.split.set(
            split_batch(self.split.global_batch_size, powers, max_rows=self.split.max_rows)
        )
        return {"devices": self.workers, "images_per_second": rates, "powers": powers}

    def calibrate_slowdown(self, batch, factors: dict) -> dict:
        """`--simulate_slowdown=worker:I=F`: worker I alone becomes F times slower, by a
        sleep per example after its backward pass. Each worker times itself; every
        worker gets every worker's sleep, for the log. Returns the slowed workers'."""
        factor = factors.get(self.workers[self._trainer.index], 1.0)
        own = 0.0
        if factor != 1:
            own = (factor - 1) * self.own_seconds(batch) / int(num_examples(batch))
        delays = self.exchange.gather(own)
        self.set_delays(np.repeat(delays, self._trainer.local_replicas))  # per replica
        return {
            worker: {"factor": factors[worker], "sleep_seconds_per_example": delay}
            for worker, delay in zip(self.workers, delays)
            if worker in factors
        }


class MultiWorkerTrainer(Trainer):
    """This worker's part of synchronous training over the whole cluster."""

    unit = "worker(s)"
    _Balancer, _Probes = WorkerBalancer, WorkerProbes

    def __init__(self, strategy, cluster, model, shards, config, jit_compile=False,
                 max_rows=None, micro_steps=1):
        """
        Args:
          strategy: from `join_cluster`.
          cluster: from `find_cluster`.
          model: the compiled, built Keras model (any kind), the same on every worker:
            trained in place, its variables made again in the strategy's scope.
          shards: examples per worker; they sum to the global batch.
          config: the run's settings; they must be the same on every worker.
          jit_compile: the model asks for XLA (see `Trainer`).
          max_rows, micro_steps: each worker's cap, and the micro-steps of an update (see
            `Trainer`).
        """
        self.workers = list(cluster.workers)
        self.index = cluster.index
        self.local_replicas = strategy.local_replicas
        # --rebalance_every or a simulated slowdown: each step times this worker
        slowdown = bool(config.simulate_slowdown)
        timed = bool(config.rebalance_every) or slowdown
        weights = model.get_weights()  # as the user's script made them, before a restore
        super().__init__(
            model,
            strategy,
            self.workers,  # the batch is split over the workers
            shards,
            balanced=timed or config.powers == AUTO,  # the split is saved with a checkpoint
            slowdown=slowdown,
            timed=timed,
            jit_compile=jit_compile,
            max_rows=max_rows,
            micro_steps=micro_steps,
        )
        self.exchange = Cluster(strategy, self.workers, self.index, cluster.is_chief)
        strategy.send_along(self.exchange.signals_caught)
        self._gather = None  # arrays: indices -> their examples (`distribute`)
        self.config = config
        self.exchange.agree([*settings_to_agree(config), initial_weights(config, weights)])

    def distribute(self, dataset, gather=None, marked=False):
        """The iterator `train_step` reads (see `Trainer.distribute`): every global batch
        whole; the step cuts this worker's slice (`_pieces`), and with `gather` (a dataset
        of example indices into arrays) gathers only that slice's examples, so a worker
        reads its share of each batch, not the whole batch. The batch's size is the
        divisor of the loss (an epoch's last batch may be partial, and is then split by
        the same rule, engine/pieces.py's).

        A plain tf.data iterator on the host, as the other modes read theirs, not
        tf.distribute's: the per-device iterators of `distribute_datasets_from_function`
        run tf.data's autotuning whatever the dataset's options say, and deleting one
        at the end of a run could wait over a second for its background thread
        (BUILD_NOTES, "How shares are fed").
        """
        from tfdp.data.arrays import prefetched

        self._marked, self._gather = marked, gather
        return iter(prefetched(dataset) if gather is not None else dataset)

    @property
    def worker_batch(self) -> int:
        """This worker's examples of a full global batch, at the current split."""
        return self.split.shards[self.index]

    def train_step(self, iterator, steps: int = 1):
        """`steps` updates on the next global batches; returns their logs (over the whole
        cluster's batch) and the workers' seconds (None: the data had ended)."""
        outputs = super().train_step(iterator, steps)
        if outputs is not None:
            self.exchange.saw_step(outputs.pop("signals"))
        return outputs

    def _update(self, batch):
        # `batch`: a global batch, or its example indices (arrays)
        outputs = {**super()._update(batch), "signals": self.strategy.received}
        self._outputs_like = outputs
        return outputs

    def _seconds(self):
        """Each worker's seconds (the mean over its local replicas)."""
        seconds = super()._seconds()
        return tf.reduce_mean(tf.reshape(seconds, [len(self.workers), -1]), axis=1)

    def _test(self, batch):
        """The model's test_step on this worker's slice of an evaluation batch (split as a
        training batch is); the metrics add up every worker's."""
        saved, self._gather = self._gather, None  # evaluation batches are examples
        try:
            pieces = self._pieces(batch)
        finally:
            self._gather = saved
        return self._test_pieces(pieces)

    def _pieces(self, batch):
        """This worker's slice of the whole global `batch` by the split of this step
        (engine/pieces.py's rule), cut near-equally over its local replicas: one
        value per local replica."""
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        sizes = piece_sizes(examples, self.split.sizes)
        begin, size = tf.reduce_sum(sizes[: self.index]), sizes[self.index]
        own = tf.nest.map_structure(lambda t: t[begin : begin + size], batch)
        if self._gather is not None:  # indices: read this worker's examples only
            own = self._gather(own)
        return self.local_pieces(own)

    def local_pieces(self, own):
        """This worker's slice `own` cut near-equally over its local replicas."""
        replicas = self.local_replicas
        pieces = [own] if replicas == 1 else cut_evenly(own, replicas)
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: pieces[context.replica_id_in_sync_group % replicas]
        )

    def info(self) -> dict:
        """This worker's entries in the result (the all-reduce sums the gradients)."""
        return {
            "reduction": None,
            "chains": self.chains,
            "worker": self.workers[self.index],
            "chief": self.exchange.is_chief,
            "worker_batch": self.worker_batch,
        }



def build(config, shards, model, jit_compile=False, max_rows=None, micro_steps=1) -> MultiWorkerTrainer:
    """The trainer of `modes.build_trainer` for mode multiworker (`max_rows`: per worker)."""
    strategy = join_cluster(config)
    strategy.batch_statistics = config.batch_statistics
    return MultiWorkerTrainer(strategy, find_cluster(config), model, shards, config, jit_compile,
                              max_rows, micro_steps)


def initial_weights(config, weights) -> Agreed:
    """The initial weights, for `agree`: a model function must not depend on the worker."""
    return Agreed(
        "model",
        config.model,
        f"{len(weights)} arrays, digest {arrays_digest(weights)}",
        differs="its initial weights differ between workers",
        needs="every worker must start from the same weights (seed them the same everywhere)",
    )
