"""What one row of a benchmark measures (the table's, the GPU, cluster and streaming
suites'), and the devices it runs on."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Spec:
    """One configuration to measure."""

    name: str
    system: str  # tfdp | keras | matmul
    mode: str  # single | mirrored | weighted | multiworker | fit
    devices: int  # multiworker: workers
    powers: tuple[float, ...] = ()
    # oneDNN's CPU kernels (onednn.py): "tfdp" on, as tfdp runs; "tensorflow", TF's own default.
    onednn: str = "tfdp"
    jit_compile: bool = False  # tfdp's --jit_compile
    precision: str = "float32"  # tfdp's --precision
    # the devices by name (suite gpu), e.g. ("GPU:0", "CPU:0"); (): `devices` of the job's kind
    device_list: tuple[str, ...] = ()
    rebalance_every: int = 0  # tfdp's --rebalance_every
    slowdown: str = ""  # tfdp's --simulate_slowdown
    intra_op_threads: int = 0  # multiworker: each worker's --intra_op_threads (0: TF's default)
    micro_steps: int = 1  # each update in this many micro-steps (--max_rows of the batch / k)


def device_names(kind: str, n: int) -> list[str]:
    """A row's n devices of `kind` ("cpu": logical CPUs, set up here, before TensorFlow
    starts; else GPUs)."""
    import tfdp

    if kind == "cpu":
        tfdp.configure_logical_devices(logical_cpus=n)
        return [f"/device:CPU:{i}" for i in range(n)]
    return [f"/device:GPU:{i}" for i in range(n)]
