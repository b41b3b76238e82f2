"""What every worker must hold the same before training, and the error that names a difference.

Before training, the workers agree (`exchange.Cluster.agree`): each exchanges a digest of
every setting that fixes the update or the steps that run collectives, of the initial
weights and of the training data (`Agreed`, `first_difference`). Workers started with
different flags or files would otherwise train wrong, or hang.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json

from tfdp.config import Config
from tfdp.errors import ConfigError

# Settings a worker keeps to itself. Every other field of Config must be the same on
# every worker: it fixes the update, the batches, or on which steps the workers run
# collectives (log_every: the metrics' all-gather; checkpoint_every: saving;
# eval_every: reading the variables); model_dir because every worker restores from it.
LOCAL_FIELDS = (
    "progress",  # a line on this worker's terminal
    "data_dir",  # where this worker finds the data; the data itself is compared
    "mnist_dir",
    "keep_checkpoints",  # only the chief keeps checkpoints
    "collective_timeout",  # how long this worker waits for the others
)
AGREED_FIELDS = tuple(f.name for f in dataclasses.fields(Config) if f.name not in LOCAL_FIELDS)


@dataclasses.dataclass(frozen=True)
class Agreed:
    """One thing every worker must hold the same, and how an error names it.

    Attributes:
        field, value: the setting that gives it, as the error names it.
        text: what this worker holds, as the error shows it; its digest is compared.
        differs: the error's words for the difference.
        needs: the error's words for the cure.
    """

    field: str
    value: object
    text: str
    differs: str = "differs between workers"
    needs: str = "every worker needs the same settings"


def digest(text: str) -> int:
    """A 48-bit hash of `text`, the same in every process (float64 holds it exactly)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=6).digest(), "big")


def arrays_digest(arrays) -> str:
    """A hex digest of numpy arrays: their dtypes, shapes and bytes (of a spec, where a
    pipeline decides shapes as it reads: the spec)."""
    import numpy as np

    hashed = hashlib.blake2b(digest_size=6)
    for array in arrays:
        if array is None or type(array).__name__.endswith("Spec"):  # an input left out;
            hashed.update(f"{array!r};".encode())  # tf.TensorSpec, tf.RaggedTensorSpec, ...
            continue
        array = np.ascontiguousarray(array)
        hashed.update(f"{array.dtype.str}{array.shape};".encode())
        hashed.update(memoryview(array).cast("B"))
    return hashed.hexdigest()


def settings_to_agree(config: Config) -> list[Agreed]:
    """The config's settings that every worker must share (AGREED_FIELDS)."""
    return [
        Agreed(field, getattr(config, field), json.dumps(getattr(config, field)))
        for field in AGREED_FIELDS
    ]


def first_difference(digests) -> int | None:
    """The first column of `digests` (one row per worker) whose workers disagree."""
    columns = list(zip(*digests))
    return next((i for i, column in enumerate(columns) if len(set(column)) > 1), None)


def disagreement(agreed: Agreed, workers, texts) -> ConfigError:
    """The error for `agreed`, which differs between `workers`: each one's `texts`."""
    held = ", ".join(f"{worker} {text}" for worker, text in zip(workers, texts))
    return ConfigError(agreed.field, agreed.value, f"{agreed.differs} ({held}); {agreed.needs}")
