"""A run's directory: checkpoints that resume exactly, the exported model, the result.

DIR/
  run.json        the settings a checkpoint depends on, written before the first save
  checkpoints/    tf.train.CheckpointManager: model, optimizer, step (= input position)
    unreadable/   checkpoints a restore skipped (truncated, files missing), kept aside
  shares.json     weighted: each device's share of the batch at the latest save
  train/, eval/   TensorBoard summaries
  model.keras     the trained model, loadable with keras.models.load_model
  result.json     the run's result

Every regular file tfdp writes is whole or absent (a temporary file renamed over it),
is created like open() creates one (0666 less the umask), and a write that
fails raises StorageError naming the file.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import itertools
import json
import os
import re
import secrets
import shutil
import stat
import sys
import tempfile
from collections.abc import Callable

from tfdp.errors import ConfigError

RUN_FILE = "run.json"
# A checkpoint only continues a run with these the same: they fix the
# variables' shapes and the sequence of batches that step k stands for.
RUN_FIELDS = ("model", "dataset", "hidden_units", "batch_size", "seed", "drop_remainder", "shuffle")
# what a run.json written before a field existed stands for
RUN_FIELD_DEFAULTS = {"drop_remainder": False, "shuffle": True}
SHARES_FILE = "shares.json"


def run_settings(config) -> dict:
    return {field: getattr(config, field) for field in RUN_FIELDS}


def check_model_dir(config) -> None:
    """Fails early if `model_dir` is unusable or holds another run's checkpoints.

    Creates nothing: a bad start leaves no trace.
    """
    model_dir = config.model_dir
    if model_dir is None:
        return
    existing = model_dir
    while not os.path.exists(existing):  # the nearest existing ancestor must be writable
        existing = os.path.dirname(os.path.abspath(existing))
    try:
        if not os.path.isdir(existing):
            raise NotADirectoryError(f"{existing} is not a directory")
        with tempfile.TemporaryFile(dir=existing):  # the only honest test of writability
            pass
    except OSError as error:
        raise ConfigError("model_dir", model_dir, f"cannot be written ({error})") from None
    run_file = os.path.join(model_dir, RUN_FILE)
    if not os.path.exists(run_file):
        return
    try:
        with open(run_file) as f:
            saved = json.load(f)
    except (OSError, ValueError) as error:
        raise ConfigError("model_dir", model_dir, f"{run_file} is unreadable: {error}") from None
    different = [
        f"{field} {saved.get(field)!r} (now {value!r})"
        for field, value in run_settings(config).items()
        if saved.get(field, RUN_FIELD_DEFAULTS.get(field)) != value
    ]
    if different:
        raise ConfigError(
            "model_dir",
            model_dir,
            f"holds checkpoints of another run: {', '.join(different)}; "
            "use another --model_dir or the same settings",
        )


class StorageError(OSError):
    """A file of the run could not be written: disk full, no permission, read-only.

    `path` names the file (or the checkpoint); the message is one line.
    """

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"could not write {path}: {reason}")


def _reason(error: BaseException) -> str:
    """One line for an OSError or a TensorFlow error, without the temporary file's name."""
    if isinstance(error, OSError) and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    message = message.split("}} ")[-1]  # TensorFlow's "{{function_node ...}}" prefix
    return (message.strip().splitlines() or [""])[0]


def _own_stream(path: str):
    """sys.stdout or sys.stderr if `path` is that stream's file (/dev/stdout), else None."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(status, os.fstat(stream.fileno())):
                return stream
        except (AttributeError, OSError, ValueError):  # closed, or no file behind it
            continue
    return None


def _is_special(path: str) -> bool:
    """Whether `path` exists and is not a regular file (a FIFO, a device, a directory)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def _replacing(path: str):
    """Yields a temporary path beside the file `path` names; renames it over that file
    when the block succeeds, and removes it when the block fails.

    Through a symlink, the file it points to is replaced and the link stays.
    An OSError becomes a StorageError naming `path`.
    """
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".tmp-{secrets.token_hex(4)}-{name}")
    try:
        yield temporary
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            raise StorageError(path, _reason(error)) from None
        raise


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path`: a regular file whole or not at all, even if the
    process is killed (a temporary file, renamed over it).

    What is not a regular file is written through, never replaced: this
    process's stdout or stderr (--result_json=/dev/stdout prints), a FIFO or a
    device. The file is created like open() creates one: 0666 less the umask.
    """
    stream = _own_stream(path)
    try:
        if stream is not None:
            stream.write(text)
            stream.flush()
            return
        if _is_special(path):
            with open(path, "w") as f:
                f.write(text)
            return
    except OSError as error:
        raise StorageError(path, _reason(error)) from None
    with _replacing(path) as temporary:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(handle, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


# The files of checkpoint N: ckpt-N.index and ckpt-N.data-K-of-M (TensorFlow's names).
CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(?:index|data-\d+-of-\d+)$")
INDEX_FILE = "checkpoint"  # tf.train.CheckpointManager's list of checkpoints
UNREADABLE = "unreadable"  # where restore moves what does not read back


class Checkpointer:
    """Saves and restores a trainer's model, optimizer and step.

    The step is also the input position: `data.train_dataset(start_step=step)`
    continues with exactly the batch the interrupted run would have read next.
    tf.train.CheckpointManager writes the checkpoint files first and updates
    its `checkpoint` index file atomically last, so a kill during a save
    leaves the previous checkpoint as the latest.
    """

    def __init__(self, config, trainer):
        import tensorflow as tf

        self.config = config
        self.trainer = trainer
        self.directory = os.path.join(config.model_dir, "checkpoints")
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.state = run_state()  # what the run's hooks keep over a restart
        self.checkpoint = self._checkpoint(run=self.state)
        self.restored_path = None  # the checkpoint `restore` read
        self.input = None  # a stream's iterator, saved with each checkpoint (`keep_input`)
        self.log = print

    def _checkpoint(self, **more):
        """A tf.train.Checkpoint of the trainer's model and optimizer, the step, and `more`."""
        import tensorflow as tf

        trainer = self.trainer
        return tf.train.Checkpoint(
            model=trainer.model, optimizer=trainer.optimizer, step=self.step, **more
        )

    @functools.cached_property
    def manager(self):
        """Built from the index file when first used, so after `restore` has tidied it."""
        import tensorflow as tf

        return tf.train.CheckpointManager(
            self.checkpoint, self.directory, max_to_keep=self.config.keep_checkpoints
        )

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"ckpt-{step}")

    def restore(self, log: Callable[[str], None] = print) -> int:
        """Restores the newest checkpoint that reads back whole; returns its step (0: none).

        The candidates are the checkpoints the index file names and those found
        by their files, so a garbled index never restarts a run at step 0.
        Each newer one that does not read back (a truncated or missing file) is
        skipped with a line to `log`; the chief moves its files to
        checkpoints/unreadable/ and rewrites the index, so that the saves that
        follow neither meet nor list them. Nothing that reads back is moved.
        """
        index, index_problem = self._read_index()
        named = [index.model_checkpoint_path, *index.all_model_checkpoint_paths] if index else []
        steps = sorted({*map(_step, named), *self._steps_on_disk()} - {None}, reverse=True)
        skipped = []
        step = None
        for candidate in steps:
            problem = self._unreadable(self.path(candidate))
            if problem is None:
                step = candidate
                break
            skipped.append((candidate, problem))
        if steps and step is None:
            problems = "; ".join(f"ckpt-{bad}: {problem}" for bad, problem in skipped)
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"none of its checkpoints reads back ({problems}); "
                f"move {self.directory} away to start again from step 0",
            )
        if step is not None:
            self._restore(self.path(step))
        listed = index is not None and _step(index.model_checkpoint_path) == step
        if (step is not None and not listed) or index_problem or skipped:
            self._tidy(step, skipped, index, index_problem, log)
        if step is None:
            return 0
        return int(self.step.numpy())

    def _read_index(self):
        """The index file's CheckpointState (None: no file, or unreadable) and, if it
        exists but does not parse, why."""
        from google.protobuf import text_format
        from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

        try:
            with open(os.path.join(self.directory, INDEX_FILE)) as f:
                index = text_format.Parse(f.read(), CheckpointState())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, text_format.ParseError) as error:
            return None, _reason(error)
        if _step(index.model_checkpoint_path) is None:  # CheckpointManager would raise
            return None, f"it names no checkpoint: {index.model_checkpoint_path!r}"
        return index, None

    def _steps_on_disk(self) -> set[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return set()
        return {int(match[1]) for match in map(CHECKPOINT_FILE.match, names) if match}

    def _unreadable(self, path: str) -> str | None:
        """Why the checkpoint `path` does not read back, or None if every tensor does
        (each is checked against the checksum TensorFlow stored with it)."""
        import tensorflow as tf

        if not os.path.exists(path + ".index"):
            return "its index file is missing"
        if not glob.glob(glob.escape(path) + ".data-*-of-*[0-9]"):
            return "its data file is missing"
        try:
            reader = tf.train.load_checkpoint(path)
            for name, dtype in reader.get_variable_to_dtype_map().items():
                if dtype != tf.variant:  # a stream's position reads back when restored
                    reader.get_tensor(name)
        except IndexError as error:  # the reader's words for a short read
            return f"its data file is truncated ({error})"
        except (tf.errors.OpError, OSError, ValueError) as error:
            return f"it does not read back ({_reason(error)})"
        return None

    def saved_input(self) -> bool:
        """Whether the restored checkpoint holds a stream's position."""
        import tensorflow as tf

        if self.restored_path is None:
            return False
        names = tf.train.load_checkpoint(self.restored_path).get_variable_to_shape_map()
        return any(name.startswith("input/") for name in names)

    def restore_input(self, iterator) -> None:
        """Puts a new iterator of the stream at the restored checkpoint's position."""
        import tensorflow as tf

        try:
            tf.train.Checkpoint(input=iterator).restore(self.restored_path).expect_partial()
        except (tf.errors.OpError, ValueError) as error:
            reason = getattr(error, "message", str(error)).strip().splitlines()[0]
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"its checkpoint {self.restored_path} holds the position of another pipeline "
                f"than this one ({reason}); give the pipeline it was saved with, or another "
                "model_dir",
            ) from None

    def keep_input(self, iterator) -> None:
        """Saves `iterator`'s position with every checkpoint from now on."""
        self.input = iterator
        self.checkpoint.input = iterator

    def _without_input(self, error) -> None:
        """The stream's position cannot be saved (a generator inside it): the checkpoints
        hold the rest, and a resume reads the stream again."""
        reason = getattr(error, "message", str(error)).strip().splitlines()[0]
        self.log(
            f"tfdp: the input position cannot be saved ({reason.split('}} ')[-1]}); a resume "
            "reads the stream again from its start and drops the trained batches"
        )
        self.input = None
        self.checkpoint = self._checkpoint(run=self.state)
        self.__dict__.pop("manager", None)

    def _restore(self, path: str) -> None:
        import tensorflow as tf

        self.restored_path = path

        checkpoint = self.checkpoint
        names = tf.train.load_checkpoint(path).get_variable_to_shape_map()
        if not any(name.startswith("run/") for name in names):  # saved before the run state
            checkpoint = self._checkpoint()
        try:
            checkpoint.restore(path).assert_existing_objects_matched()
        except (AssertionError, ValueError) as error:  # another run's checkpoint
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"its checkpoint {path} does not fit this model ({error})".replace("\n", " "),
            ) from None

    def _tidy(self, step, skipped, index, index_problem, log) -> None:
        """Says what restore found; the chief moves the files that do not read back
        aside and rewrites the index to list the checkpoints up to `step`."""
        chief = self.trainer.is_chief  # other workers read the chief's directory
        index_file = os.path.join(self.directory, INDEX_FILE)
        resuming = f"resuming from {self.path(step)}" if step is not None else "starting at step 0"
        if index_problem:
            moved = f"moved it to {self._move_aside('index', [INDEX_FILE])}; " if chief else ""
            log(
                f"the checkpoint index {index_file} is unreadable ({index_problem}); {moved}"
                f"found the checkpoints by their files; {resuming}"
            )
        elif index is None:
            log(
                f"the checkpoint index {index_file} is missing; found the checkpoints by their files; {resuming}"
            )
        for bad, problem in skipped:
            names = [
                name
                for name in _listdir(self.directory)
                if name.startswith((f"ckpt-{bad}.", f"ckpt-{bad}_temp"))
            ]
            moved = (  # an index may name a checkpoint whose files are all gone
                f"moved its files to {self._move_aside(f'ckpt-{bad}', names)}; "
                if chief and names
                else ""
            )
            log(f"skipped checkpoint {self.path(bad)}: {problem}; {moved}{resuming}")
        if index is not None and not skipped:
            log(
                f"{resuming}, the newest checkpoint, which the index file did not list yet "
                "(its save was stopped before its last write)"
            )
        if chief and step is not None:
            self._write_index(step, index)

    def _move_aside(self, label: str, names: list[str]) -> str:
        """Moves `names` (in the checkpoints directory) to a new unreadable/LABEL[.K]."""
        for attempt in itertools.count(1):
            aside = os.path.join(
                self.directory, UNREADABLE, label + (f".{attempt}" if attempt > 1 else "")
            )
            try:
                os.makedirs(aside)
                break
            except FileExistsError:
                continue
            except OSError as error:
                raise StorageError(aside, _reason(error)) from None
        try:
            for name in names:
                os.replace(os.path.join(self.directory, name), os.path.join(aside, name))
        except OSError as error:
            raise StorageError(aside, _reason(error)) from None
        return aside

    def _write_index(self, step: int, index) -> None:
        """Writes the index CheckpointManager reads: the checkpoints up to `step` that
        it listed (or, without a readable index, all found on disk), and `step` last."""
        from google.protobuf import text_format
        from tensorflow.python.training.checkpoint_state_pb2 import CheckpointState

        stamps = {}
        if index is not None:
            times = list(index.all_model_checkpoint_timestamps)
            paths = list(index.all_model_checkpoint_paths)
            for i, path in enumerate(paths):
                stamps[_step(path)] = times[i] if len(times) == len(paths) else None
        else:
            stamps = dict.fromkeys(self._steps_on_disk())
        kept = sorted(s for s in {*stamps, step} if s is not None and s <= step)
        kept = [s for s in kept if os.path.exists(self.path(s) + ".index")]
        times = [stamps.get(s) or os.path.getmtime(self.path(s) + ".index") for s in kept]
        preserved = index.last_preserved_timestamp if index is not None else min(times) - 1
        state = CheckpointState(
            model_checkpoint_path=f"ckpt-{step}",
            all_model_checkpoint_paths=[f"ckpt-{s}" for s in kept],
            all_model_checkpoint_timestamps=times,
            last_preserved_timestamp=preserved,
        )
        write_atomically(
            os.path.join(self.directory, INDEX_FILE), text_format.MessageToString(state)
        )
        self.__dict__.pop("manager", None)  # the next use reads the index written here

    def save(self, step: int) -> str:
        """Saves the state after `step` steps; writes run.json before the first save.

        If the files cannot be written (disk full, no permission), this save's
        partial files are removed, so the previous checkpoint stays the latest,
        and a StorageError names the checkpoint.
        """
        run_file = os.path.join(self.config.model_dir, RUN_FILE)
        if not os.path.exists(run_file):
            write_atomically(run_file, json.dumps(run_settings(self.config), indent=2) + "\n")
        self.step.assign(step)
        before = set(_listdir(self.directory))
        try:
            path = self.manager.save(checkpoint_number=step)
        except Exception as error:
            import tensorflow as tf

            unsaveable = (tf.errors.UnimplementedError, tf.errors.FailedPreconditionError)
            if self.input is not None and isinstance(error, unsaveable):
                for name in set(_listdir(self.directory)) - before:
                    _remove(os.path.join(self.directory, name))
                self._without_input(error)
                return self.save(step)
            if not self._is_storage_error(error):
                raise
            index, _ = self._read_index()
            if not (index and _step(index.model_checkpoint_path) == step):  # not listed: partial
                for name in set(_listdir(self.directory)) - before:
                    _remove(os.path.join(self.directory, name))
            self.__dict__.pop("manager", None)  # its list holds the failed save
            raise StorageError(self.path(step), _reason(error)) from None
        if self.trainer.balanced:  # the split is not a variable of the step's math
            shares = {"step": step, "devices": self.trainer.devices, "shards": self.trainer.shards}
            write_atomically(self.shares_file, json.dumps(shares) + "\n")
        return path

    def _is_storage_error(self, error: Exception) -> bool:
        """An OSError, or a TensorFlow error that names a file of the checkpoints
        directory; a lost peer of a cluster names none and is left to the caller."""
        import tensorflow as tf

        if isinstance(error, OSError):
            return True
        return isinstance(error, tf.errors.OpError) and self.directory in (error.message or "")

    @property
    def shares_file(self) -> str:
        return os.path.join(self.config.model_dir, SHARES_FILE)

    def saved_shares(self) -> dict | None:
        """The split saved with the latest checkpoint (`step`, `devices`, `shards`), if any."""
        if not os.path.exists(self.shares_file):
            return None
        try:
            with open(self.shares_file) as f:
                saved = json.load(f)
            return {
                "step": int(saved["step"]),
                "devices": saved["devices"],
                "shards": saved["shards"],
            }
        except (OSError, ValueError, KeyError, TypeError) as error:
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"{self.shares_file} is unreadable: {error!r}; delete it to measure the split again",
            ) from None


def run_state():
    """A `tf.train.experimental.PythonState` saved in every checkpoint: `providers` maps a
    name to a function returning what to keep under it (numbers, strings, lists, dicts
    and numpy arrays), `restored` holds what the checkpoint restored (empty: none)."""
    import tensorflow as tf

    class RunState(tf.train.experimental.PythonState):
        def __init__(self):
            self.providers = {}
            self.restored = {}

        def serialize(self):
            return json.dumps(
                {name: get() for name, get in self.providers.items()}, default=_encode
            )

        def deserialize(self, string):
            self.restored = json.loads(string, object_hook=_decode)

    return RunState()


def _encode(value):
    import base64
    import io

    import numpy as np

    if isinstance(value, np.ndarray):
        buffer = io.BytesIO()
        np.save(buffer, value, allow_pickle=False)
        return {"__array__": base64.b64encode(buffer.getvalue()).decode()}
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"{type(value).__name__} cannot be kept in a checkpoint's run state")


def _decode(mapping):
    import base64
    import io

    import numpy as np

    if set(mapping) == {"__array__"}:
        return np.load(io.BytesIO(base64.b64decode(mapping["__array__"])), allow_pickle=False)
    return mapping


def export_model(model, path: str) -> None:
    """Writes `model` (its structure, trained weights and compile settings) to `path`
    (.keras), atomically; `keras.models.load_model` reads it back.

    A .keras file is a zip archive that is only whole at its end: a path that
    is not a regular file (a FIFO, a device) is refused, never replaced.
    """
    if _is_special(path):
        raise StorageError(path, "it is not a regular file, and a model is written whole")
    with _replacing(path) as temporary:  # the name ends in .keras, as Keras requires
        model.save(temporary)


def _step(path: str) -> int | None:
    """N of a path ending in ckpt-N, else None."""
    match = re.search(r"ckpt-(\d+)$", path)
    return int(match[1]) if match else None


def _listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def _remove(path: str) -> None:
    """Removes a file or a directory tree, if it is still there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
