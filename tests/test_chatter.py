"""TensorFlow's C++ start-up chatter is dropped from a tfdp command's stderr, and
nothing else is: the lines below are the ones TensorFlow 2.21 writes here."""

import os

import pytest

from tfdp import chatter

CHATTER = [
    "WARNING: All log messages before absl::InitializeLog() is called are written to STDERR",
    "I0000 00:00:1796170412.845128   31083 port.cc:153] oneDNN custom operations are on. You "
    "may see slightly different numerical results due to floating-point round-off errors from "
    "different computation orders. To turn them off, set the environment variable "
    "`TF_ENABLE_ONEDNN_OPTS=0`.",
    "I0000 00:00:1796169991.144171   25501 cpu_feature_guard.cc:227] This TensorFlow binary is "
    "optimized to use available CPU instructions in performance-critical operations.",
    "To enable the following instructions: AVX2 FMA, in other operations, rebuild TensorFlow "
    "with the appropriate compiler flags.",
]
CUDA_PROBING = [
    "I0000 00:00:1796170412.849656   31083 cudart_stub.cc:31] Could not find cuda drivers on "
    "your machine, GPU will not be used.",
    "E0000 00:00:1796170420.125765   31083 cuda_platform.cc:52] failed call to cuInit: INTERNAL: "
    "CUDA error: Failed call to cuInit: UNKNOWN ERROR (303)",
]
REAL = [
    "W0000 00:00:1796170420.125765   31083 bfc_allocator.cc:291] Allocator (GPU_0_bfc) ran out "
    "of memory trying to allocate 2.1GiB",
    "E0000 00:00:1796170420.125765   31083 cuda_dnn.cc:535] Could not create cudnn handle",
    "tfdp: error: --batch_size=0: must be at least 1",
    "Traceback (most recent call last):",
]


@pytest.mark.parametrize("line", CHATTER + CUDA_PROBING)
def test_start_up_chatter_is_dropped_without_a_gpu_driver(line):
    assert chatter.is_chatter(line + "\n", chatter.chatter_pattern(gpu_driver=False))


@pytest.mark.parametrize("line", REAL)
def test_real_warnings_and_errors_are_kept(line):
    assert not chatter.is_chatter(line + "\n", chatter.chatter_pattern(gpu_driver=False))
    assert not chatter.is_chatter(line + "\n", chatter.chatter_pattern(gpu_driver=True))


@pytest.mark.parametrize("line", CUDA_PROBING)
def test_cuda_probing_is_kept_where_there_is_a_driver(line):
    """With an NVIDIA driver, a failed cuInit is news: it is shown."""
    assert not chatter.is_chatter(line + "\n", chatter.chatter_pattern(gpu_driver=True))


def test_the_filter_passes_every_other_line_in_order(capfd):
    lines = [CHATTER[0], REAL[0], CHATTER[1], REAL[2], CUDA_PROBING[1], REAL[3]]
    with chatter.filtered_stderr(enabled=True):
        for line in lines:
            os.write(2, (line + "\n").encode())
    kept = capfd.readouterr().err.splitlines()
    want = [REAL[0], REAL[2], REAL[3]]
    if chatter.has_nvidia_driver():
        want = [REAL[0], REAL[2], CUDA_PROBING[1], REAL[3]]
    assert kept == want


def test_a_user_log_level_keeps_tensorflows_output(capfd):
    with chatter.filtered_stderr(enabled=False):
        os.write(2, (CHATTER[0] + "\n").encode())
    assert capfd.readouterr().err == CHATTER[0] + "\n"
