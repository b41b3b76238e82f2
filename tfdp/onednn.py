"""oneDNN's CPU kernels: on by default in tfdp, on every x86-64 CPU.

TensorFlow turns its oneDNN kernels on by default only on x86 CPUs with
AVX-512-class features; elsewhere, AVX2 machines such as AMD EPYCs among them,
it leaves them off unless `TF_ENABLE_ONEDNN_OPTS=1` is set. With them, LeNet
trains about 1.8x faster on such a CPU (BUILD_NOTES, "oneDNN").

TensorFlow reads the variable once, when its runtime loads, so tfdp's entry
points set it before TensorFlow is imported: the `tfdp` command (and so every
worker `tfdp-launch` starts) and `tfdp-bench`. `import tfdp` changes nothing;
a library user who wants the kernels calls `enable_by_default()` before
TensorFlow is first imported (or sets `TF_ENABLE_ONEDNN_OPTS=1`):
  - a value the user set (`TF_ENABLE_ONEDNN_OPTS=0` turns the kernels off) is
    left as it is;
  - `TFDP_ONEDNN=tensorflow` keeps TensorFlow's own default (tfdp-bench's
    Keras baseline runs that way: what a TensorFlow user gets out of the box);
  - if TensorFlow was imported before tfdp, nothing can change any more.
Every run records whether the kernels were on (`onednn` in result.json).
"""

from __future__ import annotations

import os
import platform
import sys

VARIABLE = "TF_ENABLE_ONEDNN_OPTS"
MARK = "TFDP_ONEDNN"  # "on": tfdp set VARIABLE (child processes inherit both)
KEEP_TENSORFLOW_DEFAULT = (MARK, "tensorflow")
# The user's own value, if any: not one that a parent tfdp process set.
USER_VALUE = None if os.environ.get(MARK) == "on" else os.environ.get(VARIABLE)


def tensorflow_default_env(environ) -> dict:
    """`environ` for a child process that should run with TensorFlow's own default."""
    env = {**environ, MARK: "tensorflow"}
    if USER_VALUE is None:
        env.pop(VARIABLE, None)
    return env


def enable_by_default() -> None:
    """Sets TF_ENABLE_ONEDNN_OPTS=1 on x86-64, unless the user chose otherwise."""
    name, value = KEEP_TENSORFLOW_DEFAULT
    if (
        VARIABLE in os.environ
        or os.environ.get(name) == value
        or "tensorflow" in sys.modules
        or platform.machine().lower() not in ("x86_64", "amd64")
    ):
        return
    os.environ[VARIABLE] = "1"
    os.environ[MARK] = "on"


def enabled() -> bool | None:
    """Whether this process's TensorFlow runs its oneDNN kernels (None: unknown)."""
    from tfdp import internals

    return internals.onednn_enabled()
