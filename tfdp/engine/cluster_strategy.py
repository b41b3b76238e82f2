"""tfdp.MultiWorkerMirroredStrategy, and joining this process's cluster with it.

Every worker of a cluster (`spec.find_cluster`: TF_CONFIG, or a Slurm step)
makes one `tfdp.MultiWorkerMirroredStrategy`: TensorFlow's, with the uneven shares
of `tfdp.MirroredStrategy` (strategy.py). `join_cluster` makes it once per process,
for mode multiworker and for a script's own `tfdp.fit`.
"""

from __future__ import annotations

import tensorflow as tf

from tfdp.cluster.spec import TF_CONFIG, find_cluster, mark_joined
from tfdp.config import Config
from tfdp.engine.strategy import UnevenShares
from tfdp.errors import ConfigError


class MultiWorkerMirroredStrategy(UnevenShares, tf.distribute.MultiWorkerMirroredStrategy):
    """TensorFlow's MultiWorkerMirroredStrategy with uneven shares: every worker reads the
    global batches (the same data on every worker, not sharded) and keeps its replicas'
    pieces of each, so plain `model.fit` on each worker makes one device's update.

    Args:
      powers: one relative speed per replica, in worker order (one per worker on CPU-only
        workers); "auto" or None as in `tfdp.MirroredStrategy`.
      cluster: where the cluster comes from: "auto", "tf_config" or "slurm" (as `tfdp
        --cluster`); TF_CONFIG is set from Slurm's variables where needed.
      communication_options: as TensorFlow's.
      max_rows: the most examples each worker takes in one step, one per worker (shared
        evenly by a worker's replicas); as in `tfdp.MirroredStrategy`.
      rebalance_every, measure_steps, simulate_slowdown, batch_statistics: as in
        `tfdp.MirroredStrategy`.
    """

    def __init__(
        self,
        powers=None,
        *,
        cluster="auto",
        communication_options=None,
        rebalance_every=None,
        measure_steps=5,
        simulate_slowdown=None,
        batch_statistics="whole",
        max_rows=None,
        **settings,
    ):
        find_cluster(Config(mode="multiworker", cluster=cluster, **settings))
        super().__init__(communication_options=communication_options)
        self._set_up_shares(powers, rebalance_every, measure_steps, simulate_slowdown,
                            batch_statistics, max_rows)


_strategy = None
_joined_with = None  # the (collective, collective_timeout) the strategy was made with


def join_cluster(config=None, **settings):
    """This process's `tfdp.MultiWorkerMirroredStrategy` (even shares), made once per process.

    It must come before any other TensorFlow op: it starts this worker's
    server and waits until every worker of TF_CONFIG has started. A script
    that builds its model before `tfdp.fit(..., mode="multiworker")` calls
    `tfdp.join_cluster()` first, as a Keras script makes its
    MultiWorkerMirroredStrategy first (settings: `cluster`, `slurm_port_base`,
    `collective`, `collective_timeout`, as in `tfdp.Config`).
    """
    global _strategy, _joined_with
    if config is None:
        config = Config(mode="multiworker", **settings)
    joined = ("cluster", "slurm_port_base", "collective", "collective_timeout")
    wanted = {field: getattr(config, field) for field in joined}
    if _strategy is not None and wanted != _joined_with:
        field = next(f for f in joined if wanted[f] != _joined_with[f])
        held = ", ".join(f"{f}={v}" for f, v in _joined_with.items())
        raise ConfigError(
            field,
            getattr(config, field),
            f"differs from the cluster this process joined with {held}",
        )
    if _strategy is None:
        cluster = find_cluster(config)
        implementation = getattr(
            tf.distribute.experimental.CommunicationImplementation, config.collective.upper()
        )
        options = tf.distribute.experimental.CommunicationOptions(
            implementation=implementation, timeout_seconds=config.collective_timeout or None
        )
        try:
            _strategy = MultiWorkerMirroredStrategy(
                communication_options=options,
                cluster=config.cluster,
                slurm_port_base=config.slurm_port_base,
            )
        except RuntimeError as error:
            if "must be configured at program startup" not in str(error):
                raise
            raise ConfigError(
                "mode",
                "multiworker",
                "joins the cluster before any other TensorFlow op: call tfdp.join_cluster() "
                "before building the model",
            ) from None
        except tf.errors.UnknownError as error:
            if "Could not start gRPC server" not in str(error):
                raise
            address = cluster.addresses[cluster.index]
            field, value = (
                ("slurm_port_base", config.slurm_port_base)
                if cluster.source == "slurm"
                else (TF_CONFIG, address)
            )
            raise ConfigError(
                field,
                value,
                f"Could not start gRPC server on {address} for {cluster.task}: "
                "the port is in use by another process; give a free port",
            ) from None
        _joined_with = wanted
        mark_joined()
    return _strategy
