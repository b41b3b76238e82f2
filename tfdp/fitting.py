"""`tfdp.fit`: `keras.Model.fit`'s arguments and meanings, on tfdp's engine.

A training script moves onto tfdp by replacing `model.fit(` with
`tfdp.fit(model, ` and adding tfdp's own settings as keywords. Keras' data
handling is Keras' own where it decides what is trained on (the validation
split, class weights), and tfdp's where it must be the same in every mode and
over a restart (the batch order is a function of the seed and the epoch).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from tfdp import internals
from tfdp.config import Config
from tfdp.data import inputs as data_inputs
from tfdp.engine import placement
from tfdp.errors import ConfigError, DoesNotFit
from tfdp.run import training
from tfdp.run.plan import prepare


def fit(
    model,
    x=None,
    y=None,
    batch_size=None,
    epochs=1,
    verbose="auto",
    callbacks=None,
    validation_split=0.0,
    validation_data=None,
    shuffle=True,
    class_weight=None,
    sample_weight=None,
    initial_epoch=0,
    steps_per_epoch=None,
    validation_steps=None,
    validation_batch_size=None,
    validation_freq=1,
    *,
    config: Config | None = None,
    log: Callable[[str], None] | None = None,
    **settings,
):
    """Trains `model` as `model.fit(x, y, ...)` would, on tfdp's devices and modes.

        history = tfdp.fit(model, x, y, batch_size=256, epochs=10, validation_split=0.1,
                           callbacks=[keras.callbacks.EarlyStopping(patience=2)],
                           mode="weighted", devices="gpu:0,cpu:0", powers="auto")
        history.history["val_loss"]   # Keras' History
        history.result                # tfdp's result (what result.json holds)

    Args:
      model: a compiled Keras 3 model (its loss, loss weights, optimizer and
        metrics are used), or a function of no arguments that returns one.
        A model you pass ends with the trained weights, as after Keras' fit.
      x, y, sample_weight: the training data, as Keras `fit` takes it: arrays
        (dict or list inputs too), or an unbatched `tf.data.Dataset` of
        `(x, y)` or `(x, y, sample_weight)` elements (then y is None).
      batch_size: the global batch, split over the devices (default 32).
      epochs, initial_epoch, steps_per_epoch: as in Keras; with
        `steps_per_epoch`, the input goes on where the last epoch stopped.
      verbose: Keras' progress bar ("auto" or 1: a bar, 2: a line per epoch,
        0: silent, tfdp's own start-up lines too).
      callbacks: keras.callbacks.Callback instances, called as `fit` calls
        them; `BackupAndRestore` is refused: give `model_dir` instead.
      validation_split, validation_data, validation_steps,
        validation_batch_size, validation_freq: as in Keras.
      shuffle: True (each epoch in a new order, a function of `seed` and the
        epoch), False (in order) or "batch".
      class_weight: as in Keras (Keras turns it into sample weights).
      config: a `tfdp.Config` of tfdp's settings; or its fields as keywords
        (`mode`, `devices`, `powers`, `rebalance_every`, `model_dir`, `seed`,
        `precision`, `jit_compile`, ...); `devices` as the command takes it
        ("cpu:0,cpu:1") or a list of names, as the strategies take them.
      log: where tfdp's own lines go (default: print, none with verbose=0).

    Returns:
      Keras' `History` (also `model.history`), with tfdp's result as
      `history.result` (`result.model`: the trained model).

    Raises:
      ConfigError: bad settings, data, model or callbacks, before any training.
    """
    from tfdp.run.hooks.keras import check_callbacks

    callbacks = check_callbacks(
        callbacks, config.model_dir if config is not None else settings.get("model_dir")
    )
    epochs, steps_per_epoch = keras_caps(epochs, steps_per_epoch)
    if config is not None and settings:
        raise ConfigError("config", config, f"and settings {sorted(settings)} both given; give one")
    inputs = data_inputs.of_fit(
        x, y, sample_weight, class_weight, validation_split, validation_data
    )
    if config is None:
        keras_settings = {
            "batch_size": batch_size,  # None: Keras' default for the data (`Inputs.streams`)
            "epochs": None if "iterations" in settings else epochs,
            "initial_epoch": initial_epoch,
            "steps_per_epoch": steps_per_epoch,
            "shuffle": shuffle,
            "log_every": 0,  # Keras' progress bar shows the training
            "finite_guard": False,  # Keras trains on a non-finite loss (TerminateOnNaN stops)
        }
        try:
            named = {"model": f"fit:{model_name(model)}", "dataset": "fit:data"}
            config = Config(**{**named, **keras_settings, **settings})
        except TypeError as error:  # an unknown keyword
            raise ConfigError("settings", sorted(settings), str(error)) from None
    with placement.outside_strategy_scopes():
        try:
            plan = prepare(config, model, inputs)
        except DoesNotFit as error:  # Keras' own error, as model.fit raises it
            raise error.keras_error from None
        validation = None
        if plan.test_data is not None:  # validated at the epochs' ends, as Keras does
            validation = (plan.test_data, validation_batch_size or plan.config.batch_size,
                          validation_steps, validation_freq)
            plan = plan.without_test_data()
        if log is None:
            log = (lambda line: None) if verbose == 0 else print
        result = training.run(plan, log, callbacks=callbacks, verbose=verbose,
                              validation=validation)
    return keras_history(result)


def keras_history(result):
    """Keras' History of a run (`model.history`), with tfdp's result as its `result`."""
    import keras

    history = result.history
    if history is None:  # a finished run, run again: the History it saved
        history = keras.callbacks.History()
        history.history = dict(result.get("history") or {})
        history.epoch = list(result.get("epochs") or [])
        history.set_model(result.model)
    result.model.history = history
    history.result = result
    return history


def keras_caps(epochs, steps_per_epoch):
    """`epochs` and `steps_per_epoch` within Keras' debugging caps
    (`keras.config.set_max_epochs`, `set_max_steps_per_epoch`), as Keras' fit caps them."""
    import warnings

    max_epochs, max_steps = internals.debug_limits()
    if max_epochs and max_epochs < epochs:
        warnings.warn(f"Limiting epochs to {max_epochs}")
        epochs = max_epochs
    if max_steps and (not steps_per_epoch or max_steps < steps_per_epoch):
        warnings.warn(f"Limiting steps_per_epoch to {max_steps}")
        steps_per_epoch = max_steps
    return epochs, steps_per_epoch


def model_name(model) -> str:
    """What the checkpoints call the model: a factory's name, or a model's class and the
    shapes of its weights (Keras numbers the names of unnamed models per process, so a
    resumed script's model would be called another name)."""
    import keras

    if not isinstance(model, keras.Model):
        return getattr(model, "__qualname__", type(model).__name__)
    shapes = ",".join("x".join(map(str, w.shape)) or "1" for w in model.weights)
    digest = hashlib.sha256(shapes.encode()).hexdigest()[:12]
    return f"{type(model).__name__}-{len(model.weights)}-weights-{digest}"
