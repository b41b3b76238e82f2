"""Data that fails while training: one line in TensorFlow's own words, the file that
holds the bad record, and a rerun that resumes once the data is repaired.

A stream's error comes out of a step (tf.data's IteratorGetNext) or out of an
evaluation's read. `failure_line` says it on one line: the data, TensorFlow's message
(`corrupted record at 26880`), the step, for a TFRecord pipeline the file found by
reading each of its files once more (`bad_files`), and the checkpoint that stands.

TensorFlow saves a pipeline's read-ahead with its position, a read error included: a
position saved after the failure was read ahead fails again when restored, even once
the file is repaired. So a failure is noted in the run's directory (`note_failure`),
and a rerun resuming at or before the failing step reads the stream again from its
start to its step (`distrusts_position`) instead of restoring the saved position.
"""

from __future__ import annotations

import json
import os
import re

from tfdp import internals

FAILURE_FILE = "input_failure.json"  # in model_dir: the step a stream last failed at
_BOILERPLATE = ("Graph execution error", "Detected at node", "<stack traces", "Traceback")
_READERS = ("_InterleaveDataset", "_ParallelInterleaveDataset", "_FlatMapDataset")
MAX_FILES = 100_000  # a file-name stream longer than this is not read through


class ValidationFailed(Exception):
    """Reading validation data raised `error` (a corrupt file, a generator that raised)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def reading(batches):
    """The batches of validation data, one by one; an error reading one (or starting to)
    is raised as ValidationFailed, to be told apart from an error of the step."""
    try:
        iterator = iter(batches)
    except Exception as error:  # the user's pipeline or generator
        raise ValidationFailed(error) from None
    while True:
        try:
            batch = next(iterator)
        except StopIteration:
            return
        except Exception as error:
            raise ValidationFailed(error) from None
        yield batch


def tf_words(error) -> str:
    """TensorFlow's own message of an error, on one line, without the stack TensorFlow
    adds where the op was defined or the node it ran in (`corrupted record at 26880`;
    `ValueError: ...` for a Python error raised in a generator or py_function)."""
    message = getattr(error, "message", None) or str(error)
    for raw in message.splitlines():
        line = raw.split("}} ", 1)[-1] if raw.startswith("{{") else raw
        several = re.match(r"^\s*\(\d+\) [A-Z_]+: +(.*)", line)  # "  (0) DATA_LOSS: ..."
        if several:  # the first of several root errors (one per device)
            line = several.group(1)
        elif not line.strip() or line[0] in " \t" or line.startswith(_BOILERPLATE):
            continue  # stack frames and their code are indented, as are [[node]] lines
        elif re.match(r"^\d+ root error\(s\) found", line):
            continue
        return line.split(" [[", 1)[0].split(" [Op:", 1)[0].strip()
    return ""


def described(error) -> str:
    """The error's class and TensorFlow's message; a Python error raised in the user's
    code (a generator, a py_function) as Python names it."""
    words = tf_words(error)
    if re.match(r"^\w+(Error|Exception): ", words):
        return words
    return f"{type(error).__name__}: {words}" if words else type(error).__name__


def _text(value) -> str | None:
    """A file name or compression type given to tf.data: str, bytes or a constant tensor."""
    if value is None:
        return ""
    try:
        value = value.numpy() if hasattr(value, "numpy") else value
    except Exception:  # a symbolic tensor: not known before reading
        return None
    return value.decode() if isinstance(value, bytes) else str(value)


def _names(dataset) -> list[str] | None:
    """The file names a finite dataset of scalar strings holds (None: not such a dataset)."""
    import tensorflow as tf

    spec = dataset.element_spec
    if not isinstance(spec, tf.TensorSpec) or spec.dtype != tf.string or spec.shape.rank != 0:
        return None
    if not 0 <= int(dataset.cardinality()) <= MAX_FILES:
        return None
    try:
        return [name.decode() for name in dataset.as_numpy_iterator()]
    except Exception:  # the names cannot be read on their own (a placeholder, a py_function)
        return None


def _reads_tfrecords(function) -> bool:
    """Whether a tf.data map function (of interleave, flat_map) makes a TFRecord reader."""
    try:
        graph = function.function.graph.as_graph_def()
    except Exception:  # no traced graph to look into
        return False
    ops = {node.op for node in graph.node}
    ops |= {node.op for f in graph.library.function for node in f.node_def}
    return any(op.startswith("TFRecordDataset") for op in ops)


def record_files(dataset) -> list[tuple[str, str]]:
    """The TFRecord files a pipeline reads, with their compression, where the pipeline
    shows them: `TFRecordDataset(files)` anywhere in it, or an interleave or flat_map of
    a TFRecord reader over a finite dataset of file names (`Dataset.list_files(...)`)."""
    files, nodes, seen = [], [dataset], set()
    while nodes:
        node = nodes.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        name = type(node).__name__
        if name.startswith("TFRecordDataset") and internals.dataset_files(node) is not None:
            compression = _text(internals.dataset_compression(node))
            names = _names(internals.dataset_files(node))
            if names is not None and compression is not None:
                files += [(file, compression) for file in names]
            continue
        inputs = internals.dataset_inputs(node)
        if name in _READERS and inputs and _reads_tfrecords(internals.dataset_map_function(node)):
            names = _names(inputs[0])
            if names is not None:
                files += [(file, "") for file in names]
                continue
        nodes.extend(inputs)
    return list(dict.fromkeys(files))


def bad_files(files: list[tuple[str, str]]) -> list[tuple[str, str]]:
    """(file, TensorFlow's words) for each TFRecord file that fails to read through."""
    import numpy as np
    import tensorflow as tf

    bad = []
    for file, compression in files:
        records = tf.data.TFRecordDataset(file, compression_type=compression)
        try:
            records.reduce(np.int64(0), lambda count, _: count + 1)
        except tf.errors.OpError as error:
            bad.append((file, described(error)))
    return bad


def where_in_files(dataset) -> str:
    """What reading each TFRecord file of the pipeline again found, as a clause of the
    failure line ("" where the pipeline shows no TFRecord files)."""
    if dataset is None:
        return ""
    files = record_files(dataset)
    if not files:
        return ""
    bad = bad_files(files)
    read = f"each of its {len(files)} TFRecord file(s) read again"
    if not bad:
        return f"{read}: all read through now"
    named = "; ".join(f"{file} ({words})" for file, words in bad)
    return f"{read}: {named}"


def failure_line(what: str, error, step: int, dataset=None, latest=None, when="at") -> str:
    """One line: `what` (the training data (tf.data.Dataset)) failed (the error in
    TensorFlow's words) at the step (`when`: "in the evaluation at"), the bad file where
    tfdp can find it, and what stands."""
    import tensorflow as tf

    if isinstance(error, tf.errors.OutOfRangeError):
        text = f"{what} ran out of batches {when} step {step}"
    else:
        text = f"{what} failed ({described(error)}) {when} step {step}"
    files = where_in_files(dataset)
    if files:
        text += f"; {files}"
    if latest:
        return f"{text}; {latest} stands: run again to resume from it"
    return f"{text}; no checkpoint was saved"


def note_failure(model_dir: str, step: int, line: str) -> None:
    """Notes in model_dir that the training stream failed at `step`, for the rerun."""
    from tfdp.storage import write_atomically

    path = os.path.join(model_dir, FAILURE_FILE)
    write_atomically(path, json.dumps({"step": step, "failure": line}, indent=2) + "\n")


def failed_step(model_dir: str | None) -> int | None:
    """The step the training stream last failed at in model_dir (None: never)."""
    if not model_dir:
        return None
    try:
        with open(os.path.join(model_dir, FAILURE_FILE)) as f:
            return int(json.load(f)["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def distrusts_position(model_dir: str | None, start_step: int) -> int | None:
    """The step the stream failed at, if a position saved at `start_step` may hold the
    failure in its read-ahead (it was saved at or before that step); else None."""
    failed = failed_step(model_dir)
    return failed if failed is not None and start_step <= failed else None
