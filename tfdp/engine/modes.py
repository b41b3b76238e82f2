"""Each mode is a strategy: the trainer (`trainer.Trainer`) of the run's mode and devices.

single       the model's own step on one device, as Keras runs it (one replica of
             tfdp.MirroredStrategy where the run times the device)
mirrored     the model's own step under tfdp.MirroredStrategy, even shares
weighted     ... of the run's uneven shares; the gradients summed on device 0 and
             sent back (--reduce=device0, the tutorial) or all-reduced
multiworker  MultiWorkerTrainer: the Trainer of one worker of TF_CONFIG, under
             tfdp.MultiWorkerMirroredStrategy
"""

from __future__ import annotations

import os

import tensorflow as tf

from tfdp.config import MODELS
from tfdp.devices import AUTO, default_chains, given_max_rows, micro_steps
from tfdp.engine.strategy import MirroredStrategy
from tfdp.engine.trainer import Trainer


def cross_device_ops_for(all_reduce: str, devices):
    """The cross-device ops for `all_reduce`; None lets MirroredStrategy choose.

    auto is MirroredStrategy's own choice: ring all-reduce with collective ops
    on CPUs, NCCL on GPUs, reduction to one device for a CPU+GPU mix.
    """
    if all_reduce == "reduce_to_one":
        return tf.distribute.ReductionToOneDevice(reduce_to_device=devices[0])
    if all_reduce == "nccl":
        return tf.distribute.NcclAllReduce()
    return None  # auto


def local_strategy(
    devices, shards, reduce="allreduce", all_reduce="auto", batch_statistics="whole"
) -> MirroredStrategy:
    """tfdp's strategy over `devices` of this machine, cutting batches by `shards`.

    reduce: "allreduce", or "device0" (the gradients summed on device 0 and sent back).
    all_reduce: with reduce="allreduce", see `cross_device_ops_for`.
    batch_statistics: what BatchNormalization normalizes by ("whole" or "replica").
    """
    cross_device_ops = None if reduce == "device0" else cross_device_ops_for(all_reduce, devices)
    # The shares cut a dataset (input "dataset"); a batch smaller than the devices
    # leaves a replica none, which even shares give too.
    powers = list(shards) if min(shards) > 0 else None
    return MirroredStrategy(
        list(devices), powers=powers, reduce=reduce, cross_device_ops=cross_device_ops,
        batch_statistics=batch_statistics,
    )


def build_trainer(config, devices: list[str], shards: list[int], model=None) -> Trainer:
    """The mode's trainer of `model` (a compiled, built Keras model, trained in place).

    model: None: the config's built-in model (`models.built_in`).
    """
    from tfdp import models

    model = model if model is not None else models.built_in(config, build=True)
    jit_compile = bool(config.jit_compile or model.jit_compile)
    caps = given_max_rows(config.max_rows, len(shards))
    steps = micro_steps(config.batch_size, caps)
    if config.mode == "multiworker":
        from tfdp.engine import multiworker

        return multiworker.build(config, shards, model, jit_compile, caps, steps)
    slowdown = bool(config.simulate_slowdown)
    # The host clock in the step (a device-to-host sync on a GPU) only where it is read.
    # (measured caps probe the devices as auto powers do)
    timed = AUTO in (config.powers, config.max_rows) or bool(config.rebalance_every) or slowdown
    # By default, only the built-in models are cut into chains: the threads per kernel
    # are chosen for them before TensorFlow starts (devices.default_intra_op_threads),
    # and chains would compute batch statistics on parts of a shard.
    chainable = config.model in MODELS and not models.has_batch_statistics(model)
    cores = os.cpu_count() or 1
    if len(devices) > 1:
        even = config.mode == "mirrored"
        # a device may get no rows: auto powers may leave it out, or its cap is 0
        leaving = (config.powers == AUTO and not even) or bool(caps and 0 in caps)
        # one device left with rows runs as mode single runs it
        alone = min(default_chains([d], cores) for d in devices) if leaving and chainable else 1
        strategy = local_strategy(
            devices, shards, "allreduce" if even else config.reduce, config.all_reduce,
            config.batch_statistics,
        )
        return Trainer(
            model,
            strategy,
            devices,
            shards,
            input=config.mirrored_input if even else "split",
            balanced=not even,
            slowdown=slowdown,
            timed=timed,
            jit_compile=jit_compile,
            max_rows=caps,
            micro_steps=steps,
            chains=alone,
            may_leave_out=leaving,
        )
    chains = config.chains or (default_chains(devices, cores) if chainable else 1)
    # No strategy: Keras' own step on the device, as model.fit runs it; one replica of
    # tfdp's strategy where the run times the device (a simulated slowdown, auto powers).
    strategy = local_strategy(devices, shards) if timed else None
    return Trainer(
        model, strategy, devices, shards, slowdown=slowdown, timed=timed,
        jit_compile=jit_compile, chains=chains, max_rows=caps, micro_steps=steps,
    )

