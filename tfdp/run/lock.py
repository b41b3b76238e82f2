"""One run per model directory: an advisory lock held for the life of a run.

Two runs on one `model_dir` would resume from, overwrite and delete each
other's checkpoints. The first takes `model_dir/lock` with `fcntl.flock`;
a second is refused at once, with the holder the first wrote into the file.
The kernel drops the lock when the holder exits, however it exits, so a
killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import datetime
import fcntl
import os
import socket

from tfdp.errors import ConfigError

LOCK_FILE = "lock"


class ModelDirLock:
    """Holds `model_dir/lock` from `acquire` to `release` (or the end of the process)."""

    def __init__(self, model_dir: str):
        self.model_dir = model_dir
        self.path = os.path.join(model_dir, LOCK_FILE)
        self.handle = None

    def acquire(self) -> ModelDirLock:
        """Takes the lock, or raises ConfigError naming the directory and its holder."""
        os.makedirs(self.model_dir, exist_ok=True)
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise ConfigError(
                "model_dir",
                self.model_dir,
                f"is in use by another run ({holder}); wait for it to end or use another "
                "--model_dir",
            ) from None
        handle.seek(0)
        handle.truncate()
        started = datetime.datetime.now().isoformat(timespec="seconds")
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}, since {started}\n")
        handle.flush()
        self.handle = handle
        return self

    def release(self) -> None:
        if self.handle is not None:
            self.handle.close()  # closing the file drops the lock
            self.handle = None

    def __enter__(self) -> ModelDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()
