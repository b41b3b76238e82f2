"""A user's model and data: MODULE:FUNCTION names, and data in the forms Keras `fit` takes.

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

from tfdp.errors import ConfigError


def is_reference(text) -> bool:
    """Whether `text` has the MODULE:FUNCTION form."""
    return isinstance(text, str) and ":" in text


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


def as_arrays(data, field: str, value=None, part: str | None = None):
    """Training or validation data as tfdp holds it: a nested structure of numpy arrays
    with one leading example axis (None stays None).

    Takes what Keras `fit` takes: arrays or nested tuples, lists and dicts of
    them (`(x, y)`, `(x, y, sample_weight)`, dict inputs), or an unbatched
    `tf.data.Dataset` of such elements, which is read into memory once (tfdp
    shuffles and cuts batches itself, so that every mode and a resumed run
    read the same batches).
    """
    from tfdp import data as data_lib

    if data is None or isinstance(data, data_lib.Arrays):
        return data
    where = f"{part} data" if part else None
    import tensorflow as tf

    if isinstance(data, tf.data.Dataset):
        data = _read_dataset(data, field, value, where)
    try:
        arrays = tf.nest.map_structure(np.asarray, data)
    except (TypeError, ValueError) as error:
        raise ConfigError(field, value or type(data).__name__, f"is not arrays ({error})") from None
    try:
        data_lib.check_arrays(arrays, field)
    except ConfigError as error:
        if value is None:
            raise
        raise ConfigError(field, value, f"{where}: {error.reason}") from None
    return arrays


def _read_dataset(dataset, field, value, where):
    import tensorflow as tf

    cardinality = int(dataset.cardinality())
    if cardinality == tf.data.INFINITE_CARDINALITY:
        raise ConfigError(
            field,
            value or "tf.data.Dataset",
            f"{where + ': ' if where else ''}is infinite; give a finite, unbatched dataset "
            "(tfdp batches, shuffles and repeats it)",
        )
    from tfdp.streams import dataset_batching

    if dataset_batching(dataset)[0]:  # Keras' form: batches, read here as examples
        dataset = dataset.unbatch()
    elements = list(dataset.as_numpy_iterator())
    if not elements:
        raise ConfigError(field, value or "tf.data.Dataset", "has no examples")
    return tf.nest.map_structure(lambda *leaves: np.stack(leaves), *elements)
