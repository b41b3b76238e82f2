"""The outer loop: config -> devices -> trainer -> data -> steps -> result.

`prepare` does everything that can fail on bad input (devices, partition,
data files) before any training work; `run` trains and returns the result
dict that `--result_json` writes; `train` is the two in one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
from typing import Callable

import tensorflow as tf

from tfdp import data as data_lib
from tfdp import onednn, replicas, sources, streams
from tfdp.checkpoints import check_model_dir, export_model, write_atomically
from tfdp.config import AUTO, DATASETS, DEFAULT_ITERATIONS, MODELS, Config
from tfdp.devices import (
    available_devices,
    even_split,
    parse_devices,
    parse_slowdown,
    short_name,
    split_batch,
)
from tfdp.errors import ConfigError, DataError
from tfdp.hooks.balancing import Rebalance
from tfdp.hooks.checkpointing import Checkpoints
from tfdp.hooks.evaluation import Evaluation, evaluate  # noqa: F401 (tfdp.training.evaluate)
from tfdp.hooks.finite import FiniteGuard, NonFinite  # noqa: F401 (the CLI catches NonFinite)
from tfdp.hooks.keras import KerasCallbacks
from tfdp.hooks.report import (
    ProgressLine,
    TutorialLog,
    learning_rate,
    schedule_of,
)
from tfdp.hooks.stopping import StopOnSignal
from tfdp.hooks.summaries import TrainSummaries
from tfdp.lock import ModelDirLock
from tfdp.loop import Hooks, Run, train_loop
from tfdp.observe import Progress, Summaries
from tfdp.signals import StopSignals
from tfdp.trainers import build_trainer


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated run: where each example of a global batch goes, the model, the data
    and the steps.

    Attributes:
      batches_per_pass: the steps of one pass over the training data.
      steps_per_epoch: the steps of one epoch of the loop: a pass over the data, unless
        the config's `steps_per_epoch` says otherwise.
      total_steps: the steps of the whole run.
      initial_epoch: the number of the run's first epoch.
    """

    config: Config
    devices: list[str]
    shards: list[int]
    model: object  # the compiled, built Keras model, trained in place
    model_name: str
    train_data: object  # data_lib.Arrays, a nested structure of arrays, or a streams.Stream
    test_data: object  # the same, or None: no evaluation
    batches_per_pass: int
    total_steps: int
    steps_per_epoch: int
    initial_epoch: int = 0

    @property
    def final_epoch(self) -> int:
        """The number of the epoch after the last (Keras fit's `epochs`)."""
        return self.initial_epoch + -(-self.total_steps // self.steps_per_epoch)

    @property
    def examples(self) -> int | None:
        """Examples of a pass (None: a stream whose length is not known)."""
        return data_lib.size(self.train_data)

    @property
    def smallest_batch(self) -> int:
        """The fewest examples a global batch of the run holds (1: a stream's may be any)."""
        if data_lib.is_stream(self.train_data):
            return 1 if self.train_data.examples is None else self.last_batch
        return min(self.config.batch_size, self.last_batch)

    @property
    def last_batch(self) -> int:
        """Examples of a pass's last batch."""
        if data_lib.is_stream(self.train_data):
            return self.train_data.last_batch
        batch, per_pass = self.config.batch_size, self.batches_per_pass
        return min(self.examples - (per_pass - 1) * batch, batch)

    def training_indices(self, start_step: int):
        """Arrays: the example indices of the global batches of steps start_step, ..."""
        config = self.config
        return data_lib.train_indices(
            self.train_data,
            config.batch_size,
            config.seed,
            start_step,
            config.drop_remainder,
            config.shuffle,
        )

    def without_test_data(self) -> Plan:
        return dataclasses.replace(self, test_data=None)

    def logs(self, step: int) -> bool:
        """Whether step `step` (counted from 0) is one `log_every` logs."""
        every = self.config.log_every
        return bool(every) and step % every == 0

    @property
    def steps_per_execution(self) -> int:
        """Steps run in one compiled call: the model's `steps_per_execution` (Keras')."""
        return max(1, int(getattr(self.model, "steps_per_execution", 1) or 1))

    def acts_after(self, step: int) -> bool:
        """Whether tfdp's hooks act after step `step` (counted from 0): a logged step, a
        checkpoint or an evaluation is due; such a step runs in a call of its own."""
        config, done = self.config, step + 1
        return (
            self.logs(step)
            or bool(config.model_dir and done % config.checkpoint_every == 0)
            or bool(config.eval_every and done % config.eval_every == 0)
        )

    def is_log_point(self, step: int) -> bool:
        """Whether the step's metrics are read: a logged step, or the last."""
        return self.logs(step) or step + 1 == self.total_steps

    def partial(self, step: int) -> bool:
        """Whether step `step` reads a pass's last batch, with fewer examples."""
        return step % self.batches_per_pass == self.batches_per_pass - 1 and (
            self.last_batch < self.config.batch_size
        )

    def examples_in(self, first: int, end: int) -> int:
        """Examples in steps first..end-1: a step is a pass's last when the next is a
        multiple of the batches per pass."""
        batch, per_pass, last = self.config.batch_size, self.batches_per_pass, self.last_batch
        return (end - first) * batch - (end // per_pass - first // per_pass) * (batch - last)


def default_devices(mode: str, available: list[str]) -> str:
    """single: the first GPU, else the CPU. Other modes: all (see parse_devices): every GPU,
    else every CPU, so that a GPU is device 0 wherever there is one."""
    if mode == "single":
        gpus = [d for d in available if ":GPU:" in d]
        return short_name((gpus or available)[0])
    return "all"


def partition(config: Config, devices: list[str]) -> list[int]:
    """Examples per device for the config's mode."""
    n, batch = len(devices), config.batch_size
    if config.mode == "single" and n != 1:
        raise ConfigError("devices", config.devices, f"mode single runs on one device, got {n}")
    if config.mode == "mirrored" and config.mirrored_input == "split":
        return split_batch(batch, (1.0,) * n, few=True)
    if config.mode == "mirrored":
        return even_split(batch, n)
    # auto powers start from an even split; the measurement replaces it (see balance.py).
    powers = (1.0,) * n if config.powers in ((), AUTO) else config.powers
    if len(powers) != n:
        raise ConfigError(
            "powers",
            config.powers,
            f"has {len(powers)} values for {n} devices "
            f"({', '.join(short_name(d) for d in devices)})",
        )
    return split_batch(batch, powers, few=True)


def check_balancing(config: Config, devices: list[str]) -> None:
    """The balancing options against the run's devices."""
    outside = [short_name(d) for d in parse_slowdown(config.simulate_slowdown) if d not in devices]
    if outside:
        raise ConfigError(
            "simulate_slowdown",
            config.simulate_slowdown,
            f"names {', '.join(outside)}, which this run does not use "
            f"({', '.join(short_name(d) for d in devices)})",
        )
    if config.rebalance_every and len(devices) < 2:
        raise ConfigError(
            "rebalance_every", config.rebalance_every, "needs at least two devices to balance"
        )


def multiworker_devices(config: Config) -> list[str]:
    """The workers of the cluster stand for the devices: one batch share each."""
    from tfdp.cluster import find_cluster

    if config.devices:
        raise ConfigError(
            "devices",
            config.devices,
            "mode multiworker uses each worker's own devices (its GPUs, else one CPU replica)",
        )
    return list(find_cluster(config).workers)


def load_split(config: Config, split: str):
    """One split of a built-in dataset, with errors reported against the setting that
    chose the source."""
    if config.dataset == "toy":
        size = 10000 if split == "train" else 2000
        return data_lib.make_toy_data(config.seed, num_examples=size, split=split)
    mnist_dir = config.mnist_dir or os.environ.get(data_lib.MNIST_DIR_ENV) or None
    if mnist_dir:
        field = "mnist_dir" if config.mnist_dir else data_lib.MNIST_DIR_ENV
        try:
            arrays = data_lib.load_mnist_idx(mnist_dir, split)
        except (OSError, ValueError) as error:
            raise ConfigError(field, mnist_dir, str(error)) from error
        if len(arrays) == 0:
            needs = "evaluation" if split == "test" else "training"
            raise ConfigError(
                field, mnist_dir, f"its {split} split has no examples; {needs} needs at least one"
            )
        return arrays
    try:
        return data_lib.load_mnist_tfds(split, config.data_dir)
    except Exception as error:  # tensorflow-datasets raises many kinds on download or read
        raise ConfigError(
            "data_dir",
            config.data_dir,
            f"MNIST through tensorflow-datasets failed ({type(error).__name__}: {error}); "
            f"offline, point --mnist_dir or {data_lib.MNIST_DIR_ENV} at the four IDX files",
        ) from error


def load_data(config: Config):
    """(train, test) of the config's dataset: a built-in one, or MODULE:FUNCTION's."""
    if config.dataset in DATASETS:
        return load_split(config, "train"), load_split(config, "test")
    if sources.is_tfds(config.dataset):
        train, test = sources.load_tfds(
            config.dataset, config.data_dir, config.shuffle is not False, config.seed
        )
    else:
        function = sources.load_function(config.dataset, "dataset")
        returned = sources.call(function, config.dataset, "dataset")
        if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
            raise ConfigError(
                "dataset", config.dataset, "must return (train, validation); validation may be None"
            )
        train, test = returned
    if streams.is_stream_input(train):  # read as a pipeline, batch by batch
        try:
            train = streams.from_input(
                train, config.batch_size, config.drop_remainder, config.shuffle, config.seed
            )
        except ConfigError as error:
            if error.field != "x":
                raise
            raise ConfigError(
                "dataset", config.dataset, f"train data, a {error.value}, {error.reason}"
            ) from None
    else:
        train = sources.as_arrays(train, "dataset", config.dataset, "train")
    return train, sources.as_arrays(test, "dataset", config.dataset, "validation")


def model_for(config: Config, model=None):
    """The run's model: `model` (a compiled Keras model or a function returning one), else
    the config's: a built-in name or MODULE:FUNCTION."""
    from tfdp import models

    if model is not None:
        return models.the_model(model, precision=config.precision)
    if config.model in MODELS:
        return models.built_in(config)
    function = sources.load_function(config.model, "model")
    return models.the_model(function, "model", config.model, config.precision)


def prepare(config: Config, model=None, train_data=None, validation_data=None) -> Plan:
    """Validates the config against this machine, loads the data and builds the model
    once on the host; writes nothing.

    model, train_data, validation_data: a library caller's own (see `tfdp.fit`);
    None: the config's (`model`, `dataset`).
    """
    check_model_dir(config)
    if config.mode == "multiworker":
        devices = multiworker_devices(config)
    else:
        available = available_devices()
        devices = parse_devices(
            config.devices or default_devices(config.mode, available), available
        )
    shards = partition(config, devices)
    check_balancing(config, devices)
    if config.mode == "multiworker":
        from tfdp.cluster import join_cluster

        join_cluster(config)  # before any other TensorFlow op; waits for every worker
    if train_data is None:
        train_data, test_data = load_data(config)
        field = "dataset"
    else:
        if not data_lib.is_stream(train_data):
            train_data = sources.as_arrays(train_data, "x")
        test_data = sources.as_arrays(validation_data, "validation_data")
        field = "x"
    examples = data_lib.size(train_data)
    if examples is not None and config.drop_remainder and config.batch_size > examples:
        raise ConfigError(
            "batch_size",
            config.batch_size,
            f"is larger than the {examples} training examples, and drop_remainder leaves "
            "no batch",
        )
    test_field = "validation_data" if field == "x" else field
    if test_data is not None and data_lib.size(test_data) == 0:
        raise ConfigError(
            test_field,
            config.dataset if test_field == "dataset" else "(0 examples)",
            "has no evaluation examples; give some, or none (None) to skip evaluation",
        )
    model = model_for(config, model)
    replicas.build(model, data_lib.first_examples(train_data, 2), field)
    if test_data is not None:
        replicas.check_fits(model, data_lib.first_examples(test_data, 2), test_field)
    if data_lib.is_stream(train_data):
        per_pass = train_data.batches or config.steps_per_epoch or config.iterations
        if per_pass is None:
            value = config.dataset if field == "dataset" else train_data.source
            raise ConfigError(
                field,
                value,
                f"{'train data, a ' + train_data.source + ', ' if field == 'dataset' else ''}"
                "is infinite or of unknown length: give steps_per_epoch, as Keras fit needs "
                "(or, for a tf.data pipeline of known length, "
                "dataset.apply(tf.data.experimental.assert_cardinality(n)))",
            )
    else:
        per_pass = data_lib.steps_per_epoch(examples, config.batch_size, config.drop_remainder)
    per_epoch = config.steps_per_epoch or per_pass
    if config.iterations is not None:
        total_steps = config.iterations
    elif config.epochs is not None:
        total_steps = (config.epochs - config.initial_epoch) * per_epoch
    else:
        total_steps = DEFAULT_ITERATIONS
    return Plan(
        config,
        devices,
        shards,
        model,
        getattr(model, "name", None) or type(model).__name__,
        train_data,
        test_data,
        per_pass,
        total_steps,
        per_epoch,
        config.initial_epoch,
    )


def resumed_shares(config: Config, trainer, checkpointer) -> dict | None:
    """The split a resumed run continues with: the one saved with its checkpoint, when
    the split was measured (auto powers or rebalancing) and the devices are the same.

    Any split makes the same update; this only spares the run measuring again.
    """
    if not trainer.balanced or not (config.powers == AUTO or config.rebalance_every):
        return None
    saved = checkpointer.saved_shares()
    if (
        saved is None
        or saved["devices"] != list(trainer.devices)
        or sum(saved["shards"]) != trainer.global_batch_size
    ):
        return None
    return saved


def restore(checkpointer, trainer, log) -> int:
    """The step the latest good checkpoint continues from (0: none).

    A checkpoint holds the optimizer's learning rate, and the rate the run was
    given when it started. A resumed run given another rate now
    (`--learning_rate`, or a user's compiled optimizer) trains at it; given the same,
    it trains at the checkpoint's, which a callback may have changed since
    (ReduceLROnPlateau, LearningRateScheduler). A schedule follows the restored
    iteration count.
    """
    if checkpointer is None:
        return 0
    checkpointer.log = log
    given = None if schedule_of(trainer.optimizer) else learning_rate(trainer.optimizer)
    checkpointer.state.providers["given_learning_rate"] = lambda: given
    step = checkpointer.restore(log)
    saved = checkpointer.state.restored.get("given_learning_rate")
    if given is not None and saved != given:
        trainer.optimizer.learning_rate = given
    return step


def saved_result(plan: Plan, start_step: int) -> dict | None:
    """For a run resumed at or past its planned end: the result it saved (None if
    there is none: it stopped between its last checkpoint and its result).
    An end before the checkpoint's step is an error: those steps cannot be undone."""
    config = plan.config
    if start_step > plan.total_steps:
        field, value = (
            ("epochs", config.epochs)
            if config.iterations is None and config.epochs is not None
            else ("iterations", plan.total_steps)
        )
        raise ConfigError(
            field,
            value,
            f"ends at iteration {plan.total_steps}, before the checkpoint of iteration "
            f"{start_step} in {config.model_dir}; train at least to {start_step}, or use "
            "another --model_dir",
        )
    try:
        with open(os.path.join(config.model_dir, "result.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def stream_iterator(plan: Plan, trainer, checkpointer, start_step: int):
    """The stream's iterator at step `start_step`, and what the banner says of it.

    A tf.data pipeline read by a host iterator has its position saved with every
    checkpoint, and a resume restores it there (with its shuffle buffers): no batch
    is read again. A PyDataset is read on by index from the step's batch. Else, or from
    a checkpoint without a position, the stream is read again from its start and the
    trained batches are dropped.
    """
    stream = plan.train_data
    unsaved = streams.unsaved_state(stream.dataset) if stream.one_pass else None
    saves = checkpointer is not None and stream.one_pass and trainer.host_iterator
    saves = saves and unsaved is None
    note = None
    if saves and start_step and checkpointer.saved_input():
        iterator = trainer.distribute(stream.training_batches(0))
        checkpointer.restore_input(iterator)
        note = f"the {stream.source} at the position saved with the checkpoint"
    else:
        iterator = trainer.distribute(stream.training_batches(start_step))
        if start_step and stream.starting_at is not None:
            note = f"the {stream.source} read on by index from step {start_step}'s batch"
        elif start_step:
            note = (
                f"the {stream.source} is read again from its start and its first "
                f"{start_step} batches dropped"
                + (f", as its {unsaved} is not saved with a position" if unsaved else "")
                + ": the same batches if it makes the same ones on every run"
            )
    if saves:
        checkpointer.keep_input(iterator)
    return iterator, note


def reading_input(error) -> bool:
    """Whether a step's error came from reading its batch (tf.data's IteratorGetNext)."""
    return "IteratorGetNext" in getattr(error, "message", str(error)) or isinstance(
        error, tf.errors.OutOfRangeError
    )


def input_failure(plan: Plan, run, error, checkpointer) -> str:
    """One line for a stream that failed at a step: what, where, and what stands."""
    data = plan.train_data
    boilerplate = ("Graph execution error", "Detected at node", "<stack traces", "Traceback")
    lines = [line.strip() for line in getattr(error, "message", str(error)).splitlines()]
    cause = next((line for line in lines if line and not line.startswith(boilerplate)), "")
    cause = cause.split(" [[", 1)[0].split(" [Op:", 1)[0]
    if isinstance(error, tf.errors.OutOfRangeError):
        what = "ran out of batches"
    elif re.match(r"^\w+(Error|Exception): ", cause):  # the user's code raised it
        what = f"failed ({cause})"
    else:
        what = f"failed ({type(error).__name__}: {cause})"
    step = run.step
    text = f"the training data ({data.source}) {what} at step {step}"
    latest = tf.train.latest_checkpoint(checkpointer.directory) if checkpointer else None
    if latest:
        return f"{text}; {latest} stands: run again to resume from it"
    return f"{text}; no checkpoint was saved"


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
) -> dict:
    """Trains as planned; logs like the tutorial; returns the result dict.

    callbacks: Keras callbacks (`tfdp.fit`'s), run beside Keras' History and, unless
    `verbose` is 0, its progress bar (`hooks.keras.KerasCallbacks`); with them the
    result has the History as `result.history`, and `validation` (data, batch size,
    steps, freq) is Keras' validation at the epochs' ends. None: no Keras callbacks.

    With `model_dir`, holds its lock (`lock.ModelDirLock`), resumes from its
    latest good checkpoint, saves every `checkpoint_every` steps and at the
    end, writes TensorBoard summaries, the model (model.keras) and the result
    (result.json). A run resumed at its end returns its saved result.

    Raises:
      signals.Stopped: SIGTERM or SIGINT arrived; the step it came in was saved.
      NonFinite: the loss or the weights stopped being finite.
    """
    config = plan.config
    trainer = build_trainer(config, plan.devices, plan.shards, plan.model, plan.smallest_batch)
    try:
        result = run_trainer(plan, trainer, log, callbacks, verbose, validation)
    finally:
        trainer.close()  # the model's own variables again, with the trained values
    return result


def run_trainer(plan: Plan, trainer, log, callbacks, verbose, validation) -> dict:
    """`run` with the trainer made."""
    config = plan.config
    locked = config.model_dir and trainer.is_chief  # only the chief writes model_dir
    lock = ModelDirLock(config.model_dir) if locked else contextlib.nullcontext()
    with lock, StopSignals() as signals:
        checkpointer = trainer.checkpointer(config) if config.model_dir else None
        start_step = restore(checkpointer, trainer, log)  # before anything is written
        if start_step >= plan.total_steps and checkpointer:
            saved = saved_result(plan, start_step)
            if saved is not None:
                log(
                    f"the run in {config.model_dir} is finished (iteration {start_step} of "
                    f"{plan.total_steps}); nothing to do"
                )
                result = FitResult(saved)
                result.model = trainer.model
                return result
        progress = (
            Progress(plan.total_steps, config.batch_size, start_step) if config.progress else None
        )
        state = Run(plan, trainer, None, log, start_step, start_step, progress=progress)
        split = trainer.Split(trainer)
        split_info, probe = set_up_split(state, split, checkpointer)
        if data_lib.is_stream(plan.train_data):  # after the split is set
            state.iterator, state.input_note = stream_iterator(
                plan, trainer, checkpointer, start_step
            )
        else:  # arrays: batches of example indices, gathered by the trainer
            state.iterator = trainer.distribute_indices(
                plan.training_indices(start_step), data_lib.gatherer(plan.train_data)
            )
        summaries = Summaries(config.model_dir) if config.model_dir and trainer.is_chief else None
        guard = FiniteGuard(checkpointer) if config.finite_guard else None
        checkpoints = Checkpoints(checkpointer, guard) if checkpointer else None
        rebalancing = split.rebalancing(config.rebalance_every, state.say, probe)
        keras_callbacks = None
        if callbacks is not None:
            keras_callbacks = KerasCallbacks(
                callbacks, verbose, plan.final_epoch, validation, chief=trainer.is_chief
            )
            if checkpointer:
                keras_callbacks.saved_state = checkpointer.state.restored.get("keras")
                checkpointer.state.providers["keras"] = keras_callbacks.state
        hooks = Hooks(
            [
                guard,
                TutorialLog(running=keras_callbacks is not None),
                Rebalance(rebalancing) if rebalancing else None,
                ProgressLine(progress) if progress else None,
                keras_callbacks,
                Evaluation(summaries),
                TrainSummaries(summaries) if summaries else None,
                checkpoints,
                StopOnSignal(signals, checkpoints),
            ]
        )
        try:
            train_loop(state, hooks)
        except tf.errors.OpError as error:
            if not data_lib.is_stream(plan.train_data) or not reading_input(error):
                raise
            raise DataError(input_failure(plan, state, error, checkpointer)) from None
        result = result_of(state, split_info)
        trainer.close()  # the model's own variables, with the trained values, before writing it
        if config.model_dir and trainer.is_chief:
            write_run_files(config.model_dir, trainer.model, result)
        trainer.exchange.finish()  # multiworker: the workers leave together, after the chief's writes
    result.model = trainer.model
    result.history = keras_callbacks.history if keras_callbacks else None
    return result


def set_up_split(state: Run, split, checkpointer) -> tuple[dict, object]:
    """The split the run starts from: the one saved with the checkpoint it resumes from
    (when measured), else measured or calibrated (`split.DeviceSplit.set_up`). Returns what
    was set up, for the result, and the probe rebalancing carries on from."""
    config, trainer = state.plan.config, state.trainer
    resumed = resumed_shares(config, trainer, checkpointer) if state.start_step else None
    split_info, probe = split.set_up(config, state.plan.train_data, state.say, resumed is None)
    split_info["resumed_shares"] = resumed
    if resumed:
        trainer.set_shards(resumed["shards"])
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
    optimizer = trainer.optimizer
    return FitResult(
        {
            "mode": config.mode,
            "model": plan.model_name,
            "dataset": config.dataset,
            "devices": [short_name(d) for d in plan.devices],
            "shards": state.result["shards"],
            "final_shards": list(trainer.shards),
            "powers": config.powers if config.powers == AUTO else list(config.powers) or None,
            "reduce": config.reduce if config.mode == "weighted" else None,
            **split_info,
            "rebalances": state.result.get("rebalances", []),
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
            **trainer.result_info(),  # chains; multiworker: this worker, chief, its slice
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
