"""Files of a run written whole or not at all, and the one error that names them.

Every regular file tfdp writes is whole or absent (a temporary file renamed over it),
is created like open() creates one (0666 less the umask), and a write that fails raises
StorageError naming the file. What is not a regular file (this process's stdout, a FIFO,
a device) is written through, never replaced.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import sys


class StorageError(OSError):
    """A file of the run could not be written: disk full, no permission, read-only.

    `path` names the file (or the checkpoint); the message is one line.
    """

    def __init__(self, path: str, reason: str):
        self.path = path
        self.reason = reason
        super().__init__(f"could not write {path}: {reason}")


def reason(error: BaseException) -> str:
    """One line for an OSError or a TensorFlow error, without the temporary file's name."""
    if isinstance(error, OSError) and error.strerror:
        return f"[Errno {error.errno}] {error.strerror}"
    message = getattr(error, "message", None) or str(error) or type(error).__name__
    message = message.split("}} ")[-1]  # TensorFlow's "{{function_node ...}}" prefix
    return (message.strip().splitlines() or [""])[0]


def _own_stream(path: str):
    """sys.stdout or sys.stderr if `path` is that stream's file (/dev/stdout), else None."""
    try:
        status = os.stat(path)
    except OSError:
        return None
    for stream in (sys.stdout, sys.stderr):
        try:
            if os.path.samestat(status, os.fstat(stream.fileno())):
                return stream
        except (AttributeError, OSError, ValueError):  # closed, or no file behind it
            continue
    return None


def _is_special(path: str) -> bool:
    """Whether `path` exists and is not a regular file (a FIFO, a device, a directory)."""
    try:
        return not stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False


@contextlib.contextmanager
def replacing(path: str):
    """Yields a temporary path beside the file `path` names; renames it over that file
    when the block succeeds, and removes it when the block fails.

    Through a symlink, the file it points to is replaced and the link stays.
    An OSError becomes a StorageError naming `path`.
    """
    target = os.path.realpath(path)
    directory, name = os.path.split(target)
    temporary = os.path.join(directory, f".tmp-{secrets.token_hex(4)}-{name}")
    try:
        yield temporary
        os.replace(temporary, target)
    except BaseException as error:
        with contextlib.suppress(OSError):
            os.remove(temporary)
        if isinstance(error, OSError) and not isinstance(error, StorageError):
            raise StorageError(path, reason(error)) from None
        raise


def write_atomically(path: str, text: str) -> None:
    """Writes `text` to `path`: a regular file whole or not at all, even if the
    process is killed (a temporary file, renamed over it).

    What is not a regular file is written through, never replaced: this
    process's stdout or stderr (--result_json=/dev/stdout prints), a FIFO or a
    device. The file is created like open() creates one: 0666 less the umask.
    """
    stream = _own_stream(path)
    try:
        if stream is not None:
            stream.write(text)
            stream.flush()
            return
        if _is_special(path):
            with open(path, "w") as f:
                f.write(text)
            return
    except OSError as error:
        raise StorageError(path, reason(error)) from None
    with replacing(path) as temporary:
        handle = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        with os.fdopen(handle, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())


def export_model(model, path: str) -> None:
    """Writes `model` (its structure, trained weights and compile settings) to `path`
    (.keras), atomically; `keras.models.load_model` reads it back.

    A .keras file is a zip archive that is only whole at its end: a path that
    is not a regular file (a FIFO, a device) is refused, never replaced.
    """
    if _is_special(path):
        raise StorageError(path, "it is not a regular file, and a model is written whole")
    with replacing(path) as temporary:  # the name ends in .keras, as Keras requires
        model.save(temporary)


def listdir(directory: str) -> list[str]:
    try:
        return os.listdir(directory)
    except FileNotFoundError:
        return []


def remove(path: str) -> None:
    """Removes a file or a directory tree, if it is still there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)
