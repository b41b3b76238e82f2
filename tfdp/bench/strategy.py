"""`python -m tfdp.bench.strategy`: plain `model.fit` under tfdp.MirroredStrategy beside
TensorFlow's MirroredStrategy, on 2 logical CPUs.

    python -m tfdp.bench.strategy --workload=lenet --rounds=5 --json=docs/bench_strategy.jsonl
    python -m tfdp.bench.strategy --workload=cnn --rounds=5 --json=docs/bench_strategy.jsonl

Rows, each in a process of its own, in interleaved rounds A B C D A B C D ...:

  tf mirrored x2            tf.distribute.MirroredStrategy(["cpu:0", "cpu:1"])
  tfdp even x2              tfdp.MirroredStrategy(["cpu:0", "cpu:1"]) (powers=None)
  tfdp even x2, replica statistics   the same with batch_statistics="replica":
                            BatchNormalization by each replica's piece, as TensorFlow's
                            (the row above: by the whole batch, one all-reduce per layer)
  tfdp even x2, slow cpu:1  the same, with replica 1 made 4x slower (simulate_slowdown)
  tfdp 4:1 x2, slow cpu:1   powers=[4, 1] with replica 1 made 4x slower: the split the
                            slowdown asks for, given (set after step 2: the slowdown is
                            calibrated on that step's even split in every slow row)
  tfdp auto x2, slow cpu:1  powers="auto" with replica 1 made 4x slower

The model is built and compiled in the strategy's scope and trained by `model.fit`, nothing
else changed. Workloads: `lenet` (the tutorial's LeNet-5 on random MNIST-shaped images,
global batch 1024, from memory through tf.data) and `cnn` (tfdp-bench's streamed small
ResNet: TFRecord files read, parsed and augmented as they are consumed, batch 256). A
callback reads each batch's loss and stamps the time; the rate is the images of the
`--steps` timed steps over their seconds, after `--warmup` steps (tracing, and for the auto
row its measurement, are in the warm-up). The summary gives each row's median and the
ratios of medians the claims rest on: tfdp even / TensorFlow's; auto / even with the slow
replica (ideal 2.5: a device at 1/4 speed beside one at full speed gives 1.25 / 0.5, with
no part of the step that a split cannot shorten), and auto / the given 4:1 split.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import app, flags

ROWS = (
    "tf mirrored x2",
    "tfdp even x2",
    "tfdp even x2, replica statistics",
    "tfdp even x2, slow cpu:1",
    "tfdp 4:1 x2, slow cpu:1",
    "tfdp auto x2, slow cpu:1",
)
SLOWDOWN = 4.0

flags.DEFINE_enum("workload", "lenet", ["lenet", "cnn"], "What to train.")
flags.DEFINE_integer("rounds", 3, "Interleaved rounds of every row.")
flags.DEFINE_integer("steps", 30, "Timed steps per measurement.")
flags.DEFINE_integer("warmup", 8, "Untimed steps first (tracing; the auto row's measurement).")
flags.DEFINE_string("json", None, "Append the summary rows to this JSON-lines file.")
flags.DEFINE_multi_string("row", None, "Only this row (repeat the flag for several); default: every row.")
flags.DEFINE_string("one", None, "Internal: measure this row in this process.")
flags.DEFINE_string("records", None, "Internal: the cnn workload's TFRecord files (comma-separated).")
FLAGS = flags.FLAGS


def strategy_for(row: str):
    import tensorflow as tf

    import tfdp
    from tfdp import internals

    devices = ["/cpu:0", "/cpu:1"]
    if row == "tf mirrored x2":
        internals.set_collective_key_base(
            tf.distribute.MirroredStrategy, internals.next_collective_key_base())
        return tf.distribute.MirroredStrategy(devices)
    slow = {1: SLOWDOWN} if "slow" in row else None
    powers = "auto" if "auto" in row else None  # the 4:1 row takes its split after step 2
    statistics = "replica" if "replica statistics" in row else "whole"
    return tfdp.MirroredStrategy(devices, powers=powers, simulate_slowdown=slow, measure_steps=3,
                                 batch_statistics=statistics)


def workload(name: str, records: list[str]):
    """(a function that makes the compiled model, the endless training dataset, batch size)."""
    import keras
    import numpy as np
    import tensorflow as tf

    if name == "lenet":
        from tfdp.models import lenet

        def make():
            model = lenet()
            model.compile(keras.optimizers.SGD(0.1),
                          keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                          metrics=["accuracy"])
            return model

        rng = np.random.default_rng(0)
        x = rng.random((8192, 28, 28, 1), dtype=np.float32)
        y = rng.integers(0, 10, size=8192).astype(np.int32)
        return make, tf.data.Dataset.from_tensor_slices((x, y)).batch(1024).repeat(), 1024
    from tfdp.bench import streaming

    return streaming.make_model, streaming.pipeline(records, 256, 2048), 256


def measure(row: str, name: str, records: list[str]) -> dict:
    import keras

    strategy = strategy_for(row)
    make, dataset, batch = workload(name, records)
    with strategy.scope():
        model = make()
    stamps = []

    class Clock(keras.callbacks.Callback):
        def on_train_batch_end(self, step, logs=None):
            float(logs["loss"])  # the step is done
            stamps.append(time.perf_counter())
            if step == 1 and "4:1" in row:  # the slowdown is calibrated on step 2's even split
                strategy.set_powers([4, 1])

    model.fit(dataset, steps_per_epoch=FLAGS.warmup + FLAGS.steps, epochs=1, verbose=0,
              callbacks=[Clock()])
    seconds = stamps[-1] - stamps[FLAGS.warmup - 1]
    shares = getattr(strategy, "shares", [0.5, 0.5])
    return {"row": row, "workload": name, "images_per_sec": FLAGS.steps * batch / seconds,
            "shares": [round(s, 3) for s in shares]}


def summarize(results: list[dict]) -> list[dict]:
    by_row = {row: [r["images_per_sec"] for r in results if r["row"] == row] for row in ROWS}
    median = {row: statistics.median(v) for row, v in by_row.items() if v}
    rows = [
        {"workload": results[0]["workload"], "row": row, "median_images_per_sec": round(median[row], 1),
         "runs": [round(v, 1) for v in by_row[row]],
         "shares": next(r["shares"] for r in results if r["row"] == row)}
        for row in ROWS if row in median
    ]
    ratios = {
        "tfdp even / tf mirrored": ("tfdp even x2", "tf mirrored x2"),
        "tfdp even, replica statistics / tf mirrored": (
            "tfdp even x2, replica statistics", "tf mirrored x2"),
        "auto / even, slow cpu:1": ("tfdp auto x2, slow cpu:1", "tfdp even x2, slow cpu:1"),
        "4:1 / even, slow cpu:1": ("tfdp 4:1 x2, slow cpu:1", "tfdp even x2, slow cpu:1"),
        "auto / 4:1, slow cpu:1": ("tfdp auto x2, slow cpu:1", "tfdp 4:1 x2, slow cpu:1"),
    }
    only = "".join(f" --row='{row}'" for row in FLAGS.row or ())
    rows.append({
        "workload": results[0]["workload"],
        **{name: round(median[a] / median[b], 3) for name, (a, b) in ratios.items()
           if a in median and b in median},
        "ideal auto / even": 2.5,
        "command": f"python -m tfdp.bench.strategy --workload={results[0]['workload']} "
                   f"--rounds={FLAGS.rounds} --steps={FLAGS.steps} --warmup={FLAGS.warmup}{only}",
    })
    return rows


def main(argv):
    del argv
    unknown = sorted(set(FLAGS.row or ()) - set(ROWS))
    if unknown:
        raise app.UsageError(f"--row={unknown[0]!r}: not a row ({'; '.join(ROWS)})")
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if FLAGS.one:
        from tfdp import onednn
        from tfdp.devices import configure_logical_devices, reserve_sleeping_threads

        onednn.enable_by_default()  # as the tfdp command runs
        configure_logical_devices(logical_cpus=2)
        reserve_sleeping_threads(1)
        records = FLAGS.records.split(",") if FLAGS.records else []
        print(json.dumps(measure(FLAGS.one, FLAGS.workload, records)))
        return
    with tempfile.TemporaryDirectory() as directory:
        records = []
        if FLAGS.workload == "cnn":
            from tfdp.bench import streaming

            records = streaming.write_records(directory, 4096)
        results = []
        for round_ in range(FLAGS.rounds):
            for row in [r for r in ROWS if not FLAGS.row or r in FLAGS.row]:
                command = [sys.executable, "-m", "tfdp.bench.strategy", f"--one={row}",
                           f"--workload={FLAGS.workload}", f"--steps={FLAGS.steps}",
                           f"--warmup={FLAGS.warmup}", f"--records={','.join(records)}"]
                done = subprocess.run(command, capture_output=True, text=True, check=False)
                if done.returncode:
                    raise SystemExit(f"{row}: {done.stderr[-2000:]}")
                results.append(json.loads(done.stdout.strip().splitlines()[-1]))
                print(f"round {round_ + 1} {row}: {results[-1]['images_per_sec']:.1f} images/s "
                      f"shares {results[-1]['shares']}", flush=True)
    rows = summarize(results)
    for row in rows:
        print(json.dumps(row))
    if FLAGS.json:
        with open(FLAGS.json, "a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    app.run(main)
