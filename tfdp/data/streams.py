"""The one type of training data, `Stream`: a tf.data.Dataset, a keras.utils.PyDataset, a
generator, or arrays held in memory (data/arrays.py, `as_stream`).

A `Stream` is the user's pipeline of global batches, read while training as
Keras `fit` reads it: nothing is held in memory whole, `map` runs again in
every pass (augmentation stays random), files are read as they are consumed.
Each global batch is made once, on the host, and the trainer splits it as it
splits a batch of arrays, so every mode makes `single`'s update on the same
batches. Passes follow one another on one stream (`dataset.repeat()`): with
`steps_per_epoch` an epoch is a window on it, as in Keras.

A resumed run skips the steps already trained: the same batches again for a
pipeline that makes the same batches every time it runs (seeded shuffles,
stateless random ops, files in a fixed order).
"""

from __future__ import annotations

import dataclasses
import itertools
import types
from collections.abc import Callable

import keras
import numpy as np
import tensorflow as tf

from tfdp import internals
from tfdp.data import leaves
from tfdp.errors import ConfigError

# tf.data's Python classes that make batches of the elements beneath them.
BATCHING = (
    "_BatchDataset",
    "_PaddedBatchDataset",
    "_ParallelBatchDataset",
    "_RebatchDataset",
    "_MapAndBatchDataset",
)
PREFETCH_BATCHES = 2  # global batches made ahead of the step that reads them


@dataclasses.dataclass(frozen=True)
class Stream:
    """A training pipeline of global batches.

    Attributes:
        dataset: one pass of global batches (or the whole stream, if infinite).
        batch_size: the examples of a full global batch.
        batches: batches of one pass; None: infinite (`endless`), or unknown until read.
        examples: examples of one pass, when known without reading it.
        source: what the user gave, as errors name it ("tf.data.Dataset", ...).
        one_pass: whether `dataset` is one pass, run again for each pass (a
            tf.data pipeline); else it is the whole stream (a generator, a PyDataset).
        sample: a global batch's structure, to build the model on: the first batch
            of a generator or PyDataset as numpy arrays; of a tf.data pipeline, zeros
            of its element spec, or the spec itself (`tf.TensorSpec`, ...) for leaves
            whose shape the pipeline decides as it reads (`padded_batch`, ragged
            and sparse tensors): Keras builds from shapes, None where unknown.
            Nothing is read ahead: that would start an iteration of the pipeline,
            and move its seeded shuffles on by one.
        starting_at: for a source read by index (a PyDataset, arrays), the stream from
            a step on, the batches before it not read; None: read from the start.
        endless: the source never ends (an infinite dataset or PyDataset).
        held: the leaves of arrays held in memory, whose batches the stream gives as
            example indices; None: the stream gives the batches themselves.
        gather: with `held`, the function from a batch of indices to the batch of those
            examples as the model reads it (the trainer gathers: a worker of a cluster
            only its slice).
    """

    dataset: tf.data.Dataset
    batch_size: int
    batches: int | None
    examples: int | None
    source: str
    one_pass: bool
    sample: object
    starting_at: Callable[[int], tf.data.Dataset] | None = None
    endless: bool = False
    held: object = None
    gather: Callable | None = None
    _read_ahead: list = dataclasses.field(default_factory=list, compare=False, repr=False)

    @property
    def in_memory(self) -> bool:
        """Whether the stream reads arrays held in memory, by index: its position is the
        step, no record can go bad, and its batches are indices (`gather`)."""
        return self.held is not None

    def identity(self) -> tuple[str, list]:
        """(what it is, its leaves): for the workers of a cluster to agree they read the
        same data. Arrays held: all of them; a pipeline: its source, batches and sample."""
        if self.in_memory:
            return f"{self.examples} examples,", list(self.held)
        sample = tf.nest.flatten(self.sample)
        return f"a {self.source} of batches of {self.batch_size}, a sample's", sample

    @property
    def marked(self) -> bool:
        """Whether each pass ends with a marker element: a pipeline run again for each
        pass, of a length not known before reading it. Each element is then (batch,
        whether the pass has ended); the marker's batch has no examples."""
        return self.one_pass and self.batches is None and not self.endless

    @property
    def last_batch(self) -> int:
        """The examples of a pass's last batch (the batch size when unknown)."""
        if self.examples is None or self.batches is None:
            return self.batch_size
        return min(self.batch_size, self.examples - (self.batches - 1) * self.batch_size)

    @property
    def shapes_known(self) -> bool:
        """Whether `sample` holds examples (else specs: shapes decided while reading)."""
        return shapes_known(self.sample)

    def first_examples(self, count: int):
        """The first `count` examples (at most a batch): `first_of` the sample."""
        return first_of(self.sample, count)

    def examples_to_time(self, count: int, log):
        """`count` examples (at most a batch) to time the devices on. Where the pipeline
        decides shapes as it reads, its first batch, read once ahead in an iteration of
        its own, and said in one line through `log` (a shuffle that reshuffles each pass
        then starts training on its second order)."""
        if self.shapes_known:
            return self.first_examples(count)
        if not self._read_ahead:
            log(
                f"the devices are timed on the {self.source}'s first batch, read once ahead "
                "(its shapes are decided as it reads): a shuffle that reshuffles each pass "
                "starts training on its second order"
            )
            with tf.device("/cpu:0"):
                self._read_ahead.append(next(iter(self.dataset.take(1))))
        return leaves.take(self._read_ahead[0], 0, count)

    def training_batches(self, start_step: int = 0, passes: int = 0) -> tf.data.Dataset:
        """The global batches of steps start_step, start_step + 1, ...: pass after pass,
        each a new run of the pipeline (`passes`: passes ended before `start_step`, whose
        markers come before it in a marked stream). Arrays held: batches of example
        indices (`gather` makes their batches)."""
        if self.in_memory:
            return self.starting_at(start_step)
        if start_step and self.starting_at is not None:
            return self.starting_at(start_step).prefetch(PREFETCH_BATCHES)
        stream = self.dataset
        if self.marked:
            # a pass's end, in the stream: an element of no examples, marked
            empty = tf.nest.map_structure(_empty, stream.element_spec)
            ended = tf.data.Dataset.from_tensors((empty, tf.constant(True)))
            stream = stream.map(_unmarked)
            stream = stream.concatenate(ended).repeat()
            return stream.skip(start_step + passes).prefetch(PREFETCH_BATCHES)
        if self.one_pass and self.batches is not None:
            stream = stream.repeat()
        return stream.skip(start_step).prefetch(PREFETCH_BATCHES)


def shapes_known(sample) -> bool:
    """Whether a stream's sample holds examples (else specs: shapes decided while reading)."""
    return not any(isinstance(leaf, tf.TypeSpec) for leaf in tf.nest.flatten(sample))


def first_of(sample, count: int):
    """The first `count` examples of a stream's sample, as a model batch on the host; where
    the pipeline decides shapes as it reads, their specs (for a symbolic build)."""
    if not shapes_known(sample):
        return tf.nest.map_structure(lambda spec: _with_batch(spec, count), sample)
    def on_host(leaf):  # a tensor (ragged, sparse), or None (an optional input), as it is
        return leaf if leaf is None or tf.is_tensor(leaf) else tf.constant(leaf)

    with tf.device("/cpu:0"):
        return tf.nest.map_structure(on_host, leaves.take(sample, 0, count))


def _packed(batch):
    """A map function's arguments as the element they came from."""
    return batch if len(batch) > 1 else batch[0]


@tf.autograph.experimental.do_not_convert
def _unmarked(*batch):
    """An element of the stream, marked as not a pass's end."""
    return _packed(batch), tf.constant(False)


def is_stream_input(x) -> bool:
    """Whether Keras `fit` would read `x` as a pipeline: a dataset, PyDataset or generator."""
    return isinstance(x, (tf.data.Dataset, keras.utils.PyDataset, types.GeneratorType))


def makes_own_batches(x) -> bool:
    """Whether a stream input comes in batches of its own: a batched tf.data pipeline,
    a PyDataset, a generator."""
    return not isinstance(x, tf.data.Dataset) or dataset_batching(x)[0]


def from_input(x, batch_size, drop_remainder=False, shuffle=True, seed=0, field="x") -> Stream:
    """The Stream of what Keras `fit` reads as a pipeline (see `is_stream_input`)."""
    if isinstance(x, tf.data.Dataset):
        return from_dataset(x, batch_size, drop_remainder, field)
    if isinstance(x, keras.utils.PyDataset):
        return from_py_dataset(x, batch_size, shuffle, seed, field)
    return from_generator(x, batch_size, field)


def unsaved_state(dataset) -> str | None:
    """What of a pipeline's state TensorFlow's iterator checkpoints do not restore
    exactly, if any: a `Dataset.random` stream (TensorFlow 2.21: a run restored at a
    saved position drew other numbers after the next pass began). None: the position
    restores exactly, as far as tfdp knows."""
    nodes = [dataset]
    while nodes:
        node = nodes.pop()
        if type(node).__name__ == "_RandomDataset":
            return "Dataset.random"
        nodes.extend(internals.dataset_inputs(node))
    return None


def dataset_batching(dataset) -> tuple[bool, int | None, bool]:
    """(batched, batch size if known, drop_remainder) of a tf.data pipeline: the nearest
    batching (or unbatching) transformation upstream of its elements."""
    node = dataset
    while True:
        name = type(node).__name__
        if name == "_UnbatchDataset":
            return False, None, False
        if name in BATCHING:
            size, dropped = internals.batching(node)
            size = int(np.asarray(size)) if size is not None else None
            return True, size, bool(np.asarray(dropped))
        inputs = internals.dataset_inputs(node)
        if not inputs:
            return False, None, False
        node = inputs[0]


def _batch_size_of(first) -> int:
    return leaves.length(leaves.first(first))


def _as_leaves(batch):
    """A batch a generator or PyDataset made, as tfdp holds data: numpy arrays, sparse and
    ragged tensors (scipy's sparse matrices as tf.SparseTensor); lists become tuples."""
    return tf.nest.map_structure(leaves.as_leaf, tuple(batch) if isinstance(batch, list) else batch)


def _with_batch(spec, size: int):
    """`spec` with its batch axis `size`."""
    if isinstance(spec, internals.none_tensor_spec()):  # an optional input given None
        return spec
    shape = [size, *spec.shape[1:]]
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensorSpec(shape, spec.dtype, spec.ragged_rank, spec.row_splits_dtype)
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensorSpec(shape, spec.dtype)
    return tf.TensorSpec(shape, spec.dtype)


def _empty(spec):
    """An element of `spec` with no examples (a pass's end marker)."""
    if isinstance(spec, internals.none_tensor_spec()):  # an optional input given None
        return None
    shape = [0] + [0 if d is None else d for d in spec.shape[1:]]
    if isinstance(spec, tf.SparseTensorSpec):
        return tf.SparseTensor(tf.zeros([0, len(shape)], tf.int64), tf.zeros([0], spec.dtype), shape)
    zeros = tf.zeros(shape, spec.dtype)
    if isinstance(spec, tf.RaggedTensorSpec):
        return tf.RaggedTensor.from_tensor(
            zeros, ragged_rank=spec.ragged_rank, row_splits_dtype=spec.row_splits_dtype
        )
    return zeros


def _sample(spec, batch_size: int):
    """A batch of a dataset's element spec to build the model on, nothing read: zeros where
    a leaf's shape after the batch axis is known, its spec (batch `batch_size`) where the
    pipeline decides it while reading."""

    def sample(leaf):
        if isinstance(leaf, internals.none_tensor_spec()):  # an optional input given None
            return None
        if leaf.shape.rank is None or not leaf.shape[1:].is_fully_defined():
            return _with_batch(leaf, batch_size)
        if isinstance(leaf, tf.SparseTensorSpec):  # no entries
            return tf.SparseTensor(
                tf.zeros([0, leaf.shape.rank], tf.int64),
                tf.zeros([0], leaf.dtype),
                [batch_size, *leaf.shape[1:]],
            )
        if isinstance(leaf, tf.TensorSpec):
            shape = (batch_size, *leaf.shape[1:])
            if leaf.dtype == tf.string:  # (numpy's zeros of bytes are Python ints)
                return np.full(shape, b"", dtype=object)
            return np.zeros(shape, leaf.dtype.as_numpy_dtype)
        return _with_batch(leaf, batch_size)  # a ragged leaf

    return tf.nest.map_structure(sample, spec)


def from_dataset(dataset, batch_size, drop_remainder, field="x", source="tf.data.Dataset"):
    """A Stream of a tf.data pipeline; an unbatched one is batched to `batch_size`.

    batch_size: the caller's, None for the dataset's own (a batched dataset), or
    Keras' default for an unbatched one. Nothing is read here.
    """
    batched, size, dropped = dataset_batching(dataset)
    if not batched:
        dataset = dataset.batch(batch_size or 32, drop_remainder=drop_remainder)
        size, dropped = batch_size or 32, drop_remainder
    if size is None:
        specs = tf.nest.flatten(dataset.element_spec)
        size = next(s for s in specs if not isinstance(s, internals.none_tensor_spec())).shape[0]
    if size is None:
        raise ConfigError(
            field,
            source,
            "is batched, but its batch size is not known before reading it: end it with "
            ".batch(n), or give batch_size and an unbatched dataset",
        )
    if batched and batch_size is not None and batch_size != size:
        raise ConfigError(
            "batch_size",
            batch_size,
            f"disagrees with the {source}'s batches of {size} (it is batched: leave "
            "batch_size out, or batch the dataset to it)",
        )
    cardinality = int(dataset.cardinality())
    if cardinality == 0:
        raise ConfigError(field, source, "has no examples")
    batches = None if cardinality < 0 else cardinality  # infinite or unknown
    examples = None
    if not batched:
        elements = int(internals.dataset_inputs(dataset)[0].cardinality())
        examples = elements if elements >= 0 else None
        if examples is not None and dropped:
            examples = (examples // size) * size
    elif dropped and batches is not None:
        examples = batches * size
    sample = _sample(dataset.element_spec, size)
    endless = cardinality == tf.data.INFINITE_CARDINALITY
    return Stream(dataset, size, batches, examples, source, True, sample, endless=endless)


def _own_batches(first_batches, batch_size, source: str):
    """(the first batch as numpy arrays, its batch size, the element signature) of a
    source that makes its own batches, from its first batches (Keras reads two): a shape
    that differs between them is None in the signature, as Keras' adapters make it. A
    `batch_size` that differs from the first batch's is an error."""
    data_adapter_utils = internals.data_adapter_utils()
    first_batches = [_as_leaves(batch) for batch in first_batches]
    first = first_batches[0]
    size = _batch_size_of(first)
    if batch_size is not None and batch_size != size:
        raise ConfigError(
            "batch_size", batch_size, f"disagrees with the {source}'s batches of {size}"
        )
    try:
        signature = data_adapter_utils.get_tensor_spec(first_batches)
    except (TypeError, ValueError):  # its first two batches differ in structure or rank
        signature = data_adapter_utils.get_tensor_spec(first_batches[:1])
    # An optional input given None is None in the batches (Keras' adapter makes it an
    # empty tf.experimental.Optional, which its step turns back into None).
    signature = tf.nest.map_structure(
        lambda spec: internals.none_tensor_spec()() if isinstance(spec, tf.OptionalSpec) else spec,
        signature,
    )
    return first, size, signature


def _described(batch) -> str:
    """A batch's structure, shapes and dtypes, e.g. (float32[32, 8], int64[32])."""

    def described(leaf):
        if leaf is None or isinstance(leaf, internals.none_tensor_spec()):
            return "None"
        return f"{leaf.dtype.name}{list(leaf.shape)}"

    shapes = tf.nest.map_structure(described, batch)
    return str(shapes).replace("'", "").replace("None", "?")


def checked(numbered, signature, batch_size: int):
    """The batches of a source that makes its own (a generator, a PyDataset) as numpy
    structures, each checked against `signature` (`_own_batches`): the same structure,
    shapes after the batch axis that fit it, at most `batch_size` examples, as many in
    every part. numbered: pairs (the batch's number in the source, the batch). A batch
    that differs is a ValueError naming it, raised before it is trained on."""
    for index, batch in numbered:
        batch = _as_leaves(batch)
        try:
            tf.nest.assert_same_structure(signature, batch, check_types=False)
            fits = all(
                (leaf is None) == isinstance(spec, internals.none_tensor_spec())
                and (leaf is None or spec.shape.is_compatible_with(leaf.shape))
                for spec, leaf in zip(tf.nest.flatten(signature), tf.nest.flatten(batch))
            )
        except (TypeError, ValueError):
            fits = False
        if not fits:
            raise ValueError(
                f"its batch {index} is {_described(batch)}, where its first batches were "
                f"{_described(signature)}"
            )
        lengths = {leaves.length(leaf) for leaf in tf.nest.flatten(batch) if leaf is not None}
        if len(lengths) > 1 or max(lengths) > batch_size:
            raise ValueError(
                f"its batch {index} is {_described(batch)}: "
                + (
                    "its parts differ in length"
                    if len(lengths) > 1
                    else f"more examples than the first batch's {batch_size}"
                )
            )
        yield batch


def from_generator(generator, batch_size, field="x"):
    """A Stream of a Python generator of batches (read once: one pass, length unknown)."""
    first_batches = list(itertools.islice(generator, 2))  # as Keras' adapter reads them
    if not first_batches:
        raise ConfigError(field, "generator", "has no examples")
    first, size, signature = _own_batches(first_batches, batch_size, "generator")
    read = []  # a generator is read once: a second pass over it finds it ended

    def batches():
        if read:
            return
        read.append(True)
        yield first
        rest = itertools.chain(first_batches[1:], generator)
        yield from checked(enumerate(rest, 1), signature, size)

    dataset = tf.data.Dataset.from_generator(batches, output_signature=signature)
    return Stream(dataset, size, None, None, "generator", False, first)


def from_py_dataset(py_dataset, batch_size, shuffle, seed, field="x"):
    """A Stream of a keras.utils.PyDataset: batch i of a pass is `py_dataset[i]`, in
    order (shuffle False) or in an order that is a function of (seed, pass), so that a
    resumed run reads from the step it resumes at by index."""
    count = py_dataset.num_batches
    if count == 0:
        raise ConfigError(field, "PyDataset", "has no examples")
    first_batches = [py_dataset[i] for i in range(2 if count is None else min(2, count))]
    first, size, signature = _own_batches(first_batches, batch_size, "PyDataset")

    def one_pass(epoch, begin):
        """Pass `epoch` from its batch `begin` on."""
        if count is None:  # an infinite PyDataset: batch 0, 1, 2, ...
            order = itertools.count(int(begin))
        elif shuffle is True:
            order = np.random.default_rng([seed, int(epoch)]).permutation(count)[int(begin) :]
        else:
            order = range(int(begin), count)
        py_dataset.on_epoch_begin()
        yield from checked(((i, py_dataset[int(i)]) for i in order), signature, size)
        py_dataset.on_epoch_end()

    def starting_at(step: int) -> tf.data.Dataset:
        if count is None:  # infinite: one endless pass
            return tf.data.Dataset.from_generator(
                one_pass, args=(0, step), output_signature=signature
            )
        first_pass, begin = divmod(step, count)  # pass after pass, each in its own order
        return tf.data.Dataset.counter(first_pass).flat_map(
            lambda epoch: tf.data.Dataset.from_generator(
                one_pass,
                args=(epoch, tf.where(epoch == first_pass, tf.cast(begin, epoch.dtype), 0)),
                output_signature=signature,
            )
        )

    return Stream(
        starting_at(0),
        size,
        count,
        None,
        "PyDataset",
        False,
        first,
        starting_at=starting_at,
        endless=count is None,
    )


def with_class_weight(x, class_weight):
    """A PyDataset or generator whose batches carry Keras' sample weights of
    `class_weight` (`class_weight_to_sample_weights` of their targets), as Keras' fit
    weighs them."""
    data_adapter_utils = internals.data_adapter_utils()

    def weighed(batch):
        x_part, y, weights = keras.utils.unpack_x_y_sample_weight(
            tuple(batch) if isinstance(batch, list) else batch
        )
        if weights is not None:
            raise ValueError(
                "its batches hold sample weights, and class_weight was given too; Keras takes one"
            )
        y = np.asarray(y)
        return x_part, y, data_adapter_utils.class_weight_to_sample_weights(y, class_weight)

    if isinstance(x, keras.utils.PyDataset):
        return _WeighedPyDataset(x, weighed)
    return (weighed(batch) for batch in x)


class _WeighedPyDataset(keras.utils.PyDataset):
    """A PyDataset's batches, weighed (`with_class_weight`)."""

    def __init__(self, py_dataset, weighed):
        super().__init__()
        self.py_dataset = py_dataset
        self.weighed = weighed

    def __len__(self):
        return len(self.py_dataset)

    @property
    def num_batches(self):
        return self.py_dataset.num_batches

    def __getitem__(self, index):
        return self.weighed(self.py_dataset[index])

    def on_epoch_begin(self):
        self.py_dataset.on_epoch_begin()

    def on_epoch_end(self):
        self.py_dataset.on_epoch_end()


@dataclasses.dataclass
class EvalStream:
    """Validation data read batch by batch at each evaluation, as Keras' `evaluate` reads
    it: a tf.data pipeline (batched, or batched here to the validation batch size) or a
    PyDataset from its start every time, with validation_steps too (Keras' `evaluate`
    resets its iterator); a generator on from where it stopped; arrays held in memory
    (data/arrays.py, `as_eval_stream`).

    Attributes:
      source: what the user gave, as errors name it.
      sample: a batch of it as the model reads it (zeros of a pipeline's spec, or the
        first batch of a PyDataset or generator), to check it fits the model.
      read: (batch_size, steps or None) -> an iterable of batches.
      endless: it never ends: an evaluation needs `validation_steps`.
    """

    source: str
    sample: object
    read: Callable
    endless: bool = False
    dataset: object = None  # a tf.data pipeline's dataset, as given

    def batches(self, batch_size: int, steps: int | None):
        """The batches of one evaluation (a batched pipeline keeps its own size)."""
        if batch_size < 1:
            raise ConfigError("batch_size", batch_size, "must be >= 1")
        return self.read(batch_size, steps)

    def first_examples(self, count: int):
        """The first `count` examples (at most the sample's): `first_of` the sample."""
        return first_of(self.sample, count)


def eval_stream(data, field: str = "validation_data") -> EvalStream:
    """The EvalStream of validation data Keras' fit would stream (`is_stream_input`)."""

    if isinstance(data, tf.data.Dataset):
        batched, size, _ = dataset_batching(data)
        cardinality = int(data.cardinality())
        if cardinality == 0:
            raise ConfigError(field, "tf.data.Dataset", "has no examples")

        def read_dataset(batch_size, steps):
            dataset = data if batched else data.batch(batch_size)
            return dataset.take(steps) if steps else dataset

        spec = (
            data.element_spec
            if batched
            else tf.nest.map_structure(
                lambda leaf: tf.TensorSpec((None, *leaf.shape), leaf.dtype), data.element_spec
            )
        )
        sample = _sample(spec, 2)
        endless = cardinality == tf.data.INFINITE_CARDINALITY
        return EvalStream("tf.data.Dataset", sample, read_dataset, endless, data)
    if isinstance(data, keras.utils.PyDataset):
        count = data.num_batches
        if count == 0:
            raise ConfigError(field, "PyDataset", "has no examples")

        def read_py_dataset(batch_size, steps):
            last = count if steps is None else min(steps, count or steps)
            return (_as_batch(data[i]) for i in range(last))

        return EvalStream("PyDataset", _as_batch(data[0]), read_py_dataset, count is None)
    try:
        first = next(data)
    except StopIteration:
        raise ConfigError(field, "generator", "has no examples") from None
    rest = itertools.chain([first], data)  # read on from where the last evaluation stopped

    def read_generator(batch_size, steps):
        return (_as_batch(batch) for batch in itertools.islice(rest, steps))

    return EvalStream("generator", _as_batch(first), read_generator)


def _as_batch(batch):
    """A batch a PyDataset or generator made, as tfdp holds data (`_as_leaves`)."""
    return _as_leaves(batch)
