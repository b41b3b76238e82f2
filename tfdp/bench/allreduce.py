"""What one all-reduce of LeNet's gradients costs between workers on this machine.

    python -m tfdp.bench.allreduce [--workers=2] [--steps=50] [--collective=auto]
                                   [--separate=true: one all-reduce per tensor]

starts the workers on loopback (one process each, as tfdp-launch does), and
each sums tensors of LeNet's gradient shapes over the cluster with
MultiWorkerMirroredStrategy, `--steps` times after a warm-up, with no
forward or backward pass. It prints one JSON line: the milliseconds per
all-reduce (median of 5 timed blocks) and the bytes each worker contributes.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time


def worker(steps: int, collective: str, separate: bool = False) -> dict:
    import tensorflow as tf

    implementation = getattr(
        tf.distribute.experimental.CommunicationImplementation, collective.upper()
    )
    strategy = tf.distribute.MultiWorkerMirroredStrategy(
        communication_options=tf.distribute.experimental.CommunicationOptions(
            implementation=implementation
        )
    )
    from tfdp.models import initial_weights

    shapes = [w.shape for w in initial_weights("lenet")]
    with strategy.scope():
        gradients = [tf.Variable(tf.ones(shape)) for shape in shapes]

    @tf.function
    def all_reduce():
        def replica():
            context = tf.distribute.get_replica_context()
            if separate:  # one collective per tensor
                return [context.all_reduce("SUM", g.read_value()) for g in gradients]
            return context.all_reduce("SUM", [g.read_value() for g in gradients])

        summed = strategy.run(replica)
        return tf.add_n([tf.reduce_sum(strategy.experimental_local_results(s)[0]) for s in summed])

    for _ in range(5):  # tracing and warm-up
        all_reduce().numpy()
    blocks = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(steps):
            all_reduce().numpy()
        blocks.append((time.perf_counter() - start) / steps * 1e3)
    return {
        "milliseconds_per_all_reduce": statistics.median(blocks),
        "blocks_ms": blocks,
        "bytes_per_worker": sum(4 * int(tf.reduce_prod(s)) for s in shapes),
        "collective": collective,
        "separate": separate,
    }


def main(argv: list[str]) -> None:
    options = dict(arg[2:].split("=", 1) for arg in argv if arg.startswith("--"))
    steps, collective = int(options.get("steps", 50)), options.get("collective", "auto")
    if "TF_CONFIG" in os.environ:
        separate = options.get("separate", "false").lower() in ("1", "true")
        print(json.dumps(worker(steps, collective, separate)))
        return
    from tfdp.cluster.workers import free_ports, tf_configs

    command = [sys.executable, "-m", "tfdp.bench.allreduce", *argv]
    processes = [
        subprocess.Popen(
            command,
            env=dict(os.environ, TF_CONFIG=tf_config, TF_CPP_MIN_LOG_LEVEL="2"),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tf_config in tf_configs(free_ports(int(options.get("workers", 2))))
    ]
    outputs = [p.communicate(timeout=600) for p in processes]
    for process, (_, stderr) in zip(processes, outputs):
        if process.returncode != 0:
            sys.exit(f"a worker failed:\n{stderr[-2000:]}")
    print(outputs[0][0].strip().splitlines()[-1])


if __name__ == "__main__":
    main(sys.argv[1:])
