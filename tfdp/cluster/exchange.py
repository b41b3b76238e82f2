"""What the processes of a run tell each other: nothing in one process, the
workers' values in a cluster.

The loop and its hooks ask a trainer's `exchange` for every worker's value
(`gather`), for agreement on settings and data (`agree`), for the step to
stop at after a signal (`agree_to_stop`) and for a last barrier (`finish`);
they never ask which mode runs.
"""

from __future__ import annotations

import signal

import numpy as np

from tfdp.cluster.agreement import Agreed, digest, disagreement, first_difference

SIGNALS = (signal.SIGTERM, signal.SIGINT)  # what a run stops on, in the order a step carries them


class Local:
    """One process: every answer is this process's own; it writes the run's files."""

    is_chief = True

    def gather(self, value: float) -> list[float]:
        return [value]

    def agree(self, items: list[Agreed]) -> None:
        """One process agrees with itself."""

    def agree_to_stop(self, signum: int) -> int:
        """The signal to stop on after this step (0: go on)."""
        return signum

    def saw_step(self, signals) -> None:
        """A step's summed signals (a cluster's only)."""

    def finish(self) -> None:
        """After the run's files are written."""


LOCAL = Local()


class Cluster:
    """The workers of a MultiWorkerMirroredStrategy, each holding one row.

    Every exchange is an all-reduce that every worker must call at the same
    point. A caught signal rides with the next step's loss (the trainer sends
    `signals_caught` and hands the summed value to `saw_step`): no collective
    of its own.
    """

    def __init__(self, strategy, workers: list[str], index: int, is_chief: bool):
        """is_chief: this worker writes the run's files (task `chief`, else `worker:0`)."""
        import tensorflow as tf

        self.tf = tf
        self.is_chief = is_chief
        self.strategy = strategy
        self.workers = list(workers)
        self.index = index
        self.local_replicas = len(strategy.extended.worker_devices)
        # which of SIGNALS this worker caught, sent with the next step's loss
        self.signals_caught = tf.Variable([0.0] * len(SIGNALS), trainable=False)
        self.signals_seen = []  # the summed signals of the last two steps, oldest first
        self._sum = tf.function(lambda values: strategy.reduce("SUM", values, axis=None))

    @property
    def worker(self) -> str:
        """This worker's name in the cluster ("worker:1")."""
        return self.workers[self.index]

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

    def saw_step(self, signals) -> None:
        self.signals_seen = [*self.signals_seen[-1:], signals]

    def agree_to_stop(self, signum: int) -> int:
        """The signal a worker had caught when the step before last started, or 0; the
        same on every worker, so that all of them stop after the same step and save it.

        The sums are read one step late, once the next step is under way, so that
        reading them never makes the host wait for the step just started (on a GPU,
        steps run ahead of the host). A signal is so acted on two steps after it came.
        """
        self.signals_caught.assign([float(signum == s) for s in SIGNALS])
        if len(self.signals_seen) < 2:
            return 0
        counts = self.signals_seen[0].numpy()
        return next((s for s, count in zip(SIGNALS, counts) if count > 0), 0)

    def finish(self) -> None:
        self.gather(0)  # a barrier: the workers leave together, after the chief's writes
