"""`python -m tfdp.bench_steps`: each variant runs and reports (speed is never asserted)."""

import json
import subprocess
import sys

import pytest


def bench_steps(variant, mnist_dir):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdp.bench_steps",
            f"--variant={variant}",
            "--iterations=10",
            "--warmup=1",
            f"--mnist_dir={mnist_dir}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.mark.parametrize("variant", ["clocks", "loop10"])
def test_variant_reports_its_speed(variant, mnist_dir):
    process = bench_steps(variant, mnist_dir)
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["variant"] == variant and result["images_per_second"] > 0
    assert isinstance(result["onednn"], bool)


def test_xla_on_the_whole_step_is_refused_by_tensorflow(mnist_dir):
    # BUILD_NOTES says so: the step reads its batch from the iterator inside tf.function.
    process = bench_steps("xla", mnist_dir)
    assert process.returncode != 0
    assert "IteratorGetNext" in process.stderr


def test_profile_reports_time_per_kernel(mnist_dir, tmp_path):
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdp.bench_steps",
            "--variant=bare",
            "--iterations=3",
            "--warmup=1",
            f"--mnist_dir={mnist_dir}",
            f"--profile_dir={tmp_path}",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    kernels = json.loads(process.stdout.strip().splitlines()[-1])["kernel_ms_per_step"]
    assert any("Conv2D" in name for name in kernels), kernels
    assert all(ms > 0 for ms in kernels.values())
    assert list(tmp_path.rglob("*.xplane.pb"))  # the trace stays for TensorBoard
