"""One trainer per mode, behind one interface (`base.Trainer`).

single       WeightedTrainer on one device: no split, no copies
mirrored     MirroredTrainer: tf.distribute.MirroredStrategy, near-equal shards
weighted     WeightedTrainer (--reduce=device0, the tutorial) or
             MirroredTrainer with uneven shards (--reduce=allreduce; with XLA, whose
             programs read no weight of another device, reduced to device 0)
multiworker  MultiWorkerTrainer: one process per worker of TF_CONFIG
"""

from __future__ import annotations

import os

from tfdp.config import MODELS
from tfdp.devices import AUTO, default_chains
from tfdp.trainers.base import Trainer

__all__ = ["Trainer", "build_trainer"]


def build_trainer(
    config, devices: list[str], shards: list[int], model=None, smallest_batch: int | None = None
) -> Trainer:
    """The mode's trainer of `model` (a compiled, built Keras model, trained in place).

    model: None: the config's built-in model (`models.built_in`).
    smallest_batch: the fewest examples a global batch of the run may hold (an epoch's
      partial last batch); None: the config's batch size.
    """
    from tfdp import models

    model = model if model is not None else models.built_in(config, build=True)
    jit_compile = bool(config.jit_compile or model.jit_compile)
    if config.mode == "multiworker":
        from tfdp.trainers import multiworker

        return multiworker.build(config, shards, model, jit_compile)
    from tfdp.trainers.mirrored import MirroredTrainer
    from tfdp.trainers.weighted import WeightedTrainer

    slowdown = bool(config.simulate_slowdown)
    # The host clock in the step (a device-to-host sync on a GPU) only where it is read.
    timed = config.powers == AUTO or bool(config.rebalance_every) or slowdown
    # By default, only the built-in models are cut into chains: the threads per kernel
    # are chosen for them before TensorFlow starts (devices.default_intra_op_threads),
    # and chains would compute batch statistics on parts of a shard.
    chains = config.chains or (
        default_chains(devices, os.cpu_count() or 1)
        if config.model in MODELS and not models.has_batch_statistics(model)
        else 1
    )
    # A batch with fewer examples than devices leaves a device without any.
    smallest = config.batch_size if smallest_batch is None else smallest_batch
    may_be_empty = min(smallest, config.batch_size) < len(devices)
    common = dict(
        slowdown=slowdown, chains=chains, timed=timed, jit_compile=jit_compile,
        may_be_empty=may_be_empty,
    )
    if config.mode == "mirrored":
        return MirroredTrainer(
            model,
            devices,
            config.batch_size,
            all_reduce=config.all_reduce,
            input=config.mirrored_input,
            **common,
        )
    if config.reduce == "allreduce":  # weighted shards, MirroredStrategy replicas
        return MirroredTrainer(
            model,
            devices,
            config.batch_size,
            all_reduce=config.all_reduce,
            shards=shards,
            **common,
        )
    if jit_compile and len(devices) > 1:
        # XLA reads no variable of another device: each device keeps a replica, and
        # the gradients are summed on device 0 and sent back (the same update).
        return MirroredTrainer(
            model, devices, config.batch_size, all_reduce="reduce_to_one", shards=shards, **common
        )
    return WeightedTrainer(model, devices, shards, balanced=config.mode == "weighted", **common)
