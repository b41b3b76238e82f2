"""`tfdp-bench --suite=streaming`: training speed on streamed data, beside Keras `fit`.

    tfdp-bench --suite=streaming --rounds=3 --json=docs/bench_streaming.jsonl

The parent writes a CIFAR-shaped dataset once, as TFRecord files in a
temporary directory (`--stream_examples` random 32x32x3 uint8 images with
int64 labels 0-9, in 8 files); every row reads the same files through the
same pipeline (`pipeline`) and trains the same small ResNet (`make_model`).
Rows, each in its own process, in interleaved rounds A B C ... A B C ...:

  keras fit                 model.fit(pipeline, steps_per_epoch=...) on one device
  tfdp single               tfdp.fit(model, pipeline, mode="single")
  tfdp single no augmentation  the same pipeline without the crop and flip: the
                            examples the in-memory row trains on, streamed
  tfdp single in memory     the same examples decoded once into numpy arrays, through
                            tfdp.fit(model, x, y, batch_size=...): tfdp's random-access
                            path, without the crop and flip (arrays have no map)
  keras fit mirrored x2     model.fit under MirroredStrategy on 2 logical CPUs, the
                            model built and compiled in strategy.scope()
  tfdp mirrored x2          tfdp.fit(..., mode="mirrored") on 2 logical CPUs
  tfdp weighted x2          tfdp.fit(..., mode="weighted", powers=(1, 1)) on 2 logical CPUs
  tfdp mirrored x2 replica statistics   the same two with batch_statistics="replica":
  tfdp weighted x2 replica statistics   BatchNormalization by each device's shard (the
                            rows above: by the whole batch, one all-reduce per layer)

Timing: one `fit` call of `--warmup` + `--iterations` steps; a callback reads each
batch's loss (so that the step is done) and stamps the time. The rate is the
timed steps' images over the time from the end of the last warm-up step to the
end of the last step: tracing, the shuffle buffer's filling and the deletion of
the input iterator at the end are not in it. Every row runs oneDNN's CPU kernels
(as tfdp runs): the Keras rows too, so that a ratio compares the input and
training engines, not the kernels (on an AVX2 CPU TensorFlow's own default is
oneDNN off; the scaling suite's `keras fit` rows measure that).

The input share of a step is an estimate, not a measured wait. A tfdp step
reads its batch inside its tf.function (`next(iterator)` in the graph, as Keras'
step does), so the loop cannot see how long it waits. Instead, after the timed
run, the same process iterates the row's input alone, with no training (a new
iterator of the same pipeline; for the in-memory row, tfdp's batches of the
arrays, `arrays.train_dataset`): `--warmup` batches untimed, then `--iterations`
timed. The share is those seconds per batch over the training's seconds per
step: the share of a step the input would take if nothing of it overlapped the
step. With its prefetched batches the input runs beside the step, so on idle
cores a step waits less than that; on cores the step keeps busy (a CPU-only
host), the input's threads take about that share of the cores from the
step's kernels.

The loop's time per step is the time between two steps' ends that the step's own
compiled call does not take (Keras' `model.train_function`, tfdp's trainer
`train_step`, each timed around its call): what the training loop and its
callbacks add to every step on the host (the median over the timed steps).

Each measurement also records the cores it used over the timed steps (its CPU
seconds over the timed seconds) and the cores other processes used meanwhile
(the machine's busy time besides it): on a shared machine, a slow round says
why.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import time

from tfdp.bench import records
from tfdp.bench.spec import Spec, device_names
from tfdp.bench.timed import CpuSpan

FILES = records.FILES  # TFRecord files the dataset is written in
IMAGE_SHAPE = (32, 32, 3)
CLASSES = 10
PAD = 4  # the random crop's padding on each side
SEED = 1  # the shuffle's and the augmentation's
READS = 4  # files read at once (TFRecordDataset's num_parallel_reads)
PREFETCH = 2  # batches the pipeline makes ahead
BATCH_SIZE = 128  # the suite's global batch unless --batch_size is given
ITERATIONS = 30  # the suite's timed steps unless --iterations is given


@dataclasses.dataclass(frozen=True)
class StreamSpec(Spec):
    """One row: `source` "stream" (the TFRecord pipeline) or "arrays" (decoded once);
    `augmented`: the pipeline crops and flips (else it only parses and decodes)."""

    source: str = "stream"
    augmented: bool = True
    batch_statistics: str = "whole"  # BatchNormalization's, in tfdp's modes over 2 devices


def configurations() -> list[StreamSpec]:
    """The suite's rows, in the order they are measured and shown."""
    return [
        StreamSpec("keras fit", "keras", "fit", 1),
        StreamSpec("tfdp single", "tfdp", "single", 1),
        StreamSpec("tfdp single no augmentation", "tfdp", "single", 1, augmented=False),
        StreamSpec("tfdp single in memory", "tfdp", "single", 1, source="arrays"),
        StreamSpec("keras fit mirrored x2", "keras", "fit", 2),
        StreamSpec("tfdp mirrored x2", "tfdp", "mirrored", 2),
        StreamSpec("tfdp weighted x2", "tfdp", "weighted", 2, (1.0, 1.0)),
        StreamSpec("tfdp mirrored x2 replica statistics", "tfdp", "mirrored", 2,
                   batch_statistics="replica"),
        StreamSpec("tfdp weighted x2 replica statistics", "tfdp", "weighted", 2, (1.0, 1.0),
                   batch_statistics="replica"),
    ]


def spec_of(fields: dict) -> StreamSpec:
    """The row a worker's job names (its JSON form back as a StreamSpec)."""
    return StreamSpec(
        **{**fields, "powers": tuple(fields["powers"]), "device_list": tuple(fields["device_list"])}
    )


# ---------------------------------------------------------------- data and model


def write_records(directory: str, examples: int, seed: int = 0) -> list[str]:
    """`examples` random CIFAR-shaped examples in FILES TFRecord files."""
    return records.write_records(directory, examples, IMAGE_SHAPE, CLASSES, seed)


def parse(record):
    """A serialized example -> (float32 image in [0, 1], int64 label)."""
    return records.parse(record, IMAGE_SHAPE)


def augment(image, seed):
    """A random crop (pad PAD, crop back to 32x32) and a random horizontal flip, each a
    stateless function of `seed`: the same seed gives the same image on every run."""
    import tensorflow as tf

    crop_seed, flip_seed = tf.unstack(tf.random.experimental.stateless_split(seed, num=2))
    padded = tf.pad(image, [[PAD, PAD], [PAD, PAD], [0, 0]])
    image = tf.image.stateless_random_crop(padded, IMAGE_SHAPE, seed=crop_seed)
    return tf.image.stateless_random_flip_left_right(image, seed=flip_seed)


def pipeline(paths, batch_size: int, shuffle_buffer: int, augmented: bool = True):
    """The training pipeline every streamed row reads: global batches, endless.

    The serialized records are shuffled (a seeded buffer, in a new order each
    pass), then numbered: example k of a pass is augmented with the seed
    (SEED, k), so an example is cropped and flipped anew in each pass (it comes
    at another place) and the same way on every run. Parsing, decoding, scaling
    and augmenting run in one map on parallel calls, in order. Not `augmented`:
    the same without the crop and flip (the examples the in-memory row trains on).
    """
    import tensorflow as tf

    def example(index, record):
        image, label = parse(record)
        if not augmented:
            return image, label
        return augment(image, tf.stack([tf.constant(SEED, tf.int64), index])), label

    return (
        tf.data.TFRecordDataset(paths, num_parallel_reads=READS)
        .shuffle(shuffle_buffer, seed=SEED)
        .enumerate()
        .map(example, num_parallel_calls=os.cpu_count() or 1, deterministic=True)
        .batch(batch_size, drop_remainder=True)
        .repeat()
        .prefetch(PREFETCH)
    )


def decoded_arrays(paths):
    """The files' examples decoded once, in file order: (images float32, labels int64)."""
    import numpy as np
    import tensorflow as tf

    dataset = tf.data.TFRecordDataset(paths).map(parse, num_parallel_calls=os.cpu_count() or 1)
    batches = [(x.numpy(), y.numpy()) for x, y in dataset.batch(4096)]
    return np.concatenate([x for x, _ in batches]), np.concatenate([y for _, y in batches])


def residual_block(x, filters: int, stride: int):
    """Two 3x3 convolutions with batch norm, added to the input (projected by a strided
    1x1 convolution where the shape changes)."""
    from keras import layers

    shortcut = x
    y = layers.Conv2D(filters, 3, strides=stride, padding="same", use_bias=False)(x)
    y = layers.ReLU()(layers.BatchNormalization()(y))
    y = layers.Conv2D(filters, 3, padding="same", use_bias=False)(y)
    y = layers.BatchNormalization()(y)
    if stride != 1 or shortcut.shape[-1] != filters:
        shortcut = layers.Conv2D(filters, 1, strides=stride, use_bias=False)(shortcut)
        shortcut = layers.BatchNormalization()(shortcut)
    return layers.ReLU()(layers.Add()([y, shortcut]))


def make_model():
    """A small ResNet for 32x32x3 images, compiled: a 3x3 stem of 16 channels, residual
    blocks of 16, 32 (stride 2) and 64 (stride 2) channels, global average pooling, a
    dense layer of 10 logits; SGD with momentum, sparse categorical cross-entropy."""
    import keras
    from keras import layers

    keras.utils.set_random_seed(0)  # the same initial weights in every row
    inputs = keras.Input(IMAGE_SHAPE)
    x = layers.Conv2D(16, 3, padding="same", use_bias=False)(inputs)
    x = layers.ReLU()(layers.BatchNormalization()(x))
    for filters, stride in ((16, 1), (32, 2), (64, 2)):
        x = residual_block(x, filters, stride)
    x = layers.GlobalAveragePooling2D()(x)
    model = keras.Model(inputs, layers.Dense(CLASSES)(x), name="small_resnet")
    model.compile(
        optimizer=keras.optimizers.SGD(0.05, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


# ---------------------------------------------------------------- one process


def step_clock(warmup: int, steps: int):
    """A Keras callback that stamps the end of every training batch, after reading its
    loss (so that the step is done), and accounts the CPU over the timed steps: this
    process's, and the machine's busy time besides it (other processes: on a shared
    machine, what the row had to share the cores with)."""
    import keras

    class StepClock(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.ends, self.span, self.cpu = [], None, {}

        def on_train_batch_end(self, batch, logs=None):
            float(logs["loss"])
            self.ends.append(time.perf_counter())
            if len(self.ends) == warmup:
                self.span = CpuSpan()
            elif len(self.ends) == warmup + steps:
                self.cpu = self.span.stop()

    return StepClock()


def seconds_per_batch(dataset, warmup: int, batches: int) -> float:
    """Seconds per batch of iterating `dataset` alone (a new iterator), after `warmup`
    batches untimed."""
    iterator = iter(dataset)
    for _ in range(warmup):
        next(iterator)
    start = time.perf_counter()
    for _ in range(batches):
        next(iterator)
    return (time.perf_counter() - start) / batches


class CallClock:
    """The start and end of every call of the function it wraps."""

    def __init__(self):
        self.calls = []

    def wrap(self, function):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            outputs = function(*args, **kwargs)
            self.calls.append((start, time.perf_counter()))
            return outputs

        return timed

    def loop_seconds(self, ends, warmup: int) -> float:
        """The median over the timed steps of the time between two step ends outside
        the step's call (the calls of the last `len(ends)` steps)."""
        calls = self.calls[-len(ends) :]
        return statistics.median(
            (ends[k] - ends[k - 1]) - (calls[k][1] - calls[k][0]) for k in range(warmup, len(ends))
        )


def train(spec: StreamSpec, devices: list[str], data, steps: int, clock, batch_size: int, calls):
    """One `fit` call of `steps` steps: Keras' or tfdp's, as the row says; `calls` times
    each call of the compiled step."""
    import tensorflow as tf

    import tfdp
    from tfdp.devices import short_name
    from tfdp.engine.trainer import Trainer

    if spec.system == "keras":
        strategy = tf.distribute.MirroredStrategy(devices) if len(devices) > 1 else None
        with strategy.scope() if strategy else tf.device(devices[0]):
            model = make_model()
        model.make_train_function()
        model.train_function = calls.wrap(model.train_function)  # fit keeps the one it finds
        model.fit(data, steps_per_epoch=steps, epochs=1, verbose=0, callbacks=[clock])
        return
    settings = {"mode": spec.mode, "devices": ",".join(short_name(d) for d in devices)}
    if spec.powers:
        settings["powers"] = spec.powers
    if spec.batch_statistics != "whole":
        settings["batch_statistics"] = spec.batch_statistics
    inputs = (data, None) if spec.source == "stream" else data
    batch = batch_size if spec.source == "arrays" else None
    original = Trainer.train_step
    Trainer.train_step = calls.wrap(original)
    try:
        tfdp.fit(
            make_model(),
            *inputs,
            batch_size=batch,
            steps_per_epoch=steps,
            epochs=1,
            verbose=0,
            callbacks=[clock],
            **settings,
        )
    finally:
        Trainer.train_step = original


def measure(job: dict) -> dict:
    """A worker's measurement of the job's row, on as many logical CPUs as it names."""
    spec = spec_of(job["spec"])
    devices = device_names("cpu", spec.devices)  # the logical CPUs, before TensorFlow starts
    return measure_on(spec, devices, job)


def measure_on(spec: StreamSpec, devices: list[str], job: dict) -> dict:
    """One row on `devices`: the timed steps, then its input alone."""
    from tfdp import onednn
    from tfdp.config import Config
    from tfdp.data import arrays as data_lib
    from tfdp.devices import short_name

    batch, warmup, steps = job["batch_size"], job["warmup"], job["iterations"]
    if spec.source == "stream":
        data = pipeline(job["paths"], batch, job["shuffle_buffer"], spec.augmented)
        alone = data
    else:
        data = decoded_arrays(job["paths"])
        alone = data_lib.train_dataset(data, batch, Config().seed)  # tfdp.fit's batches
    clock, calls = step_clock(warmup, steps), CallClock()
    start = time.perf_counter()
    train(spec, devices, data, warmup + steps, clock, batch, calls)
    fit_seconds = time.perf_counter() - start
    if len(clock.ends) != warmup + steps:
        raise RuntimeError(f"{spec.name}: {len(clock.ends)} steps ran, not {warmup + steps}")
    seconds = clock.ends[-1] - clock.ends[warmup - 1]
    step_seconds = seconds / steps
    input_seconds = seconds_per_batch(alone, warmup, steps)
    cpu = clock.cpu
    return {
        "name": spec.name,
        "seconds": seconds,
        "step_seconds": step_seconds,
        "images_per_second": steps * batch / seconds,
        "loop_seconds_per_step": calls.loop_seconds(clock.ends, warmup),
        "warmup_seconds": clock.ends[warmup - 1] - start,
        "fit_seconds": fit_seconds,
        "input_seconds_per_batch": input_seconds,
        "input_images_per_second": batch / input_seconds,
        "input_share": input_seconds / step_seconds,
        "cores_used": cpu["cpu_seconds"] / seconds if "cpu_seconds" in cpu else None,
        # other processes' cores, at most the machine's minus this one's
        "others_cores_used": max(cpu["others_cpu_seconds"], 0.0) / seconds
        if "others_cpu_seconds" in cpu
        else None,
        **cpu,
        "device_list": [short_name(d) for d in devices],
        "onednn": onednn.enabled(),
    }


# ---------------------------------------------------------------- the parent


def summarize(specs, measurements) -> list[dict]:
    """One row per configuration: medians over the rounds, and ratios of the medians:
    against Keras fit on the same number of devices and input, and (tfdp single rows)
    the streamed rate over the in-memory one. The input share is the median of each
    measurement's."""
    median = {
        name: statistics.median(m["images_per_second"] for m in runs)
        for name, runs in measurements.items()
        if runs
    }
    keras_at = {s.devices: s.name for s in specs if s.system == "keras"}
    in_memory_at = {(s.mode, s.devices): s.name for s in specs if s.source == "arrays"}
    rows = []
    for spec in specs:
        runs = measurements[spec.name]
        rates = [m["images_per_second"] for m in runs]
        # against Keras only on Keras' input (the augmented pipeline)
        same_input = spec.source == "stream" and spec.augmented
        keras_name = keras_at.get(spec.devices) if same_input else None
        in_memory = in_memory_at.get((spec.mode, spec.devices)) if spec.system == "tfdp" else None
        in_memory = in_memory if spec.source == "stream" else None
        cores = [m["cores_used"] for m in runs if m.get("cores_used") is not None]
        others = [m["others_cores_used"] for m in runs if m.get("others_cores_used") is not None]
        steal = [m["steal_fraction"] for m in runs if "steal_fraction" in m]
        rows.append(
            {
                "configuration": spec.name,
                "system": spec.system,
                "mode": spec.mode,
                "source": spec.source,
                "devices": spec.devices,
                "device_list": runs[0].get("device_list"),
                "powers": list(spec.powers) or None,
                "images_per_second": median[spec.name],
                "images_per_second_min": min(rates),
                "images_per_second_max": max(rates),
                "step_seconds": statistics.median(m["step_seconds"] for m in runs),
                "keras_same_devices": keras_name,
                "vs_keras_same_devices": median[spec.name] / median[keras_name]
                if keras_name in median
                else None,
                "in_memory": in_memory,
                "vs_in_memory": median[spec.name] / median[in_memory]
                if in_memory in median
                else None,
                "input_images_per_second": statistics.median(
                    m["input_images_per_second"] for m in runs
                ),
                "input_share": statistics.median(m["input_share"] for m in runs),
                "input_share_per_round": [m["input_share"] for m in runs],
                "loop_seconds_per_step": statistics.median(
                    m["loop_seconds_per_step"] for m in runs
                ),
                "cores_used": statistics.median(cores) if cores else None,
                "others_cores_used": statistics.median(others) if others else None,
                "steal_fraction_max": max(steal) if steal else None,
                "onednn": [m.get("onednn") for m in runs],
                "rounds": len(runs),
            }
        )
    return rows


def format_table(rows) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = (
        "| configuration | devices | images/s (min-max) | vs keras, same devices "
        "| streamed / in memory | input alone, images/s | input share of a step "
        "| loop per step, ms | cores used (by others) |"
    )
    lines = [header, "|" + " --- |" * 9]
    for r in rows:
        lines.append(
            f"| {r['configuration']} | {r['devices']} | {r['images_per_second']:.0f} "
            f"({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f}) "
            f"| {num(r['vs_keras_same_devices'], '.2f')} | {num(r['vs_in_memory'], '.2f')} "
            f"| {r['input_images_per_second']:.0f} | {r['input_share']:.1%} "
            f"| {1e3 * r['loop_seconds_per_step']:.2f} "
            f"| {num(r['cores_used'], '.2f')} ({num(r['others_cores_used'], '.2f')}) |"
        )
    return "\n".join(lines)


def parameters() -> int:
    """The model's weights, for the header line."""
    return make_model().count_params()


def run(job: dict, rounds: int, json_path: str | None, measure_in_subprocess, only=()):
    """Writes the dataset, measures the rows in interleaved rounds
    (`measure_in_subprocess(spec, job)`: table.py's), prints the table and appends JSON
    lines (one per measurement, one per row). `only`: the rows to measure (all when
    empty)."""
    specs = [spec for spec in configurations() if not only or spec.name in only]
    print(
        f"small ResNet ({parameters():,} weights) on {job['examples']} CIFAR-shaped examples "
        f"in {FILES} TFRecord files, batch {job['batch_size']}, {job['iterations']} timed steps "
        f"after {job['warmup']} warm-up; {rounds} interleaved rounds on CPU (2 logical CPUs "
        "for the x2 rows)",
        flush=True,
    )
    measurements = {spec.name: [] for spec in specs}
    records = []
    with tempfile.TemporaryDirectory() as root:
        paths = write_records(root, job["examples"])
        for round_index in range(rounds):
            for spec in specs:
                measured = measure_in_subprocess(spec, {**job, "paths": paths})
                measurements[spec.name].append(measured)
                print(
                    f"round {round_index + 1}: {spec.name}: "
                    f"{measured['images_per_second']:.0f} images/s; input alone "
                    f"{measured['input_images_per_second']:.0f} images/s, "
                    f"{measured['input_share']:.1%} of a step",
                    flush=True,
                )
                fields = {"round": round_index + 1, **dataclasses.asdict(spec), **job}
                records.append({**fields, **measured})
    rows = summarize(specs, measurements)
    print()
    print(format_table(rows))
    records += [{"summary": True, **job, **row} for row in rows]
    if json_path:
        with open(json_path, "a") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
    return rows
