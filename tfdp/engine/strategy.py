"""tfdp.MirroredStrategy: TensorFlow's MirroredStrategy, with uneven shares of each global batch.

    strategy = tfdp.MirroredStrategy(["gpu:0", "cpu:0"], powers=[5, 1])
    with strategy.scope():
        model = make_model()
        model.compile(...)
    model.fit(dataset, epochs=10)          # one device's update, 5/6 of each batch on the GPU

It is a `tf.distribute.MirroredStrategy` (isinstance holds), so Keras' `fit`, `evaluate`
and `predict` and TensorFlow's own custom loops (`experimental_distribute_dataset`,
`strategy.run`, `strategy.reduce`) take it unchanged. What differs from TensorFlow's:

1. **The cut.** With even shares (`powers=None`) on one machine, TensorFlow's own. Else
   `experimental_distribute_dataset` cuts each global batch of n rows into one
   consecutive piece per replica, of round(n * cumulative share) rows, so replica i
   holds rows [b_i, b_i+1) of every batch (a short batch, or a batch whose shape changes
   from step to step, is cut by share too; a piece may be empty).
2. **The weight.** `run` measures each replica's rows n_i and the batch's N (one scalar
   all-reduce) and runs the replica's step with its losses weighed n_i/N where Keras weighs
   them 1/R (`shards.piece`), `tf.nn.compute_average_loss` likewise. The gradients the
   optimizer sums are then the whole batch's, however uneven the pieces.
3. **The logs.** A Keras step's logs are read from its metrics summed over the replicas
   (the whole batch's values), where Keras would average the replicas' own.
4. **BatchNormalization** normalizes by the whole batch's statistics
   (`batch_statistics="whole"`); with "replica", by each piece's, and its moving
   statistics are the replicas' combined by share.
5. **`reduce`** of pieces of different shapes is the batch they were cut from.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import warnings
import weakref

import tensorflow as tf

from tfdp import internals
from tfdp.engine import clock as host_clock
from tfdp.engine import shards
from tfdp.config import BATCH_STATISTICS
from tfdp.errors import ConfigError

REDUCES = ("allreduce", "device0")
_key_bases = itertools.count(1)
_local = threading.local()  # the replica step being traced in this thread
_local.moving_statistics = set()


def next_collective_key_base() -> int:
    """A range of collective keys of its own for each strategy made in this process.

    Every MirroredStrategy numbers its collective groups from the same start, so two
    strategies in one process collide ("Shape mismatch in the collective instance 100",
    or "joining a group with size 4, but that group has size 2"), after which every
    collective of the process is aborted. TensorFlow reads the base from the strategy
    (`_collective_key_base`) when it builds the strategy's collective ops.
    """
    return 100_000 * next(_key_bases)


class UnevenShares:
    """What tfdp's strategies add to TensorFlow's: the cut, the weight, the logs, the
    moving statistics, and the shares themselves (given, or measured)."""

    def _set_up_shares(self, powers, rebalance_every, measure_steps, simulate_slowdown,
                       batch_statistics="whole"):
        count = self.num_replicas_in_sync
        if batch_statistics not in BATCH_STATISTICS:
            raise ConfigError("batch_statistics", batch_statistics,
                              f"must be one of {', '.join(BATCH_STATISTICS)}")
        self.batch_statistics = batch_statistics
        self.auto = isinstance(powers, str) and powers == "auto"
        self.powers = [1.0] * count if self.auto else _checked_powers(powers, count)
        # powers=None on one machine: TensorFlow's own cut of a dataset (its static shapes
        # too), until new powers are set; the weighing in `run` makes any cut exact. (A
        # cluster's workers each read the whole batches and keep their replicas' pieces.)
        self.tensorflows_cut = powers is None and not isinstance(
            self, tf.distribute.MultiWorkerMirroredStrategy)
        self.rebalance_every = _checked_steps("rebalance_every", rebalance_every, allow_none=True)
        self.measure_steps = _checked_steps("measure_steps", measure_steps)
        self.slowdown = _checked_slowdown(simulate_slowdown, count)
        self._books = None  # the variables of the shares and the timing, made on first use
        self._reports_seconds = False
        self._sent = self._received = None
        self.notes = []  # how it ran a model's own step, where not as Keras would (one line each)
        self.warn_notes = True
        self._sleep_per_example = None
        self._lifted = weakref.WeakKeyDictionary()  # a tf.function -> it, over the replicas
        shards.install()
        _install_assign_by_share()
        _install_clip_of_the_sum()
        _install_keras_functions()
        _install_tensorflows_losses()
        _install_batch_statistics()
        _install_build_check()

    def _variable(self, value, dtype, name):
        """A variable of tfdp's books: on the host, outside any strategy's scope and any
        graph of the caller's (a tf.compat.v1 graph gets none of tfdp's variables)."""
        with tf.init_scope(), internals.outside_strategy_scopes(), tf.device("/cpu:0"):
            return tf.Variable(value, trainable=False, dtype=dtype, name=name)

    @property
    def books(self) -> _Books:
        """The shares and the timing, as variables a step reads and writes (made on first use)."""
        if self._books is None:
            self._books = _Books(self, self.num_replicas_in_sync)
        return self._books

    @property
    def local_replicas(self) -> int:
        """Replicas on this worker (all of them on one machine)."""
        return len(self.extended.worker_devices)

    # -- the shares -------------------------------------------------------------------

    @property
    def shares(self) -> list[float]:
        """Each replica's fraction of a global batch, in replica order."""
        if self._books is None:
            return _shares(self.powers)
        return [float(s) for s in self._books.shares.numpy()]

    @property
    def measured_speeds(self) -> list[float]:
        """Examples per second of each replica's step in the last measurement (powers="auto";
        zeros before the first)."""
        if self._books is None:
            return [0.0] * self.num_replicas_in_sync
        return [float(s) for s in self._books.measured.numpy()]

    def set_powers(self, powers) -> None:
        """New relative speeds; batches cut from now on take the new shares (a few batches
        may already be cut, and are weighed by the rows they hold, so the update stays exact)."""
        self.powers = _checked_powers(powers, self.num_replicas_in_sync)
        self.tensorflows_cut = False
        if self._books is not None:
            self._books.shares.assign(_shares(self.powers))

    def report_seconds(self, sleep_per_example=None) -> None:
        """Every step from now on times each replica (`last_seconds`), as a driver that
        balances the replicas itself reads them (tfdp.fit). `sleep_per_example`: seconds per
        example each replica sleeps before its gradients leave (a simulated slowdown set by
        the driver; zeros for none), in place of `simulate_slowdown`'s own calibration.
        Takes effect in steps traced after it."""
        self._reports_seconds = True
        if sleep_per_example is not None:
            self._sleep_per_example = self._variable(sleep_per_example, tf.float64, "tfdp_sleep")

    def send_along(self, values) -> None:
        """Every step from now on also sums `values` (a float32 vector variable of this
        worker's) over the workers, in the all-reduce that counts the batch's rows, so it
        costs no collective of its own (a driver's stop signals); `received` holds the last
        step's sum. Takes effect in steps traced after it."""
        self._sent = values
        self._received = self._variable(
            lambda: tf.zeros(values.shape, values.dtype), values.dtype, "tfdp_received"
        )

    @property
    def received(self) -> tf.Tensor:
        """The workers' `send_along` values summed in the last step (zeros before one)."""
        return self._received.read_value()

    def _count_rows(self, context, all_reduce, rows):
        """The batch's rows (the sum of every replica's `rows`), with `send_along`'s sum."""
        if self._sent is None:
            return all_reduce(tf.distribute.ReduceOp.SUM, rows)
        replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        first = replica % self.local_replicas == 0  # one replica per worker sends
        sent = tf.convert_to_tensor(self._sent) if first else tf.zeros_like(self._sent)
        both = all_reduce(tf.distribute.ReduceOp.SUM, tf.concat([[rows], sent], 0))
        if first:
            self._received.assign(both[1:])
        return both[0]

    @property
    def sleep_per_example(self):
        """Each replica's seconds of sleep per example set by a driver (a variable), or None."""
        return self._sleep_per_example

    def set_sleep_per_example(self, seconds) -> None:
        """New seconds of sleep per example for each replica (see `report_seconds`)."""
        self._sleep_per_example.assign(seconds)

    @property
    def last_seconds(self) -> tf.Tensor:
        """Each replica's seconds in the last timed step (with `report_seconds`)."""
        return self.books.last_seconds.read_value()

    def piece_bounds(self, rows):
        """Where a batch of `rows` rows is cut: R+1 increasing row indices from 0 to rows."""
        rows = tf.cast(rows, tf.int64)
        ends = tf.cast(tf.floor(tf.cast(rows, tf.float64) * tf.cumsum(self.books.shares) + 0.5), tf.int64)
        ends = tf.minimum(ends, rows)
        ends = tf.concat([ends[:-1], [rows]], 0)
        return tf.concat([[tf.constant(0, tf.int64)], ends], 0)

    def _slow_down(self, replica, factor, start, end, rows):
        """The simulated slowdown of one replica: a sleep of (factor - 1) times its seconds
        per example, taken from its second step (the first sets up kernels) and fixed from
        then on, so that the sleep follows the rows it is given. Returns the time after it."""
        calls = self.books.slowdown_calls.scatter_nd_add([[replica]], [1])[replica]
        seconds = tf.maximum(end - start, 0.0)
        per_example = tf.math.divide_no_nan(seconds, tf.cast(rows, tf.float64))
        fixed = self.books.slowdown_per_example.scatter_nd_update(
            [[replica]], [tf.where(tf.equal(calls, 2), per_example, self.books.slowdown_per_example[replica])]
        )[replica]
        sleep = tf.where(fixed > 0, fixed * tf.cast(rows, tf.float64), seconds) * (factor - 1.0)
        return host_clock.sleep_then_read(end, sleep)

    def _account(self, rows, seconds):
        """One timed step's rows and seconds per replica, into the measurement window;
        at the window's end the shares become the measured speeds (in the step's graph)."""
        books = self.books
        step = books.timed_steps.assign_add(1)
        counting = step > 1  # the first step sets up kernels
        window_rows = books.window_rows.assign_add(tf.where(counting, rows, 0.0))
        window_seconds = books.window_seconds.assign_add(tf.where(counting, seconds, 0.0))
        first = self.measure_steps
        due = tf.equal(step, first + 1)
        if self.rebalance_every:
            later = tf.logical_and(step > first + 1, tf.equal((step - first - 1) % self.rebalance_every, 0))
            due = tf.logical_or(due, later)
        speeds = tf.math.divide_no_nan(window_rows, window_seconds)
        valid = tf.logical_and(due, tf.reduce_all(speeds > 0))
        books.measured.assign(tf.where(valid, speeds, books.measured))
        books.shares.assign(tf.where(valid, speeds / tf.reduce_sum(speeds), books.shares))
        books.window_rows.assign(tf.where(due, tf.zeros_like(rows), window_rows))
        books.window_seconds.assign(tf.where(due, tf.zeros_like(seconds), window_seconds))

    # -- data ---------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """The dataset's batches, each cut into one piece per replica: TensorFlow's own
        cut with even shares (`powers=None`), else by share (`piece_bounds`). Either way
        a `tf.distribute.DistributedDataset`, as TensorFlow's strategy returns."""
        structure = dataset.element_spec
        if dataset.options().autotune.enabled is None:  # the user's own setting stands
            dataset = dataset.with_options(_without_autotune())
        replication = None if options is None else options.experimental_replication_mode
        if self.tensorflows_cut or replication == tf.distribute.InputReplicationMode.PER_REPLICA:
            distributed = super().experimental_distribute_dataset(dataset, options)
        else:
            distributed = self._distribute_by_share(dataset, structure, options)
        distributed._tfdp_element_spec = structure  # noqa: SLF001 (Keras builds the model from it)
        distributed._tfdp_dataset = dataset  # noqa: SLF001 (tfdp.fit cuts its global batches itself)
        return distributed

    def _distribute_by_share(self, dataset, structure, options):
        if not any(_has_rows(spec) for spec in tf.nest.flatten(structure)):
            raise ConfigError(
                "dataset", structure, "has no batch axis: batch it first (dataset.batch(n))"
            )
        local = self.local_replicas
        # Every replica gets a piece of every batch (maybe empty), so TensorFlow's stand-ins
        # for a replica without data are never used; they cannot be made for a None (an
        # optional input given None), so a dataset holding one is read without them.
        extended = self.extended
        stand_ins = extended.experimental_enable_get_next_as_optional
        if any(_none_for_none_spec(spec) is None for spec in tf.nest.flatten(structure)):
            extended.experimental_enable_get_next_as_optional = False
        try:
            if isinstance(self, tf.distribute.MultiWorkerMirroredStrategy):
                # every worker reads the global batches and keeps its own replicas' pieces
                input_options = tf.distribute.InputOptions(
                    experimental_replication_mode=tf.distribute.InputReplicationMode.PER_WORKER,
                    experimental_fetch_to_device=(
                        True if options is None else options.experimental_fetch_to_device
                    ),
                    experimental_per_replica_buffer_size=(
                        1 if options is None else options.experimental_per_replica_buffer_size
                    ),
                )
                return super().distribute_datasets_from_function(
                    lambda context: self._pieces(dataset, context.input_pipeline_id * local),
                    input_options,
                )
            return internals.distribute_without_rebatching(self, self._pieces(dataset, 0), options)
        finally:
            extended.experimental_enable_get_next_as_optional = stand_ins

    def _pieces(self, dataset, first):
        """Replicas first..first+local-1's pieces of each global batch, in turn."""
        structure = dataset.element_spec
        local = self.local_replicas
        self.books  # noqa: B018 (the shares the cut reads, made outside the dataset's functions)

        def cut(*element):
            batch = element if isinstance(structure, tuple) else element[0]
            leaves = tf.nest.flatten(batch)
            bounds = self.piece_bounds(rows_of(leaves))

            def piece(index):
                start, stop = bounds[index], bounds[index + 1]
                # the element's own structure (a list stays a list, a 1-tuple a 1-tuple)
                return tf.nest.pack_sequence_as(
                    structure, [_rows(leaf, start, stop) for leaf in leaves]
                )

            return tf.data.Dataset.range(first, first + local).map(piece)

        return dataset.flat_map(cut)

    def distribute_datasets_from_function(self, dataset_fn, options=None):
        """TensorFlow's, with the replicas' pieces by share where the shares are not
        even: the dataset function's per-replica batches are read back, as many as the
        replicas at a time, as the global batch they make together, and cut as
        `experimental_distribute_dataset` cuts. Several workers with uneven shares are
        refused (each reads data of its own, which cannot be cut across them). Elements
        without a batch axis are one value per replica, as TensorFlow deals them."""
        replication = None if options is None else options.experimental_replication_mode
        if self.tensorflows_cut or replication == tf.distribute.InputReplicationMode.PER_REPLICA:
            return super().distribute_datasets_from_function(dataset_fn, options)
        if self.num_replicas_in_sync != self.local_replicas:
            raise ConfigError(
                "powers", "auto" if self.auto else self.powers,
                "distribute_datasets_from_function cannot cut by share over several workers "
                "(each reads its own data): use experimental_distribute_dataset, or powers=None",
            )
        local = self.local_replicas

        def by_share(context):
            dataset = dataset_fn(context)
            if not any(_has_rows(spec) for spec in tf.nest.flatten(dataset.element_spec)):
                return dataset  # one value per replica, no batch to cut: TensorFlow's
            return self._pieces(_global_batches(dataset, local), 0)

        return super().distribute_datasets_from_function(by_share, options)

    # -- the step -----------------------------------------------------------------------

    @property
    def compiles_with_xla(self) -> bool:
        """Whether a model's `jit_compile=True` is kept: XLA compiles the whole step over the
        replicas only where every replica is a GPU, as in TensorFlow's MirroredStrategy, or
        on the one replica of a machine's strategy."""
        if self.num_replicas_in_sync == 1 and isinstance(self, tf.distribute.MirroredStrategy):
            return True
        return all("GPU" in d.upper() for d in self.extended.worker_devices)

    def run(self, fn, args=(), kwargs=None, options=None):
        """`fn` in every replica, its losses weighed by the replica's share of the batch.

        As TensorFlow's: a `tf.function` is lifted over the replicas (one function that
        runs every replica inside it, so a sync point in it works and each replica reads
        its own copy of a variable), and a `tf.function` compiled with XLA on GPUs only is
        called in each replica. The batch is the arguments that hold a value per replica
        (a distributed dataset's pieces; every argument, on one replica per worker)."""
        kwargs = kwargs or {}
        if isinstance(fn, tf.types.experimental.PolymorphicFunction) and not (
            internals.function_jit_compile(fn) and self.compiles_with_xla
        ):
            lifted = self._lifted.get(fn)
            if lifted is None:
                # converted as the tf.function would convert it (not tfdp's own code)
                python_function = internals.as_the_function_converts(fn)

                @tf.autograph.experimental.do_not_convert
                def over_the_replicas(*lifted_args, **lifted_kwargs):
                    return self.run(python_function, lifted_args, lifted_kwargs, options)

                lifted = self._lifted[fn] = internals.clone_function(fn, over_the_replicas)
            return lifted(*args, **kwargs)

        model = _trainer_of(fn)
        fn = internals.autograph_convert(fn)
        timed = self.auto or bool(self.slowdown) or self._reports_seconds
        if timed:
            self.books  # noqa: B018 (made here, outside the replicas' threads)
        batch = _batch_positions((args, kwargs), every=self.local_replicas == 1)

        @tf.autograph.experimental.do_not_convert
        def weighed(*replica_args, **replica_kwargs):
            rows = rows_of(_leaves_at((replica_args, replica_kwargs), batch))
            if rows is None:  # no batch: Keras' own 1/R
                return fn(*replica_args, **replica_kwargs)
            context = tf.distribute.get_replica_context()
            all_reduce = _placed(context, self)  # tfdp's own reductions are never timed
            rows = tf.cast(rows, tf.float32)
            total = self._count_rows(context, all_reduce, rows)
            fraction = tf.math.divide_no_nan(rows, total)
            clock = None
            if timed:  # from the moment every piece is in (the sum of rows) ...
                clock = _Clock(self, context, rows, after=total)
                with tf.control_dependencies([clock.start]):  # ... the step starts after the clock
                    replica_args, replica_kwargs = tf.nest.map_structure(
                        tf.identity, (replica_args, replica_kwargs), expand_composites=True
                    )
            _local.fraction, _local.all_reduce = fraction, all_reduce
            _local.traced = not tf.executing_eagerly()  # (a build may lift out to eager)
            _local.moving_statistics = set()  # BatchNormalization's, with "replica" statistics
            _local.own_loss = model is not None and shards.overrides(model, fn.__name__)
            _local.weighed_own = False
            try:
                outputs_weighed = (
                    shards.weighing_output_losses(model, fraction) if model is not None
                    else contextlib.nullcontext()
                )
                with shards.piece(fraction) as piece, outputs_weighed, (clock or contextlib.nullcontext()):
                    outputs = fn(*replica_args, **replica_kwargs)
                if model is not None and not piece.scaled:
                    self._say_not_scaled(model, fn, _local.weighed_own)
                if clock is not None:
                    clock.record(all_reduce)
                if model is not None and isinstance(outputs, dict):
                    outputs = whole_batch_logs(model, outputs, fraction, context, all_reduce)
            finally:
                _local.fraction = _local.all_reduce = _local.own_loss = None
                _local.moving_statistics = set()
            return outputs

        return super().run(weighed, args=args, kwargs=kwargs, options=options)

    def run_unweighed(self, fn, args=(), kwargs=None):
        """TensorFlow's `run`: `fn` in every replica as it is, with no collective of tfdp's
        (a probe that times one worker alone must not wait for the others)."""
        return tf.distribute.Strategy.run(self, fn, args=args, kwargs=kwargs or {})

    def _say_not_scaled(self, model, fn, weighed) -> None:
        """One line, once per strategy and step, for an own step whose loss Keras never
        scaled (`notes`; also a warning unless a driver reports the notes itself)."""
        name = f"{type(model).__name__}.{fn.__name__}"
        if fn.__name__ != "train_step" or not shards.overrides(model, "train_step"):
            return
        if self.num_replicas_in_sync == 1:  # one replica holds the whole batch: nothing to weigh
            return
        if not model.trainable_weights:
            return
        if weighed:
            note = (
                f"{name} computes its loss without Keras' loss functions (compute_loss): each "
                "replica's gradients and the scalars its Mean trackers take are weighed by its "
                "share of the batch's examples, which is exact for a loss that is a mean over "
                "the batch"
            )
        else:
            note = (
                f"{name} computes its loss without Keras' loss functions and hands no gradients "
                "to an optimizer: its update is not weighed by each replica's share of the "
                "batch, and is not one device's; compute the loss with self.compute_loss(...)"
            )
        if note in self.notes:
            return
        self.notes.append(note)
        if self.warn_notes:
            warnings.warn(f"tfdp.MirroredStrategy: {note}", stacklevel=3)

    def reduce(self, reduce_op, value, axis=None):
        """TensorFlow's reduce, but: with axis=None, a value whose replicas' pieces differ
        in shape (pieces of a batch cut by share) is those pieces concatenated in replica
        order, the batch they were cut from, for SUM and MEAN alike; eagerly and in a
        tf.function the same (decided when the step runs where the shapes are not static).
        Pieces of equal shapes reduce as TensorFlow's. A value without a batch axis (a
        scalar log) is reduced across the replicas only, where TensorFlow fails to reduce
        it along `axis` (Keras does so for every log on several workers)."""
        if axis is not None and _rank(self, value) == 0:
            axis = None
        tensorflows = super().reduce
        if axis is not None:
            return tensorflows(reduce_op, value, axis)
        leaves = tf.nest.flatten(value)
        if not any(_rank(self, leaf) for leaf in leaves):
            return tensorflows(reduce_op, value, axis)
        return tf.nest.pack_sequence_as(
            value, [_pieces_reduced(self, tensorflows, reduce_op, leaf) for leaf in leaves]
        )


class _Books:
    """The variables a step reads and writes: the shares, and the timing behind "auto"."""

    def __init__(self, strategy, count):
        make = strategy._variable  # noqa: SLF001 (the strategy's own maker)
        self.shares = make(_shares(strategy.powers), tf.float64, "tfdp_shares")
        self.timed_steps = make(0, tf.int64, "tfdp_timed_steps")
        self.window_rows = make([0.0] * count, tf.float64, "tfdp_window_rows")
        self.window_seconds = make([0.0] * count, tf.float64, "tfdp_window_seconds")
        self.measured = make([0.0] * count, tf.float64, "tfdp_measured")
        self.slowdown_calls = make([0] * count, tf.int64, "tfdp_slowdown_calls")
        self.slowdown_per_example = make([0.0] * count, tf.float64, "tfdp_slowdown")
        self.last_seconds = make([0.0] * count, tf.float64, "tfdp_last_seconds")


class MirroredStrategy(UnevenShares, tf.distribute.MirroredStrategy):
    """Synchronous replicas on one machine, each taking its share of every global batch.

    Args:
      devices: as TensorFlow's: device names, or None for every local GPU (else the CPU).
      powers: one relative speed per device (`[5, 1]`), "auto" (measured), or None for even
        shares, the results of TensorFlow's MirroredStrategy on those devices.
      reduce: "allreduce" (TensorFlow's choice of all-reduce) or "device0" (the MXNet
        tutorial's: the gradients summed on device 0 and sent back from there).
      cross_device_ops: as TensorFlow's (with reduce="allreduce" only).
      rebalance_every: with powers="auto", measure again over every K steps and take the
        measured shares (None: once, over the first `measure_steps` steps).
      measure_steps: with powers="auto", the steps of the first measurement (the step that
        starts a run is left out: it sets up kernels).
      simulate_slowdown: {replica index: factor}, to try the balancing without unequal
        devices: before its gradients leave, that replica sleeps (factor - 1) times its
        seconds per example (as measured in its second step) for every example it holds; a
        sleep holds no core. Never on by default.
      batch_statistics: what a BatchNormalization layer in training normalizes by:
        "whole", the whole global batch's mean and variance (one device's step, however
        uneven the pieces; one small all-reduce per layer and step), or "replica", each
        piece's own, as TensorFlow's MirroredStrategy (the moving statistics then move by
        the pieces' statistics combined by share).

    With powers="auto" the shares start even and are measured on the model's own step, in
    the step itself: each replica's seconds from the moment every replica holds its piece
    to the moment its gradients are ready, over its rows. The shares become those speeds,
    which moves the replicas toward equal finishing times; the batches cut after a change
    take them, and every step stays exact whatever its pieces hold.
    """

    def __init__(
        self,
        devices=None,
        powers=None,
        *,
        reduce="allreduce",
        cross_device_ops=None,
        rebalance_every=None,
        measure_steps=5,
        simulate_slowdown=None,
        batch_statistics="whole",
    ):
        if reduce not in REDUCES:
            raise ConfigError("reduce", reduce, f"must be one of {', '.join(REDUCES)}")
        if reduce == "device0":
            if cross_device_ops is not None:
                raise ConfigError(
                    "cross_device_ops", cross_device_ops, "is set by reduce='device0'; give one"
                )
            first = _device_names(devices)[0] if devices else None
            cross_device_ops = tf.distribute.ReductionToOneDevice(reduce_to_device=first)
        self._collective_key_base = next_collective_key_base()
        super().__init__(devices, cross_device_ops=cross_device_ops)
        self.reduce_to = reduce
        self._set_up_shares(powers, rebalance_every, measure_steps, simulate_slowdown,
                            batch_statistics)


def whole_batch_logs(model, logs, fraction, context, all_reduce=None):
    """A Keras step's logs as the whole batch gives them: every value that is one of the
    model's metrics read from its variables summed over the replicas; any other float
    value the replicas' values weighed by share."""
    all_reduce = all_reduce or context.all_reduce
    metrics = model.metrics
    variables, seen = [], set()
    for metric in metrics:
        for variable in metric.variables:
            if id(variable) not in seen:
                seen.add(id(variable))
                variables.append(variable)
    whole = {}
    if variables:
        values = [tf.convert_to_tensor(v.value) for v in variables]
        summable = [i for i, v in enumerate(variables) if v.aggregation in ("sum", "mean")]
        reduced = _sum_by_dtype(all_reduce, [_as_float(values[i]) for i in summable])
        count = float(context.num_replicas_in_sync)
        for i, value in zip(summable, reduced):
            if variables[i].aggregation == "mean":
                value = value / count
            values[i] = tf.cast(value, values[i].dtype)
        with internals.stateless_scope(list(zip(variables, values))):
            for metric in metrics:
                result = metric.result()
                if isinstance(result, dict):
                    whole.update(result)
                else:
                    whole[metric.name] = result
    weighed = {}
    for name, value in logs.items():
        if name in whole and _same_shape(whole[name], value):
            weighed[name] = tf.cast(whole[name], tf.convert_to_tensor(value).dtype)
        elif tf.is_tensor(value) and value.dtype.is_floating:
            share = tf.cast(fraction, value.dtype)
            weighed[name] = all_reduce(tf.distribute.ReduceOp.SUM, value * share)
        else:
            weighed[name] = value
    return weighed


class _Clock:
    """Times one replica's step on the step's own ops: from the moment every replica holds
    its piece to the moment its gradients are handed to the all-reduce (the last sum the step asks for),
    with the simulated slowdown added there. `record` publishes the replicas' speeds and,
    when a measurement window ends, sets the shares to them."""

    def __init__(self, strategy, context, rows, after):
        self.strategy, self.context, self.rows = strategy, context, rows
        self.replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        self.start = host_clock.read_after(after)
        self.end = None

    def __enter__(self):
        keras_all_reduce = self.context.all_reduce

        def all_reduce(reduce_op, value, options=None):
            if reduce_op == tf.distribute.ReduceOp.SUM or reduce_op == "SUM":
                value = self.gradients_ready(value)
            return keras_all_reduce(reduce_op, value, options)

        self.context.all_reduce = all_reduce
        return self

    def __exit__(self, *exc):
        del self.context.all_reduce

    def gradients_ready(self, value):
        leaves = [v for v in tf.nest.flatten(value, expand_composites=True) if tf.is_tensor(v)]
        end = host_clock.read_after(*leaves)
        factor = self.strategy.slowdown.get(self.replica)
        given = self.strategy._sleep_per_example  # noqa: SLF001
        if given is not None:
            end = host_clock.sleep_then_read(end, given[self.replica] * tf.cast(self.rows, tf.float64))
        elif factor:
            end = self.strategy._slow_down(self.replica, factor, self.start, end, self.rows)  # noqa: SLF001
        self.end = end
        # The gradients leave after the clock (and the sleep): a data dependency, as a
        # control dependency on a stateless op is pruned when nothing reads its value.
        return tf.nest.map_structure(lambda leaf: _after(leaf, end), value)

    def record(self, all_reduce):
        strategy = self.strategy
        if self.end is None or not (strategy.auto or strategy._reports_seconds):  # noqa: SLF001
            return  # (no gradients: an evaluation step)
        count = self.strategy.num_replicas_in_sync
        mine = tf.one_hot(self.replica, count, dtype=tf.float64)
        seconds = tf.maximum(self.end - self.start, 1e-9)
        both = all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.concat([mine * tf.cast(self.rows, tf.float64), mine * seconds], 0),
        )
        if self.replica % strategy.local_replicas == 0:  # one replica per worker keeps the books
            if strategy.auto:
                strategy._account(both[:count], both[count:])  # noqa: SLF001
            strategy.books.last_seconds.assign(both[count:])


# -- Keras' step functions under this strategy -------------------------------------------

_keras_installed = {}


def _install_keras_functions() -> None:
    """For a model under tfdp's strategy, Keras builds the model from the data's shapes
    (`element_spec`) where it would take the first batch of a fresh iterator (which loses
    the batches a generator had read ahead), and Keras' train, test and predict functions run
    `steps_per_execution` steps as that many calls of a one-step function (Keras' own
    multi-step loop fails inside tf.distribute on this TensorFlow: keras-team/keras#19246),
    and without XLA where the replicas are not all GPUs (one XLA program cannot span
    several CPU devices), saying so once."""
    if _keras_installed:
        return
    TensorFlowTrainer = internals.tensorflow_trainer()  # noqa: N806 (Keras' class)
    keras_make = TensorFlowTrainer._make_function  # noqa: SLF001
    keras_make_predict = TensorFlowTrainer.make_predict_function

    def _make_function(self, step_function):
        strategy = self.distribute_strategy
        if not isinstance(strategy, UnevenShares):
            return keras_make(self, step_function)
        with _without_xla(self, strategy):
            one_step = keras_make(self, step_function)
        return _step_by_step(self, one_step)

    def make_predict_function(self, force=False):
        strategy = self.distribute_strategy
        if not isinstance(strategy, UnevenShares):
            return keras_make_predict(self, force)
        with _without_xla(self, strategy):
            return keras_make_predict(self, force)

    keras_build = TensorFlowTrainer._maybe_symbolic_build  # noqa: SLF001

    def _maybe_symbolic_build(self, iterator=None, data_batch=None):
        strategy = internals.model_strategy(self)
        dataset = internals.distributed_dataset(iterator)
        spec = getattr(dataset, "_tfdp_element_spec", None)
        if not isinstance(strategy, UnevenShares) or data_batch is not None or spec is None:
            return keras_build(self, iterator=iterator, data_batch=data_batch)
        spec = tf.nest.map_structure(_none_for_none_spec, spec)  # an optional input given None
        with strategy.scope():
            self._symbolic_build(data_batch=spec)  # noqa: SLF001

    TensorFlowTrainer._make_function = _make_function  # noqa: SLF001
    TensorFlowTrainer.make_predict_function = make_predict_function
    TensorFlowTrainer._maybe_symbolic_build = _maybe_symbolic_build  # noqa: SLF001
    _keras_installed.update(make=keras_make, make_predict=keras_make_predict, build=keras_build)


@contextlib.contextmanager
def _without_xla(model, strategy):
    if model.run_eagerly or not model.jit_compile or strategy.compiles_with_xla:
        yield
        return
    warnings.warn(
        f"tfdp.MirroredStrategy: {model.name} runs without XLA (jit_compile=True is set): "
        f"one XLA program cannot span the devices {', '.join(strategy.extended.worker_devices)}",
        stacklevel=4,
    )
    internals.set_jit_compile(model, False)
    try:
        yield
    finally:
        internals.set_jit_compile(model, True)


def _step_by_step(model, one_step):
    """Keras' function of `steps_per_execution` steps, as that many one-step calls."""

    def function(iterator):
        steps = model.steps_per_execution
        outputs = None
        for _ in range(steps):
            model.steps_per_execution = 1  # read when Keras' function traces
            try:
                outputs = one_step(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if outputs is None:
                    raise
                break
            finally:
                model.steps_per_execution = steps
        return outputs

    return function


# -- BatchNormalization: the whole batch's statistics -------------------------------------

_batch_statistics_installed = {}


def _install_batch_statistics() -> None:
    """Inside a weighted replica step of tfdp's strategy, a BatchNormalization layer in
    training normalizes by the whole global batch's mean and variance (`batch_statistics=
    "whole"`, the default): the pieces' sums and counts are summed over the replicas, as
    Keras' `synchronized=True` does, so the step is one device's on the whole batch
    however uneven the pieces. With "replica", by each piece's own statistics, as
    TensorFlow's MirroredStrategy computes them (unless the layer is `synchronized`), and
    its moving statistics are the pieces' combined by share (`_install_assign_by_share`)."""
    if _batch_statistics_installed:
        return
    BatchNormalization = internals.batch_normalization()  # noqa: N806 (Keras' class)
    keras_moments = BatchNormalization._moments  # noqa: SLF001

    def _moments(self, inputs, mask):
        all_reduce = getattr(_local, "all_reduce", None)
        context = tf.distribute.get_replica_context()
        if all_reduce is None or context is None or context.num_replicas_in_sync == 1:
            return keras_moments(self, inputs, mask)
        if context.strategy.batch_statistics == "replica" and not self.synchronized:
            _local.moving_statistics.update(
                id(internals.variable_value(v)) for v in self.non_trainable_variables
            )
            return keras_moments(self, inputs, mask)
        return whole_batch_moments(self, inputs, mask, all_reduce)

    BatchNormalization._moments = _moments  # noqa: SLF001
    _batch_statistics_installed["moments"] = keras_moments


def whole_batch_moments(layer, inputs, mask, all_reduce):
    """A BatchNormalization layer's mean and variance over the whole global batch. Each
    replica computes its piece's count, mean and sum of squared deviations, as one
    device computes them; one all-reduce hands every replica every piece's, which
    combine as parallel variance does (Chan et al.): no precision lost to a large mean.
    A mask weighs the examples as Keras' own masked moments do."""
    context = tf.distribute.get_replica_context()
    replicas = context.num_replicas_in_sync
    replica = tf.get_static_value(context.replica_id_in_sync_group)
    axes = internals.reduction_axes(layer)
    if mask is None:
        weights = tf.ones_like(inputs[tuple(slice(0, 1) if i in axes else slice(None)
                                             for i in range(inputs.shape.rank))])
        count = tf.cast(tf.reduce_prod(tf.gather(tf.shape(inputs), axes)), inputs.dtype) * weights
        weights = None
        epsilon = 0.0
    else:
        weights = tf.cast(tf.broadcast_to(tf.expand_dims(mask, -1), tf.shape(inputs)), inputs.dtype)
        count = tf.reduce_sum(weights, axes, keepdims=True)
        epsilon = internals.keras_epsilon()
    weighed = inputs if weights is None else inputs * weights
    mean = tf.math.divide_no_nan(tf.reduce_sum(weighed, axes, keepdims=True), count)
    deviations = tf.square(inputs - mean)
    if weights is not None:
        deviations *= weights
    squares = tf.reduce_sum(deviations, axes, keepdims=True)
    mine = tf.stack([count, mean, squares])  # [3, 1.., C, ..1]
    slot = tf.reshape(tf.one_hot(replica, replicas, dtype=inputs.dtype),
                      [replicas] + [1] * mine.shape.rank)
    every = all_reduce(tf.distribute.ReduceOp.SUM, slot * mine[tf.newaxis])
    counts, means, squares = every[:, 0], every[:, 1], every[:, 2]
    total = tf.reduce_sum(counts, 0)
    mean = tf.math.divide_no_nan(tf.reduce_sum(counts * means, 0), total + epsilon)
    squares = tf.reduce_sum(squares + counts * tf.square(means - mean), 0)
    variance = tf.math.divide_no_nan(squares, total + epsilon)
    return tf.squeeze(mean, axes), tf.squeeze(variance, axes)


# -- moving statistics, combined by share ------------------------------------------------

_assign_installed = {}


def _install_assign_by_share() -> None:
    """Inside a weighted replica step of tfdp's strategy with per-replica batch statistics
    (`batch_statistics="replica"`), an assignment to a BatchNormalization layer's moving
    statistics assigns the replicas' values combined by share, on every replica. Every
    other assignment in a replica is TensorFlow's (an ON_WRITE variable with aggregation
    NONE keeps each replica's own value)."""
    if _assign_installed:
        return
    values_util = internals.values_util()
    tensorflow_assign = values_util.on_write_assign

    def on_write_assign(var, value, use_locking=False, name=None, read_value=True):
        fraction = getattr(_local, "fraction", None)
        if fraction is not None and id(var) in _local.moving_statistics:
            context = tf.distribute.get_replica_context()
            value = tf.convert_to_tensor(value, var.dtype)
            share = tf.cast(fraction, value.dtype)
            mine = tf.where(share > 0, value * share, tf.zeros_like(value))
            value = (getattr(_local, "all_reduce", None) or context.all_reduce)(
                tf.distribute.ReduceOp.SUM, mine
            )
        return tensorflow_assign(var, value, use_locking=use_locking, name=name,
                                 read_value=read_value)

    values_util.on_write_assign = on_write_assign
    _assign_installed["assign"] = tensorflow_assign


# -- TensorFlow's loss arithmetic, by share -----------------------------------------------

_losses_installed = {}


def _install_tensorflows_losses() -> None:
    """Inside a weighted replica step of tfdp's strategy, `tf.nn.compute_average_loss`
    without `global_batch_size` is the replica's part of the whole batch's mean (its
    piece's mean times its share), where TensorFlow's divides by the piece's rows times
    the replicas, right for even pieces only. With `global_batch_size`, or outside
    tfdp's replicas, it is TensorFlow's."""
    if _losses_installed:
        return
    tensorflow_average = tf.nn.compute_average_loss

    def compute_average_loss(per_example_loss, sample_weight=None, global_batch_size=None):
        fraction = getattr(_local, "fraction", None)
        if global_batch_size is not None or fraction is None:
            return tensorflow_average(per_example_loss, sample_weight=sample_weight,
                                      global_batch_size=global_batch_size)
        per_example_loss = tf.convert_to_tensor(per_example_loss)
        rows = tf.shape(per_example_loss)[0] if per_example_loss.shape.rank else None
        mean = tensorflow_average(per_example_loss, sample_weight=sample_weight,
                                  global_batch_size=rows)
        return mean * tf.cast(fraction, mean.dtype)

    compute_average_loss.__doc__ = tensorflow_average.__doc__
    internals.replace_everywhere(tensorflow_average, compute_average_loss)
    _losses_installed["compute_average_loss"] = tensorflow_average


# -- an optimizer built inside a distributed tf.function ------------------------------------

_build_installed = {}


def _install_build_check() -> None:
    """A layer or an optimizer that makes variables on its first call inside
    `strategy.run` in a tf.function (TensorFlow's custom-training tutorial, as published:
    a Sequential model without an input shape, Adam) makes a step TensorFlow cannot run
    on several replicas: TensorFlow's MirroredStrategy fails there when the step runs,
    with "You must feed a value for placeholder tensor" (keras-team/keras#19246). Under
    tfdp's strategy it is one line, when the step is traced, naming what to build first.
    (An optimizer that makes no variables, SGD without momentum, builds there as under
    TensorFlow's.)"""
    if _build_installed:
        return
    BaseOptimizer = internals.base_optimizer()  # noqa: N806 (Keras' class)
    keras_add_variable = BaseOptimizer.add_variable
    Layer = internals.keras_layer()  # noqa: N806 (Keras' class)
    keras_add_weight = Layer.add_weight

    def add_weight(self, *args, **kwargs):
        _refuse_a_build_inside_a_distributed_function("layer", self.name, "call")
        return keras_add_weight(self, *args, **kwargs)

    def add_variable(self, *args, **kwargs):
        _refuse_a_build_inside_a_distributed_function("optimizer", self.name, "apply_gradients")
        return keras_add_variable(self, *args, **kwargs)

    BaseOptimizer.add_variable = add_variable
    Layer.add_weight = add_weight
    _build_installed["add_weight"] = keras_add_weight
    _build_installed["add_variable"] = keras_add_variable


def _refuse_a_build_inside_a_distributed_function(field, name, first) -> None:
    """ConfigError where a variable is being made inside a weighted replica step of tfdp's
    strategy, in a tf.function being traced, over several replicas."""
    context = tf.distribute.get_replica_context()
    if (
        getattr(_local, "fraction", None) is not None
        and getattr(_local, "traced", False)
        and context is not None
        and context.num_replicas_in_sync > 1
    ):
        raise ConfigError(
            field, name,
            f"builds its variables on its first {first}, inside strategy.run in a tf.function, "
            "which TensorFlow cannot run on several replicas: in strategy.scope(), before the "
            "loop, build the model and then the optimizer (model.build(input_shape); "
            "optimizer.build(model.trainable_variables))",
        )


# -- gradient clipping, of the summed gradient ------------------------------------------

_clip_installed = {}


def _install_clip_of_the_sum() -> None:
    """Inside a weighted replica step of tfdp's strategy, the gradients an own step whose
    loss Keras never scaled (its own mean) hands to the optimizer are weighed by the
    replica's share (exact for a mean over the batch), and an optimizer that clips
    (clipnorm, clipvalue, global_clipnorm) clips the gradient summed over the replicas,
    as on one device: Keras clips each replica's gradient before its all-reduce, which
    depends on the pieces. The replicas' gradients are summed, clipped by Keras' own rule,
    and each replica hands on 1/R of the result: Keras' clip then leaves each part as it
    is (each is within the bound) and its all-reduce sums them to the clipped sum. One
    more all-reduce per step, only where the optimizer clips."""
    if _clip_installed:
        return
    BaseOptimizer = internals.base_optimizer()  # noqa: N806 (Keras' class)
    keras_clip = BaseOptimizer._clip_gradients  # noqa: SLF001

    def _clip_gradients(self, grads):
        all_reduce = getattr(_local, "all_reduce", None)
        if all_reduce is None:
            return keras_clip(self, grads)
        piece = shards.current()
        if _local.own_loss and piece is not None and not piece.scaled:
            # an own step's own mean loss: its gradients count by the replica's share
            grads = [None if g is None else shards.weighed(g, _local.fraction) for g in grads]
            _local.weighed_own = True
        clips = any(getattr(self, name, None) for name in ("clipnorm", "clipvalue", "global_clipnorm"))
        if not clips:
            return keras_clip(self, grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        summed = all_reduce(tf.distribute.ReduceOp.SUM, [grads[i] for i in present])
        clipped = keras_clip(self, list(summed))
        replicas = tf.distribute.get_replica_context().num_replicas_in_sync
        grads = list(grads)
        for i, g in zip(present, clipped):
            grads[i] = g / tf.cast(replicas, g.dtype)
        return keras_clip(self, grads)

    BaseOptimizer._clip_gradients = _clip_gradients  # noqa: SLF001
    _clip_installed["clip"] = keras_clip


# -- helpers ---------------------------------------------------------------------------


def _without_autotune():
    """tf.data options with autotuning off, where the user set none: with it on, deleting
    an iterator (Keras deletes one at the end of every fit, evaluation and prediction) was
    seen to wait for a tf.data thread that sleeps 10 ms x 2^k, up to a minute and more
    beside another busy process (BUILD_NOTES, "tf.data autotuning: off")."""
    options = tf.data.Options()
    options.autotune.enabled = False
    return options


def _checked_steps(field, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "must be a whole number of steps >= 1")
    return value


def _checked_slowdown(slowdown, count):
    slowdown = dict(slowdown or {})
    for replica, factor in slowdown.items():
        if not isinstance(replica, int) or not 0 <= replica < count:
            raise ConfigError("simulate_slowdown", slowdown, f"{replica!r} is not a replica index below {count}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ConfigError("simulate_slowdown", slowdown, f"factor {factor!r} must be a number >= 1")
    return {replica: float(factor) for replica, factor in slowdown.items()}


def _checked_powers(powers, count):
    if powers is None:
        return [1.0] * count
    if isinstance(powers, str):
        raise ConfigError("powers", powers, "must be 'auto', a sequence of numbers (e.g. [1, 3]) or None")
    powers = list(powers)
    if len(powers) != count:
        raise ConfigError("powers", powers, f"needs one power per replica ({count}), got {len(powers)}")
    for p in powers:
        if isinstance(p, bool) or not isinstance(p, (int, float)) or not p > 0 or p == float("inf"):
            raise ConfigError("powers", powers, f"every power must be a positive finite number, got {p!r}")
    return [float(p) for p in powers]


def _shares(powers):
    total = sum(powers)
    return [p / total for p in powers]


def _device_names(devices):
    return [d if isinstance(d, str) else d.name for d in devices]


def _none_for_none_spec(spec):
    """None for the spec of a None in a dataset's elements (Keras builds an optional input
    given None from None), any other spec as it is."""
    return None if type(spec).__name__ == "NoneTensorSpec" else spec


def _has_rows(spec) -> bool:
    shape = getattr(spec, "shape", None)
    return shape is not None and shape.rank is not None and shape.rank >= 1


def rows_of(structure):
    """Rows of the first leaf of `structure` that is a batch (a dense, ragged or sparse
    tensor with a batch axis; not a variable, nor another composite such as a gradient's
    IndexedSlices), else None."""
    for leaf in tf.nest.flatten(structure, expand_composites=False):
        if isinstance(leaf, tf.RaggedTensor):
            return leaf.nrows(out_type=tf.int64)
        if isinstance(leaf, tf.SparseTensor):
            return leaf.dense_shape[0]
        if isinstance(leaf, tf.Tensor) and leaf.shape.rank is not None and leaf.shape.rank >= 1:
            return tf.shape(leaf, out_type=tf.int64)[0]
    return None


def _batch_positions(structure, every):
    """The positions (in `tf.nest.flatten` order) of the leaves of `run`'s arguments that
    hold a value per replica; with `every`, all of them."""
    leaves = tf.nest.flatten(structure, expand_composites=False)
    if every:
        return None
    return [
        i for i, leaf in enumerate(leaves)
        if isinstance(leaf, tf.distribute.DistributedValues)
        and not isinstance(leaf, (tf.Variable, internals.mirrored_type()))
    ]


def _leaves_at(structure, positions):
    """The leaves of a replica's arguments at `positions` (all of them for None)."""
    leaves = tf.nest.flatten(structure, expand_composites=False)
    if positions is None:
        return leaves
    return [leaves[i] for i in positions if i < len(leaves)]


def _rows(leaf, start, stop):
    """Rows [start, stop) of one leaf of a batch; a leaf without a batch axis whole."""
    if isinstance(leaf, tf.SparseTensor):
        shape = leaf.dense_shape
        begin = tf.concat([[start], tf.zeros_like(shape[1:])], 0)
        size = tf.concat([[stop - start], shape[1:]], 0)
        return tf.sparse.slice(leaf, begin, size)
    if isinstance(leaf, tf.RaggedTensor):
        return leaf[start:stop]
    if tf.is_tensor(leaf) and leaf.shape.rank is not None and leaf.shape.rank >= 1:
        return leaf[start:stop]
    return leaf


def _placed(context, strategy):
    """The replica context's all-reduce, its values first placed on the replica's device (a
    collective needs a device to send from; a value Keras reads from a variable may have
    none)."""
    replica = int(tf.get_static_value(context.replica_id_in_sync_group))
    device = strategy.extended.worker_devices[replica % strategy.local_replicas]
    keras_all_reduce = context.all_reduce

    def all_reduce(reduce_op, value, options=None):
        with tf.device(device):
            value = tf.nest.map_structure(tf.identity, value)
        return keras_all_reduce(reduce_op, value, options)

    return all_reduce


def _trainer_of(fn):
    """The Keras model whose own step `fn` is (Keras passes `model.train_step`), else None."""
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__name__", "")
    if isinstance(owner, internals.keras_trainer()) and name in ("train_step", "test_step"):
        return owner
    return None


def _after(leaf, clock):
    """`leaf` (a tensor, or a sparse gradient's rows), computed only once `clock` is."""
    if isinstance(leaf, tf.IndexedSlices):
        return tf.IndexedSlices(_after(leaf.values, clock), leaf.indices, leaf.dense_shape)
    if not tf.is_tensor(leaf) or not (leaf.dtype.is_floating or leaf.dtype.is_complex):
        with tf.control_dependencies([clock]):
            return tf.identity(leaf)
    return leaf + tf.cast(clock * 0.0, leaf.dtype)


def _sum_by_dtype(all_reduce, values):
    """The replicas' sums of `values`, one all-reduce per dtype (TensorFlow packs a list
    into one tensor, which fails on mixed dtypes: a float64 confusion matrix beside
    float32 totals)."""
    sums = [None] * len(values)
    for dtype in sorted({v.dtype for v in values}, key=lambda d: d.name):  # the same order on every replica
        indices = [i for i, v in enumerate(values) if v.dtype == dtype]
        for i, total in zip(indices, all_reduce(tf.distribute.ReduceOp.SUM, [values[i] for i in indices])):
            sums[i] = total
    return sums


def _as_float(value):
    return value if value.dtype.is_floating else tf.cast(value, tf.float64)


def _same_shape(a, b) -> bool:
    try:
        return tf.convert_to_tensor(a).shape == tf.convert_to_tensor(b).shape
    except (TypeError, ValueError):
        return False


def _pieces_reduced(strategy, tensorflows, reduce_op, leaf):
    """One leaf of `reduce(..., axis=None)`: TensorFlow's reduction where the replicas'
    values have one shape, their concatenation where not."""
    if not isinstance(leaf, tf.distribute.DistributedValues) or not _rank(strategy, leaf):
        return tensorflows(reduce_op, leaf, None)
    pieces = strategy.experimental_local_results(leaf)
    shapes = [getattr(piece, "shape", None) for piece in pieces]
    if any(shape is None or shape.rank != shapes[0].rank for shape in shapes):
        return tensorflows(reduce_op, leaf, None)
    if all(shape.is_fully_defined() for shape in shapes):
        if len({tuple(shape) for shape in shapes}) == 1:
            return tensorflows(reduce_op, leaf, None)
        return _concat(pieces)
    if not all(isinstance(piece, tf.Tensor) for piece in pieces):
        return tensorflows(reduce_op, leaf, None)
    first = tf.shape(pieces[0])
    same = tf.reduce_all([tf.reduce_all(tf.equal(tf.shape(p), first)) for p in pieces[1:]])
    return tf.cond(same, lambda: tensorflows(reduce_op, leaf, None), lambda: _concat(pieces))


def _rank(strategy, value):
    first = strategy.experimental_local_results(value)[0] if isinstance(
        value, tf.distribute.DistributedValues) else value
    shape = getattr(first, "shape", None)
    return None if shape is None else shape.rank


def _concat(pieces):
    pieces = list(pieces)
    if isinstance(pieces[0], tf.SparseTensor):
        return tf.sparse.concat(0, pieces)
    return tf.concat(pieces, 0)



def _global_batches(dataset, replicas):
    """`replicas` consecutive per-replica batches of `dataset` at a time, as one batch
    (their rows in order): the global batch a dataset function's batches make."""
    structure = dataset.element_spec

    def concatenated(*window):
        # a window is the element's structure of datasets (a tuple's parts as arguments)
        batches = tf.data.Dataset.zip(window if isinstance(structure, tuple) else window[0])
        return batches.unbatch().batch(2**62)

    return dataset.window(replicas).flat_map(concatenated)
