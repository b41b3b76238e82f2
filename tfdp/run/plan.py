"""A run planned before any work: devices, partition, data, model and epochs.

`prepare` does everything that can fail on bad input (devices, partition, data
files, the model against the data) before any training work, and writes
nothing; it returns the `Plan` that `training.run` carries out.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from tfdp import models
from tfdp.config import AUTO, DEFAULT_BATCH_SIZE, DEFAULT_ITERATIONS, MODELS, Config
from tfdp.data import inputs as data_inputs
from tfdp.data import sources
from tfdp.data.epochs import Schedule
from tfdp.data.inputs import Inputs
from tfdp.devices import (
    available_devices,
    even_split,
    given_max_rows,
    micro_step_rows,
    micro_steps,
    parse_devices,
    parse_slowdown,
    short_name,
    split_batch,
)
from tfdp.errors import ConfigError
from tfdp.run.checkpoints import check_model_dir


@dataclasses.dataclass(frozen=True)
class Plan:
    """A validated run: where each example of a global batch goes, the model, the data
    and the epochs.

    Attributes:
      schedule: the run's epochs, by Keras' rule over the passes of the data
        (`epochs.Schedule`).
    """

    config: Config
    devices: list[str]
    shards: list[int]
    model: object  # the compiled, built Keras model, trained in place
    model_name: str
    train_data: object  # a streams.Stream (arrays held in memory: `arrays.as_stream`)
    test_data: object  # a streams.EvalStream (arrays: `arrays.as_eval_stream`), or None
    schedule: Schedule
    batch_from: str | None = None  # where a batch size not given came from, for the banner

    @property
    def batches_per_pass(self) -> float | None:
        """Batches of one pass over the training data (math.inf: endless; None: unknown)."""
        return self.schedule.batches

    @functools.cached_property
    def total_steps(self) -> int | None:
        """The run's steps (None: they depend on where the data's passes end)."""
        return self.schedule.total_steps()

    @property
    def steps_per_epoch(self) -> int | None:
        """An epoch's steps, as Keras' progress bar counts them (None: not known)."""
        per_pass = self.batches_per_pass
        if self.schedule.steps_per_epoch:
            return self.schedule.steps_per_epoch
        return per_pass if per_pass not in (None, math.inf) else None

    @property
    def initial_epoch(self) -> int:
        return self.schedule.initial_epoch

    @property
    def final_epoch(self) -> int:
        """The number of the epoch after the last (Keras fit's `epochs`)."""
        if self.schedule.final_epoch is not None:
            return self.schedule.final_epoch
        per_epoch = self.steps_per_epoch or self.total_steps
        return self.initial_epoch + -(-self.total_steps // per_epoch)

    @property
    def examples(self) -> int | None:
        """Examples of a pass (None: a stream whose length is not known)."""
        return self.train_data.examples

    @property
    def last_batch(self) -> int:
        """Examples of a pass's last batch."""
        return self.train_data.last_batch

    def without_test_data(self) -> Plan:
        return dataclasses.replace(self, test_data=None)

    def logs(self, step: int) -> bool:
        """Whether step `step` (counted from 0) is one `log_every` logs."""
        every = self.config.log_every
        return bool(every) and step % every == 0

    def acts_after(self, step: int) -> bool:
        """Whether tfdp's hooks act after step `step` (counted from 0): a logged step, a
        checkpoint or an evaluation is due; such a step ends its compiled call."""
        config, done = self.config, step + 1
        return (
            self.logs(step)
            or bool(config.model_dir and done % config.checkpoint_every == 0)
            or bool(config.eval_every and done % config.eval_every == 0)
        )

    def partial(self, step: int) -> bool:
        """Whether step `step` reads a pass's last batch, with fewer examples."""
        per_pass = self.batches_per_pass
        if per_pass in (None, math.inf):
            return False
        return step % per_pass == per_pass - 1 and self.last_batch < self.config.batch_size

    def examples_in(self, first: int, end: int) -> int:
        """Examples in steps first..end-1: a step is a pass's last when the next is a
        multiple of the batches per pass."""
        batch, per_pass = self.config.batch_size, self.batches_per_pass
        if per_pass in (None, math.inf):
            return (end - first) * batch
        last = self.last_batch
        return (end - first) * batch - (end // per_pass - first // per_pass) * (batch - last)


def default_devices(mode: str, available: list[str]) -> str:
    """single: the first GPU, else the CPU. Other modes: all (see parse_devices): every GPU,
    else every CPU, so that a GPU is device 0 wherever there is one."""
    if mode == "single":
        gpus = [d for d in available if ":GPU:" in d]
        return short_name((gpus or available)[0])
    return "all"


def partition(config: Config, devices: list[str]) -> list[int]:
    """Examples per device for the config's mode: of the global batch, or, where the
    devices' caps (`--max_rows`) hold less, of one micro-step (`micro_steps`)."""
    n, batch = len(devices), config.batch_size
    if config.mode == "single" and n != 1:
        raise ConfigError("devices", config.devices, f"mode single runs on one device, got {n}")
    caps = given_max_rows(config.max_rows, len(devices))
    if caps is not None and micro_steps(batch, caps) > 1:
        if config.simulate_slowdown:
            raise ConfigError(
                "simulate_slowdown", config.simulate_slowdown,
                f"sleeps per example of one step, not of micro-steps: give a batch within "
                f"max_rows={list(caps)} ({sum(caps)} examples)",
            )
        batch = micro_step_rows(batch, caps)
    if config.max_rows == AUTO and config.mode == "multiworker":
        raise ConfigError(
            "max_rows", AUTO, "is measured on one machine's devices: give each worker's cap"
        )
    if config.mode == "mirrored" and config.max_rows and config.mirrored_input != "split":
        raise ConfigError(
            "max_rows", AUTO if caps is None else list(caps),
            "cuts each batch on the host: give --mirrored_input=split (the dataset's own cut is even)",
        )
    if config.mode == "mirrored" and config.mirrored_input == "split":
        return split_batch(batch, (1.0,) * n, few=True, max_rows=caps)
    if config.mode == "mirrored":
        return even_split(batch, n)
    # auto powers start from an even split; the measurement replaces it (see balance/balancers.py).
    powers = (1.0,) * n if config.powers in ((), AUTO) else config.powers
    if len(powers) != n:
        raise ConfigError(
            "powers",
            config.powers,
            f"has {len(powers)} values for {n} devices "
            f"({', '.join(short_name(d) for d in devices)})",
        )
    return split_batch(batch, powers, few=True, max_rows=caps)


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
    # a cluster's size is the platform's to choose (a requeue, a launcher's restart): one
    # worker has nothing to balance, and trains on
    if config.rebalance_every and len(devices) < 2 and config.mode != "multiworker":
        raise ConfigError(
            "rebalance_every", config.rebalance_every, "needs at least two devices to balance"
        )


def multiworker_devices(config: Config) -> list[str]:
    """The workers of the cluster stand for the devices: one batch share each."""
    from tfdp.cluster.spec import find_cluster

    if config.devices:
        raise ConfigError(
            "devices",
            config.devices,
            "mode multiworker uses each worker's own devices (its GPUs, else one CPU replica)",
        )
    return list(find_cluster(config).workers)


def model_for(config: Config, model=None):
    """The run's model: `model` (a compiled Keras model or a function returning one), else
    the config's: a built-in name or MODULE:FUNCTION."""
    if model is not None:
        return models.the_model(model, precision=config.precision)
    if config.model in MODELS:
        return models.built_in(config)
    function = sources.load_function(config.model, "model")
    return models.the_model(function, "model", config.model, config.precision)


def prepare(config: Config, model=None, inputs: Inputs | None = None) -> Plan:
    """Validates the config against this machine, makes the data's streams and builds
    the model once on the host; writes nothing.

    model, inputs: a library caller's own (see `tfdp.fit`; `inputs.of_fit`); None:
    the config's (`model`, `dataset`).
    """
    check_model_dir(config)
    if config.mode == "multiworker":
        devices = multiworker_devices(config)
    else:
        available = available_devices()
        devices = parse_devices(
            config.devices or default_devices(config.mode, available), available
        )
    partition(with_batch_size(config), devices)  # bad powers fail before data is read
    check_balancing(config, devices)
    if config.mode == "multiworker":
        from tfdp.engine.cluster_strategy import join_cluster

        join_cluster(config)  # before any other TensorFlow op; waits for every worker
    inputs = inputs or data_inputs.of_dataset(config)
    train_data, test_data = inputs.streams(config)
    batch_from = None
    if config.batch_size is None and train_data.source != "arrays":
        batch_from = f"the {train_data.source}'s batches"
    config = dataclasses.replace(config, batch_size=train_data.batch_size)
    check_model_dir(config)  # now with the batch size the data gave
    shards = partition(config, devices)
    model = model_for(config, model)
    # Keras builds on the first batch's shapes (its errors name them)
    models.build_on(model, train_data.first_examples(config.batch_size), inputs.field)
    if test_data is not None:
        models.check_fits(model, test_data.first_examples(2), inputs.validation_field)
    per_pass = train_data.batches or (math.inf if train_data.endless else None)
    if per_pass == math.inf and not config.steps_per_epoch and config.iterations is None:
        named = inputs.field == "dataset"
        raise ConfigError(
            inputs.field,
            inputs.value if named else train_data.source,
            f"{'train data, a ' + train_data.source + ', ' if named else ''}"
            "is infinite: give steps_per_epoch, as Keras fit needs",
        )
    schedule = Schedule(
        per_pass,
        config.steps_per_epoch,
        max(1, int(getattr(model, "steps_per_execution", 1) or 1)),
        config.initial_epoch,
        config.epochs,
        config.iterations
        if config.iterations is not None or config.epochs is not None
        else DEFAULT_ITERATIONS,
    )
    return Plan(
        config,
        devices,
        shards,
        model,
        getattr(model, "name", None) or type(model).__name__,
        train_data,
        test_data,
        schedule,
        batch_from,
    )


def with_batch_size(config: Config) -> Config:
    """The config with a batch size to check the partition against before the data is
    read: the one given, else the command's default."""
    if config.batch_size is not None:
        return config
    return dataclasses.replace(config, batch_size=DEFAULT_BATCH_SIZE)
