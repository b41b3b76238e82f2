"""The outer loop: config -> plan -> trainer -> hooks -> steps -> result.

`plan.prepare` does everything that can fail on bad input before any training
work; `run` trains as planned and returns the result dict that `--result_json`
writes; `train` is the two in one call. Where a resumed run continues from is
resume.py.
"""

from __future__ import annotations

import contextlib
import json
import os
from typing import Callable

import tensorflow as tf

from tfdp import onednn
from tfdp.config import AUTO, Config
from tfdp.data import bad_data
from tfdp.devices import short_name
from tfdp.engine.modes import build_trainer
from tfdp.errors import DataError
from tfdp.run.checkpoints import Checkpointer
from tfdp.run.hooks import default as default_hooks
from tfdp.run.hooks.evaluation import evaluate  # noqa: F401 (tfdp.run.training.evaluate)
from tfdp.run.hooks.finite import NonFinite  # noqa: F401 (the CLI catches NonFinite)
from tfdp.run.hooks.keras import finalize
from tfdp.run.hooks.report import learning_rate
from tfdp.run.lock import ModelDirLock
from tfdp.run.loop import Run, train_loop
from tfdp.run.observe import Progress
from tfdp.run.plan import Plan, partition, prepare  # noqa: F401 (tfdp.run.training.prepare, partition)
from tfdp.run.resume import (
    keep_position,
    position,
    restore,
    resumed_shares,
    saved_result,
    stream_iterator,
)
from tfdp.run.signals import StopSignals
from tfdp.storage import export_model, write_atomically


def reading_input(error) -> bool:
    """Whether a step's error came from reading its batch (tf.data's IteratorGetNext)."""
    return "IteratorGetNext" in getattr(error, "message", str(error)) or isinstance(
        error, tf.errors.OutOfRangeError
    )


def input_failure(plan: Plan, run, error, checkpointer) -> str:
    """One line for a training stream that failed at a step (`bad_data.failure_line`);
    noted in model_dir, so that a rerun does not restore a position saved past it."""
    data = plan.train_data
    latest = checkpointer.standing if checkpointer else None
    line = bad_data.failure_line(
        f"the training data ({data.source})", error, run.step, data.dataset, latest
    )
    if checkpointer is not None and run.trainer.exchange.is_chief:
        bad_data.note_failure(plan.config.model_dir, run.step, line)
    return line


def validation_failure(data, run, error, checkpointer) -> str:
    """One line for validation data that failed to read in an evaluation."""
    latest = checkpointer.standing if checkpointer else None
    return bad_data.failure_line(
        f"the validation data ({data.source})",
        error,
        run.step,
        getattr(data, "dataset", None),
        latest,
        when="in the evaluation at",
    )


class FitResult(dict):
    """The result dict (the content of result.json), `model`: the trained model, and
    `history`: Keras' History of a run with Keras callbacks."""

    model = None
    history = None


def run(
    plan: Plan,
    log: Callable[[str], None] = print,
    callbacks=None,
    verbose="auto",
    validation=None,
    hooks=(),
) -> dict:
    """Trains as planned; logs like the tutorial; returns the result dict.

    callbacks: Keras callbacks (`tfdp.fit`'s), run beside Keras' History and, unless
    `verbose` is 0, its progress bar (`hooks.keras.KerasCallbacks`); with them the
    result has the History as `result.history`, and `validation` (data, batch size,
    steps, freq) is Keras' validation at the epochs' ends. None: no Keras callbacks.
    hooks: more `loop.Hook`s, called after tfdp's own (a benchmark's clock, say).

    With `model_dir`, holds its lock (`lock.ModelDirLock`), resumes from its
    latest good checkpoint, saves every `checkpoint_every` steps and at the
    end, writes TensorBoard summaries, the model (model.keras) and the result
    (result.json). A run resumed at its end returns its saved result.

    Raises:
      signals.Stopped: SIGTERM or SIGINT arrived; the step it came in was saved.
      NonFinite: the loss or the weights stopped being finite.
    """
    config = plan.config
    trainer = build_trainer(config, plan.devices, plan.shards, plan.model)
    try:
        result = run_trainer(plan, trainer, log, callbacks, verbose, validation, hooks)
    finally:
        trainer.close()  # the model's own variables again, with the trained values
    return result


def run_trainer(plan: Plan, trainer, log, callbacks, verbose, validation, more_hooks) -> dict:
    """`run` with the trainer made."""
    config = plan.config
    locked = config.model_dir and trainer.exchange.is_chief  # only the chief writes model_dir
    lock = ModelDirLock(config.model_dir) if locked else contextlib.nullcontext()
    with lock, StopSignals() as signals:
        checkpointer = (
            Checkpointer(config, trainer.model, trainer.split, trainer.exchange)
            if config.model_dir
            else None
        )
        start_step = restore(checkpointer, trainer, log)  # before anything is written
        cursor = position(plan, checkpointer, start_step)
        ended = not plan.schedule.running(cursor) or (
            plan.total_steps is not None and start_step >= plan.total_steps
        )
        if start_step and checkpointer and ended:
            saved = saved_result(plan, start_step)
            if saved is not None:
                log(
                    f"the run in {config.model_dir} is finished (iteration {start_step}"
                    + (f" of {plan.total_steps}" if plan.total_steps is not None else "")
                    + "); nothing to do"
                )
                result = FitResult(saved)
                result.model = trainer.model
                return result
        progress = (
            Progress(plan.total_steps, config.batch_size, start_step) if config.progress else None
        )
        state = Run(plan, trainer, None, log, start_step, cursor, progress=progress)
        keep_position(checkpointer, state)
        split_info, probe = set_up_split(state, trainer.balancer, checkpointer)
        # after the split is set
        state.iterator, state.input_note = stream_iterator(plan, trainer, checkpointer, cursor)
        state.seek_input = lambda cursor: stream_iterator(plan, trainer, None, cursor)[0]
        hooks, keras_callbacks = default_hooks(
            state, checkpointer, signals, probe, callbacks, verbose, validation, more_hooks
        )
        try:
            train_loop(state, hooks)
        except bad_data.ValidationFailed as failed:
            data = plan.test_data if plan.test_data is not None else validation[0]
            raise DataError(validation_failure(data, state, failed.error, checkpointer)) from None
        except tf.errors.OpError as error:
            # (arrays held in memory have no record to go bad)
            if plan.train_data.in_memory or not reading_input(error):
                raise
            raise DataError(input_failure(plan, state, error, checkpointer)) from None
        if keras_callbacks is None:  # (with them, before their on_train_end, as Keras does)
            finalize(trainer.model)
        result = result_of(state, split_info)
        trainer.close()  # the model's own variables, with the trained values, before writing it
        if config.model_dir and trainer.exchange.is_chief:
            write_run_files(config.model_dir, trainer.model, result)
        trainer.exchange.finish()  # multiworker: the workers leave together, after the chief's writes
    result.model = trainer.model
    result.history = keras_callbacks.history if keras_callbacks else None
    return result


def set_up_split(state: Run, balancer, checkpointer) -> tuple[dict, object]:
    """The split the run starts from: the one saved with the checkpoint it resumes from
    (when measured), else measured or calibrated (`balancers.DeviceBalancer.set_up`). Returns what
    was set up, for the result, and the probe rebalancing carries on from."""
    config, trainer = state.plan.config, state.trainer
    resumed = resumed_shares(config, trainer, checkpointer) if state.start_step else None
    split_info, probe = balancer.set_up(config, state.plan.train_data, state.say, resumed is None)
    split_info["resumed_shares"] = resumed
    if resumed:
        trainer.split.set(resumed["shards"])
        state.say(
            f"shares {resumed['shards']}: the split at iteration {resumed['step']}, "
            f"from {checkpointer.shares_file}"
        )
    return split_info, probe


def result_of(state: Run, split_info: dict) -> FitResult:
    """The run's result: what result.json holds."""
    import keras
    import tensorflow as tf

    plan, trainer = state.plan, state.trainer
    config, last = plan.config, state.metrics
    evals = state.result.get("evals", [])
    final = evals[-1] if evals else {}
    if "val_logs" in state.result:  # Keras' validation, at the last epoch that ran one
        final = {f"test_{k}": v for k, v in state.result["val_logs"].items()}
    optimizer = trainer.model.optimizer
    return FitResult(
        {
            "mode": config.mode,
            "model": plan.model_name,
            "dataset": config.dataset,
            "devices": [short_name(d) for d in plan.devices],
            "shards": state.result["shards"],
            "final_shards": list(trainer.split.shards),
            "max_rows": None if trainer.split.max_rows is None else list(trainer.split.max_rows),
            "micro_steps": trainer.split.micro_steps,
            "powers": config.powers if config.powers == AUTO else list(config.powers) or None,
            "reduce": config.reduce if config.mode == "weighted" else None,
            **split_info,
            "rebalances": state.result.get("rebalances", []),
            "membership": state.result.get("membership"),  # under tfdp-launch's supervision
            "device_seconds": state.result.get("device_seconds"),
            "batch_size": config.batch_size,
            "iterations": plan.total_steps,
            "start_iteration": state.start_step,
            "steps_per_epoch": plan.batches_per_pass,
            "drop_remainder": config.drop_remainder,
            "learning_rate": learning_rate(optimizer),
            "optimizer": type(optimizer).__name__,
            "optimizer_config": optimizer_config(optimizer),
            "seed": config.seed,
            "init": config.init,
            "log": state.result["log"],
            "final_loss": last.get("loss") if last else None,
            "final_accuracy": last.get("accuracy") if last else None,
            "final_metrics": last,
            "test_accuracy": final.get("test_accuracy"),
            "test_metrics": {k[5:]: v for k, v in final.items() if k.startswith("test_")} or None,
            "evals": evals,
            "history": state.result.get("history"),
            "epochs": state.result.get("epochs"),
            "seconds": state.result["seconds"],
            "first_step_seconds": state.result["first_step_seconds"],
            "images_per_second": state.result["images_per_second"],
            "model_dir": config.model_dir,
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "onednn": onednn.enabled(),
            # threads one CPU kernel may use; 0: TensorFlow's default, every core
            "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
            **trainer.info(),  # reduction, chains; multiworker: this worker, chief, its slice
        }
    )


def optimizer_config(optimizer) -> dict:
    """The optimizer's class and settings (Keras' `get_config`), as JSON can hold them."""
    import json

    inner = getattr(optimizer, "inner_optimizer", optimizer)  # under loss scaling: the user's
    settings = {"class": type(inner).__name__, **inner.get_config()}
    return json.loads(json.dumps(settings, default=repr))


def write_run_files(model_dir: str, model, result: dict) -> None:
    """model.keras and result.json, each whole or absent."""
    export_model(model, os.path.join(model_dir, "model.keras"))
    write_atomically(os.path.join(model_dir, "result.json"), json.dumps(result, indent=2) + "\n")


def train(config: Config, log: Callable[[str], None] = print) -> dict:
    """Validates, loads data and trains; returns the result dict."""
    return run(prepare(config), log)
