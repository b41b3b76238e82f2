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
   `experimental_distribute_dataset` cuts each global batch into one consecutive piece
   per replica by engine/pieces.py's rule, the one `tfdp.fit` cuts by (a short batch,
   or one whose shape changes from step to step, too; a piece may be empty).
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
import warnings
import weakref

import tensorflow as tf

from tfdp import internals
from tfdp.config import BATCH_STATISTICS
from tfdp.data.arrays import without_autotune
from tfdp.engine import books as books_lib
from tfdp.engine import patches, pieces, replica, shards, whole_batch
from tfdp.errors import ConfigError

REDUCES = ("allreduce", "device0")


class UnevenShares:
    """What tfdp's strategies add to TensorFlow's: the cut, the weight, the logs, the
    moving statistics, and the shares themselves (given, or measured).

    What a driver (tfdp's trainer, the cluster's exchange) uses of a strategy beyond
    `tf.distribute.Strategy`'s public API, and nothing else (tests/test_layout.py):
      the shares: `shares`, `set_powers`, `measured_speeds`, `local_replicas`;
      the timing: `report_seconds`, `last_seconds`, `sleep_per_example`,
        `set_sleep_per_example`;
      the cluster: `send_along`, `received`, `run_unweighed`;
      how it runs: `compiles_with_xla`, `batch_statistics`, `reduce_to`, `notes`,
        `warn_notes`.
    """

    weighs_pieces = True  # what engine/patches.py asks of a model's strategy

    def _set_up_shares(self, powers, rebalance_every, measure_steps, simulate_slowdown,
                       batch_statistics="whole", max_rows=None):
        count = self.num_replicas_in_sync
        if batch_statistics not in BATCH_STATISTICS:
            raise ConfigError("batch_statistics", batch_statistics,
                              f"must be one of {', '.join(BATCH_STATISTICS)}")
        self.batch_statistics = batch_statistics
        self.auto = isinstance(powers, str) and powers == "auto"
        self.powers = [1.0] * count if self.auto else books_lib.checked_powers(powers, count)
        self.max_rows = books_lib.replica_caps(max_rows, count, self.local_replicas,
                                               self.extended.worker_devices)
        # powers=None, no caps, one machine (workers read whole batches): TensorFlow's cut
        # (its static shapes too) until powers are set; `run`'s weighing makes any cut exact.
        self.tensorflows_cut = powers is None and self.max_rows is None and not isinstance(
            self, tf.distribute.MultiWorkerMirroredStrategy)
        self.rebalance_every = books_lib.checked_steps("rebalance_every", rebalance_every, allow_none=True)
        self.measure_steps = books_lib.checked_steps("measure_steps", measure_steps)
        self.slowdown = books_lib.checked_slowdown(simulate_slowdown, count)
        self._books = None  # the variables of the shares and the timing, made on first use
        self.balance_log = []  # what the balancing said (one line per re-split)
        # the shares balanced by balance/'s rule (powers="auto", or rebalance_every)
        self.balancing = (
            books_lib.Balancing(self) if self.auto or self.rebalance_every else None
        )
        self.reports_seconds = False
        self._sent = self._received = None
        self.notes = []  # how it ran a model's own step, where not as Keras would (one line each)
        self.warn_notes = True
        self._sleep_per_example = None
        self._lifted = weakref.WeakKeyDictionary()  # a tf.function -> it, over the replicas
        patches.install()

    @property
    def books(self) -> books_lib.Books:
        """The shares and the timing, as variables a step reads and writes (made on first use)."""
        if self._books is None:
            self._books = books_lib.Books(self.powers)
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
            return books_lib.shares_of(self.powers)
        return [float(s) for s in self._books.shares.numpy()]

    @property
    def measured_speeds(self) -> list[float]:
        """Examples per second of each replica's step over the balancing's last window
        (powers="auto" or rebalance_every; zeros before the first)."""
        if self.balancing is None:
            return [0.0] * self.num_replicas_in_sync
        return self.balancing.speeds()

    def set_powers(self, powers) -> None:
        """New relative speeds; batches cut from now on take the new shares (a few batches
        may already be cut, and are weighed by the rows they hold, so the update stays exact).
        With powers="auto" or `rebalance_every`, the balancing starts again from them."""
        self.powers = books_lib.checked_powers(powers, self.num_replicas_in_sync)
        self.tensorflows_cut = False
        if self._books is not None:
            self._books.shares.assign(books_lib.shares_of(self.powers))
        if self.balancing is not None:
            self.balancing = books_lib.Balancing(self)

    def report_seconds(self, sleep_per_example=None) -> None:
        """Every step from now on times each replica (`last_seconds`), as a driver that
        balances the replicas itself reads them (tfdp.fit). `sleep_per_example`: seconds per
        example each replica sleeps before its gradients leave (a simulated slowdown set by
        the driver; zeros for none), in place of `simulate_slowdown`'s own calibration.
        Takes effect in steps traced after it."""
        self.reports_seconds = True
        if sleep_per_example is not None:
            self._sleep_per_example = books_lib.variable(sleep_per_example, tf.float64, "tfdp_sleep")

    def send_along(self, values) -> None:
        """Every step from now on also sums `values` (a float32 vector variable of this
        worker's) over the workers, in the all-reduce that counts the batch's rows, so it
        costs no collective of its own (a driver's stop signals); `received` holds the last
        step's sum. Takes effect in steps traced after it."""
        self._sent = values
        self._received = books_lib.variable(
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
        """Where a batch of `rows` rows is cut by the shares (engine/pieces.py's rule): R+1
        increasing row indices from 0 to rows."""
        return pieces.piece_bounds(rows, self.books.shares, self.max_rows)

    # -- data ---------------------------------------------------------------------------

    def experimental_distribute_dataset(self, dataset, options=None):
        """The dataset's batches, each cut into one piece per replica: TensorFlow's own
        cut with even shares (`powers=None`), else by share (`piece_bounds`). Either way
        a `tf.distribute.DistributedDataset`, as TensorFlow's strategy returns."""
        structure = dataset.element_spec
        if dataset.options().autotune.enabled is None:  # the user's own setting stands
            dataset = dataset.with_options(without_autotune())
        replication = None if options is None else options.experimental_replication_mode
        if self.tensorflows_cut or replication == tf.distribute.InputReplicationMode.PER_REPLICA:
            distributed = super().experimental_distribute_dataset(dataset, options)
        else:
            distributed = self._distribute_by_share(dataset, structure, options)
        # tfdp's own marks on the dataset it returns (not another library's members):
        distributed._tfdp_element_spec = structure  # noqa: SLF001 (Keras builds the model from it)
        distributed._tfdp_dataset = dataset  # noqa: SLF001 (tfdp.fit cuts its global batches itself)
        return distributed

    def _distribute_by_share(self, dataset, structure, options):
        if not any(pieces.has_rows(spec) for spec in tf.nest.flatten(structure)):
            raise ConfigError(
                "dataset", structure, "has no batch axis: batch it first (dataset.batch(n))"
            )
        pieces.check_within(structure, self.max_rows)  # where the batch's size is static
        local = self.local_replicas
        # Every replica gets a piece of every batch (maybe empty), so TensorFlow's stand-ins
        # for a replica without data are never used; they cannot be made for a None (an
        # optional input given None), so a dataset holding one is read without them.
        extended = self.extended
        stand_ins = extended.experimental_enable_get_next_as_optional
        if any(pieces.none_for_none_spec(spec) is None for spec in tf.nest.flatten(structure)):
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
                    lambda context: self._by_share(dataset, context.input_pipeline_id * local),
                    input_options,
                )
            return internals.distribute_without_rebatching(self, self._by_share(dataset, 0), options)
        finally:
            extended.experimental_enable_get_next_as_optional = stand_ins

    def _by_share(self, dataset, first):
        """Replicas first..first+local-1's pieces of each batch, cut by the shares."""
        return pieces.by_share(dataset, self.books.shares, first, self.local_replicas, self.max_rows)

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
            if not any(pieces.has_rows(spec) for spec in tf.nest.flatten(dataset.element_spec)):
                return dataset  # one value per replica, no batch to cut: TensorFlow's
            return self._by_share(pieces.global_batches(dataset, local), 0)

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

        model = shards.trainer_of(fn)
        fn = internals.autograph_convert(fn)
        timed = self.balancing is not None or bool(self.slowdown) or self.reports_seconds
        if timed:
            self.books  # noqa: B018 (made here, outside the replicas' threads)
        batch = pieces.batch_positions((args, kwargs), every=self.local_replicas == 1)

        @tf.autograph.experimental.do_not_convert
        def weighed(*replica_args, **replica_kwargs):
            rows = pieces.rows_of(pieces.leaves_at((replica_args, replica_kwargs), batch))
            if rows is None:  # no batch: Keras' own 1/R
                return fn(*replica_args, **replica_kwargs)
            context = tf.distribute.get_replica_context()
            all_reduce = replica.placed_all_reduce(context, self)  # tfdp's own: never timed
            rows = tf.cast(rows, tf.float32)
            total = self._count_rows(context, all_reduce, rows)
            fraction = tf.math.divide_no_nan(rows, total)
            clock = None
            if timed:  # from the moment every piece is in (the sum of rows) ...
                clock = books_lib.StepClock(self, context, rows, after=total)
                with tf.control_dependencies([clock.start]):  # ... the step starts after the clock
                    replica_args, replica_kwargs = tf.nest.map_structure(
                        tf.identity, (replica_args, replica_kwargs), expand_composites=True
                    )
            own_loss = model is not None and shards.overrides(model, fn.__name__)
            weighs_outputs = (
                shards.weighing_output_losses(model, fraction) if model is not None
                else contextlib.nullcontext()
            )
            with replica.weighed(fraction, all_reduce, own_loss) as step:
                with shards.piece(fraction) as piece, weighs_outputs, (clock or contextlib.nullcontext()):
                    outputs = fn(*replica_args, **replica_kwargs)
                if model is not None and not piece.scaled:
                    self._say_not_scaled(model, fn, step.weighed_own)
                if clock is not None:
                    clock.record(all_reduce)
                if model is not None and isinstance(outputs, dict):
                    outputs = whole_batch.logs(model, outputs, fraction, context, all_reduce)
            return outputs

        return super().run(weighed, args=args, kwargs=kwargs, options=options)

    def run_unweighed(self, fn, args=(), kwargs=None):
        """TensorFlow's `run`: `fn` in every replica as it is, with no collective of tfdp's
        (a probe that times one worker alone must not wait for the others)."""
        return tf.distribute.Strategy.run(self, fn, args=args, kwargs=kwargs or {})

    def _say_not_scaled(self, model, fn, weighed) -> None:
        """One line, once per strategy and step, for an own step whose loss Keras never
        scaled (`notes`; also a warning unless a driver reports the notes itself)."""
        note = shards.not_scaled(model, fn.__name__, weighed, self.num_replicas_in_sync)
        if note is None or note in self.notes:
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
        if axis is not None and pieces.rank(self, value) == 0:
            axis = None
        tensorflows = super().reduce
        if axis is not None:
            return tensorflows(reduce_op, value, axis)
        leaves = tf.nest.flatten(value)
        if not any(pieces.rank(self, leaf) for leaf in leaves):
            return tensorflows(reduce_op, value, axis)
        return tf.nest.pack_sequence_as(
            value, [pieces.reduced(self, tensorflows, reduce_op, leaf) for leaf in leaves]
        )


class MirroredStrategy(UnevenShares, tf.distribute.MirroredStrategy):
    """Synchronous replicas on one machine, each taking its share of every global batch.

    Args:
      devices: as TensorFlow's: device names, or None for every local GPU (else the CPU).
      powers: one relative speed per device (`[5, 1]`), "auto" (measured), or None for even
        shares, the results of TensorFlow's MirroredStrategy on those devices.
      reduce: "allreduce" (TensorFlow's choice of all-reduce) or "device0" (the MXNet
        tutorial's: the gradients summed on device 0 and sent back from there).
      cross_device_ops: as TensorFlow's (with reduce="allreduce" only).
      rebalance_every: rebalance the shares in windows of up to K steps, by the rule
        `tfdp.fit` rebalances by (None: with powers="auto", the shares hold once settled).
      measure_steps: with powers="auto", the steps of each of the first windows, in which
        the shares settle under load (the step that starts a run is left out: it sets up
        kernels).
      simulate_slowdown: {replica index: factor}, to try the balancing without unequal
        devices: before its gradients leave, that replica sleeps (factor - 1) times its
        seconds per example (as measured in its second step) for every example it holds; a
        sleep holds no core. Never on by default.
      batch_statistics: what a BatchNormalization layer in training normalizes by:
        "whole", the whole global batch's mean and variance (one device's step, however
        uneven the pieces; one small all-reduce per layer and step), or "replica", each
        piece's own, as TensorFlow's MirroredStrategy (the moving statistics then move by
        the pieces' statistics combined by share).
      max_rows: the most examples each replica takes in a step, e.g. [512, 64], or "auto"
        (none on CPUs); a batch beyond their sum fails in one line naming them
        (`books.replica_caps`, `pieces.by_share`; the guide's "Unequal memory").

    With powers="auto" (or rebalance_every) each step is timed on the model's own step:
    each replica's seconds from the moment every replica holds its piece to the moment its
    gradients are ready. The shares move by balance/'s rule, the one `tfdp.fit` balances
    by (`books.Balancing`): damped moves toward the fastest expected step, and only beyond
    the measured noise; `balance_log` says each move. The batches cut after a change take
    the new shares, and every step stays exact whatever its pieces hold.
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
        max_rows=None,
    ):
        if reduce not in REDUCES:
            raise ConfigError("reduce", reduce, f"must be one of {', '.join(REDUCES)}")
        if reduce == "device0":
            if cross_device_ops is not None:
                raise ConfigError(
                    "cross_device_ops", cross_device_ops, "is set by reduce='device0'; give one"
                )
            first = [d if isinstance(d, str) else d.name for d in devices][0] if devices else None
            cross_device_ops = tf.distribute.ReductionToOneDevice(reduce_to_device=first)
        internals.set_collective_key_base(self, internals.next_collective_key_base())
        super().__init__(devices, cross_device_ops=cross_device_ops)
        self.reduce_to = reduce
        self._set_up_shares(powers, rebalance_every, measure_steps, simulate_slowdown,
                            batch_statistics, max_rows)
