"""A user's Keras callbacks, called as `keras.Model.fit` calls them.

`KerasCallbacks` is the loop hook that drives a `keras.callbacks.CallbackList`
(with Keras' own `History` and progress bar): the train, epoch, train-batch and
test hooks in `fit`'s order, with the logs `fit` passes (running means since the
epoch began of the loss and the compiled metrics, over the global batches; the
validation's with `val_` prefixes). The callbacks see the trainer's master copy
of the model: a learning rate they set is the one the update uses on every
device, `model.stop_training` stops the run after that step, and weights they
set reach every copy (each trainer's next step starts from the master's).

Callback state is saved with each checkpoint (`state` / `restore`): the built-in
callbacks' counters (EarlyStopping's wait and best, ReduceLROnPlateau's, ...)
and any callback's that has `state_dict()` and `load_state_dict(state)`, so a
resumed run makes the decisions an unbroken run makes.
"""

from __future__ import annotations

import os

import keras
import numpy as np

from tfdp import internals
from tfdp.errors import ConfigError
from tfdp.run.hooks.report import keras_logs
from tfdp.run.loop import Hook

# The attributes that carry a built-in callback's decisions from one epoch to the next.
STATE_OF = {
    keras.callbacks.History: ("history", "epoch"),
    keras.callbacks.EarlyStopping: ("wait", "stopped_epoch", "best", "best_weights", "best_epoch"),
    keras.callbacks.ReduceLROnPlateau: ("wait", "cooldown_counter", "best"),
    keras.callbacks.ModelCheckpoint: (
        "best",
        "_batches_seen_since_last_saving",
        "_last_batch_seen",
        "_current_epoch",
    ),
    keras.callbacks.TensorBoard: (
        "_global_train_batch",
        "_global_test_batch",
        "_previous_epoch_iterations",
    ),
}
# Callbacks that write files: on a cluster's other workers they are left out.
FILE_WRITERS = (
    keras.callbacks.ModelCheckpoint,
    keras.callbacks.CSVLogger,
    keras.callbacks.TensorBoard,
)


def check_callbacks(callbacks, model_dir=None) -> list:
    """The user's callbacks as a list; ConfigError for one tfdp cannot run with the run's
    settings."""
    callbacks = list(callbacks or [])
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore) and model_dir:
            raise ConfigError(
                "callbacks",
                type(callback).__name__,
                f"and model_dir={model_dir!r} both resume an interrupted run; give one "
                "(model_dir resumes at the next batch, with every callback's state)",
            )
        if not isinstance(callback, keras.callbacks.Callback):
            raise ConfigError(
                "callbacks", type(callback).__name__, "is not a keras.callbacks.Callback"
            )
    return callbacks


class KerasCallbacks(Hook):
    """Runs `callbacks` (a user's, beside Keras' History and progress bar) at the loop's
    points, as `Model.fit` calls them.

    Args:
      callbacks: keras.callbacks.Callback instances (`check_callbacks`).
      verbose: Keras' `verbose` ("auto", 0, 1, 2): its progress bar.
      epochs: the number of the epoch after the last (`fit`'s `epochs`).
      validation: (data, batch size, steps or None, freq) of the validation, or None.
      chief: whether this process writes files (in a cluster, the file-writing
        callbacks run on the chief only).
    """

    def __init__(self, callbacks, verbose, epochs, validation=None, chief=True):
        self.user = [c for c in callbacks if chief or not isinstance(c, FILE_WRITERS)]
        self.verbose = verbose
        self.epochs = epochs
        self.validation = validation
        self.saved_state = None  # from the checkpoint the run resumes from
        self.epoch_logs = {}

    def on_train_begin(self, run):
        self.model = run.trainer.model  # the user's own model object
        self.list = keras.callbacks.CallbackList(
            self.user,
            add_history=True,
            add_progbar=self.verbose != 0,
            model=self.model,
            verbose=self.verbose,
            epochs=self.epochs,
            steps=run.plan.steps_per_epoch,
        )
        self.history = internals.callback_history(self.list)
        self.model.stop_training = False
        self.logs = {}
        if self.saved_state is not None:  # a CSV of the run so far is continued, not replaced
            for callback in self.user:
                if isinstance(callback, keras.callbacks.CSVLogger):
                    callback.append = True
        self.list.on_train_begin()
        if self.saved_state is not None:
            self.restore(self.saved_state)
            run.stopping = self.model.stop_training
        # Keras' fit starts at the model's `_initial_epoch` when a callback set it in
        # on_train_begin (BackupAndRestore, restoring its backup)
        restored = internals.initial_epoch(self.model)
        if restored and not run.start_step and restored != run.cursor.epoch:
            run.seek(restored)
        # the unbroken run began this epoch before the checkpoint
        self.resumed_in = run.cursor.epoch if run.start_epoch_batch else None

    def on_epoch_begin(self, run, epoch):
        if epoch == self.resumed_in:  # the unbroken run began this epoch before the checkpoint
            return
        self.model.reset_metrics()
        self.list.on_epoch_begin(epoch)

    def on_step_begin(self, run, step):
        self.list.on_train_batch_begin(run.call[0])

    def on_step_end(self, run, step):
        self.logs = keras_logs(run.outputs["logs"])
        self.list.on_train_batch_end(internals.batch_end_index(*run.call), self.logs)
        if self.model.stop_training:
            run.stopping = True

    def on_epoch_end(self, run, epoch):
        logs = keras_logs(internals.metrics_result_or_logs(self.model, self.logs))
        if self.validation and self.due(epoch):
            logs.update({f"val_{k}": v for k, v in self.validate(run).items()})
        self.list.on_epoch_end(epoch, logs)
        self.epoch_logs = logs
        if self.model.stop_training:
            run.stopping = True

    def on_train_end(self, run):
        finalize(self.model)
        self.list.on_train_end(logs=self.epoch_logs or None)
        # a float per epoch, or a list of them for a metric of several values (F1Score)
        run.result["history"] = {
            k: [np.asarray(value).tolist() for value in v] for k, v in self.history.history.items()
        }
        run.result["epochs"] = list(self.history.epoch)

    def due(self, epoch) -> bool:
        """Keras' `validation_freq`: every N epochs, or the epochs (counted from 1) listed."""
        freq = self.validation[3]
        if isinstance(freq, int):
            return (epoch + 1) % freq == 0
        return epoch + 1 in freq

    def validate(self, run) -> dict[str, float]:
        """The validation, with the callbacks' test hooks, as Keras' `evaluate` runs it."""
        from tfdp.run.hooks.evaluation import evaluate

        data, batch_size, steps, _ = self.validation
        self.list.on_test_begin()
        logs = evaluate(run.trainer, data, batch_size, callbacks=self.list, steps=steps)
        self.list.on_test_end(logs)
        run.result["val_logs"] = logs
        return logs

    # --- state saved with a checkpoint

    def state(self) -> dict:
        """What a resumed run needs to call the callbacks as an unbroken run would: their
        own state, and the model's metrics mid-epoch (the running values they are given)."""
        return {
            "stop_training": bool(self.model.stop_training),
            "epoch_logs": self.epoch_logs,
            "logs": self.logs,
            "metrics": [np.asarray(v.numpy()) for v in self.model.metrics_variables],
            "callbacks": [callback_state(c) for c in self.list.callbacks],
        }

    def restore(self, state: dict) -> None:
        self.model.stop_training = state["stop_training"]
        self.epoch_logs = state["epoch_logs"]
        self.logs = state.get("logs") or {}
        for variable, value in zip(self.model.metrics_variables, state["metrics"], strict=True):
            variable.assign(value)
        for callback, saved in zip(self.list.callbacks, state["callbacks"]):
            restore_callback(callback, saved)


def finalize(model) -> None:
    """What Keras' fit does after its last epoch: the optimizer's final values (its moving
    averages replace the weights, with `use_ema`)."""
    if isinstance(model.optimizer, keras.optimizers.Optimizer):
        model.optimizer.finalize_variable_values(model.trainable_weights)


def callback_state(callback) -> dict | None:
    """A callback's state: a built-in's attributes (STATE_OF), a CSVLogger's file, or
    what the callback's own `state_dict()` returns; None when it keeps none."""
    if hasattr(callback, "state_dict"):
        return {"state_dict": callback.state_dict()}
    if isinstance(callback, keras.callbacks.CSVLogger):
        size = os.path.getsize(callback.filename) if os.path.exists(callback.filename) else 0
        return {"csv_bytes": size, "keys": callback.keys}
    for kind, names in STATE_OF.items():
        if isinstance(callback, kind):
            return {"attributes": {n: _plain(getattr(callback, n, None)) for n in names}}
    return None


def restore_callback(callback, saved) -> None:
    if saved is None:
        return
    if "state_dict" in saved:
        callback.load_state_dict(saved["state_dict"])
    elif "csv_bytes" in saved:
        # the rows written after the checkpoint are dropped; the next ones are appended
        if callback.csv_file is not None:
            callback.csv_file.close()
        with open(callback.filename, "r+") as file:
            file.truncate(saved["csv_bytes"])
        callback.csv_file = open(callback.filename, "a")
        callback.append_header = False
        callback.keys = saved["keys"]
        callback.writer = None
    else:
        for name, value in saved["attributes"].items():
            setattr(callback, name, value)


def _plain(value):
    """A value as the checkpoint's run state holds it: numbers, lists, arrays."""
    if hasattr(value, "numpy"):
        value = value.numpy()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, list) and value and all(isinstance(v, np.ndarray) for v in value):
        return [np.asarray(v) for v in value]
    return value
