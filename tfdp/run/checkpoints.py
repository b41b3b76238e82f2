"""A run's directory: checkpoints that resume exactly, the exported model, the result.

DIR/
  run.json        the settings a checkpoint depends on, written before the first save
  checkpoints/    tf.train.CheckpointManager: model, optimizer, step (= input position)
    unreadable/   checkpoints a restore skipped (truncated, files missing), kept aside
  shares.json     weighted: each device's share of the batch at the latest save
  train/, eval/   TensorBoard summaries
  model.keras     the trained model, loadable with keras.models.load_model
  result.json     the run's result

This module checks a run's directory before a run (`check_model_dir`) and saves and
restores its checkpoints (`Checkpointer`); the index's repair is checkpoint_index.py,
writing files whole is storage.py.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
from collections.abc import Callable

from tfdp.cluster.exchange import LOCAL
from tfdp.errors import ConfigError
from tfdp.run.checkpoint_index import CheckpointIndex, step_of
from tfdp.storage import StorageError, listdir, reason, remove, write_atomically

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
        and not (field == "batch_size" and value is None)  # known once the data is: checked again
    ]
    if different:
        raise ConfigError(
            "model_dir",
            model_dir,
            f"holds checkpoints of another run: {', '.join(different)}; "
            "use another --model_dir or the same settings",
        )


class Checkpointer:
    """Saves and restores a run's model, its optimizer, the step and the split.

    The step is also the input position: `arrays.train_dataset(start_step=step)`
    continues with exactly the batch the interrupted run would have read next.
    tf.train.CheckpointManager writes the checkpoint files first and updates
    its `checkpoint` index file atomically last, so a kill during a save
    leaves the previous checkpoint as the latest.

    In a cluster (`exchange` of a trainer of mode multiworker) every worker saves, as
    saving may take part in collectives, but only the chief keeps its files: the others
    write to a fresh temporary directory and delete it at once, as TensorFlow's
    multi-worker guide recommends. Every worker restores from the chief's directory, so
    all of them must be able to read `model_dir`.
    """

    def __init__(self, config, model, split, exchange=LOCAL):
        """model: the run's model (its optimizer is saved with it); split: the run's
        `split.Split`, whose `saved` goes in shares.json; exchange: the other processes."""
        import tensorflow as tf

        self.config = config
        self.model, self.split, self.exchange = model, split, exchange
        self.directory = os.path.join(config.model_dir, "checkpoints")
        self.index = CheckpointIndex(self.directory, exchange.is_chief)
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.state = run_state()  # what the run's hooks keep over a restart
        self.checkpoint = self._checkpoint(run=self.state)
        self.restored_path = None  # the checkpoint `restore` read
        self.saved_path = None  # the checkpoint this process's last `save` made
        self.input = None  # a stream's iterator, saved with each checkpoint (`keep_input`)
        self.restore_status = None  # of the restored checkpoint, if any
        self.log = print

    def _checkpoint(self, **more):
        """A tf.train.Checkpoint of the model and its optimizer, the step, and `more`."""
        import tensorflow as tf

        return tf.train.Checkpoint(
            model=self.model, optimizer=self.model.optimizer, step=self.step, **more
        )

    @functools.cached_property
    def manager(self):
        """Built from the index file when first used, so after `restore` has tidied it."""
        import tensorflow as tf

        return tf.train.CheckpointManager(
            self.checkpoint, self.directory, max_to_keep=self.config.keep_checkpoints
        )

    def path(self, step: int) -> str:
        return self.index.path(step)

    def restore(self, log: Callable[[str], None] = print) -> int:
        """Restores the newest checkpoint that reads back whole (`_restore_newest`); returns its
        step (0: none), the same on every worker of a cluster."""
        step = self._restore_newest(log)
        steps = [int(s) for s in self.exchange.gather(step)]
        if len(set(steps)) > 1:
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"the workers found different checkpoints to resume from (steps {steps}); "
                "every worker must read the chief's model_dir (one path on a shared filesystem)",
            )
        return step

    def _restore_newest(self, log: Callable[[str], None]) -> int:
        """Restores the newest checkpoint that reads back whole; returns its step (0: none).

        The candidates are the checkpoints the index file names and those found
        by their files, so a garbled index never restarts a run at step 0.
        Each newer one that does not read back (a truncated or missing file) is
        skipped with a line to `log`; the chief moves its files to
        checkpoints/unreadable/ and rewrites the index, so that the saves that
        follow neither meet nor list them. Nothing that reads back is moved.
        """
        index, index_problem = self.index.read()
        named = [index.model_checkpoint_path, *index.all_model_checkpoint_paths] if index else []
        steps = sorted({*map(step_of, named), *self.index.steps_on_disk()} - {None}, reverse=True)
        skipped = []
        step = None
        for candidate in steps:
            problem = self.index.unreadable(self.path(candidate))
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
        listed = index is not None and step_of(index.model_checkpoint_path) == step
        if (step is not None and not listed) or index_problem or skipped:
            self.index.tidy(step, skipped, index, index_problem, log)
            self.__dict__.pop("manager", None)  # the next use reads the index tidied here
        if step is None:
            return 0
        return int(self.step.numpy())

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
            why = getattr(error, "message", str(error)).strip().splitlines()[0]
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"its checkpoint {self.restored_path} holds the position of another pipeline "
                f"than this one ({why}); give the pipeline it was saved with, or another "
                "model_dir",
            ) from None

    def keep_input(self, iterator, restored: bool = True) -> None:
        """Saves `iterator`'s position with every checkpoint from now on. restored: it
        was put at the restored checkpoint's position (else the position that checkpoint
        holds is not restored into it)."""
        self.input = iterator
        if restored:
            self.checkpoint.input = iterator
        else:  # a new Checkpoint object: the old one would restore its saved position
            if self.restore_status is not None:
                self.restore_status.expect_partial()  # the position is left unrestored
            self.checkpoint = self._checkpoint(run=self.state, input=iterator)
            self.__dict__.pop("manager", None)

    def _without_input(self, error) -> None:
        """The stream's position cannot be saved (a generator inside it): the checkpoints
        hold the rest, and a resume reads the stream again."""
        self.log(
            f"tfdp: the input position cannot be saved ({reason(error)}); a resume "
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
            self.restore_status = checkpoint.restore(path)
            self.restore_status.assert_existing_objects_matched()
        except (AssertionError, ValueError) as error:  # another run's checkpoint
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"its checkpoint {path} does not fit this model ({error})".replace("\n", " "),
            ) from None

    def save(self, step: int) -> str:
        """Saves the state after `step` steps; writes run.json before the first save.

        If the files cannot be written (disk full, no permission), this save's
        partial files are removed, so the previous checkpoint stays the latest,
        and a StorageError names the checkpoint. Returns the path of the run's checkpoint
        of `step` (a worker that is not the chief: the one the chief writes).
        """
        if not self.exchange.is_chief:
            return self._save_as_worker(step)
        run_file = os.path.join(self.config.model_dir, RUN_FILE)
        if not os.path.exists(run_file):
            write_atomically(run_file, json.dumps(run_settings(self.config), indent=2) + "\n")
        self.step.assign(step)
        before = set(listdir(self.directory))
        try:
            path = self.manager.save(checkpoint_number=step)
        except Exception as error:
            import tensorflow as tf

            unsaveable = (tf.errors.UnimplementedError, tf.errors.FailedPreconditionError)
            if self.input is not None and isinstance(error, unsaveable):
                for name in set(listdir(self.directory)) - before:
                    remove(os.path.join(self.directory, name))
                self._without_input(error)
                return self.save(step)
            if not self._is_storage_error(error):
                raise
            index, _ = self.index.read()
            if not (index and step_of(index.model_checkpoint_path) == step):  # not listed: partial
                for name in set(listdir(self.directory)) - before:
                    remove(os.path.join(self.directory, name))
            self.__dict__.pop("manager", None)  # its list holds the failed save
            raise StorageError(self.path(step), reason(error)) from None
        shares = self.split.saved(step)  # (not a variable of the step's math)
        if shares is not None:
            write_atomically(self.shares_file, json.dumps(shares) + "\n")
        self.saved_path = self.path(step)
        return path

    def _save_as_worker(self, step: int) -> str:
        """A save on a worker that is not the chief: to a scratch directory, deleted."""
        import tensorflow as tf

        self.step.assign(step)
        scratch = tempfile.mkdtemp(prefix=f"tfdp-{self.exchange.worker}-")
        try:
            tf.train.CheckpointManager(self.checkpoint, scratch, 1).save(step)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self.saved_path = self.path(step)
        return self.saved_path

    @property
    def standing(self) -> str | None:
        """The checkpoint a rerun resumes from, as this process knows it: its last save,
        else the one it restored (None: neither). Not read off the directory: in a
        cluster the chief writes the files, and may still be writing the save that a
        worker stopping now has made."""
        return self.saved_path or self.restored_path

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


