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

from tfdp.errors import ConfigError
from tfdp.loop import Hook

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


def check_callbacks(callbacks) -> list:
    """The user's callbacks as a list; ConfigError for one tfdp cannot run exactly."""
    callbacks = list(callbacks or [])
    for callback in callbacks:
        if isinstance(callback, keras.callbacks.BackupAndRestore):
            raise ConfigError(
                "callbacks",
                type(callback).__name__,
                "restarts an interrupted epoch from its first batch; give tfdp.fit a "
                "model_dir instead: it resumes at the next batch, with every callback's state",
            )
        if not isinstance(callback, keras.callbacks.Callback):
            raise ConfigError(
                "callbacks", type(callback).__name__, "is not a keras.callbacks.Callback"
            )
    return callbacks


class KerasLogs:
    """What Keras' `fit` logs for its callbacks: running means, since the last `reset`,
    of the loss (each batch weighted by its examples) and of the compiled metrics,
    computed from each global batch and its predictions, with Keras' own metric
    objects in Keras' order (loss, compiled metrics, each output's loss): inside the
    training step's compiled call (`add_step`), or from the host (`update`)."""

    def __init__(self, model):
        from keras.src.trainers.compile_utils import CompileLoss, CompileMetrics

        from tfdp.objective import compile_settings

        settings = compile_settings(model)
        names = getattr(model, "output_names", None)
        self.loss = keras.metrics.Mean(name="loss")
        metrics, weighted = settings.get("metrics"), settings.get("weighted_metrics")
        self.compiled = (
            CompileMetrics(metrics, weighted, output_names=names)
            if metrics is not None or weighted is not None
            else None
        )
        self.losses = CompileLoss(
            settings["loss"], settings.get("loss_weights"), output_names=names
        )
        self._update = None
        self._saved = None  # values to load once Keras has built the metrics

    def update(self, batch, predictions, loss) -> dict[str, float]:
        """Adds one batch (host tensors): its examples, their outputs, its loss; returns
        the logs after it (`result`), from the same compiled call."""
        import tensorflow as tf

        if self._update is None:
            self._update = tf.function(self._add, reduce_retracing=True)
        with tf.device("/cpu:0"):
            if self._saved is not None:
                self._build(batch, predictions)
            logs = self._update(batch, predictions, tf.cast(loss, tf.float32))
        return floats(logs)

    def load(self, values) -> None:
        """Sets the running means to saved `values` (of `variables()` once built). Keras
        builds the compiled metrics on their first batch: until then they wait."""
        self._saved = list(values)
        if len(self.variables()) == len(self._saved):
            self._assign()

    def build_on(self, batch, model) -> None:
        """Makes the metrics' variables now, from a few examples (host tensors) and
        `model`'s outputs on them, so that a compiled step can update them."""
        import tensorflow as tf

        from tfdp.objective import unpack

        x, _, _ = unpack(batch)
        with tf.device("/cpu:0"):
            self._build(batch, model(x, training=False))

    def add_step(self, outputs) -> dict:
        """Inside a step's compiled call: adds its global batch (`step_batch`); returns
        the logs after it, as tensors."""
        import tensorflow as tf

        with tf.device("/cpu:0"):
            return self._add(*step_batch(outputs))

    def _build(self, batch, predictions) -> None:
        from tfdp.objective import unpack

        _, y, _ = unpack(batch)
        for metrics in (self.compiled, self.losses):
            if metrics is not None and not metrics.built:
                metrics.build(y, predictions)
        if self._saved is not None:
            self._assign()

    def _assign(self) -> None:
        for variable, value in zip(self.variables(), self._saved, strict=True):
            variable.assign(value)
        self._saved = None

    def _add(self, batch, predictions, loss):
        import tensorflow as tf

        from tfdp.objective import num_examples, unpack

        _, y, sample_weight = unpack(batch)
        loss = tf.cast(loss, tf.float32)
        self.loss.update_state(loss, sample_weight=num_examples(batch))
        if self.compiled is not None:
            self.compiled.update_state(y, predictions, sample_weight)
        if len(self.losses.metrics) > 1:  # each output's loss, as Keras logs it
            self.losses(y, predictions, sample_weight)
        return self._results()

    def metrics(self) -> list:
        return [
            self.loss,
            *([self.compiled] if self.compiled is not None else []),
            *self.losses.metrics,
        ]

    def result(self) -> dict[str, float]:
        return floats(self._results())

    def _results(self) -> dict:
        """Every metric's running value (tensors), in Keras' order."""
        logs = {}
        for metric in self.metrics():
            value = metric.result()
            if isinstance(value, dict):
                logs.update(value)
            else:
                logs[metric.name] = value
        return logs

    def reset(self) -> None:
        for metric in self.metrics():
            metric.reset_state()

    def variables(self) -> list:
        return [v for metric in self.metrics() for v in metric.variables]


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
        from tfdp.data import first_examples

        trainer = run.trainer
        self.model = trainer.model
        self.logs = KerasLogs(self.model)
        # A step's logs come out of the step's own compiled call where the trainer can
        # compute them there, else from its outputs on the host.
        self.in_step = trainer.compute_in_step("keras_logs", self.logs.add_step)
        if self.in_step:  # the metrics' variables, before the step is traced
            self.logs.build_on(first_examples(run.plan.train_data, 2), self.model)
        self.val_logs = KerasLogs(self.model) if self.validation else None
        self.list = keras.callbacks.CallbackList(
            self.user,
            add_history=True,
            add_progbar=self.verbose != 0,
            model=self.model,
            verbose=self.verbose,
            epochs=self.epochs,
            steps=run.plan.steps_per_epoch,
        )
        self.history = self.list._history
        self.model.stop_training = False
        if self.saved_state is not None:  # a CSV of the run so far is continued, not replaced
            for callback in self.user:
                if isinstance(callback, keras.callbacks.CSVLogger):
                    callback.append = True
        self.list.on_train_begin()
        if self.saved_state is not None:
            self.restore(self.saved_state)
            run.stopping = self.model.stop_training
        self.resumed_in = (
            run.epoch_of(run.start_step) if run.batch_in_epoch(run.start_step) else None
        )

    def on_epoch_begin(self, run, epoch):
        if epoch == self.resumed_in:  # the unbroken run began this epoch before the checkpoint
            return
        self.logs.reset()
        self.list.on_epoch_begin(epoch)

    def on_step_begin(self, run, step):
        self.list.on_train_batch_begin(run.batch_in_epoch(step))

    def on_step_end(self, run, step):
        if self.in_step:
            logs = floats(run.outputs["keras_logs"])
        else:
            run.outputs = run.trainer.global_outputs(run.outputs)  # multiworker: the whole batch
            logs = self.logs.update(*step_batch(run.outputs))
        self.list.on_train_batch_end(run.batch_in_epoch(step), logs)
        if self.model.stop_training:
            run.stopping = True

    def on_epoch_end(self, run, epoch):
        logs = self.logs.result()
        if self.validation and self.due(epoch):
            logs.update({f"val_{k}": v for k, v in self.validate(run).items()})
        self.list.on_epoch_end(epoch, logs)
        self.epoch_logs = logs
        if self.model.stop_training:
            run.stopping = True

    def on_train_end(self, run):
        self.list.on_train_end(logs=self.epoch_logs or None)
        run.result["history"] = {k: list(map(float, v)) for k, v in self.history.history.items()}
        run.result["epochs"] = list(self.history.epoch)

    def due(self, epoch) -> bool:
        """Keras' `validation_freq`: every N epochs, or the epochs (counted from 1) listed."""
        freq = self.validation[3]
        if isinstance(freq, int):
            return (epoch + 1) % freq == 0
        return epoch + 1 in freq

    def validate(self, run) -> dict[str, float]:
        """The validation, with the callbacks' test hooks, as Keras' `evaluate` runs it."""
        from tfdp.hooks.evaluation import evaluate

        data, batch_size, steps, _ = self.validation
        regularization = sum(float(v) for v in run.trainer.model.losses)
        self.list.on_test_begin()
        self.val_logs.reset()

        def on_batch(index, batch, summed, predictions):
            from tfdp.objective import num_examples

            self.list.on_test_batch_begin(index)
            loss = float(summed) / int(num_examples(batch)) + regularization
            self.list.on_test_batch_end(index, self.val_logs.update(batch, predictions, loss))

        evaluate(run.trainer, run.plan.spec, data, batch_size, on_batch=on_batch, steps=steps)
        logs = self.val_logs.result()
        self.list.on_test_end(logs)
        run.result["val_logs"] = logs
        return logs

    # --- state saved with a checkpoint

    def state(self) -> dict:
        """What a resumed run needs to call the callbacks as an unbroken run would."""
        return {
            "stop_training": bool(self.model.stop_training),
            "epoch_logs": self.epoch_logs,
            "logs": [np.asarray(v) for v in self.logs.variables()],
            "callbacks": [callback_state(c) for c in self.list.callbacks],
        }

    def restore(self, state: dict) -> None:
        self.model.stop_training = state["stop_training"]
        self.epoch_logs = state["epoch_logs"]
        self.logs.load(state["logs"])
        for callback, saved in zip(self.list.callbacks, state["callbacks"]):
            restore_callback(callback, saved)


def step_batch(outputs) -> tuple:
    """(global batch, its predictions, its loss) of a step's outputs over the whole batch."""
    from tfdp.objective import concat

    batch = concat(outputs["batches"]) if "batches" in outputs else outputs["batch"]
    return batch, concat(outputs["predictions"]), outputs["loss"]


def floats(logs) -> dict[str, float]:
    """Logs of tensors -> logs of Python numbers, as callbacks get them."""
    return {name: float(value) for name, value in logs.items()}


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
