"""The checkpoints' index, and its repair when a restore finds it wrong.

tf.train.CheckpointManager lists a run's checkpoints in an index file
(checkpoints/checkpoint). A restore trusts neither it nor the files alone: it takes
the checkpoints either names, newest first, skips those that do not read back, and
the chief moves what it skipped to checkpoints/unreadable/ and writes the index
again, so that the saves that follow neither meet nor list them. Nothing that
reads back is moved.
"""

from __future__ import annotations

import glob
import itertools
import os
import re

from tfdp import internals
from tfdp.storage import StorageError, listdir, reason, write_atomically

# The files of checkpoint N: ckpt-N.index and ckpt-N.data-K-of-M (TensorFlow's names).
CHECKPOINT_FILE = re.compile(r"ckpt-(\d+)\.(?:index|data-\d+-of-\d+)$")
INDEX_FILE = "checkpoint"  # tf.train.CheckpointManager's list of checkpoints
UNREADABLE = "unreadable"  # where restore moves what does not read back


def step_of(path: str) -> int | None:
    """N of a path ending in ckpt-N, else None."""
    match = re.search(r"ckpt-(\d+)$", path)
    return int(match[1]) if match else None


class CheckpointIndex:
    """The index file of the checkpoints in `directory`, read and repaired.

    Attributes:
      directory: the checkpoints directory.
      is_chief: whether this process may move files and write the index (other
        workers of a cluster read the chief's directory).
    """

    def __init__(self, directory: str, is_chief: bool):
        self.directory = directory
        self.is_chief = is_chief

    def path(self, step: int) -> str:
        return os.path.join(self.directory, f"ckpt-{step}")

    def read(self):
        """The index file's CheckpointState (None: no file, or unreadable) and, if it
        exists but does not parse, why."""
        from google.protobuf import text_format

        CheckpointState = internals.checkpoint_state()  # noqa: N806 (TensorFlow's class)

        try:
            with open(os.path.join(self.directory, INDEX_FILE)) as f:
                index = text_format.Parse(f.read(), CheckpointState())
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError, text_format.ParseError) as error:
            return None, reason(error)
        if step_of(index.model_checkpoint_path) is None:  # CheckpointManager would raise
            return None, f"it names no checkpoint: {index.model_checkpoint_path!r}"
        return index, None

    def steps_on_disk(self) -> set[int]:
        try:
            names = os.listdir(self.directory)
        except FileNotFoundError:
            return set()
        return {int(match[1]) for match in map(CHECKPOINT_FILE.match, names) if match}

    def unreadable(self, path: str) -> str | None:
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
            return f"it does not read back ({reason(error)})"
        return None

    def tidy(self, step, skipped, index, index_problem, log) -> None:
        """Says what restore found; the chief moves the files that do not read back
        aside and rewrites the index to list the checkpoints up to `step`."""
        chief = self.is_chief  # other workers read the chief's directory
        index_file = os.path.join(self.directory, INDEX_FILE)
        resuming = f"resuming from {self.path(step)}" if step is not None else "starting at step 0"
        if index_problem:
            moved = f"moved it to {self.move_aside('index', [INDEX_FILE])}; " if chief else ""
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
                for name in listdir(self.directory)
                if name.startswith((f"ckpt-{bad}.", f"ckpt-{bad}_temp"))
            ]
            moved = (  # an index may name a checkpoint whose files are all gone
                f"moved its files to {self.move_aside(f'ckpt-{bad}', names)}; "
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
            self.write(step, index)

    def move_aside(self, label: str, names: list[str]) -> str:
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
                raise StorageError(aside, reason(error)) from None
        try:
            for name in names:
                os.replace(os.path.join(self.directory, name), os.path.join(aside, name))
        except OSError as error:
            raise StorageError(aside, reason(error)) from None
        return aside

    def write(self, step: int, index) -> None:
        """Writes the index CheckpointManager reads: the checkpoints up to `step` that
        it listed (or, without a readable index, all found on disk), and `step` last."""
        from google.protobuf import text_format

        CheckpointState = internals.checkpoint_state()  # noqa: N806 (TensorFlow's class)

        stamps = {}
        if index is not None:
            times = list(index.all_model_checkpoint_timestamps)
            paths = list(index.all_model_checkpoint_paths)
            for i, path in enumerate(paths):
                stamps[step_of(path)] = times[i] if len(times) == len(paths) else None
        else:
            stamps = dict.fromkeys(self.steps_on_disk())
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
