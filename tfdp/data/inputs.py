"""The one way in for data: what `Model.fit` takes, made into a run's two streams.

`tfdp.fit`'s data arguments (`of_fit`) and the command's `--dataset` (`of_dataset`)
become `Inputs`, checked; `Inputs.streams` makes the run's training `Stream` and
validation `EvalStream` of them once the run's settings are known (the batch size,
the shuffle, the seed) and, in a cluster, after the worker has joined it:

    inputs = of_fit(x, y, sample_weight, class_weight, validation_split, validation_data)
    train, validation = inputs.streams(config)  # in plan.prepare

Arrays held in memory become a stream read by index (`arrays.as_stream`: a resumed
run reads on from its step's batch); a tf.data pipeline, a PyDataset or a generator
a stream read as it runs (`streams.from_input`).
"""

from __future__ import annotations

import dataclasses
import os

import tensorflow as tf

from tfdp import internals
from tfdp.config import DATASETS, DEFAULT_BATCH_SIZE
from tfdp.data import arrays as data_lib
from tfdp.data import leaves, mnist, sources, streams
from tfdp.errors import ConfigError

KERAS_BATCH_SIZE = 32  # Keras fit's default


@dataclasses.dataclass(frozen=True)
class Inputs:
    """A run's data, checked, before its streams are made.

    Attributes:
      train: arrays (a nested structure of them, or mnist's `Arrays`), or what Keras
        fit reads as a pipeline (a tf.data.Dataset, a PyDataset, a generator).
      validation: arrays, an `EvalStream`, or None.
      field: the setting errors about the data name ("x": tfdp.fit's; "dataset").
      value: the setting's value, as errors show it (the dataset's name).
      default_batch: the batch size when none is given and the data has no batches
        of its own.
      keras_batch: with `steps_per_epoch` and no batch size, arrays are cut into the
        batch that covers them in one epoch, as Keras fit cuts them.
    """

    train: object
    validation: object
    field: str = "x"
    value: object = None
    default_batch: int = KERAS_BATCH_SIZE
    keras_batch: bool = True

    @property
    def validation_field(self) -> str:
        return "validation_data" if self.field == "x" else self.field

    def streams(self, config) -> tuple[streams.Stream, streams.EvalStream | None]:
        """(training stream, validation stream or None) under the run's settings; the
        training stream's `batch_size` is the run's."""
        return self._train_stream(config), self._validation_stream()

    def _train_stream(self, config) -> streams.Stream:
        train, batch_size = self.train, config.batch_size
        if streams.is_stream_input(train):  # read as a pipeline, batch by batch
            if batch_size is None and not streams.makes_own_batches(train):
                batch_size = self.default_batch
            try:
                return streams.from_input(
                    train, batch_size, config.drop_remainder, config.shuffle, config.seed
                )
            except ConfigError as error:
                if error.field != "x" or self.field == "x":
                    raise
                raise ConfigError(
                    self.field, self.value, f"train data, a {error.value}, {error.reason}"
                ) from None
        examples = data_lib.size(train)
        if batch_size is None and self.keras_batch and config.steps_per_epoch:
            batch_size = -(-examples // config.steps_per_epoch)
        batch_size = batch_size or self.default_batch
        if config.drop_remainder and batch_size > examples:
            raise ConfigError(
                "batch_size",
                batch_size,
                f"is larger than the {examples} training examples, and drop_remainder leaves "
                "no batch",
            )
        return data_lib.as_stream(
            train, batch_size, config.seed, config.drop_remainder, config.shuffle
        )

    def _validation_stream(self) -> streams.EvalStream | None:
        validation = self.validation  # arrays were checked to hold examples (`as_arrays`)
        if validation is None or isinstance(validation, streams.EvalStream):
            return validation
        return data_lib.as_eval_stream(validation)


def of_fit(x, y, sample_weight, class_weight, validation_split, validation_data) -> Inputs:
    """tfdp.fit's data, as Keras fit takes it. The validation split and the class weights
    are Keras' own; a dataset a strategy distributed is its dataset of global batches."""
    x = undistributed(x, "x")
    validation_data = undistributed(validation_data, "validation_data")
    if streams.is_stream_input(x):
        if y is not None or sample_weight is not None:
            raise ConfigError(
                "y",
                type(y).__name__,
                "must be None when x is a dataset: its elements hold the targets",
            )
        if validation_split:
            raise ConfigError(
                "validation_split", validation_split, "needs arrays; give validation_data instead"
            )
        if class_weight is not None and isinstance(x, tf.data.Dataset):
            x = x.map(internals.class_weight_map_fn(class_weight))  # as Keras weighs a dataset
        elif class_weight is not None:  # a PyDataset or a generator: each batch, as read
            x = streams.with_class_weight(x, class_weight)
        return Inputs(x, _validation(validation_data))
    if x is None:
        raise ConfigError("x", None, "has no training data")
    if y is None:
        raise ConfigError(
            "y",
            None,
            "has no targets: tfdp.fit(model, x, y) takes them as Keras fit does (a "
            "tuple (x, y) as x is the inputs of a model with two inputs)",
        )
    if not 0 <= validation_split < 1:
        raise ConfigError("validation_split", validation_split, "must be in [0, 1)")
    if validation_split and validation_data is None:
        (x, y, sample_weight), validation_data = internals.train_validation_split(
            (x, y, sample_weight), validation_split
        )
    train = as_arrays((x, y) if sample_weight is None else (x, y, sample_weight), "x")
    if class_weight is not None:
        train = _class_weighted(train, class_weight)
    return Inputs(train, _validation(validation_data))


def _class_weighted(train, class_weight):
    """Arrays (x, y) with Keras' sample weights for `class_weight`."""
    data_adapter_utils = internals.data_adapter_utils()
    x, y, weights = data_adapter_utils.unpack_x_y_sample_weight(train)
    if weights is not None:
        raise ConfigError(
            "class_weight", class_weight, "and sample_weight both given; Keras takes one"
        )
    return x, y, data_adapter_utils.class_weight_to_sample_weights(y, class_weight)


def _validation(data):
    """Keras fit's `validation_data`: a tuple (x, y) or (x, y, sample_weight) of arrays
    held in memory; a tf.data pipeline, PyDataset or generator streamed, batch by batch,
    at each validation (`streams.EvalStream`)."""
    if data is None:
        return None
    if streams.is_stream_input(data):
        return streams.eval_stream(data)
    unpack = internals.data_adapter_utils().unpack_x_y_sample_weight
    val_x, val_y, val_weight = unpack(tuple(data) if isinstance(data, list) else data)
    data = (val_x, val_y) if val_weight is None else (val_x, val_y, val_weight)
    return as_arrays(data, "validation_data")


def of_dataset(config) -> Inputs:
    """The data `--dataset` names: a built-in dataset, tfds:NAME, or MODULE:FUNCTION's
    (train, validation)."""
    common = {"field": "dataset", "value": config.dataset, "keras_batch": False,
              "default_batch": DEFAULT_BATCH_SIZE}
    if config.dataset in DATASETS:
        return Inputs(built_in(config, "train"), built_in(config, "test"), **common)
    if sources.is_tfds(config.dataset):
        train, test = sources.load_tfds(
            config.dataset, config.data_dir, config.shuffle is not False, config.seed
        )
    else:
        function = sources.load_function(config.dataset, "dataset")
        returned = sources.call(function, config.dataset, "dataset")
        if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
            raise ConfigError(
                "dataset", config.dataset, "must return (train, validation); validation may be None"
            )
        train, test = returned
    if not streams.is_stream_input(train):
        train = as_arrays(train, "dataset", config.dataset, "train")
    return Inputs(train, _dataset_validation(test, config), **common)


def _dataset_validation(test, config):
    """The validation data of `--dataset`: a pipeline streamed (`eval_steps` needed where
    it never ends), arrays held."""
    if not streams.is_stream_input(test):
        return as_arrays(test, "dataset", config.dataset, "validation")
    try:
        test = streams.eval_stream(test, "dataset")
    except ConfigError as error:
        raise ConfigError(
            "dataset", config.dataset, f"validation data, a {error.value}, {error.reason}"
        ) from None
    if test.endless and config.eval_steps is None:
        raise ConfigError(
            "eval_steps",
            None,
            f"the validation data of {config.dataset}, a {test.source}, is infinite: give "
            "eval_steps, the batches each evaluation reads",
        )
    return test


def built_in(config, split: str):
    """One split of a built-in dataset, with errors naming the setting that chose its
    source (`mnist_dir`, the environment variable, `data_dir`)."""
    if config.dataset == "toy":
        size = 10000 if split == "train" else 2000
        return mnist.make_toy_data(config.seed, num_examples=size, split=split)
    mnist_dir = config.mnist_dir or os.environ.get(mnist.MNIST_DIR_ENV) or None
    if mnist_dir:
        field = "mnist_dir" if config.mnist_dir else mnist.MNIST_DIR_ENV
        try:
            arrays = mnist.load_mnist_idx(mnist_dir, split)
        except (OSError, ValueError) as error:
            raise ConfigError(field, mnist_dir, str(error)) from error
        if len(arrays) == 0:
            needs = "evaluation" if split == "test" else "training"
            raise ConfigError(
                field, mnist_dir, f"its {split} split has no examples; {needs} needs at least one"
            )
        return arrays
    try:
        return mnist.load_mnist_tfds(split, config.data_dir)
    except Exception as error:  # tensorflow-datasets raises many kinds on download or read
        raise ConfigError(
            "data_dir",
            config.data_dir,
            f"MNIST through tensorflow-datasets failed ({type(error).__name__}: {error}); "
            f"offline, point --mnist_dir or {mnist.MNIST_DIR_ENV} at the four IDX files",
        ) from error


def undistributed(x, field: str):
    """A dataset a strategy distributed (`strategy.experimental_distribute_dataset(ds)`, as
    Keras' fit takes under a strategy): `ds`, its global batches, which tfdp cuts for its
    own devices; anything else as it is. One distributed from a function holds each
    worker's part only, and is refused."""
    if not isinstance(x, tf.distribute.DistributedDataset):
        return x
    original = internals.original_dataset(x)  # TensorFlow's DistributedDataset
    original = getattr(x, "_tfdp_dataset", original)  # tfdp.MirroredStrategy's
    if isinstance(original, tf.data.Dataset):
        return original
    raise ConfigError(
        field,
        type(x).__name__,
        "is distributed from a function (each worker's part of a batch): give tfdp.fit "
        "the tf.data.Dataset of whole global batches",
    )


def as_arrays(data, field: str, value=None, part: str | None = None):
    """Training or validation data as tfdp holds it: a nested structure of numpy arrays
    with one leading example axis (None stays None).

    Takes the arrays Keras `fit` takes: arrays or nested tuples, lists and dicts of
    them (`(x, y)`, `(x, y, sample_weight)`, dict inputs); mnist's `Arrays` as they are.
    """
    if data is None or isinstance(data, data_lib.Arrays):
        return data
    data = internals.lists_to_tuples(data)  # as Keras reads it: tf.data takes a list for a tensor
    try:
        arrays = tf.nest.map_structure(leaves.as_leaf, data)
    except (TypeError, ValueError) as error:
        raise ConfigError(field, value or type(data).__name__, f"is not arrays ({error})") from None
    try:
        data_lib.check_arrays(arrays, field)
    except ConfigError as error:
        if value is None:
            raise
        raise ConfigError(field, value, f"{part} data: {error.reason}") from None
    return arrays
