"""One trainer per mode, behind one interface (`base.Trainer`).

single       WeightedTrainer on one device: no split, no copies
mirrored     MirroredTrainer: tf.distribute.MirroredStrategy, near-equal shards
weighted     WeightedTrainer (--reduce=device0, the tutorial) or
             MirroredTrainer with uneven shards (--reduce=allreduce)
multiworker  MultiWorkerTrainer: one process per worker of TF_CONFIG
"""

from __future__ import annotations

import os

from tfdp.config import MODELS
from tfdp.devices import AUTO, default_chains
from tfdp.trainers.base import Trainer

__all__ = ["Trainer", "build_trainer"]


def build_trainer(config, devices: list[str], shards: list[int], spec=None) -> Trainer:
    """The mode's trainer, with every model copy starting from the spec's weights.

    spec: the model (`models.ModelSpec`); None: the config's built-in model.
    """
    from tfdp.models import built_in_spec

    spec = spec or built_in_spec(config)
    if config.mode == "multiworker":
        from tfdp.trainers import multiworker

        return multiworker.build(config, shards, spec)
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
        if config.model in MODELS and not spec.batch_statistics
        else 1
    )
    if config.mode == "mirrored":
        return MirroredTrainer(
            spec,
            devices,
            config.batch_size,
            all_reduce=config.all_reduce,
            input=config.mirrored_input,
            slowdown=slowdown,
            chains=chains,
            timed=timed,
        )
    if config.reduce == "allreduce":  # weighted shards, MirroredStrategy replicas
        return MirroredTrainer(
            spec,
            devices,
            config.batch_size,
            all_reduce=config.all_reduce,
            shards=shards,
            slowdown=slowdown,
            chains=chains,
            timed=timed,
        )
    return WeightedTrainer(
        spec,
        devices,
        shards,
        slowdown=slowdown,
        chains=chains,
        timed=timed,
        balanced=config.mode == "weighted",
    )
