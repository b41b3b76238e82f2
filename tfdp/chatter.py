"""TensorFlow's C++ start-up chatter, kept off a tfdp command's stderr.

Importing TensorFlow and listing its devices writes lines to file
descriptor 2 from C++, before absl's logging is set up, so
TF_CPP_MIN_LOG_LEVEL does not hide them: absl's notice that it is not set
up, the oneDNN notice, CUDA probing and, on a machine without an NVIDIA
driver, a `cuInit` error. `filtered_stderr` drops exactly those lines while
TensorFlow starts and passes every other line through, in order. A user who
sets TF_CPP_MIN_LOG_LEVEL keeps TensorFlow's output as it is.
"""

from __future__ import annotations

import contextlib
import glob
import os
import re
import threading

USER_LOG_LEVEL = "TF_CPP_MIN_LOG_LEVEL" in os.environ  # read before tfdp sets a default

ALWAYS = [
    r"WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR",
    r".*\bport\.cc:\d+\] oneDNN custom operations are on\b.*",
    r".*\bcpu_feature_guard\.cc:\d+\] This TensorFlow binary is optimized\b.*",
    r"To enable the following instructions: .*, in other operations, rebuild TensorFlow .*",
    r".*\bUnable to register (cuDNN|cuFFT|cuBLAS) factory\b.*",
    r".*\bcomputation placer already registered\b.*",
]
# CUDA probing: noise where there is no NVIDIA driver, news where there is one
WITHOUT_GPU = [
    r".*\bcudart_stub\.cc:\d+\] Could not find cuda drivers on your machine\b.*",
    r".*\bcuda_platform\.cc:\d+\] failed call to cuInit\b.*",
    r".*\bcuda_executor\.cc:\d+\] .*(CUDA_ERROR_NO_DEVICE|no NVIDIA GPU device).*",
]


def has_nvidia_driver() -> bool:
    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia")


def chatter_pattern(gpu_driver: bool) -> re.Pattern:
    lines = ALWAYS + ([] if gpu_driver else WITHOUT_GPU)
    return re.compile("|".join(f"(?:{line})" for line in lines))


def is_chatter(line: str, pattern: re.Pattern) -> bool:
    return pattern.fullmatch(line.rstrip("\r\n")) is not None


@contextlib.contextmanager
def filtered_stderr(enabled: bool | None = None):
    """Within the block, file descriptor 2 goes through a pipe that drops TensorFlow's
    start-up chatter (`is_chatter`). Enabled unless the user set TF_CPP_MIN_LOG_LEVEL."""
    if enabled is None:
        enabled = not USER_LOG_LEVEL
    if not enabled:
        yield
        return
    import sys

    pattern = chatter_pattern(has_nvidia_driver())
    sys.stderr.flush()
    saved = os.dup(2)
    read, write = os.pipe()
    os.dup2(write, 2)
    os.close(write)

    def forward():
        with os.fdopen(read, "rb") as pipe:
            for raw in pipe:
                if not is_chatter(raw.decode(errors="replace"), pattern):
                    os.write(saved, raw)

    thread = threading.Thread(target=forward, name="tfdp-stderr", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)  # closes the pipe's last write end: the thread drains it and ends
        thread.join()
        os.close(saved)
