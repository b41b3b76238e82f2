"""`tfdp-bench --suite=gpu`: tfdp on GPUs, each row beside Keras `fit` on the same devices.

    tfdp-bench --suite=gpu --mnist_dir=DIR --json=bench_gpu.jsonl

Rows (LeNet, the tutorial's batch and iterations, interleaved rounds, as the
scaling table measures them):

  tfdp single                  gpu:0
  keras fit                    gpu:0, no strategy (what OneDeviceStrategy runs)
  tfdp mirrored xN             every GPU (with 2 or more)
  keras fit mirrored xN        MirroredStrategy over every GPU
  tfdp weighted gpu+cpu auto   gpu:0,cpu:0 with --powers=auto (the GPU first: it sums
                               the gradients)
  keras fit mirrored gpu+cpu   MirroredStrategy over gpu:0 and cpu:0: Keras has no
                               weighted split, so it splits each batch evenly

On a machine without GPUs the same code runs on logical CPUs as a smoke test:
2 logical CPUs stand in for 2 GPUs and a third for the CPU (`stand_in`). The
header and every JSON record say so (`stand_in`), and the figures are then
only the overhead of the code paths, not a GPU's speed.
"""

from __future__ import annotations

from tfdp.bench.spec import Spec

STAND_IN_GPUS = 2  # without GPUs: logical CPUs standing for this many GPUs


def stand_in(gpus: int = STAND_IN_GPUS) -> dict:
    """The logical CPUs that stand for `gpus` GPUs and the CPU: GPU:i is CPU:i, and the
    CPU is the next logical CPU."""
    devices = {f"GPU:{i}": f"CPU:{i}" for i in range(gpus)}
    devices["CPU:0"] = f"CPU:{gpus}"
    return {"logical_cpus": gpus + 1, "devices": devices}


def gpu_configurations(gpus: int) -> list[Spec]:
    """The rows for a machine with `gpus` GPUs (the mirrored pair needs 2 or more)."""
    one, pair = ("GPU:0",), ("GPU:0", "CPU:0")
    every = tuple(f"GPU:{i}" for i in range(gpus))
    specs = [
        Spec("matmul peak", "matmul", "matmul", 1),
        Spec("tfdp single", "tfdp", "single", 1, device_list=one),
        Spec("keras fit", "keras", "fit", 1, device_list=one, onednn="tensorflow"),
    ]
    if gpus > 1:
        specs += [
            Spec(f"tfdp mirrored x{gpus}", "tfdp", "mirrored", gpus, device_list=every),
            Spec(
                f"keras fit mirrored x{gpus}",
                "keras",
                "fit",
                gpus,
                device_list=every,
                onednn="tensorflow",
            ),
        ]
    specs += [
        Spec("tfdp weighted gpu+cpu auto", "tfdp", "weighted", 2, "auto", device_list=pair),
        Spec(
            "keras fit mirrored gpu+cpu", "keras", "fit", 2, device_list=pair, onednn="tensorflow"
        ),
    ]
    return specs


def header(job: dict, gpus: int) -> str:
    """What the devices are, for the line above the table."""
    if not job.get("stand_in"):
        return f"{gpus} GPU(s) and the CPU"
    devices = job["stand_in"]["devices"]
    return "STAND-IN, no GPU here: logical CPUs " + ", ".join(
        f"{cpu} for {name}" for name, cpu in devices.items()
    )
