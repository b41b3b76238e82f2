"""What every mode does on one device: the model's own steps on its shard of the batch.

`DeviceWork` runs `model.train_step` on a device's shard, cut into side-by-side
pieces (chains), each weighed by its examples (shards.py), and returns the
gradients the pieces handed over, summed, for the mode to reduce and apply. How
a batch is cut is engine/pieces.py's, one rule for every door.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.engine import patches, replica, whole_batch
from tfdp.engine import shards as shards_lib
from tfdp.engine.pieces import cut_evenly, num_examples
from tfdp.engine.shards import add_gradients


def zeros_like_gradient(gradient, variable):
    """What an empty piece adds to `variable`'s gradient, like `gradient`: nothing (no rows,
    for a sparse one). Made from shapes alone, so that it may stand in another branch."""
    shape = tf.TensorShape(variable.shape)
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.zeros([0, *shape[1:]], gradient.values.dtype)
        indices = tf.zeros([0], gradient.indices.dtype)
        dense = None
        if gradient.dense_shape is not None:
            dense = tf.constant(shape.as_list(), gradient.dense_shape.dtype)
        return tf.IndexedSlices(values, indices, dense)
    return tf.zeros(shape, gradient.dtype)


def _zeros_like(tensor):
    """Zeros of a tensor's shape and dtype, from its static shape where it is known (so that
    they may stand in another branch of a tf.cond)."""
    if tensor.shape.is_fully_defined():
        return tf.zeros(tensor.shape, tensor.dtype)
    return tf.zeros_like(tensor)


class DeviceWork:
    """One device's part of a step: the model's train_step (or test_step) on its shard.

    Args:
      model: the Keras model (any kind); its steps run as the model defines them.
      chains: pieces each shard is cut into, run side by side: a CPU device keeps
        several cores busy with one-threaded kernels (`devices.default_chains`).
        The pieces' gradients add up to the shard's (shards.py), for models without
        batch statistics (tfdp picks 1 chain for those).
      jit_compile: each piece's forward and backward pass is one XLA program.
      may_be_empty: a shard may hold no examples (a batch smaller than the devices):
        its pieces are then skipped (a kernel such as oneDNN's max-pooling gradient
        does not take an empty batch).
    """

    def __init__(self, model, chains=1, jit_compile=False, may_be_empty=False):
        self.model = model
        self.chains = chains
        self.jit_compile = jit_compile
        self.may_be_empty = may_be_empty
        self.variables = None  # of the gradients, in order (known once traced)
        self.gradients_like = None  # a piece's gradients, once one has run (their kinds)
        self.notes = []  # how the model's own train_step was run, where not as Keras' (shards.py)
        run = self._train_piece
        if jit_compile:
            run = tf.function(run, jit_compile=True, autograph=False)
        self._run = run
        patches.install()

    @property
    def guarded(self) -> bool:
        """Whether a piece may hold no examples on some step: a shard cut into chains (an
        epoch's last batch may be smaller than the pieces), or a device that may get none."""
        return self.may_be_empty or self.chains > 1

    def full(self, shard_sizes):
        """Whether every piece of shards of `shard_sizes` holds examples this step."""
        return tf.reduce_min(shard_sizes) >= self.chains

    def train_either(self, shard, examples):
        """`train`, with its pieces guarded against holding no examples only on a step where
        one may: a guard is a conditional of the whole piece, and the model's metric
        updates inside it would make the piece wait for every piece traced before it
        (a tf.function runs the stateful ops on one variable in program order), where
        unguarded pieces run side by side."""
        if not self.guarded or tf.executing_eagerly():
            return self.train(shard, examples)
        return tf.cond(
            self.full(tf.reshape(num_examples(shard), [1])),
            lambda: self.train(shard, examples, guard=False),
            lambda: self.train(shard, examples),
        )

    def train(self, shard, examples, guard=True):
        """The model's train_step on `shard` of a global batch of `examples`, without the
        update: (its logs, its summed gradients (one per `self.variables`), whether it
        held examples). `guard=False`: every piece holds examples (`full`)."""
        n = num_examples(shard)
        parts = cut_evenly(shard, self.chains) if self.chains > 1 else [shard]
        logs, gradients = None, None
        for index, part in enumerate(parts):
            guarded = guard and (self.may_be_empty or index > 0)  # later pieces of a small shard
            part_logs, part_gradients = self._piece(part, examples, guarded)
            if logs is None:
                logs, gradients = part_logs, part_gradients
                continue
            size = num_examples(part)
            logs = tf.nest.map_structure(
                lambda new, old: tf.where(size > 0, new, old), part_logs, logs
            )
            gradients = [add_gradients(g, p) for g, p in zip(gradients, part_gradients)]
        return logs, gradients, n > 0

    def _piece(self, part, examples, guarded):
        fraction = tf.cast(num_examples(part), tf.float32) / tf.cast(examples, tf.float32)
        if not guarded:
            return self._run(part, fraction)
        traced = {}

        def run():
            logs, gradients = self._run(part, fraction)
            traced.update(logs=logs, gradients=gradients)
            self.gradients_like = gradients
            return logs, gradients

        def nothing():  # traced after `run` (tf.cond traces the true branch first)
            like = traced.get("logs", self.logs_like)
            zeros = tf.nest.map_structure(_zeros_like, like)
            gradients = traced.get("gradients", self.gradients_like)
            if gradients is None:  # eager, and no piece has run yet
                return zeros, [tf.zeros_like(v) for v in self.model.trainable_variables]
            return zeros, [zeros_like_gradient(g, v) for g, v in zip(gradients, self.variables)]

        if tf.executing_eagerly():  # run_eagerly: only the branch taken runs
            return run() if bool(num_examples(part) > 0) else nothing()
        return tf.cond(num_examples(part) > 0, run, nothing)

    @property
    def logs_like(self):
        """What a piece's logs look like, before one has run: the model's metrics."""
        return _tensors(self.model.get_metrics_result())

    def _train_piece(self, part, fraction):
        logs, handed, note = shards_lib.train_piece(self.model, part, fraction)
        if note and note not in self.notes:
            self.notes.append(note)
        pairs = handed.pairs()
        variables = [v for _, v in pairs]
        if self.variables is None:
            self.variables = variables
        elif [id(v) for v in variables] != [id(v) for v in self.variables]:
            raise ValueError("the model's train_step handed over other variables on another piece")
        logs = tf.nest.map_structure(tf.convert_to_tensor, logs)
        return logs, [g for g, _ in pairs]


class LeavingWork:
    """A replica's part of a step where the balancing may leave devices out (a share of
    0): the model's train_step on its piece, skipped where the piece holds no rows; cut
    into `chains` side-by-side pieces while it is the only replica with rows (it then
    has the cores of the devices left out, as mode single has them), else whole.

    Args:
      model, jit_compile: as `DeviceWork`'s.
      chains: pieces of a replica left alone (1 on a GPU).
      sizes: the split's variable, each replica's rows of a full global batch.
    """

    def __init__(self, model, chains, jit_compile, sizes):
        self.model = model
        self.whole = DeviceWork(model, 1, jit_compile, may_be_empty=True)
        self.alone = DeviceWork(model, chains, jit_compile, may_be_empty=True) if chains > 1 else None
        self.sizes = sizes

    @property
    def variables(self):
        return self.whole.variables or getattr(self.alone, "variables", None)

    @property
    def notes(self):
        return [*self.whole.notes, *getattr(self.alone, "notes", [])]

    def train_either(self, shard, examples):
        """`DeviceWork.train_either`, in chains while this replica is alone."""
        if self.alone is None:
            return self.whole.train_either(shard, examples)
        alone = tf.math.count_nonzero(self.sizes) == 1
        if tf.executing_eagerly():
            return (self.alone if bool(alone) else self.whole).train_either(shard, examples)
        return tf.cond(
            alone,
            lambda: self.alone.train_either(shard, examples),
            lambda: self.whole.train_either(shard, examples),
        )

    def test(self, piece):
        """The model's test_step on `piece`, skipped where it holds no rows; its logs as
        the whole batch gives them (over the replicas, in a strategy's step)."""
        model, traced, step = self.model, {}, replica.current()

        def run():
            fraction = 1.0 if step is None else step.fraction
            with shards_lib.weighing_output_losses(model, fraction):
                traced["logs"] = _tensors(model.test_step(piece))
            return traced["logs"]

        def nothing():  # traced after `run` (tf.cond traces the true branch first)
            if "logs" not in traced:  # eager, and no piece has run yet
                return _tensors(model.get_metrics_result())
            return tf.nest.map_structure(_zeros_like, traced["logs"])

        if tf.executing_eagerly():
            logs = run() if bool(num_examples(piece) > 0) else nothing()
        else:
            logs = tf.cond(num_examples(piece) > 0, run, nothing)
        if step is None or not isinstance(logs, dict):
            return with_metrics(model, logs)
        context = tf.distribute.get_replica_context()
        return whole_batch.logs(model, logs, step.fraction, context, step.all_reduce)


def _tensors(logs):
    return tf.nest.map_structure(tf.convert_to_tensor, logs)


def with_metrics(model, logs):
    """`logs` with each entry that is one of the model's metrics read from the metric
    itself (in a strategy's cross-replica context: summed over the replicas), as Keras'
    fit reads them at an epoch's end."""
    if not isinstance(logs, dict):
        return logs
    results = model.get_metrics_result()
    return {name: results.get(name, value) for name, value in logs.items()}


def in_micro_steps(work, pieces, examples):
    """One replica's part of an update in micro-steps: the model's train_step on each of
    its `pieces` (one per micro-step) in turn, each piece's loss weighed by its rows over
    the global batch's `examples`, their summed gradients applied once with the model's
    optimizer. Each piece is read only once the previous gradients are computed, so a
    micro-step's memory is freed before the next starts. Returns the logs as the whole
    batch gives them (over the replicas, in a strategy's step)."""
    model, gradients, logs = work.model, None, None
    with shards_lib.handing_over(model):
        for piece in pieces:
            if gradients is not None:
                piece = _after_all(piece, gradients)
            piece_logs, piece_gradients, held = work.train_either(piece, examples)
            if gradients is None:
                logs, gradients = piece_logs, piece_gradients
                continue
            logs = tf.nest.map_structure(
                lambda new, old, held=held: tf.where(held, new, old), piece_logs, logs
            )
            gradients = [add_gradients(a, b) for a, b in zip(gradients, piece_gradients)]
    if gradients:  # (a model without trainable weights has nothing to update)
        model.optimizer.apply_gradients(zip(gradients, work.variables))
    step = replica.current()
    if step is None:  # one device, without a strategy
        return with_metrics(model, logs)
    context = tf.distribute.get_replica_context()
    return whole_batch.logs(model, logs, step.fraction, context, step.all_reduce)


def _after_all(batch, gradients):
    """`batch`, read only once every one of `gradients` is computed."""
    leaves = [g.values if isinstance(g, tf.IndexedSlices) else g for g in gradients]
    with tf.control_dependencies([g for g in leaves if g is not None]):
        return tf.nest.map_structure(tf.identity, batch, expand_composites=True)
