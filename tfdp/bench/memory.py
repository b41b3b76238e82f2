"""`python -m tfdp.bench.memory`: peak memory of a streamed run against the data's size.

Writes MNIST-shaped TFRecord files of `--examples` and of `--factor` times as many
random examples (uint8 28x28 images, int64 labels), then trains one pass over each
through `tfdp.fit` (a small dense model, batch `--batch_size`, mode `--mode`), each run
in a fresh process, and reports each process's peak resident memory (ru_maxrss).
For contrast, the same examples held as numpy arrays: their memory grows with them.
Then validation data of each size, streamed: the command's `--dataset=FILE:FUNCTION`
returning the smaller training stream and the validation stream, 20 steps with an
evaluation every 10 (each one reads all of the validation data).

  python -m tfdp.bench.memory --examples=20000 --factor=8 --json=docs/bench_memory.jsonl
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time

from absl import app, flags

from tfdp.bench import records

FLAGS = flags.FLAGS


def define_flags() -> None:
    flags.DEFINE_integer("examples", 20000, "Examples of the smaller dataset.")
    flags.DEFINE_integer("factor", 8, "How many times larger the other dataset is.")
    flags.DEFINE_integer("batch_size", 256, "Global batch size.")
    flags.DEFINE_string("mode", "single", "tfdp mode of the runs (single, mirrored, weighted).")
    flags.DEFINE_string("devices", "", "tfdp devices of the runs (default: the mode's).")
    flags.DEFINE_integer("logical_cpus", 0, "Logical CPUs of each run (for mirrored, weighted).")
    flags.DEFINE_string("json", None, "Append each run's figures to this JSON-lines file.")
    flags.DEFINE_list(
        "checkpoint_buffers",
        [],
        "Instead: the size of a checkpoint (model and the stream's saved position) after 40 "
        "steps of --examples, with each of these shuffle buffers (0: no shuffle).",
    )
    flags.DEFINE_string("child", None, "Internal: the JSON job of one measured run.")


SOURCES = ("stream", "arrays", "validation")  # what grows: the training data, or the validation data
FILES = records.FILES  # TFRecord files per dataset
IMAGE_BYTES = 28 * 28


def write_records(directory: str, examples: int, seed: int) -> list[str]:
    """`examples` random MNIST-shaped examples in FILES TFRecord files."""
    return records.write_records(directory, examples, [IMAGE_BYTES], seed=seed)


def _parse(record):
    return records.parse(record, [IMAGE_BYTES])


def _model():
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((IMAGE_BYTES,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def stream(paths, examples, batch_size, shuffle=True):
    """The TFRecord files' examples, parsed, shuffled through a buffer of 10,000 (or
    not), batched."""
    import tensorflow as tf

    data = (
        tf.data.TFRecordDataset(paths)
        .map(_parse)
        .apply(tf.data.experimental.assert_cardinality(examples))
    )
    return (data.shuffle(10000, seed=1) if shuffle else data).batch(batch_size)


VALIDATION_SCRIPT = """
import json
import os

from tfdp.bench import memory

JOB = json.loads(os.environ["TFDP_MEMORY_JOB"])


def model():
    return memory._model()


def data():
    train = memory.stream(JOB["train_paths"], JOB["train_examples"], JOB["batch_size"])
    return train, memory.stream(JOB["paths"], JOB["examples"], JOB["batch_size"], shuffle=False)
"""


def validation_run(job: dict) -> dict:
    """20 steps of the command's path with streamed validation data, evaluated every 10."""
    from tfdp.config import Config
    from tfdp.run import training

    script = job["script"]
    config = Config(
        model=f"{script}:model",
        dataset=f"{script}:data",
        mode=job["mode"],
        devices=job["devices"] or None,
        iterations=20,
        eval_every=10,
        log_every=0,
    )
    result = training.run(training.prepare(config), lambda line: None)
    return {"steps": result["iterations"], "evaluations": len(result["evals"])}


def child(job: dict) -> dict:
    """One run in this process: one pass over the job's data; its peak memory."""
    if job["logical_cpus"]:
        from tfdp.devices import configure_logical_devices

        configure_logical_devices(logical_cpus=job["logical_cpus"])
    import numpy as np

    import tfdp

    examples, batch = job["examples"], job["batch_size"]
    if job["source"] == "validation":
        start = time.perf_counter()
        ran = validation_run(job)
        return measured(job, ran["steps"], time.perf_counter() - start, ran)
    if job["source"] == "stream":
        inputs = {"x": stream(job["paths"], examples, batch)}
    else:  # the same kind of examples, held as arrays
        rng = np.random.default_rng(job["seed"])
        x = rng.integers(0, 256, (examples, IMAGE_BYTES), dtype=np.uint8).astype(np.float32) / 255
        inputs = {"x": x, "y": rng.integers(0, 10, examples), "batch_size": batch}
    settings = {"mode": job["mode"]}
    if job["devices"]:
        settings["devices"] = job["devices"]
    start = time.perf_counter()
    history = tfdp.fit(_model(), **inputs, epochs=1, verbose=0, **settings)
    return measured(job, history.result["iterations"], time.perf_counter() - start)


def measured(job: dict, steps: int, seconds: float, more=None) -> dict:
    """The job's figures: its steps and time, this process's peak resident memory."""
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {
        **{k: v for k, v in job.items() if k not in ("paths", "train_paths", "script")},
        **(more or {}),
        "steps": steps,
        "seconds": seconds,
        "peak_rss_mib": peak_kib / 1024,
        "data_mib": job["examples"] * (IMAGE_BYTES + 8) / 2**20,
    }


def run_child(job: dict) -> dict:
    process = subprocess.run(
        [sys.executable, "-m", "tfdp.bench.memory", f"--child={json.dumps(job)}"],
        capture_output=True,
        text=True,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", TFDP_MEMORY_JOB=json.dumps(job)),
    )
    if process.returncode != 0:
        raise RuntimeError(process.stderr[-3000:])
    return json.loads(process.stdout.strip().splitlines()[-1])


def checkpoint_sizes(examples: int, buffers: list[int], batch_size: int) -> None:
    """The size of a streamed run's checkpoint with each shuffle buffer."""
    import tensorflow as tf

    import tfdp

    with tempfile.TemporaryDirectory() as root:
        paths = write_records(root, examples, seed=0)
        for buffer in buffers:
            data = (
                tf.data.TFRecordDataset(paths)
                .map(_parse)
                .apply(tf.data.experimental.assert_cardinality(examples))
            )
            data = (data.shuffle(buffer, seed=1) if buffer else data).batch(batch_size)
            model_dir = os.path.join(root, f"run{buffer}")
            tfdp.fit(_model(), data, iterations=40, verbose=0, model_dir=model_dir)
            saved = os.path.join(model_dir, "checkpoints")
            size = sum(
                os.path.getsize(os.path.join(saved, name))
                for name in os.listdir(saved)
                if name.startswith("ckpt-40.")
            )
            print(f"shuffle buffer {buffer}: checkpoint {size / 2**20:.2f} MiB", flush=True)


def main(argv) -> None:
    del argv
    if FLAGS.child:
        print(json.dumps(child(json.loads(FLAGS.child))))
        return
    if FLAGS.checkpoint_buffers:
        buffers = [int(b) for b in FLAGS.checkpoint_buffers]
        checkpoint_sizes(FLAGS.examples, buffers, FLAGS.batch_size)
        return
    sizes = [FLAGS.examples, FLAGS.examples * FLAGS.factor]
    common = {
        "batch_size": FLAGS.batch_size,
        "mode": FLAGS.mode,
        "devices": FLAGS.devices,
        "logical_cpus": FLAGS.logical_cpus,
    }
    rows = []
    with tempfile.TemporaryDirectory() as root:
        paths = {}
        for i, examples in enumerate(sizes):
            directory = os.path.join(root, str(examples))
            os.makedirs(directory)
            paths[examples] = write_records(directory, examples, seed=i)
        script = os.path.join(root, "validated.py")
        with open(script, "w") as f:
            f.write(VALIDATION_SCRIPT)
        for source in SOURCES:
            for i, examples in enumerate(sizes):
                job = {**common, "source": source, "examples": examples, "seed": i}
                if source != "arrays":
                    job["paths"] = paths[examples]
                if source == "validation":  # training on the smaller stream
                    job.update(script=script, train_paths=paths[sizes[0]], train_examples=sizes[0])
                rows.append(run_child(job))
                r = rows[-1]
                print(
                    f"{source}: {examples} examples ({r['data_mib']:.0f} MiB of data), "
                    f"{r['steps']} steps in {r['seconds']:.1f} s: "
                    f"peak RSS {r['peak_rss_mib']:.0f} MiB",
                    flush=True,
                )
    for source in SOURCES:
        small, large = (r for r in rows if r["source"] == source)
        print(
            f"{source}: peak RSS with {FLAGS.factor}x the data: "
            f"{large['peak_rss_mib'] / small['peak_rss_mib']:.3f}x"
        )
    if FLAGS.json:
        with open(FLAGS.json, "a") as out:
            for row in rows:
                out.write(json.dumps(row) + "\n")


def run() -> None:
    define_flags()
    app.run(main)


if __name__ == "__main__":
    run()
