"""tfdp: data-parallel training in TensorFlow, from the MXNet multi-device tutorial.

    import tfdp
    tfdp.split_batch(100, [1, 5])          # [17, 83]
    history = tfdp.fit(model, x, y, batch_size=256, epochs=1, mode="weighted", powers="auto")
    strategy = tfdp.MirroredStrategy(["gpu:0", "cpu:0"], powers="auto")  # plain model.fit in its scope
    result = tfdp.train(tfdp.Config(mode="mirrored", devices="all"))   # the tutorial's runs

The modules that import TensorFlow load on first use, so `import tfdp` is quick,
and it leaves TensorFlow's settings as they are. The tfdp commands turn on
oneDNN's CPU kernels where TensorFlow leaves them off (AVX2 CPUs); a library
user does the same with `tfdp.onednn.enable_by_default()` before TensorFlow is
first imported (see onednn.py).
"""

import importlib
import os
import sys

from tfdp import internals

_problem = internals.check_versions(os.environ)
if _problem:
    if internals.is_tfdp_command(sys.argv, sys.orig_argv):  # one line, no traceback
        print(f"tfdp: error: {_problem}", file=sys.stderr)
        raise SystemExit(2)
    raise ImportError(_problem)

from tfdp.config import Config  # noqa: E402
from tfdp.devices import configure_logical_devices, split_batch  # noqa: E402
from tfdp.errors import ConfigError  # noqa: E402

_LAZY = {
    "fit": "tfdp.fitting",
    "join_cluster": "tfdp.engine.cluster_strategy",
    "train": "tfdp.run.training",
    "prepare": "tfdp.run.training",
    "run": "tfdp.run.training",
    "build_trainer": "tfdp.engine.modes",
    "Trainer": "tfdp.engine.trainer",
    "build_model": "tfdp.models",
    "lenet": "tfdp.models",
    "toy_mlp": "tfdp.models",
    "initial_weights": "tfdp.models",
    "load_mnist": "tfdp.data.mnist",
    "make_toy_data": "tfdp.data.mnist",
    "train_dataset": "tfdp.data.arrays",
    "MirroredStrategy": "tfdp.engine.strategy",
    "MultiWorkerMirroredStrategy": "tfdp.engine.cluster_strategy",
}

__all__ = ["Config", "ConfigError", "configure_logical_devices", "split_batch", *_LAZY]


def __getattr__(name):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tfdp' has no attribute {name!r}")
