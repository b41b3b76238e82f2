"""A run's directory: checkpoints that resume exactly, the exported model, the result.

DIR/
  run.json        the settings a checkpoint depends on, written before the first save
  checkpoints/    tf.train.CheckpointManager: model, optimizer, step (= input position)
  shares.json     weighted: each device's share of the batch at the latest save
  train/, eval/   TensorBoard summaries
  model.keras     the trained model, loadable with keras.models.load_model
  result.json     the run's result
"""

from __future__ import annotations

import json
import os
import tempfile

from tfdp.errors import ConfigError

RUN_FILE = "run.json"
# A checkpoint only continues a run with these the same: they fix the
# variables' shapes and the sequence of batches that step k stands for.
RUN_FIELDS = ("model", "dataset", "hidden_units", "batch_size", "seed", "drop_remainder")
# what a run.json written before a field existed stands for
RUN_FIELD_DEFAULTS = {"drop_remainder": False}
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


def write_atomically(path: str, text: str) -> None:
    """Writes a whole file or nothing, even if the process is killed."""
    directory = os.path.dirname(os.path.abspath(path))
    handle, temporary = tempfile.mkstemp(dir=directory, prefix=".tmp-")
    with os.fdopen(handle, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)


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
        self.step = tf.Variable(0, dtype=tf.int64, trainable=False)
        self.checkpoint = tf.train.Checkpoint(
            model=trainer.model, optimizer=trainer.optimizer, step=self.step
        )
        self.manager = tf.train.CheckpointManager(
            self.checkpoint,
            os.path.join(config.model_dir, "checkpoints"),
            max_to_keep=config.keep_checkpoints,
        )

    def restore(self) -> int:
        """Restores the latest checkpoint, if any; returns the step to continue from."""
        latest = self.manager.latest_checkpoint
        if latest is None:
            return 0
        try:
            self.checkpoint.restore(latest).assert_existing_objects_matched()
        except (AssertionError, ValueError) as error:
            raise ConfigError(
                "model_dir",
                self.config.model_dir,
                f"its checkpoint {latest} does not fit this model ({error})".replace("\n", " "),
            ) from None
        self.trainer.sync_copies()
        return int(self.step.numpy())

    def save(self, step: int) -> str:
        """Saves the state after `step` steps; writes run.json before the first save."""
        run_file = os.path.join(self.config.model_dir, RUN_FILE)
        if not os.path.exists(run_file):
            write_atomically(run_file, json.dumps(run_settings(self.config), indent=2) + "\n")
        self.step.assign(step)
        path = self.manager.save(checkpoint_number=step)
        if self.trainer.balanced:  # the split is not a variable of the step's math
            shares = {"step": step, "devices": self.trainer.devices, "shards": self.trainer.shards}
            write_atomically(self.shares_file, json.dumps(shares) + "\n")
        return path

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


def export_model(model, path: str) -> None:
    """Writes `model` (its structure, trained weights and compile settings) to `path`
    (.keras), atomically; `keras.models.load_model` reads it back."""
    directory = os.path.dirname(os.path.abspath(path))
    temporary = os.path.join(directory, f".tmp-{os.getpid()}.keras")
    model.save(temporary)
    os.replace(temporary, path)
