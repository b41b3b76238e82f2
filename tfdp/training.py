"""The outer loop: config -> devices -> trainer -> data -> steps -> result.

`prepare` does everything that can fail on bad input (devices, partition,
data files) before any training work; `run` trains and returns the result
dict that `--result_json` writes; `train` is the two in one call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from typing import Callable

from tfdp import onednn, sources
from tfdp import data as data_lib
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
from tfdp.errors import ConfigError
from tfdp.lock import ModelDirLock
from tfdp.models import ModelSpec
from tfdp.observe import Progress, Summaries
from tfdp.signals import Stopped, StopSignals
from tfdp.trainers import build_trainer


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated run: where each example of a global batch goes, the model and the data."""

    config: Config
    devices: list[str]
    shards: list[int]
    spec: ModelSpec
    train_data: object  # data_lib.Arrays, or a nested structure of arrays
    test_data: object  # the same, or None: no evaluation
    steps_per_epoch: int
    total_steps: int


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
    if batch < n:
        raise ConfigError(
            "batch_size",
            batch,
            f"is smaller than the number of devices ({n}); every device needs at least one example",
        )
    if config.mode == "mirrored" and config.mirrored_input == "split":
        return split_batch(batch, (1.0,) * n)
    if config.mode == "mirrored":
        shards = even_split(batch, n)
        if 0 in shards:
            raise ConfigError(
                "batch_size",
                batch,
                f"tf.distribute would split it {shards} over {n} replicas, "
                f"leaving one idle; use a multiple of {n} or mode weighted",
            )
        return shards
    # auto powers start from an even split; the measurement replaces it (see balance.py).
    powers = (1.0,) * n if config.powers in ((), AUTO) else config.powers
    if len(powers) != n:
        raise ConfigError(
            "powers",
            config.powers,
            f"has {len(powers)} values for {n} devices "
            f"({', '.join(short_name(d) for d in devices)})",
        )
    return split_batch(batch, powers)


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
    """The workers of TF_CONFIG stand for the devices: one batch share each."""
    from tfdp.cluster import read_cluster

    if config.devices:
        raise ConfigError(
            "devices",
            config.devices,
            "mode multiworker uses each worker's own devices (its GPUs, else one CPU replica)",
        )
    return list(read_cluster().workers)


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
    function = sources.load_function(config.dataset, "dataset")
    returned = sources.call(function, config.dataset, "dataset")
    if not (isinstance(returned, (tuple, list)) and len(returned) == 2):
        raise ConfigError(
            "dataset", config.dataset, "must return (train, validation); validation may be None"
        )
    train, test = (
        sources.as_arrays(part, "dataset", config.dataset, name)
        for part, name in zip(returned, ("train", "validation"))
    )
    return train, test


def model_spec_for(config: Config, samples: dict, model=None) -> ModelSpec:
    """The run's model: `model` (a compiled Keras model or a function returning one), else
    the config's: a built-in name or MODULE:FUNCTION. `samples`: a few examples of each
    split, by the setting that gave them, checked against the model."""
    from tfdp import models

    switches = {"precision": config.precision, "jit_compile": config.jit_compile}
    if model is not None:
        return models.model_spec(model, samples, **switches)
    if config.model in MODELS:
        return models.built_in_spec(config, samples)
    function = sources.load_function(config.model, "model")
    return models.model_spec(function, samples, field="model", source=config.model, **switches)


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
        train_data = sources.as_arrays(train_data, "train_data")
        test_data = sources.as_arrays(validation_data, "validation_data")
        field = "train_data"
    examples = data_lib.size(train_data)
    if config.batch_size > examples:
        raise ConfigError(
            "batch_size",
            config.batch_size,
            f"is larger than the {examples} training examples",
        )
    test_field = "validation_data" if field == "train_data" else field
    if test_data is not None and data_lib.size(test_data) == 0:
        raise ConfigError(
            test_field,
            config.dataset if test_field == "dataset" else "(0 examples)",
            "has no evaluation examples; give some, or none (None) to skip evaluation",
        )
    samples = {field: data_lib.first_examples(train_data, 2)}
    if test_data is not None:
        samples[test_field] = data_lib.first_examples(test_data, 2)
    spec = model_spec_for(config, samples, model)
    steps_per_epoch = data_lib.steps_per_epoch(examples, config.batch_size, config.drop_remainder)
    if config.iterations is not None:
        total_steps = config.iterations
    elif config.epochs is not None:
        total_steps = config.epochs * steps_per_epoch
    else:
        total_steps = DEFAULT_ITERATIONS
    return Plan(config, devices, shards, spec, train_data, test_data, steps_per_epoch, total_steps)


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


class NonFinite(RuntimeError):
    """The loss or the weights became NaN or infinite; the run stopped without saving
    that state."""


def first_non_finite(pending) -> int | None:
    """The first step among `(step, loss)` pairs whose loss is not finite."""
    for step, loss in pending:
        if not math.isfinite(float(loss)):
            return step
    return None


def non_finite_weights(model) -> list[str]:
    """The model's variables (weights and statistics) holding a NaN or an infinity."""
    import numpy as np

    return [v.path for v in model.weights if not np.isfinite(np.asarray(v)).all()]


def restore(checkpointer, trainer, log) -> int:
    """The step the latest good checkpoint continues from (0: none).

    A checkpoint holds the optimizer's learning rate; a resumed run trains at
    the rate it is given now (`--learning_rate`, or a user's compiled optimizer).
    """
    if checkpointer is None:
        return 0
    try:
        rate = float(trainer.optimizer.learning_rate)
    except TypeError:  # a schedule: it follows the restored iteration count
        rate = None
    step = checkpointer.restore(log)
    if rate is not None:
        trainer.optimizer.learning_rate = rate
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


def banner(plan: Plan, trainer, start_step: int, shards: list[int]) -> str:
    """The batch arithmetic, printed once at start."""
    config, n = plan.config, len(plan.devices)
    split = " + ".join(str(s) for s in shards)
    epochs = plan.total_steps / plan.steps_per_epoch
    text = (
        f"global batch {config.batch_size} = {split} over {n} {trainer.unit}, mode {config.mode}; "
        f"{plan.steps_per_epoch} steps per epoch of {data_lib.size(plan.train_data)} examples; "
        f"{plan.total_steps} iterations ({epochs:.2f} epochs) at learning rate "
        f"{config.learning_rate}"
    )
    text += trainer.describe()
    if config.rebalance_every:
        text += (
            f"; re-split by measured device times, in windows of up to "
            f"{config.rebalance_every} iterations"
        )
    if start_step:
        text += f"; resuming at iteration {start_step} from {config.model_dir}"
    if config.mode == "weighted" and config.reduce == "device0":
        from tfdp.devices import master_on_cpu

        warning = master_on_cpu(plan.devices)
        if warning:
            text += f"; warning: {warning}"
    return text


class FitResult(dict):
    """The result dict (the content of result.json), and `model`: the trained model."""

    model = None


def evaluate(trainer, spec: ModelSpec, data, batch_size: int) -> dict[str, float]:
    """The compiled loss (with `model.losses`) and metrics over every example of `data`,
    each batch split over the devices as the trainer splits a training batch."""
    objective = spec.objective
    objective.reset_metrics()
    summed = 0.0
    for batch in data_lib.eval_batches(data, batch_size):
        loss, predictions = trainer.predict(batch)
        summed += float(loss)
        objective.update_metrics(batch, predictions)
    regularization = sum(float(value) for value in trainer.model.losses)
    return {"loss": summed / data_lib.size(data) + regularization, **objective.read_metrics()}


def step_metrics(objective, metrics) -> dict[str, float]:
    """The loss and compiled metrics of a step's global batch, on the host."""
    from tfdp.objective import concat

    if "batches" in metrics:  # per-replica batches (mirrored_input dataset)
        batch = concat(metrics["batches"])
    else:
        batch = metrics["batch"]
    values = objective.batch_metrics(batch, concat(metrics["predictions"]))
    return {**values, "loss": float(metrics["loss"])}


def described(values: dict[str, float], prefix: str = "") -> str:
    """'accuracy 0.910000, loss 0.300000': the metrics first, as the tutorial prints them."""
    names = [name for name in values if name != "loss"] + ["loss"]
    return ", ".join(f"{prefix}{name} {values[name]:f}" for name in names if name in values)


def run(plan: Plan, log: Callable[[str], None] = print) -> dict:
    """Trains as planned; logs like the tutorial; returns the result dict.

    With `model_dir`, holds its lock (`lock.ModelDirLock`), resumes from its
    latest good checkpoint, saves every `checkpoint_every` steps and at the
    end, writes TensorBoard summaries, the model (model.keras) and the result
    (result.json). A run resumed at its end returns its saved result.

    Raises:
      signals.Stopped: SIGTERM or SIGINT arrived; the step it came in was saved.
      NonFinite: the loss or the weights stopped being finite.
    """
    config = plan.config
    trainer = build_trainer(config, plan.devices, plan.shards, plan.spec)
    locked = config.model_dir and trainer.is_chief  # only the chief writes model_dir
    lock = ModelDirLock(config.model_dir) if locked else contextlib.nullcontext()
    with lock, StopSignals() as stop:
        return train_loop(plan, trainer, stop, log)


def train_loop(plan: Plan, trainer, stop: StopSignals, log: Callable[[str], None]) -> dict:
    """`run`'s loop, for a trainer built from `plan`; stops at a step boundary when
    `stop` has caught a signal."""
    import keras
    import tensorflow as tf

    config = plan.config
    batch = config.batch_size
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
    summaries = Summaries(config.model_dir) if config.model_dir and trainer.is_chief else None
    progress = Progress(plan.total_steps, batch, start_step) if config.progress else None

    def say(line):
        if progress:
            progress.clear()
        log(line)

    resumed = resumed_shares(config, trainer, checkpointer) if start_step else None
    split_info, probe = trainer.set_up_split(config, plan.train_data, say, resumed is None)
    split_info["resumed_shares"] = resumed
    if resumed:
        trainer.set_shards(resumed["shards"])
        say(
            f"shares {resumed['shards']}: the split at iteration {resumed['step']}, "
            f"from {checkpointer.shares_file}"
        )
    rebalancing = trainer.rebalancing(config.rebalance_every, say, probe)
    iterator = trainer.distribute(  # after the split is set: a worker keeps its slice
        data_lib.train_dataset(
            plan.train_data, batch, config.seed, start_step, config.drop_remainder
        )
    )
    shards = list(trainer.shards)
    say(f"workload partition: {[(short_name(d), n) for d, n in zip(plan.devices, shards)]}")
    say(banner(plan, trainer, start_step, shards))

    last_examples = data_lib.size(plan.train_data) - (plan.steps_per_epoch - 1) * batch

    def partial(iteration):
        """Whether step `iteration` reads an epoch's last batch, with fewer examples."""
        return iteration % plan.steps_per_epoch == plan.steps_per_epoch - 1 and (
            last_examples < batch
        )

    def examples_in(first, end):
        """Examples in steps first..end-1: step i is an epoch's last when i + 1 is a
        multiple of the steps per epoch."""
        epoch_ends = end // plan.steps_per_epoch - first // plan.steps_per_epoch
        return (end - first) * batch - epoch_ends * (batch - min(last_examples, batch))

    history, evals, pending = [], [], []
    metrics, last = None, None
    side_seconds = 0.0  # evaluation and checkpoints, left out of images/s
    first_step_seconds = 0.0

    def check_finite():
        bad = first_non_finite(pending)
        pending.clear()
        if bad is not None:
            if progress:
                progress.close()
            kept = checkpointer.manager.latest_checkpoint if checkpointer else None
            raise NonFinite(
                f"the loss became non-finite at iteration {bad}; stopped before saving that "
                + (f"state; the last good checkpoint is {kept}" if kept else "state")
            )

    def save(step):
        """Saves the state after `step` steps, if it is finite."""
        check_finite()  # never save a state that came from a non-finite loss
        bad = non_finite_weights(trainer.model)
        if bad:
            if progress:
                progress.close()
            kept = checkpointer.manager.latest_checkpoint
            raise NonFinite(
                f"the weights became non-finite by iteration {step} ({', '.join(bad[:3])}); "
                "stopped before saving them"
                + (f"; the last good checkpoint is {kept}" if kept else "")
            )
        return checkpointer.save(step)

    def run_evaluation(step):
        if plan.test_data is None:
            return
        values = evaluate(trainer, plan.spec, plan.test_data, batch)
        evals.append({"iteration": step, **{f"test_{k}": v for k, v in values.items()}})
        say(
            f"iteration {step}, {described(values, 'test ')} "
            f"({data_lib.size(plan.test_data)} examples)"
        )
        if summaries:
            summaries.write_eval(step, {f"test_{k}": v for k, v in values.items()})

    start = time.perf_counter()
    for iteration in range(start_step, plan.total_steps):
        metrics = trainer.train_step(iterator)
        pending.append((iteration, metrics["loss"]))
        done = iteration + 1
        if iteration == start_step:
            float(metrics["loss"])  # wait for the first step: it includes tracing
            first_step_seconds = time.perf_counter() - start
        if iteration % config.log_every == 0 or done == plan.total_steps:
            check_finite()  # reading metrics waits for the device: only here
            metrics = trainer.global_outputs(metrics)  # multiworker: join the workers' slices
            last = step_metrics(plan.spec.objective, metrics)
            if iteration % config.log_every == 0:
                history.append({"iteration": iteration, **last})
                say(f"iteration {iteration}, {described(last)}")
                if summaries:
                    elapsed = time.perf_counter() - start - side_seconds
                    summaries.write_train(
                        iteration,
                        {
                            **last,
                            "learning_rate": config.learning_rate,
                            "images_per_second": examples_in(start_step, done) / max(elapsed, 1e-9),
                            **{
                                f"shard/{short_name(d)}": n
                                for d, n in zip(plan.devices, trainer.shards)
                            },
                        },
                    )
        # The first step has first-run costs; a partial batch is not the split's speed.
        if rebalancing and iteration > start_step and not partial(iteration):
            rebalancing.observe(iteration, metrics["device_seconds"])
        if progress:
            progress.update(
                done,
                lambda metrics=metrics: step_metrics(plan.spec.objective, metrics),
                force=done == plan.total_steps,
            )
        side_start = time.perf_counter()
        if config.eval_every and done % config.eval_every == 0 and done != plan.total_steps:
            run_evaluation(done)
        saved = None
        if checkpointer and (done % config.checkpoint_every == 0 or done == plan.total_steps):
            saved = save(done)
        side_seconds += time.perf_counter() - side_start
        signum = trainer.agree_to_stop(stop.signum or 0)
        if signum and done < plan.total_steps:
            saved = saved or (save(done) if checkpointer else None)
            if progress:
                progress.close()
            if summaries:
                summaries.close()
            raise Stopped(signum, done, saved)
    seconds = time.perf_counter() - start
    if progress:
        progress.close()

    steps_run = plan.total_steps - start_step
    steady_seconds = seconds - side_seconds - first_step_seconds
    images_per_second = (
        examples_in(start_step + 1, plan.total_steps) / steady_seconds
        if steps_run > 1
        else examples_in(start_step, plan.total_steps) / max(seconds, 1e-9)
    )
    say(
        f"time for {steps_run} iterations of {plan.spec.name} on "
        f"{len(plan.devices)} {trainer.unit}, mode {config.mode}: {seconds:f} sec "
        f"(first step {first_step_seconds:.2f} sec with tracing; then "
        f"{images_per_second:.0f} images/sec)"
    )
    run_evaluation(plan.total_steps)
    final = evals[-1] if evals else {}
    result = FitResult(
        {
            "mode": config.mode,
            "model": plan.spec.name,
            "dataset": config.dataset,
            "devices": [short_name(d) for d in plan.devices],
            "shards": shards,
            "final_shards": list(trainer.shards),
            "powers": config.powers if config.powers == AUTO else list(config.powers) or None,
            "reduce": config.reduce if config.mode == "weighted" else None,
            **split_info,
            "rebalances": rebalancing.resplits if rebalancing else [],
            "device_seconds": rebalancing.seconds() if rebalancing else None,
            "batch_size": batch,
            "iterations": plan.total_steps,
            "start_iteration": start_step,
            "steps_per_epoch": plan.steps_per_epoch,
            "drop_remainder": config.drop_remainder,
            "learning_rate": config.learning_rate,
            "optimizer": trainer.optimizer.__class__.__name__,
            "seed": config.seed,
            "init": config.init,
            "log": history,
            "final_loss": last["loss"] if last else None,
            "final_accuracy": last.get("accuracy") if last else None,
            "final_metrics": last,
            "test_accuracy": final.get("test_accuracy"),
            "test_metrics": {k[5:]: v for k, v in final.items() if k.startswith("test_")} or None,
            "evals": evals,
            "seconds": seconds,
            "first_step_seconds": first_step_seconds,
            "images_per_second": images_per_second,
            "model_dir": config.model_dir,
            "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
            "onednn": onednn.enabled(),
            # threads one CPU kernel may use; 0: TensorFlow's default, every core
            "intra_op_threads": tf.config.threading.get_intra_op_parallelism_threads(),
            **trainer.result_info(),  # chains; multiworker: this worker, chief, its slice
        }
    )
    if config.model_dir and trainer.is_chief:
        summaries.close()
        export_model(trainer.model, os.path.join(config.model_dir, "model.keras"))
        write_atomically(
            os.path.join(config.model_dir, "result.json"), json.dumps(result, indent=2) + "\n"
        )
    trainer.finish()  # multiworker: the workers leave together, after the chief's writes
    result.model = trainer.model
    return result


def train(config: Config, log: Callable[[str], None] = print) -> dict:
    """Validates, loads data and trains; returns the result dict."""
    return run(prepare(config), log)


def fit(
    model,
    train_data,
    validation_data=None,
    *,
    config: Config | None = None,
    log: Callable[[str], None] = print,
    **settings,
) -> FitResult:
    """Trains a user's Keras model on a user's data with tfdp's engine.

        result = tfdp.fit(model, (x, y), validation_data=(x_val, y_val),
                          mode="weighted", devices="gpu:0,cpu:0", powers="auto",
                          batch_size=256, epochs=1)
        result["test_metrics"]   # the compiled metrics on the validation data
        result.model             # the trained model (also `model`, when one was given)

    Args:
      model: a compiled Keras 3 model (its loss, loss weights, optimizer and
        metrics are used), or a function of no arguments that returns one;
        tfdp builds one copy per device (in a strategy's scope where the mode
        has one) and starts every copy from the same weights.
      train_data, validation_data: what Keras `fit` takes as data: numpy arrays
        or nested structures of them (`(x, y)`, `(x, y, sample_weight)`, dict
        inputs), or an unbatched, finite `tf.data.Dataset` of such elements.
        tfdp batches to the global batch and splits every leaf along it.
      config: a `tfdp.Config`; or its fields as keywords (`mode`, `devices`,
        `powers`, `batch_size`, `epochs` or `iterations`, `model_dir`,
        `rebalance_every`, ...). `learning_rate` and `init` apply to the
        built-in models only: a user's model brings its own optimizer and weights.
        `precision` builds a model function's copies under that Keras dtype
        policy (Keras' compile adds loss scaling for mixed_float16); a model
        object keeps its dtypes. `jit_compile` compiles each device's forward
        and backward pass with XLA.
      log: where the run's lines go.

    Returns:
      The result dict (what `result.json` holds), with the trained model as
      `result.model`. When `model` is a Keras model, its weights are set to the
      trained ones too, as Keras `fit` leaves them; with `model_dir`,
      `model.keras` there is the trained model, loadable by `keras.models.load_model`.

    Raises:
      ConfigError: bad settings, data or model, before any training work.
    """
    if config is not None and settings:
        raise ConfigError("config", config, f"and settings {sorted(settings)} both given; give one")
    if config is None:
        name = getattr(model, "name", getattr(model, "__name__", "model"))
        try:
            config = Config(**{"model": f"fit:{name}", "dataset": "fit:data", **settings})
        except TypeError as error:  # an unknown keyword
            raise ConfigError("settings", sorted(settings), str(error)) from None
    plan = prepare(config, model=model, train_data=train_data, validation_data=validation_data)
    result = run(plan, log)
    import keras

    if isinstance(model, keras.Model):
        model.set_weights(result.model.get_weights())
    return result
