"""A user's model and data named on the command line: MODULE:FUNCTION, tfds:NAME.

`--model=MODULE:FUNCTION` and `--dataset=MODULE:FUNCTION` name a function of
no arguments in an importable module (`examples.mnist_cnn:make_model`) or in
a Python file (`examples/mnist_cnn.py:make_model`).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys

import numpy as np

from tfdp import internals
from tfdp.errors import ConfigError


def load_function(text: str, field: str):
    """The function `text` (MODULE:FUNCTION) names; ConfigError naming `field` if there is none."""
    module_name, _, name = text.rpartition(":")
    if not module_name or not name.isidentifier():
        raise ConfigError(
            field, text, "must be MODULE:FUNCTION, e.g. examples/mnist_cnn.py:make_model"
        )
    try:
        if module_name.endswith(".py") or os.sep in module_name:
            module = _load_file(module_name)
        else:
            module = importlib.import_module(module_name)
    except FileNotFoundError:
        raise ConfigError(field, text, f"{module_name} does not exist") from None
    except ModuleNotFoundError as error:
        raise ConfigError(field, text, f"cannot import {module_name} ({error})") from None
    except Exception as error:  # the user's module failed while loading
        raise ConfigError(
            field, text, f"importing {module_name} raised {type(error).__name__}: {error}"
        ) from None
    function = getattr(module, name, None)
    if not callable(function):
        raise ConfigError(field, text, f"{module_name} has no function {name}")
    return function


def _load_file(path: str):
    if not os.path.isfile(path):
        raise FileNotFoundError(path)
    name = "tfdp_user_" + os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # pickling and Keras' serialisation look modules up here
    spec.loader.exec_module(module)
    return module


def call(function, text: str, field: str):
    """`function()`, with any error it raises reported on one line against `field`."""
    try:
        return function()
    except ConfigError:
        raise
    except Exception as error:  # the user's code
        raise ConfigError(field, text, f"raised {type(error).__name__}: {error}") from None


TFDS_PREFIX = "tfds:"
TFDS_SHUFFLE_BUFFER = 4096  # examples; the buffer is saved with each checkpoint


def is_tfds(text) -> bool:
    """Whether `text` names a tensorflow-datasets dataset: tfds:NAME."""
    return isinstance(text, str) and text.startswith(TFDS_PREFIX)


def load_tfds(text: str, data_dir=None, shuffle=True, seed=0):
    """(train, validation) of the tensorflow-datasets dataset `text` (tfds:NAME, with
    NAME as `tfds.load` takes it: mnist, cifar10, imagenette/160px:1.0.0, ...).

    Both are unbatched tf.data pipelines of (input, target): the dataset's supervised
    keys. Image features become float32 in [0, 1]; integer targets (class labels)
    int32; every other feature as tensorflow-datasets gives it. train is the "train"
    split, read in its files' order and, with `shuffle`, through a seeded buffer of
    TFDS_SHUFFLE_BUFFER examples; validation is "test", else "validation", else None.
    Files already under `data_dir` are read as they are; missing ones are downloaded.
    """
    import tensorflow as tf
    import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top  # slow import

    name = text[len(TFDS_PREFIX) :]
    try:
        builder = tfds.builder(name, data_dir=data_dir)
    except tfds.core.registered.DatasetNotFoundError:
        raise ConfigError(
            "dataset", text, f"tensorflow-datasets has no dataset {name} (see tfds.list_builders())"
        ) from None
    except Exception as error:  # a bad config or version: tfds raises several kinds
        raise ConfigError("dataset", text, f"{type(error).__name__}: {error}") from None
    keys = builder.info.supervised_keys
    if not keys or len(keys) != 2:
        raise ConfigError(
            "dataset",
            text,
            f"has no supervised keys (input, target) to train on (its features: "
            f"{', '.join(builder.info.features)}); pick them with --dataset=MODULE:FUNCTION",
        )
    try:
        builder.download_and_prepare()
    except Exception as error:  # tensorflow-datasets raises many kinds on download or read
        raise ConfigError(
            "data_dir",
            data_dir,
            f"{name} through tensorflow-datasets failed ({type(error).__name__}: {error})",
        ) from None
    features = tf.nest.map_structure(lambda key: builder.info.features[key], tuple(keys))

    def scaled(feature, tensor):
        if isinstance(feature, tfds.features.Image):
            return tf.cast(tensor, tf.float32) / 255.0
        if isinstance(feature, tfds.features.ClassLabel):
            return tf.cast(tensor, tf.int32)
        return tensor

    def split(split_name):
        return builder.as_dataset(split=split_name, as_supervised=True, shuffle_files=False)

    train = split("train")
    if shuffle:
        train = train.shuffle(TFDS_SHUFFLE_BUFFER, seed=seed)
    known = list(builder.info.splits)  # empty under tensorflow-datasets' mock data
    validation_name = next((s for s in ("test", "validation") if s in known or not known), None)
    validation = split(validation_name) if validation_name else None

    @tf.autograph.experimental.do_not_convert
    def scale(*element):
        return tf.nest.map_structure(scaled, features, element)

    return (
        train.map(scale, num_parallel_calls=tf.data.AUTOTUNE, deterministic=True),
        validation.map(scale) if validation is not None else None,
    )
