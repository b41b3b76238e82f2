"""The outer loop: config -> devices -> trainer -> data -> steps -> result.

`prepare` does everything that can fail on bad input (devices, partition,
data files) before any training work; `run` trains and returns the result
dict that `--result_json` writes; `train` is the two in one call.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from typing import Callable

from tfdp import data as data_lib
from tfdp.config import Config
from tfdp.devices import available_devices, even_split, parse_devices, short_name, split_batch
from tfdp.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated run: where each example of a global batch goes, and the data."""

    config: Config
    devices: list[str]
    shards: list[int]
    train_data: data_lib.Arrays


def default_devices(mode: str, available: list[str]) -> str:
    """single: the first GPU, else the CPU. Other modes: all (see parse_devices)."""
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
    powers = config.powers or (1.0,) * n
    if len(powers) != n:
        raise ConfigError(
            "powers",
            config.powers,
            f"has {len(powers)} values for {n} devices "
            f"({', '.join(short_name(d) for d in devices)})",
        )
    return split_batch(batch, powers)


def load_train_data(config: Config) -> data_lib.Arrays:
    """The training split, with data errors reported against the setting that chose the source."""
    if config.dataset == "toy":
        return data_lib.make_toy_data(config.seed)
    mnist_dir = config.mnist_dir or os.environ.get(data_lib.MNIST_DIR_ENV) or None
    if mnist_dir:
        field = "mnist_dir" if config.mnist_dir else data_lib.MNIST_DIR_ENV
        try:
            return data_lib.load_mnist_idx(mnist_dir, "train")
        except (OSError, ValueError) as error:
            raise ConfigError(field, mnist_dir, str(error)) from error
    try:
        return data_lib.load_mnist_tfds("train", config.data_dir)
    except Exception as error:  # tensorflow-datasets raises many kinds on download or read
        raise ConfigError(
            "data_dir",
            config.data_dir,
            f"MNIST through tensorflow-datasets failed ({type(error).__name__}: {error}); "
            f"offline, point --mnist_dir or {data_lib.MNIST_DIR_ENV} at the four IDX files",
        ) from error


def prepare(config: Config) -> Plan:
    """Validates the config against this machine and loads the data."""
    available = available_devices()
    devices = parse_devices(config.devices or default_devices(config.mode, available), available)
    shards = partition(config, devices)
    train_data = load_train_data(config)
    if config.batch_size > len(train_data):
        raise ConfigError(
            "batch_size",
            config.batch_size,
            f"is larger than the {len(train_data)} training examples",
        )
    return Plan(config, devices, shards, train_data)


def build_trainer(config: Config, devices: list[str], shards: list[int]):
    """The mode's trainer, with every model copy starting from the seed's weights."""
    from tfdp.mirrored import MirroredTrainer
    from tfdp.models import build_model, initial_weights
    from tfdp.weighted import WeightedTrainer

    model_args = dict(
        name=config.model, init=config.init, seed=config.seed, hidden_units=config.hidden_units
    )
    weights = initial_weights(**model_args)
    make_model = functools.partial(build_model, **model_args)
    if config.mode == "mirrored":
        return MirroredTrainer(
            make_model, weights, devices, config.batch_size, config.learning_rate
        )
    # single is the weighted algorithm on one device: no split, no copies.
    return WeightedTrainer(make_model, weights, devices, shards, config.learning_rate)


def run(plan: Plan, log: Callable[[str], None] = print) -> dict:
    """Trains as planned; logs like the tutorial; returns the result dict."""
    import keras
    import tensorflow as tf

    config = plan.config
    trainer = build_trainer(config, plan.devices, plan.shards)
    iterator = trainer.distribute(
        data_lib.train_dataset(plan.train_data, config.batch_size, config.seed)
    )
    log(f"workload partition: {[(short_name(d), n) for d, n in zip(plan.devices, plan.shards)]}")

    history = []
    start = time.perf_counter()
    first_step_seconds = None
    for iteration in range(config.iterations):
        metrics = trainer.train_step(iterator)
        last = iteration == config.iterations - 1
        # Reading metrics waits for the device: only at log points and the end.
        if iteration % config.log_every == 0 or last:
            accuracy = float(metrics["correct"]) / config.batch_size
            loss = float(metrics["loss_sum"]) / config.batch_size
            if iteration % config.log_every == 0:
                history.append({"iteration": iteration, "accuracy": accuracy, "loss": loss})
                log(f"iteration {iteration}, accuracy {accuracy:f}, loss {loss:f}")
        if iteration == 0:
            first_step_seconds = time.perf_counter() - start
    seconds = time.perf_counter() - start

    steady_steps = config.iterations - 1
    steady_seconds = seconds - first_step_seconds
    images_per_second = (
        steady_steps * config.batch_size / steady_seconds
        if steady_steps
        else config.batch_size / seconds
    )
    log(
        f"time for {config.iterations} iterations of {config.model} on "
        f"{len(plan.devices)} device(s), mode {config.mode}: {seconds:f} sec "
        f"(first step {first_step_seconds:.2f} sec with tracing; then "
        f"{images_per_second:.0f} images/sec)"
    )
    return {
        "mode": config.mode,
        "model": config.model,
        "dataset": config.dataset,
        "devices": [short_name(d) for d in plan.devices],
        "shards": plan.shards,
        "powers": list(config.powers) or None,
        "batch_size": config.batch_size,
        "iterations": config.iterations,
        "learning_rate": config.learning_rate,
        "seed": config.seed,
        "init": config.init,
        "log": history,
        "final_loss": loss,
        "final_accuracy": accuracy,
        "seconds": seconds,
        "first_step_seconds": first_step_seconds,
        "images_per_second": images_per_second,
        "versions": {"tensorflow": tf.__version__, "keras": keras.__version__},
    }


def train(config: Config, log: Callable[[str], None] = print) -> dict:
    """Validates, loads data and trains; returns the result dict."""
    return run(prepare(config), log)
