"""The cut: how every door of tfdp cuts a batch into the replicas' pieces, by one rule.

A batch of n rows over replicas weighed w_1..w_R (powers, a split's examples, measured
speeds) gives replica i the floor of n w_i / W rows, then one row more to each of the
replicas with the largest remainders until the pieces hold n, ties to the earlier
replica (largest remainder: every piece within one row of its exact share). Where that
leaves a replica of positive weight without a row, and the batch has a row for each (a
short batch), each takes one row first and the rest goes by largest remainder: a
kernel such as oneDNN's max-pooling gradient does not take an empty piece.
`piece_sizes` is the rule in a step's graph; `devices.split_batch` the same rule on the
host for a full batch. The trainer cuts its host batches by it (`cut`), the strategy the batches of a
dataset it distributes (`by_share`), short batches alike.
"""

from __future__ import annotations

import functools

import tensorflow as tf

from tfdp import internals
from tfdp.data.leaves import first, rows
from tfdp.errors import ConfigError


def piece_sizes(examples, weights, caps=None) -> tf.Tensor:
    """The rows of each replica's piece of a batch of `examples` rows (int32): the largest
    remainder, or, where that leaves a replica of positive weight without a row and the
    batch has a row for each, one row each and the rest by largest remainder. With `caps`
    (the most rows each replica takes; the batch within their sum), capped water-filling:
    what a capped replica cannot take goes to the others by their weights."""
    n = tf.cast(examples, tf.int64)
    weights = tf.cast(weights, tf.float64)
    if caps is None:
        taking = tf.cast(weights > 0, tf.int64)
        share = _largest_remainder
    else:
        caps = tf.cast(caps, tf.int64)
        taking = tf.cast(tf.logical_and(weights > 0, caps > 0), tf.int64)
        share = functools.partial(_capped, caps=caps)
    sizes = share(n, weights)
    short = tf.logical_and(
        tf.reduce_any(tf.logical_and(sizes == 0, taking > 0)), n >= tf.reduce_sum(taking)
    )
    # both cuts are a few integer ops: one `where`, no branch of its own (Grappler
    # rewrote a branch's adds into a per-step temporary variable: AlreadyExists)
    rest = tf.maximum(n - tf.reduce_sum(taking), 0)
    if caps is None:
        one_each = taking + _largest_remainder(rest, weights)
    else:
        one_each = taking + _capped(rest, weights, caps - taking)
    return tf.cast(tf.where(short, one_each, sizes), tf.int32)


def _capped(n, weights, caps):
    """`n` rows by largest remainder over `weights`, each within its cap: a replica whose
    share would pass its cap takes its cap and leaves the sharing (as many rounds as
    replicas; `devices.capped_split` on the host)."""
    capped = tf.zeros(tf.shape(weights), tf.bool)
    for _ in range(weights.shape[0] + 1):
        held = tf.reduce_sum(tf.where(capped, caps, tf.zeros_like(caps)))
        free = tf.where(capped, tf.zeros_like(weights), weights)
        sizes = _largest_remainder(tf.maximum(n - held, 0), free)
        capped = tf.logical_or(capped, sizes > caps)
    return tf.where(capped, caps, sizes)


def _largest_remainder(n, weights):
    exact = tf.math.divide_no_nan(tf.cast(n, tf.float64) * weights, tf.reduce_sum(weights))
    base = tf.cast(tf.floor(exact), tf.int64)
    missing = tf.where(tf.reduce_sum(weights) > 0, tf.maximum(n - tf.reduce_sum(base), 0), 0)
    order = tf.argsort(-(exact - tf.floor(exact)), stable=True)  # ties: the earlier first
    extra = tf.scatter_nd(tf.expand_dims(order[:missing], 1), tf.ones([missing], tf.int64),
                          tf.shape(base))
    return base + extra


def piece_bounds(examples, weights, caps=None) -> tf.Tensor:
    """Where a batch of `examples` rows is cut: R+1 increasing row indices, 0 to examples."""
    sizes = tf.cast(piece_sizes(examples, weights, caps), tf.int64)
    return tf.concat([tf.zeros([1], tf.int64), tf.cumsum(sizes)], 0)


def cut(batch, sizes, parts):
    """A nested batch cut along its first axis into pieces of `sizes`: a list of batches.
    Sparse and ragged leaves are cut by their rows."""
    leaves = tf.nest.flatten(batch)
    if all(isinstance(leaf, tf.Tensor) for leaf in leaves):
        pieces = [tf.split(leaf, sizes, num=parts) for leaf in leaves]
    elif all(leaf is None or isinstance(leaf, tf.Tensor) for leaf in leaves):
        pieces = [[None] * parts if leaf is None else tf.split(leaf, sizes, num=parts) for leaf in leaves]
    else:
        sizes = tf.convert_to_tensor(sizes)
        starts = tf.concat([[0], tf.cumsum(sizes)[:-1]], 0)
        pieces = [[rows(leaf, starts[j], sizes[j]) for j in range(parts)] for leaf in leaves]
    return [tf.nest.pack_sequence_as(batch, [piece[j] for piece in pieces]) for j in range(parts)]


def cut_evenly(batch, parts):
    """A nested batch cut into `parts` near-equal pieces: the rule with equal weights (the
    earlier pieces one row longer), in two ops."""
    n = num_examples(batch)
    return cut(batch, n // parts + tf.cast(tf.range(parts) < n % parts, tf.int32), parts)


def num_examples(batch) -> tf.Tensor:
    """The examples in a batch: the length of its first leaf (dense, sparse or ragged; not
    an optional input given None)."""
    leaf = first(batch)
    if isinstance(leaf, tf.SparseTensor):
        return tf.cast(leaf.dense_shape[0], tf.int32)
    if isinstance(leaf, tf.RaggedTensor):
        return tf.cast(leaf.nrows(), tf.int32)
    return tf.shape(leaf)[0]

def none_for_none_spec(spec):
    """None for the spec of a None in a dataset's elements (Keras builds an optional input
    given None from None), any other spec as it is."""
    return None if type(spec).__name__ == "NoneTensorSpec" else spec


def has_rows(spec) -> bool:
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

def batch_positions(structure, every):
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


def leaves_at(structure, positions):
    """The leaves of a replica's arguments at `positions` (all of them for None)."""
    leaves = tf.nest.flatten(structure, expand_composites=False)
    if positions is None:
        return leaves
    return [leaves[i] for i in positions if i < len(leaves)]


def rows_between(leaf, start, stop):
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

def reduced(strategy, tensorflows, reduce_op, leaf):
    """One leaf of `reduce(..., axis=None)`: TensorFlow's reduction where the replicas'
    values have one shape, their concatenation where not."""
    if not isinstance(leaf, tf.distribute.DistributedValues) or not rank(strategy, leaf):
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


def rank(strategy, value):
    """The rank of `value` (of its first replica's, for a distributed value); None: unknown."""
    first = strategy.experimental_local_results(value)[0] if isinstance(
        value, tf.distribute.DistributedValues) else value
    shape = getattr(first, "shape", None)
    return None if shape is None else shape.rank


def _concat(pieces):
    pieces = list(pieces)
    if isinstance(pieces[0], tf.SparseTensor):
        return tf.sparse.concat(0, pieces)
    return tf.concat(pieces, 0)

def by_share(dataset, weights, first, local, caps=None):
    """Replicas first..first+local-1's pieces of each batch of `dataset`, in turn, cut by
    `weights` (a variable: batches cut after it changes take the new weights), each within
    its cap (`caps`; a batch beyond their sum fails, naming them)."""
    structure = dataset.element_spec

    @tf.autograph.experimental.do_not_convert
    def pieces(*element):
        batch = element if isinstance(structure, tuple) else element[0]
        leaves = tf.nest.flatten(batch)
        rows = rows_of(leaves)
        checks = []
        if caps is not None:
            checks = [tf.debugging.assert_less_equal(
                rows, tf.constant(sum(caps), rows.dtype), message=f"max_rows={list(caps)}: {beyond_caps(caps)}")]
        with tf.control_dependencies(checks):
            bounds = piece_bounds(rows, weights, caps)

        @tf.autograph.experimental.do_not_convert
        def piece(index):
            start, stop = bounds[index], bounds[index + 1]
            # the element's own structure (a list stays a list, a 1-tuple a 1-tuple)
            return tf.nest.pack_sequence_as(
                structure, [rows_between(leaf, start, stop) for leaf in leaves]
            )

        return tf.data.Dataset.range(first, first + local).map(piece)

    return dataset.flat_map(pieces)


def beyond_caps(caps, rows=None) -> str:
    """What a batch beyond the caps' sum is told (one line; `rows`: the batch's, if known)."""
    batch = "a batch holds" if rows is None else f"the batch of {rows}"
    return (
        f"hold {sum(caps)} examples in a step, fewer than {batch}: batch the data at "
        f"most {sum(caps)} and set the optimizer's "
        "gradient_accumulation_steps (Keras' micro-steps), or train with tfdp.fit, "
        "which runs the micro-steps itself"
    )


def check_within(structure, caps) -> None:
    """A ConfigError naming the caps where a dataset's spec (`structure`) says its batches
    hold more rows than the caps' sum."""
    if caps is None:
        return
    for spec in tf.nest.flatten(structure):
        if has_rows(spec) and spec.shape[0] is not None:
            if spec.shape[0] > sum(caps):
                raise ConfigError("max_rows", caps, beyond_caps(caps, int(spec.shape[0])))
            return


def global_batches(dataset, replicas):
    """`replicas` consecutive per-replica batches of `dataset` at a time, as one batch
    (their rows in order): the global batch a dataset function's batches make."""
    structure = dataset.element_spec

    @tf.autograph.experimental.do_not_convert
    def concatenated(*window):
        # a window is the element's structure of datasets (a tuple's parts as arguments)
        batches = tf.data.Dataset.zip(window if isinstance(structure, tuple) else window[0])
        return batches.unbatch().batch(2**62)

    return dataset.window(replicas).flat_map(concatenated)
