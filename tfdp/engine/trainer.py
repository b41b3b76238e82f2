"""The trainer of every mode: the model's own step under the mode's strategy.

The model's variables are made again in the scope of a `tfdp.MirroredStrategy`
(`placement.Placement`) whose replicas take the run's shares of each global batch:
one replica in mode single, even shares in mirrored, the run's in weighted (in
multiworker, a `tfdp.MultiWorkerMirroredStrategy`: `multiworker.py`). A step is
Keras' own: `strategy.run(model.train_step)` on each replica's piece. The strategy
weighs each piece's loss by its share, sums the gradients (all-reduce, or on device
0 and back: the tutorial's reduction) in the model's optimizer, combines moving
statistics by share, and reads the logs as the whole batch gives them; what the
model's step does with `training=False`, its own trackers or its optimizer is what
Keras does with it.

Each global batch is cut on the host (the run's split, by engine/pieces.py's rule), so its
input position can be saved. The loop (`training.run`) calls only what this class
declares; it never asks which mode it runs.
"""

from __future__ import annotations

import functools
import time

import tensorflow as tf

from tfdp.balance.balancers import DeviceBalancer
from tfdp.cluster.exchange import LOCAL
from tfdp.engine import shards as shards_lib
from tfdp.engine.pieces import cut, cut_evenly, num_examples, piece_sizes
from tfdp.engine.placement import Placement, kept
from tfdp.engine.split import Split
from tfdp.engine.steps import DeviceWork, LeavingWork, in_micro_steps, with_metrics


class Probes:
    """A trainer's probes: each device's seconds for the model's forward and backward pass
    on its piece, without the update, timed by the strategy's own clock as a training
    step is, and the simulated slowdown (`set_delays`). What a balancer
    (balance/balancers.py) measures the devices with; `split` is the split they time and
    the balancer sets; `timed`: each training step reads every device's seconds.
    """

    def __init__(self, trainer):
        self._trainer = trainer
        self.split, self.timed = trainer.split, trainer.timed
        # the model's train_step on a piece, its gradients not applied (all devices at once:
        # as the step runs it, where the balancing may leave devices out)
        self._work = DeviceWork(trainer.model, 1, False, may_be_empty=True)
        self._all, self.may_leave_out = trainer.leaving or self._work, trainer.leaving is not None
        self._alone = tf.function(self._seconds_alone, autograph=False)
        self._together = tf.function(self._seconds_together, autograph=False)

    def set_delays(self, delays) -> None:
        """Simulated slowdown: seconds of sleep per example, per replica."""
        self._trainer.strategy.set_sleep_per_example(delays)

    def alone(self, batch, index: int) -> float:
        """Device `index`'s seconds for its forward and backward pass on `batch`, the others
        idle, without an update (the model's state as it was before)."""
        with self.untouched():
            return float(self._alone(batch, index))

    def together(self, batch, host=False):
        """Each device's seconds for forward and backward on its shard of the global
        batch, all devices at once as in a step, without an update. With `host`: (the
        step's seconds on the host's clock, waiting and all-reduce included, those)."""
        with self.untouched():
            start = time.perf_counter()
            seconds = self._together(batch).numpy()
            return (time.perf_counter() - start, seconds) if host else seconds

    def untouched(self):
        """Inside: what a probe step changes besides the weights (metrics, batch-norm
        statistics, random seeds) is put back afterwards."""
        model = self._trainer.model
        return kept([*model.non_trainable_variables, *model.metrics_variables])

    def _seconds_together(self, batch):
        return self._timed(batch, tf.convert_to_tensor(self.split.sizes), self._all.train_either)

    def _seconds_alone(self, batch, index):
        # The other replicas get empty pieces: the same program, no work.
        sizes = [0] * len(self.split.devices)
        sizes[index] = num_examples(batch)
        # (through the split's variable: sizes the trace knows would fold the clock to a constant)
        sizes = tf.maximum(tf.stack(sizes), tf.minimum(tf.convert_to_tensor(self.split.sizes), 0))
        return self._timed(batch, sizes, self._work.train)[index]

    def _timed(self, batch, sizes, train):
        """Each replica's seconds for its train_step on its piece, without the update: the
        step's gradients are handed to the all-reduce, where the strategy's clock stops
        (and the simulated slowdown sleeps), and never applied."""
        trainer, examples = self._trainer, num_examples(batch)
        if not trainer.timed:
            raise ValueError("probes time the devices by the strategy's clock: a timed trainer")

        def handed_over(piece):
            gradients = train(piece, examples)[1]
            tf.distribute.get_replica_context().all_reduce(
                tf.distribute.ReduceOp.SUM, [*gradients, tf.zeros([])]
            )

        with shards_lib.handing_over(trainer.model):
            trainer.strategy.run(handed_over, args=(trainer.cut(batch, sizes),))
        return trainer.strategy.last_seconds


class Trainer:
    """Synchronous replicas of one Keras model, each running the model's own step on its
    piece of every global batch.

    What the rest of tfdp uses of it, and nothing else:
      the step: `distribute` (the iterator of a dataset of global batches), `train_step`,
        `test_step`, `close`;
      model: the model being trained (the user's own object, its variables placed for the
        strategy while the trainer is open; its weights and optimizer are the run's);
      split: how each global batch is split (`split.Split`: devices, shards, what a
        checkpoint saves);
      balancer: what measures and sets the split (balance/balancers.py), through the
        trainer's `Probes`;
      exchange: what this process tells the others of its run, and whether it writes the
        run's files (cluster/exchange.py);
      what it says: `info` (the banner's and the result's entries), `notes` (how the
        model's step ran, once traced).
    """

    unit = "device(s)"  # what the split's devices are, for the banner
    exchange = LOCAL
    _marked = False  # each element is (batch, whether its pass has ended) (`distribute`)
    _Balancer, _Probes = DeviceBalancer, Probes  # what measures and sets the split

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
        chains=1,
        max_rows=None,
        micro_steps=1,
        may_leave_out=False,
    ):
        """
        Args:
          model: a compiled, built Keras model (any kind): it is trained in place, its
            variables mirrored over the strategy's replicas while the trainer is open.
          strategy: tfdp's strategy of the mode (`modes.local_strategy`, or a
            `tfdp.MultiWorkerMirroredStrategy`); None: no strategy, the model's step on
            the one device of `devices` as Keras runs it (mode single, untimed).
          devices: what the batch is split over: the devices of one machine, one replica
            each, or the workers of a cluster.
          shards: examples of a full global batch on each of `devices`.
          input: "split": each global batch is cut on the host by `shards`; "dataset": the
            strategy cuts a dataset of global batches itself (its iterator cannot be saved).
          balanced: the split is the run's own (mode weighted): it may be measured,
            rebalanced and saved with a checkpoint.
          slowdown: build the simulated slowdown in (seconds set by `set_delays`).
          timed: read each replica's seconds in every step (auto powers, rebalancing).
          jit_compile: the model asks for XLA; the step is compiled with it where the
            strategy can (one replica, or GPUs only: one XLA program cannot span CPU devices).
          chains: with one replica (or one left with rows: `may_leave_out`), side-by-side
            pieces its batch is cut into (`steps.DeviceWork`: a CPU device keeps several
            cores busy with one-threaded kernels); 1: the model's train_step as it is.
          max_rows: the most examples each of `devices` takes in one step (None: no caps).
          micro_steps: steps of `shards` per update (a global batch beyond the caps).
          may_leave_out: a device may get no rows (auto powers, a cap of 0): it skips the step.
        """
        self.split = Split(devices, shards, balanced=balanced, fixed=input != "split", unit=self.unit,
                           max_rows=max_rows, micro_steps=micro_steps, leaving=may_leave_out)
        self.split.sizes  # noqa: B018 (the variable, before any step is traced)
        self.timed = timed or slowdown
        self._input = input
        self.strategy = strategy
        self._device = None if strategy is not None else self.split.devices[0]
        if strategy is None and (self.timed or len(self.split.devices) > 1):
            raise ValueError("a timed step, or several devices, need a strategy")
        if strategy is not None:
            strategy.warn_notes = False  # the run says them (`notes`)
        if self.timed:
            replicas = strategy.num_replicas_in_sync
            strategy.report_seconds([0.0] * replicas if slowdown else None)
        self.model = model
        self._placement = Placement(model, strategy=strategy, device=self._device)
        self._placement.enter()
        if chains > 1 and len(self.split.devices) > 1 and not may_leave_out:
            raise ValueError(f"chains={chains} needs one device")
        self.chains = chains if len(self.split.devices) == 1 else 1
        self.jit_compile = bool(jit_compile and (strategy is None or strategy.compiles_with_xla))
        self._notes = []
        if jit_compile and not self.jit_compile:
            self._notes.append(
                "jit_compile: the step runs without XLA: one XLA program cannot span the "
                f"devices {', '.join(strategy.extended.worker_devices)} and their all-reduce"
            )
        # chains: the batch cut into pieces whose gradients are summed and applied once
        self._work = DeviceWork(model, chains, self.jit_compile) if self.chains > 1 else None
        # micro-steps: a device's piece of each micro-batch (`_micro_update`); one micro-step
        # where a device may get no rows (the model's step skipped there)
        self.leaving = LeavingWork(model, chains, self.jit_compile, self.split.sizes) if may_leave_out else None
        self._micro = self.leaving
        self._replica_step = model.train_step if self._work is None else self._chained_step
        self._replicas_train = self._replicas_test = None  # each step one XLA program, as in Keras
        if self.jit_compile and not model.run_eagerly:
            if self._work is None:
                self._replicas_train = tf.function(self._train_replicas, jit_compile=True, autograph=False)
            self._replicas_test = tf.function(self._test_replicas, jit_compile=True, autograph=False)
        self._outputs_like = None  # a step's outputs, once traced (what a marker's step gives)
        self._compile()

    def notes(self) -> list[str]:
        """How the model's own train_step is run, where not as Keras runs it (once traced)."""
        work = [*getattr(self._work, "notes", []), *getattr(self._micro, "notes", [])]
        return [*self._notes, *work, *getattr(self.strategy, "notes", [])]

    # --- the data

    @functools.cached_property
    def balancer(self):
        """What measures and sets the split, through this trainer's probes (made on first
        use, once the trainer is whole)."""
        return self._Balancer(self._Probes(self))

    def distribute(self, dataset, gather=None, marked=False):
        """The iterator `train_step` reads, from a dataset of global batches: a tf.data
        iterator on the host, whose position a checkpoint can save, unless the strategy
        cuts the batches itself (`split.fixed`: tf.distribute's iterator).

        gather: the dataset holds batches of example indices into arrays, and `gather`
          makes their batch (indices -> examples). A trainer that reads a whole global
          batch gathers it here; multiworker gathers only its worker's slice.
        marked: each element is (batch, whether its pass has ended) (`Stream.marked`).
        """
        from tfdp.data.arrays import prefetched

        self._marked = marked
        if gather is not None:
            dataset = prefetched(dataset.map(gather))
        if self._input == "split":
            return iter(dataset)
        return iter(self.strategy.experimental_distribute_dataset(dataset))

    # --- the step: Keras' own, on every replica's piece

    def _compile(self) -> None:
        """Makes the compiled step functions, as the model asks: eager with `run_eagerly`,
        else one tf.function per kind of call (autograph off, as Keras traces a step)."""
        if self.model.run_eagerly:
            wrap = _eager
        else:
            wrap = lambda f: tf.function(f, autograph=False, reduce_retracing=True)  # noqa: E731
        self._train_step = wrap(self._step_on)
        self._train_steps = wrap(self._steps)
        self._test_step = wrap(self._test)

    def train_step(self, iterator, steps: int = 1) -> dict | None:
        """Up to `steps` updates on the next global batches, in one compiled call (Keras'
        `steps_per_execution`), fewer where the data ends. Returns tensors: `logs`, what
        the model's train_step returned for the last of them (its metrics over the whole
        batch, running since `model.reset_metrics()`), `device_seconds` of that step
        (zeros where devices are not timed), and `steps`, how many ran; None when the
        data had ended before the first."""
        try:
            if steps == 1:
                return self._train_step(iterator=iterator)
            return self._train_steps(iterator, tf.constant(steps))
        except (tf.errors.OutOfRangeError, StopIteration):  # (StopIteration: run eagerly)
            return None

    def test_step(self, batch) -> dict:
        """The model's test_step on an evaluation batch, split over the devices as a
        training batch is: its logs, the metrics over every batch since
        `model.reset_metrics()`."""
        return self._test_step(batch)

    def _update(self, batch):
        """The model's train_step on every replica's piece of `batch` (its update): the
        logs it returned (each holds the whole batch's: the strategy reads them so), each
        device's seconds, and `steps` 1."""
        if self.split.micro_steps > 1 or self._micro is not None:  # (caps measured later too)
            return self._micro_update(batch)
        pieces = self._pieces(batch)
        if self._replicas_train is not None:  # XLA
            logs = self._replicas_train(pieces)
        elif self.strategy is None:
            with tf.device(self._device):
                logs = self._replica_step(pieces)
        else:
            per_replica = self.strategy.run(self._replica_step, args=(pieces,))
            logs = tf.nest.map_structure(
                lambda value: self.strategy.experimental_local_results(value)[0], per_replica
            )
        self._outputs_like = {"logs": logs, "device_seconds": self._seconds(), "steps": tf.constant(1)}
        return self._outputs_like

    def _seconds(self):
        """Each device's seconds in the step just run (zeros where not timed)."""
        if not self.timed:
            return tf.zeros([len(self.split.devices)], tf.float64)
        return self.strategy.last_seconds

    def _train_replicas(self, pieces):
        return self.run(self._replica_step, pieces)

    def run(self, fn, pieces):
        """`fn` on every replica's piece, in the strategy; its values as a replica's (each
        holds the whole batch's: the strategy reads them so). Without a strategy, `fn` on
        the device, as Keras runs the model's step."""
        if self.strategy is None:
            with tf.device(self._device):
                return fn(pieces)
        per_replica = self.strategy.run(fn, args=(pieces,))
        return tf.nest.map_structure(
            lambda value: self.strategy.experimental_local_results(value)[0], per_replica
        )

    def _chained_step(self, batch):
        """The model's train_step on side-by-side pieces of `batch`, summed, applied once."""
        with shards_lib.handing_over(self.model):
            logs, gradients, _ = self._work.train_either(batch, num_examples(batch))
        if gradients:  # (a model without trainable weights has nothing to update)
            self.model.optimizer.apply_gradients(zip(gradients, self._work.variables))
        return with_metrics(self.model, logs)

    def _micro_update(self, batch):
        """One update of a global batch in `split.micro_steps` near-equal micro-batches (caps),
        each cut over the replicas by the split, in turn (`steps.in_micro_steps`)."""
        if self._micro is None:  # (a micro-step's chains share its rows: within the cap)
            self._micro = DeviceWork(self.model, self.chains, self.jit_compile, may_be_empty=True)
        micro = [self._pieces(part) for part in cut_evenly(batch, self.split.micro_steps)]
        work = lambda args: in_micro_steps(self._micro, *args)  # noqa: E731
        logs = self.run(work, (micro, num_examples(batch)))
        self._outputs_like = {"logs": logs, "device_seconds": self._seconds(), "steps": tf.constant(1)}
        return self._outputs_like

    def _test(self, batch):
        return self._test_pieces(self._pieces(batch))

    def _test_pieces(self, pieces):
        return (self._replicas_test or self._test_replicas)(pieces)  # (XLA)

    def _test_replicas(self, pieces):  # (a replica that may get no rows skips the step)
        return self.run(getattr(self._micro, "test", self.model.test_step), pieces)

    def _pieces(self, batch):
        """A global batch on the host -> one piece per replica, of the run's split."""
        if self._input != "split":
            return batch  # the strategy's iterator cut it
        examples = num_examples(batch)  # the global batch, or an epoch's partial last one
        # (by the rule on one device too: its sizes, unknown to the trace, keep the batch
        # size unknown to Keras' step, as in Keras' fit, whose loss trackers weigh by it)
        return self.cut(batch, piece_sizes(examples, self.split.sizes))

    def cut(self, batch, sizes):
        """`batch` cut into pieces of `sizes`, one per replica (a distributed value)."""
        pieces = cut(batch, sizes, len(self.split.devices))
        if self.strategy is None:
            return pieces[0]  # (its batch size unknown to the trace, as in Keras' fit)
        return self.strategy.experimental_distribute_values_from_function(
            lambda context: pieces[context.replica_id_in_sync_group]
        )

    def _step_on(self, element=None, iterator=None):
        """One step on an element of the stream (the next of `iterator`, given one): its
        outputs, with `steps` 1, or 0 for a marker of a pass's end, which is not trained on."""
        if iterator is not None:
            element = next(iterator)
        if not self._marked:
            return self._update(element)
        batch, ended = element
        if tf.executing_eagerly():  # run_eagerly: the marker read, nothing to train
            return {"steps": tf.constant(0)} if bool(ended) else self._update(batch)
        # (tf.cond traces its true branch first: a marker's step is shaped like it)
        return tf.cond(tf.logical_not(ended), functools.partial(self._update, batch), self._skipped)

    def _skipped(self):
        """A marker's outputs: zeros shaped like a step's, `steps` 0."""
        return {**tf.nest.map_structure(tf.zeros_like, self._outputs_like), "steps": tf.constant(0)}

    def _steps(self, iterator, steps):
        """Up to `steps` steps, as Keras runs `steps_per_execution`: each next batch read
        only while another step is due, and none read past the data's end (or its pass's
        end, in a marked stream)."""
        outputs = self._step_on(iterator=iterator)
        if self.model.run_eagerly:
            done = int(outputs["steps"])
            while done and done < int(steps):
                upcoming = iterator.get_next_as_optional()
                if not upcoming.has_value():
                    break
                more = self._step_on(upcoming.get_value())
                if not int(more["steps"]):
                    break
                outputs, done = more, done + 1
            return {**outputs, "steps": tf.constant(done)}

        def more(done, ended, outputs, upcoming):
            return tf.logical_and(
                tf.logical_and(done < steps, tf.logical_not(ended)), upcoming.has_value()
            )

        def read_on(done, ended, upcoming):
            """The next element, read only if another step is due."""
            return tf.cond(
                tf.logical_and(done < steps, tf.logical_not(ended)),
                iterator.get_next_as_optional,
                lambda: upcoming,
            )

        def step(done, ended, outputs, upcoming):
            new = self._step_on(upcoming.get_value())
            ran = new.pop("steps")
            outputs = tf.nest.map_structure(  # a marker leaves the last step's outputs
                lambda a, b: tf.where(ran > 0, a, b), new, outputs
            )
            done, ended = done + ran, tf.equal(ran, 0)
            return done, ended, outputs, read_on(done, ended, upcoming)

        first = dict(outputs)
        done = first.pop("steps")
        ended = tf.equal(done, 0)
        nothing = tf.experimental.Optional.empty(iterator.element_spec)
        start = (done, ended, first, read_on(done, ended, nothing))
        done, _, outputs, _ = tf.while_loop(more, step, start)
        return {**outputs, "steps": done}

    def close(self) -> None:
        """The model's variables back as the model had them, with the trained values."""
        if self._placement is not None:
            self._placement.exit()
            self._placement = None

    def info(self) -> dict:
        """What the banner and the result say of this trainer: how the gradients are
        reduced where the split is the run's own ("device0" or "allreduce"; None), chains,
        jit_compile."""
        reduction = None
        if self.split.balanced:
            reduction = getattr(self.strategy, "reduce_to", None) or "allreduce"
        return {"reduction": reduction, "chains": self.chains, "jit_compile": self.jit_compile}



def _eager(function):
    return function

