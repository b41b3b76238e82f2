"""One leaf of data as tfdp holds it: a numpy array, or a sparse or ragged tensor, whose
first axis is the examples; and a nested structure of such leaves (what Keras `fit` takes
as x, y and sample weights).
"""

import numpy as np
import tensorflow as tf

from tfdp import internals


def as_leaf(leaf):
    """One leaf of data as tfdp holds it: a numpy array, or a sparse or ragged tensor
    (scipy's sparse matrices as tf.SparseTensor, as Keras takes them); None (an optional
    input left out) stays None, in every batch."""
    if leaf is None or is_composite(leaf):
        return leaf
    if hasattr(leaf, "tocoo") and hasattr(leaf, "nnz"):  # a scipy sparse matrix
        return internals.data_adapter_utils().scipy_sparse_to_tf_sparse(leaf)
    return np.asarray(leaf)


def is_composite(leaf) -> bool:
    """Whether a leaf is a sparse or ragged tensor (kept as it is, read by its rows)."""
    return isinstance(leaf, (tf.SparseTensor, tf.RaggedTensor))


def first(data):
    """The first leaf of a nested structure that is not None (an optional input given None
    holds no examples); None if there is none."""
    return next((leaf for leaf in tf.nest.flatten(data) if leaf is not None), None)


def length(leaf) -> int | None:
    """The examples of one leaf of data (rows of a sparse or ragged tensor); None: not an
    array of examples."""
    if isinstance(leaf, tf.SparseTensor):
        return int(leaf.dense_shape[0])
    if isinstance(leaf, tf.RaggedTensor):
        return int(leaf.nrows())
    return len(leaf) if np.ndim(leaf) else None


def shape_of(leaf) -> tuple:
    """A leaf's shape, for messages (a ragged tensor's ragged dimensions as None)."""
    if isinstance(leaf, tf.SparseTensor):
        return tuple(int(n) for n in leaf.dense_shape)
    if isinstance(leaf, tf.RaggedTensor):
        return tuple(leaf.shape.as_list())
    return tuple(np.shape(leaf))


def rows(leaf, begin, size):
    """Rows begin..begin+size-1 of a dense, ragged or sparse tensor (None: None)."""
    if leaf is None:
        return None
    if isinstance(leaf, tf.SparseTensor):
        rank = leaf.shape.rank
        start = tf.concat(
            [tf.reshape(tf.cast(begin, tf.int64), [1]), tf.zeros([rank - 1], tf.int64)], 0
        )
        extent = tf.concat([tf.reshape(tf.cast(size, tf.int64), [1]), leaf.dense_shape[1:]], 0)
        return tf.sparse.slice(leaf, start, extent)
    return leaf[begin : begin + size]


def take(data, begin: int, end: int):
    """Examples begin..end-1 of a nested structure of leaves."""

    def part(leaf):
        if leaf is None:
            return None
        if isinstance(leaf, tf.SparseTensor):
            return rows(leaf, begin, min(end, length(leaf)) - begin)
        return leaf[begin:end]

    return tf.nest.map_structure(part, data)


def gather_rows(leaf, indices):
    """The rows `indices` of a dense, ragged or sparse tensor, in that order (None: None)."""
    if leaf is None:
        return None
    if not isinstance(leaf, tf.SparseTensor):
        return tf.gather(leaf, indices)
    # a sparse tensor's entries in the rows asked for, their rows renumbered 0, 1, ...
    indices = tf.cast(indices, tf.int64)
    place = (
        tf.scatter_nd(
            indices[:, None], tf.range(tf.size(indices, tf.int64)) + 1, [leaf.dense_shape[0]]
        )
        - 1
    )  # each row's place in `indices`, -1 for the rows not asked for
    kept = tf.gather(place, leaf.indices[:, 0]) >= 0
    entries = tf.boolean_mask(leaf.indices, kept)
    rows = tf.gather(place, entries[:, 0])
    selected = tf.SparseTensor(
        tf.concat([rows[:, None], entries[:, 1:]], 1),
        tf.boolean_mask(leaf.values, kept),
        tf.concat([[tf.size(indices, tf.int64)], leaf.dense_shape[1:]], 0),
    )
    return tf.sparse.reorder(selected)
