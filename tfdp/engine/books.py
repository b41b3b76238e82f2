"""The strategy's books: each replica's share of a batch, and the timing of every step
that balances the shares (`powers="auto"`) or reports the replicas' seconds to a driver.

`StepClock` times one replica's step on the step's own ops (engine/clock.py reads the
host clock without ordering the replicas); `Balancing` turns the steps' rows and
seconds into new shares by balance/'s rule, the one `tfdp.fit` balances by.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tfdp import internals
from tfdp.engine.clock import read_after, sleep_then_read
from tfdp.errors import ConfigError


def variable(value, dtype, name):
    """A variable of tfdp's books: on the host, outside any strategy's scope and any graph
    of the caller's (a tf.compat.v1 graph gets none of tfdp's variables)."""
    with tf.init_scope(), internals.outside_strategy_scopes(), tf.device("/cpu:0"):
        return tf.Variable(value, trainable=False, dtype=dtype, name=name)


class Books:
    """The variables a step reads and writes: the shares, the simulated slowdown's
    calibration, and the last timed step's seconds."""

    def __init__(self, powers):
        make, count = variable, len(powers)
        self.shares = make(shares_of(powers), tf.float64, "tfdp_shares")
        self.slowdown_calls = make([0] * count, tf.int64, "tfdp_slowdown_calls")
        self.slowdown_per_example = make([0.0] * count, tf.float64, "tfdp_slowdown")
        self.last_seconds = make([0.0] * count, tf.float64, "tfdp_last_seconds")


class Balancing:
    """The shares balanced by the rule `tfdp.fit` balances by (`balance.Rebalancing`:
    damped moves toward the fastest expected step, beyond the measured noise only), fed
    each timed step's rows and seconds per replica by a host call at the step's end
    (`observe`), so it runs in any loop: Keras' fit, a custom loop, `steps_per_execution`.

    powers="auto": the shares start even and settle under load in the first steps, in
    `balance.PROBE_WINDOWS` windows of `measure_steps` steps, as `tfdp.fit`'s auto powers
    settle after their measurement alone; with `rebalance_every` K the rebalancing carries
    on from there in windows of K steps. Given powers with `rebalance_every`: rebalancing
    from the given split, in windows of 1, 1, 2, 4, ... up to K steps, as `tfdp.fit`'s.
    A step is left out where it cannot tell the split's speed: the first (it sets up
    kernels), one of another batch size than the first's (a short last batch), and one
    cut before the last re-split reached the data (a dataset cuts a few batches ahead).
    """

    def __init__(self, strategy, log=None):
        self.strategy = strategy
        self.devices = list(range(strategy.num_replicas_in_sync))  # every worker's replicas
        self.log = log or strategy.balance_log.append
        self.split = None  # balance's view: whole examples of the first batch's size
        self.steps = 0  # timed steps seen
        self.settling = None  # powers="auto": the first windows, under load
        self.rebalancing = None  # rebalance_every: the windows after

    @property
    def resplits(self) -> list[dict]:
        """Every re-split so far (`balance.Rebalancing.resplits`)."""
        return [*getattr(self.settling, "resplits", []), *getattr(self.rebalancing, "resplits", [])]

    def speeds(self) -> list[float]:
        """Examples per second of each replica over the last window (zeros before one)."""
        active = self.rebalancing or self.settling
        seconds = None if active is None else active.seconds()
        if not seconds:
            return [0.0] * len(self.devices)
        return [shard / t for shard, t in zip(self.split.shards, seconds)]

    def observe(self, rows, seconds):
        """One timed step's rows and seconds per replica (numpy, from the step); returns
        the shares the batches cut from now on take."""
        from tfdp import balance
        from tfdp.engine.split import Split

        strategy, self.steps = self.strategy, self.steps + 1
        shares = np.asarray(strategy.books.shares.numpy(), np.float64)
        rows = [int(round(r)) for r in rows]
        if self.split is None:  # the first batch's size is the global batch balance splits
            caps = strategy.max_rows
            self.split = Split(self.devices, balance.whole_shares(sum(rows), list(shares), caps),
                               max_rows=caps)
            if strategy.auto:
                every = strategy.measure_steps
                self.settling = balance.Rebalancing(
                    self, every, self.log, first_window=every, unit="step")
            elif strategy.rebalance_every:
                self.rebalancing = balance.Rebalancing(self, strategy.rebalance_every, self.log,
                                                       unit="step")
        if self.steps == 1 or rows != self.split.shards:
            return shares
        if self.settling is not None and self.rebalancing is None:
            self.settling.observe(self.steps, [float(t) for t in seconds])
            if self.settling.windows >= balance.PROBE_WINDOWS:
                if strategy.rebalance_every:
                    self.rebalancing = balance.Rebalancing(
                        self, strategy.rebalance_every, self.log, unit="step")
                    self.rebalancing.carry_over(self.settling)
                else:
                    self.settling.every = 0  # settled: the shares hold
        elif self.rebalancing is not None:
            self.rebalancing.observe(self.steps, [float(t) for t in seconds])
        return np.asarray(self.split.shards, np.float64) / self.split.global_batch_size


class StepClock:
    """Times one replica's step on the step's own ops: from the moment every replica holds
    its piece to the moment its gradients are handed to the all-reduce (the last sum the
    step asks for), with the simulated slowdown added there. `record` publishes the replicas' speeds and,
    when a measurement window ends, sets the shares to them."""

    def __init__(self, strategy, context, rows, after):
        self.strategy, self.context, self.rows = strategy, context, rows
        self.replica = int(tf.get_static_value(context.replica_id_in_sync_group))
        self.start = read_after(after)
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
        end = read_after(*leaves)
        factor = self.strategy.slowdown.get(self.replica)
        given = self.strategy.sleep_per_example
        if given is not None:
            end = sleep_then_read(end, given[self.replica] * tf.cast(self.rows, tf.float64))
        elif factor:
            end = slow_down(self.strategy.books, self.replica, factor, self.start, end, self.rows)
        self.end = end
        # The gradients leave after the clock (and the sleep): a data dependency, as a
        # control dependency on a stateless op is pruned when nothing reads its value.
        return tf.nest.map_structure(lambda leaf: _after(leaf, end), value)

    def record(self, all_reduce):
        strategy = self.strategy
        if self.end is None or not (strategy.balancing is not None or strategy.reports_seconds):
            return  # (no gradients: an evaluation step)
        count = self.strategy.num_replicas_in_sync
        mine = tf.one_hot(self.replica, count, dtype=tf.float64)
        seconds = tf.maximum(self.end - self.start, 1e-9)
        both = all_reduce(
            tf.distribute.ReduceOp.SUM,
            tf.concat([mine * tf.cast(self.rows, tf.float64), mine * seconds], 0),
        )
        if self.replica % strategy.local_replicas == 0:  # one replica per worker keeps the books
            if strategy.balancing is not None:  # the shares from the balancing, on the host
                def observe(rows, seconds):  # the balancing of the call (`set_powers` starts anew)
                    return strategy.balancing.observe(rows, seconds)

                shares = tf.numpy_function(
                    observe, [both[:count], both[count:]], tf.float64, stateful=True
                )
                strategy.books.shares.assign(tf.reshape(shares, [count]))
            strategy.books.last_seconds.assign(both[count:])


def slow_down(books, replica, factor, start, end, rows):
    """The simulated slowdown of one replica: a sleep of (factor - 1) times its seconds
    per example, taken from its second step (the first sets up kernels) and fixed from
    then on, so that the sleep follows the rows it is given. Returns the time after it."""
    calls = books.slowdown_calls.scatter_nd_add([[replica]], [1])[replica]
    seconds = tf.maximum(end - start, 0.0)
    per_example = tf.math.divide_no_nan(seconds, tf.cast(rows, tf.float64))
    fixed = books.slowdown_per_example.scatter_nd_update(
        [[replica]], [tf.where(tf.equal(calls, 2), per_example, books.slowdown_per_example[replica])]
    )[replica]
    sleep = tf.where(fixed > 0, fixed * tf.cast(rows, tf.float64), seconds) * (factor - 1.0)
    return sleep_then_read(end, sleep)


def _after(leaf, clock):
    """`leaf` (a tensor, or a sparse gradient's rows), computed only once `clock` is."""
    if isinstance(leaf, tf.IndexedSlices):
        return tf.IndexedSlices(_after(leaf.values, clock), leaf.indices, leaf.dense_shape)
    if not tf.is_tensor(leaf) or not (leaf.dtype.is_floating or leaf.dtype.is_complex):
        with tf.control_dependencies([clock]):
            return tf.identity(leaf)
    return leaf + tf.cast(clock * 0.0, leaf.dtype)


def checked_steps(field, value, allow_none=False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(field, value, "must be a whole number of steps >= 1")
    return value


def checked_slowdown(slowdown, count):
    slowdown = dict(slowdown or {})
    for replica, factor in slowdown.items():
        if not isinstance(replica, int) or not 0 <= replica < count:
            raise ConfigError("simulate_slowdown", slowdown, f"{replica!r} is not a replica index below {count}")
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1:
            raise ConfigError("simulate_slowdown", slowdown, f"factor {factor!r} must be a number >= 1")
    return {replica: float(factor) for replica, factor in slowdown.items()}


def checked_powers(powers, count):
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


def replica_caps(max_rows, count, local, devices):
    """The most rows each of `count` replicas takes in a step, from `max_rows` (one per
    device; on several workers, one per worker, shared evenly by its `local` replicas);
    None for none. "auto": none on CPUs; GPUs are measured by `tfdp.fit` only."""
    from tfdp.devices import checked_max_rows, split_batch

    if max_rows is None:
        return None
    if isinstance(max_rows, str) and max_rows == "auto":
        if any("GPU" in d.upper() for d in devices):
            raise ConfigError(
                "max_rows", max_rows, "is measured by tfdp.fit and the tfdp command, which "
                "run the model's step first; under model.fit give the caps, one per device",
            )
        return None  # a CPU holds what the host holds: no cap
    if count == local:
        return list(checked_max_rows(max_rows, count))
    per_worker = checked_max_rows(max_rows, count // local)
    return [c for cap in per_worker for c in split_batch(cap, [1.0] * local, few=True)]


def shares_of(powers):
    """Each power's fraction of their sum."""
    total = sum(powers)
    return [p / total for p in powers]
