"""How each global batch is split: one object, `Split`, the shares the step cuts by,
what balancing sets (balance/balancers.py) and what a checkpoint saves.

It imports no TensorFlow until its variable is first used, so the balancing's
arithmetic and its tests run without it.
"""

from __future__ import annotations


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
      max_rows: the most examples each device takes in one step (None: no caps); every
        split set stays within them.
      micro_steps: steps of `shards` whose gradients make one update (the batch is beyond
        the caps); `global_batch_size` is then one micro-step's.
      leaving: a device may take no examples (auto powers leave out a device that only
        slows the step); else every device takes some.
    """

    def __init__(self, devices, shards, balanced=False, fixed=False, unit="device(s)",
                 max_rows=None, micro_steps=1, leaving=False):
        self.devices = list(devices)
        self.max_rows = None if max_rows is None else tuple(max_rows)
        self.micro_steps = micro_steps
        self.leaving = leaving
        self._check(shards)
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
        self._check(shards)
        self.shards = list(shards)
        if self._sizes is not None:
            self._sizes.assign(shards)

    def cap(self, max_rows, batch_size: int) -> None:
        """Caps measured before the first step (`max_rows="auto"`): the split of each
        micro-step of a global batch of `batch_size` within them, by the shares as they
        stand."""
        from tfdp.devices import capped_split, micro_step_rows, micro_steps

        if self.fixed:
            raise ValueError("the split cannot be capped: the strategy cuts the batches itself")
        micro = micro_step_rows(batch_size, max_rows)
        self.max_rows, self.micro_steps = tuple(max_rows), micro_steps(batch_size, max_rows)
        self.shards = capped_split(micro, self.shards, self.max_rows)
        self.global_batch_size = micro
        if self._sizes is not None:
            self._sizes.assign(self.shards)

    def within(self, shards) -> bool:
        """Whether every device's share of `shards` is within its cap."""
        return self.max_rows is None or all(s <= c for s, c in zip(shards, self.max_rows))

    def _check(self, shards):
        if not self.within(shards):
            raise ValueError(f"shards {list(shards)} pass the caps max_rows={list(self.max_rows)}")

    def saved(self, step: int) -> dict | None:
        """What a checkpoint of `step` saves of the split: the run's own split, None for
        one fixed by the mode (any split makes the same update)."""
        if not self.balanced:
            return None
        return {"step": step, "devices": self.devices, "shards": self.shards}

    def takes(self, saved: dict) -> bool:
        """Whether a split a checkpoint saved (`saved`) applies here: the same devices and
        global batch, within this run's caps, a device without examples only where one may
        be left out."""
        return (
            saved["devices"] == self.devices
            and sum(saved["shards"]) == self.global_batch_size
            and self.within(saved["shards"])
            and (self.leaving or min(saved["shards"]) > 0)
        )
