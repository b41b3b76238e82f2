"""`tfdp-bench`: the tutorial's timing table, side by side with Keras `fit`.

Every configuration runs in its own process (device sets never share a
process, so collective ops never collide, and logical CPUs can differ), in
interleaved rounds A B C ... A B C ..., so that a noisy machine slows all of
them alike. Each measurement is one run: a tfdp row the `tfdp` command's,
through its loop and every hook of it (tfdp/bench/timed.py); a Keras row one
`fit`. The clock starts at the end of the warm-up's last step (tracing and
compilation are not timed) and stops at the end of the last step: LeNet,
batch 1024, 50 iterations after 5 warm-up. The accuracy at iteration 40 is
the run's own, counted from its first step.

  tfdp-bench --mnist_dir=../shared/data/mnist --json=bench.jsonl --plot=bench.png

`--suite=mixed` measures the ways of splitting a batch over devices of
unequal speed instead (tfdp/bench/mixed.py); `--suite=gpu` single GPU,
mirrored over all GPUs and a GPU with the CPU (tfdp/bench/gpu.py);
`--suite=cluster` 2 workers, one slowed, split evenly against rebalanced
(tfdp/bench/cluster.py); `--suite=streaming` a small ResNet on TFRecord files
through a tf.data pipeline, tfdp beside Keras fit (tfdp/bench/streaming.py);
`--suite=elastic` the seconds a change of a cluster's members costs
(tfdp/bench/elastic.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tfdp import onednn  # noqa: E402

onednn.enable_by_default()  # an entry point: before TensorFlow is imported
from tfdp.bench.flops import FORWARD_FLOPS, TRAIN_FLOPS  # noqa: E402
from tfdp.bench.spec import Spec, device_names  # noqa: E402

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (a module that imports this one for its
    functions, a test among them, gets none of them, so no flag of tfdp's is redefined)."""
    if "rounds" in FLAGS:
        return
    flags.DEFINE_integer("rounds", 3, "Interleaved rounds; the table reports medians over them.")
    flags.DEFINE_integer("iterations", 50, "Timed iterations per measurement (the tutorial's 50).")
    flags.DEFINE_integer("warmup", 5, "Untimed iterations first: tracing, compilation, caches.")
    flags.DEFINE_integer("batch_size", 1024, "Global batch size.")
    flags.DEFINE_list("device_counts", ["1", "2", "4"], "Device counts to measure.")
    flags.DEFINE_enum(
        "devices",
        "auto",
        ["auto", "cpu", "gpu"],
        "auto: GPUs where there are any, else logical CPUs.",
    )
    flags.DEFINE_list("uneven_powers", ["1", "3"], "Powers of the uneven weighted configuration.")
    flags.DEFINE_list("only", [], "Measure only these configurations (names as in the table).")
    flags.DEFINE_list(
        "keras_onednn",
        ["1"],
        "Device counts at which Keras fit also runs with oneDNN's CPU kernels on, as tfdp does "
        "(the plain keras rows keep TensorFlow's own default).",
    )
    flags.DEFINE_list(
        "workers",
        [],
        "Also measure mode multiworker with these worker counts, e.g. 1,2: one local process per "
        "worker on loopback, as tfdp-launch starts them. Default: none.",
    )
    flags.DEFINE_bool("synthetic", False, "Random images of MNIST's shape instead of MNIST.")
    flags.DEFINE_string(
        "model",
        "lenet",
        "lenet (the tutorial's, plain SGD), or MODULE:FUNCTION returning a compiled Keras model "
        "for MNIST's images, e.g. examples/mnist_cnn.py:make_model: every row trains it, tfdp's "
        "and Keras fit's alike.",
    )
    flags.DEFINE_string("mnist_dir", None, "MNIST IDX files (default: $TFDP_MNIST_DIR, else tfds).")
    flags.DEFINE_string("json", None, "Append one JSON line per measurement and per table row.")
    flags.DEFINE_string("plot", None, "Draw images/s against device count per mode (PNG).")
    flags.DEFINE_enum(
        "suite",
        "scaling",
        ["scaling", "mixed", "switches", "gpu", "cluster", "streaming", "elastic"],
        "scaling: the tutorial's table over device counts; mixed: splits over unequal devices; "
        "switches: --jit_compile, each --precision and 2 and 4 micro-steps (--max_rows) against "
        "the plain step, at each of "
        "--device_counts (single at 1, mirrored above); gpu: one GPU, all GPUs, GPU+CPU, each "
        "beside Keras fit (logical CPUs stand in without a GPU); cluster: 2 workers, "
        "--cluster_slowdown, even split against rebalancing; streaming: a small ResNet on "
        "CIFAR-shaped TFRecord files through a tf.data pipeline, tfdp beside Keras fit (its "
        "own defaults: --batch_size=128, --iterations=30); elastic: the seconds from a change of "
        "a cluster's members to its next trained step, under tfdp-launch --discover.",
    )
    flags.DEFINE_integer("elastic_checkpoint_every", 20, "elastic: the run's --checkpoint_every.")
    flags.DEFINE_integer(
        "stream_examples",
        8192,
        "streaming: random CIFAR-shaped examples written as TFRecord files for every row.",
    )
    flags.DEFINE_integer(
        "stream_shuffle", 2048, "streaming: the pipeline's shuffle buffer, in examples."
    )
    flags.DEFINE_list(
        "worker_threads",
        ["0"],
        "multiworker rows: threads per kernel in each worker (0: TensorFlow's default, as the "
        "tfdp command runs a worker), one row per value.",
    )
    flags.DEFINE_string(
        "cluster_slowdown", "worker:1=4", "cluster: the simulated slowdown (--simulate_slowdown)."
    )
    flags.DEFINE_integer(
        "settle",
        20,
        "cluster: untimed iterations after --warmup, rebalancing as in training, so that the "
        "timed iterations run at the split rebalancing settled on.",
    )
    flags.DEFINE_list("mixed_devices", ["cpu:0", "cpu:1"], "mixed: the two devices.")
    flags.DEFINE_string(
        "slowdown",
        "cpu:1=4",
        "mixed: simulated slowdown DEVICE=FACTOR (empty on really unequal devices).",
    )
    flags.DEFINE_list(
        "sweep", ["96", "128", "160", "192", "256"], "mixed: static shares of the slow device."
    )
    flags.DEFINE_string("worker", None, "Internal: measure one configuration given as JSON.")


def configurations(
    counts, uneven_powers, worker_counts=(), keras_onednn=(), worker_threads=(0,)
) -> list[Spec]:
    specs = [Spec("matmul peak", "matmul", "matmul", 1)]
    for n in counts:
        keras_name = "keras fit" if n == 1 else f"keras fit mirrored x{n}"
        if n == 1:
            specs.append(Spec("tfdp single", "tfdp", "single", 1))
        else:
            specs += [
                Spec(f"tfdp mirrored x{n}", "tfdp", "mirrored", n),
                Spec(f"tfdp weighted x{n}", "tfdp", "weighted", n, (1.0,) * n),
            ]
        specs.append(Spec(keras_name, "keras", "fit", n, onednn="tensorflow"))
        if n in keras_onednn:
            specs.append(Spec(f"{keras_name}, oneDNN", "keras", "fit", n))
    if 2 in counts and uneven_powers:
        label = ":".join(f"{p:g}" for p in uneven_powers)
        specs.append(Spec(f"tfdp weighted {label}", "tfdp", "weighted", 2, tuple(uneven_powers)))
    for n in worker_counts:
        for threads in worker_threads:
            threads_text = f" ({threads} thread{'s' if threads > 1 else ''} per kernel)"
            name = f"tfdp multiworker x{n}" + (threads_text if threads else "")
            specs.append(Spec(name, "tfdp", "multiworker", n, intra_op_threads=threads))
    return specs


def micro_step_caps(batch_size: int, steps: int, devices: int) -> tuple[int, ...]:
    """Caps (--max_rows) that make each update of `batch_size` `steps` micro-steps over
    `devices` devices; () for one step."""
    if steps == 1:
        return ()
    return (-(-batch_size // (steps * devices)),) * devices


def switch_configurations(counts) -> list[Spec]:
    """`--suite=switches`: at each device count, tfdp's plain step, then --jit_compile, the
    mixed precisions, and updates in 2 and 4 micro-steps (--max_rows; single at 1 device,
    mirrored above)."""
    specs = [Spec("matmul peak", "matmul", "matmul", 1)]
    for n in counts:
        mode, label = ("single", "tfdp single") if n == 1 else ("mirrored", f"tfdp mirrored x{n}")
        specs += [
            Spec(label, "tfdp", mode, n),
            Spec(f"{label} jit", "tfdp", mode, n, jit_compile=True),
            Spec(f"{label} bfloat16", "tfdp", mode, n, precision="mixed_bfloat16"),
            Spec(f"{label} float16", "tfdp", mode, n, precision="mixed_float16"),
            Spec(f"{label} in 2 micro-steps", "tfdp", mode, n, micro_steps=2),
            Spec(f"{label} in 4 micro-steps", "tfdp", mode, n, micro_steps=4),
        ]
    return specs


# ---------------------------------------------------------------- one process


def load_arrays(synthetic: bool, mnist_dir: str | None):
    from tfdp.data import mnist

    return mnist.synthetic_mnist() if synthetic else mnist.load_mnist("train", mnist_dir=mnist_dir)


def measure_matmul(n: int = 2048, repeats: int = 10) -> dict:
    """The best float32 matrix-multiply rate of this machine, in FLOP/s."""
    import tensorflow as tf

    a = tf.random.stateless_uniform((n, n), seed=[1, 2])
    b = tf.random.stateless_uniform((n, n), seed=[3, 4])
    matmul = tf.function(lambda a, b: tf.reduce_sum(tf.matmul(a, b)))
    float(matmul(a, b))
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        float(matmul(a, b))
        best = min(best, time.perf_counter() - start)
    return {"flops_per_second": 2 * n**3 / best}


def spec_devices(spec: Spec, job: dict) -> list[str]:
    """The devices a measurement runs on: the spec's by name (on a machine without GPUs,
    the logical CPUs that stand in for them: `gpu.stand_in`), else `spec.devices` of the
    job's kind."""
    if not spec.device_list:
        return device_names(job["kind"], spec.devices)
    import tfdp
    from tfdp.devices import canonical_name

    stand_in = job.get("stand_in")
    if stand_in:
        tfdp.configure_logical_devices(logical_cpus=stand_in["logical_cpus"])
        return [canonical_name(stand_in["devices"][name]) for name in spec.device_list]
    return [canonical_name(name) for name in spec.device_list]


def measure_tfdp(spec: Spec, job: dict) -> dict:
    """A tfdp row: the run of the `tfdp` command with the row's settings, through its
    loop and every hook of it (`timed.run`), timed from the end of the warm-up.

    The cluster suite's rows warm up `job["settle"]` more iterations, so that the clock
    starts at the split rebalancing settled on; rebalancing goes on while it is timed.
    A multiworker row is one worker of the cluster TF_CONFIG names."""
    from tfdp import Config
    from tfdp.bench import timed
    from tfdp.devices import (
        default_intra_op_threads,
        parse_slowdown,
        reserve_sleeping_threads,
        set_intra_op_threads,
        short_name,
    )

    multiworker = spec.mode == "multiworker"
    devices = [] if multiworker else spec_devices(spec, job)
    config = Config(
        mode=spec.mode,
        model=job.get("model", "lenet"),
        dataset=timed.SYNTHETIC if job["synthetic"] else "mnist",
        mnist_dir=job["mnist_dir"],
        devices=",".join(short_name(d) for d in devices),
        powers=spec.powers,
        batch_size=job["batch_size"],
        rebalance_every=spec.rebalance_every,
        simulate_slowdown=spec.slowdown,
        jit_compile=spec.jit_compile,
        precision=spec.precision,
        max_rows=micro_step_caps(job["batch_size"], spec.micro_steps, len(devices)),
    )
    # as the tfdp command sets them, before TensorFlow starts (the Keras rows keep
    # TensorFlow's default threads)
    reserve_sleeping_threads(len(parse_slowdown(config.simulate_slowdown)))
    if multiworker:
        set_intra_op_threads(spec.intra_op_threads)
    else:
        set_intra_op_threads(default_intra_op_threads(config, 0, 0, os.cpu_count() or 1))
    warmup = job["warmup"] + job.get("settle", 0)
    result = timed.run(config, warmup, job["iterations"])
    before = [r for r in result["rebalances"] if r["iteration"] < warmup]
    return {
        "seconds": result["seconds"],
        "set_up_seconds": result["set_up_seconds"],
        "warmup_iterations": warmup,
        "warmup_seconds": result["warmup_seconds"],
        "shards": result["shards"],
        "timed_shards": before[-1]["new"] if before else result["shards"],
        "final_shards": result["final_shards"],
        "resplits_before_timing": len(before),
        "resplits_timed": len(result["rebalances"]) - len(before),
        "accuracy_at_40": next(
            (entry.get("accuracy") for entry in result["log"] if entry["iteration"] == 40), None
        ),
        "test_accuracy": result["test_accuracy"],
        "chains": result.get("chains"),
        "device_list": result["devices"],
        "simulated_slowdown": result.get("simulated_slowdown"),
        "auto_powers": result.get("auto_powers"),
        "intra_op_threads_asked": spec.intra_op_threads if multiworker else None,
        # each device's (worker's) median seconds per step over the last window, sleep included
        "device_seconds": result["device_seconds"],
        **timed.cpu_of(result),
    }


def user_function(job: dict):
    """The function that makes the job's model (None: the built-in LeNet)."""
    if job.get("model", "lenet") == "lenet":
        return None
    from tfdp.data import sources

    return sources.load_function(job["model"], "model")


def measure_keras(spec: Spec, job: dict) -> dict:
    import keras
    import tensorflow as tf

    from tfdp.bench import timed
    from tfdp.data.arrays import train_dataset
    from tfdp.devices import short_name
    from tfdp.models import build_model, initial_weights

    devices = spec_devices(spec, job)
    # What a Keras user would write: fit, with MirroredStrategy's own defaults.
    strategy = tf.distribute.MirroredStrategy(devices) if len(devices) > 1 else None
    arrays = load_arrays(job["synthetic"], job["mnist_dir"])
    own = user_function(job)
    with strategy.scope() if strategy else tf.device(devices[0]):
        if own:  # the user's factory, compiled as the user compiled it
            model = own()
            initial = model.get_weights()
        else:
            initial = initial_weights("lenet")
            model = build_model("lenet")
            model.compile(
                optimizer=keras.optimizers.SGD(0.1),
                loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                metrics=["accuracy"],
            )
        model.set_weights(initial)
    # one fit: the clock starts at the end of the warm-up's last step, as tfdp's rows' does
    warmup, iterations = job["warmup"], job["iterations"]
    clock = timed.keras_window(warmup, iterations)
    running = {}

    class RunningAccuracy(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            if batch in (39, 40):
                running[batch] = float(logs["accuracy"])

    dataset = train_dataset(arrays, job["batch_size"], 0)
    model.fit(
        dataset,
        steps_per_epoch=warmup + iterations,
        epochs=1,
        verbose=0,
        callbacks=[clock, RunningAccuracy()],
    )
    # Keras logs a running mean over the epoch; batch 40's own accuracy follows from two of them.
    accuracy_40 = 41 * running[40] - 40 * running[39] if 40 in running else None
    return {
        "seconds": clock.window.seconds,
        "accuracy_at_40": accuracy_40,
        "device_list": [short_name(d) for d in devices],
        **clock.window.cpu,
    }


def run_worker(job: dict) -> dict:
    if job.get("suite") == "streaming":
        from tfdp.bench import streaming as bench_streaming

        return bench_streaming.measure(job)
    if job.get("suite") == "mixed":
        from tfdp.bench import mixed as bench_mixed

        if job.get("calibrate"):
            return bench_mixed.calibrate(job)
        return {"results": bench_mixed.measure_round(job)}
    fields = job["spec"]
    spec = Spec(
        **{
            **fields,
            "powers": fields["powers"] if fields["powers"] == "auto" else tuple(fields["powers"]),
            "device_list": tuple(fields["device_list"]),
        }
    )
    if spec.system == "matmul":
        return {**measure_matmul(), "onednn": onednn.enabled()}
    measure = measure_tfdp if spec.system == "tfdp" else measure_keras
    result = measure(spec, job)
    result["images_per_second"] = job["iterations"] * job["batch_size"] / result["seconds"]
    result["onednn"] = onednn.enabled()
    result["intra_op_threads"] = tf_intra_op_threads()
    return result


def tf_intra_op_threads() -> int:
    import tensorflow as tf

    return tf.config.threading.get_intra_op_parallelism_threads()


# ---------------------------------------------------------------- the parent


def measure_in_subprocess(spec, job: dict) -> dict:
    job = {**job, "spec": dataclasses.asdict(spec) if spec else None}
    command = [sys.executable, "-m", "tfdp.bench", f"--worker={json.dumps(job)}"]
    if spec is not None and spec.mode == "multiworker":
        return measure_in_cluster(spec, command)
    env = None
    if spec is not None and spec.onednn == "tensorflow":
        env = onednn.tensorflow_default_env(os.environ)
    process = subprocess.run(command, capture_output=True, text=True, env=env)
    if process.returncode != 0:
        name = spec.name if spec else ("calibration" if job.get("calibrate") else "a mixed round")
        raise RuntimeError(f"{name} failed:\n{process.stderr[-3000:]}")
    return json.loads(process.stdout.strip().splitlines()[-1])


def measure_in_cluster(spec: Spec, command: list[str]) -> dict:
    """Runs `command` once per worker of a loopback cluster; returns the chief's measurement."""
    from tfdp.cluster.workers import free_ports, tf_configs

    workers = [
        subprocess.Popen(
            command,
            env=dict(os.environ, TF_CONFIG=tf_config),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tf_config in tf_configs(free_ports(spec.devices))
    ]
    outputs = [worker.communicate() for worker in workers]
    for worker, (_, stderr) in zip(workers, outputs):
        if worker.returncode != 0:
            raise RuntimeError(f"{spec.name} failed:\n{stderr[-3000:]}")
    return json.loads(outputs[0][0].strip().splitlines()[-1])


def count_gpus() -> int:
    import tensorflow as tf

    return len(tf.config.list_physical_devices("GPU"))


def detect_kind() -> str:
    return "gpu" if count_gpus() else "cpu"


def summarize(specs, measurements, batch_size, iterations, model="lenet") -> list[dict]:
    """One row per configuration: medians over the rounds, and ratios of medians."""
    peak = statistics.median(m["flops_per_second"] for m in measurements["matmul peak"])
    median = {
        name: statistics.median(m["images_per_second"] for m in runs)
        for name, runs in measurements.items()
        if name != "matmul peak"
    }
    # Keras fit on the same devices: by count, or (suite gpu) by name
    keras_at = {
        (s.devices, s.device_list): s.name
        for s in specs
        if s.system == "keras" and s.onednn != "tfdp"
    }
    keras_onednn_at = {
        (s.devices, s.device_list): s.name
        for s in specs
        if s.system == "keras" and s.onednn == "tfdp"
    }
    rows = []
    for spec in specs:
        if spec.system == "matmul":
            continue
        runs = measurements[spec.name]
        rates = [m["images_per_second"] for m in runs]
        accuracy = [m["accuracy_at_40"] for m in runs if m.get("accuracy_at_40") is not None]
        # Keras fit runs in one process; multiworker rows have no Keras counterpart here.
        same_devices = (spec.devices, spec.device_list)
        keras_name = keras_at.get(same_devices) if spec.mode != "multiworker" else None
        keras_onednn_name = (
            keras_onednn_at.get(same_devices) if spec.mode != "multiworker" else None
        )
        steal = [m["steal_fraction"] for m in runs if "steal_fraction" in m]
        rows.append(
            {
                "configuration": spec.name,
                "system": spec.system,
                "mode": spec.mode,
                "devices": spec.devices,
                "device_list": runs[0].get("device_list"),  # the devices it ran on
                "stands_for": list(spec.device_list) or None,  # suite gpu: the devices named
                "powers": spec.powers if spec.powers == "auto" else list(spec.powers) or None,
                "images_per_second": median[spec.name],
                "images_per_second_min": min(rates),
                "images_per_second_max": max(rates),
                "seconds": statistics.median(m["seconds"] for m in runs),
                "iterations": iterations,
                "vs_tfdp_single": median[spec.name] / median["tfdp single"]
                if "tfdp single" in median
                else None,
                "vs_keras_same_devices": median[spec.name] / median[keras_name]
                if keras_name in median
                else None,
                "keras_same_devices": keras_name,
                "vs_keras_onednn_same_devices": median[spec.name] / median[keras_onednn_name]
                if keras_onednn_name in median
                else None,
                "onednn": [m.get("onednn") for m in runs],
                "steal_fraction_max": max(steal) if steal else None,
                # LeNet's FLOPs: for another model, no fraction
                "fraction_of_peak": median[spec.name] * TRAIN_FLOPS / peak
                if model == "lenet"
                else None,
                "model": model,
                "accuracy_at_40": statistics.median(accuracy) if accuracy else None,
                "peak_flops_per_second": peak,
                "rounds": len(runs),
            }
        )
    return rows


def format_table(rows, iterations) -> str:
    def num(value, fmt):
        return "-" if value is None else format(value, fmt)

    header = (
        f"| configuration | devices | images/s (min-max) | s / {iterations} it | vs tfdp single "
        "| vs keras, same devices | vs keras + oneDNN | of peak | accuracy at it 40 "
        "| most time stolen |"
    )
    lines = [header, "|" + " --- |" * 10]
    for r in rows:
        devices = r["devices"]
        if r.get("stands_for"):  # suite gpu: by name, with their stand-ins
            devices = ", ".join(r["stands_for"])
            if r["device_list"] != r["stands_for"]:
                devices += f" (as {', '.join(r['device_list'])})"
        lines.append(
            f"| {r['configuration']} | {devices} | {r['images_per_second']:.0f} "
            f"({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f}) "
            f"| {r['seconds']:.2f} | {num(r['vs_tfdp_single'], '.2f')} "
            f"| {num(r['vs_keras_same_devices'], '.2f')} "
            f"| {num(r['vs_keras_onednn_same_devices'], '.2f')} "
            f"| {num(r['fraction_of_peak'], '.2f')} "
            f"| {num(r['accuracy_at_40'], '.4f')} | {num(r['steal_fraction_max'], '.0%')} |"
        )
    return "\n".join(lines)


def draw(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    series = {}
    for r in rows:
        if r["powers"] == "auto":
            label = f"tfdp {r['mode']} auto"
        elif r["mode"] == "weighted" and r["powers"] and len(set(r["powers"])) > 1:
            label = f"tfdp weighted {':'.join(f'{p:g}' for p in r['powers'])}"
        elif r["mode"] in ("single", "mirrored"):
            label = "tfdp mirrored (1 = single)"
        else:
            label = f"{r['system']} {r['mode']}"
        series.setdefault(label, []).append(r)
    for label, points in series.items():
        points.sort(key=lambda r: r["devices"])
        x = [r["devices"] for r in points]
        y = [r["images_per_second"] for r in points]
        error = [
            [r["images_per_second"] - r["images_per_second_min"] for r in points],
            [r["images_per_second_max"] - r["images_per_second"] for r in points],
        ]
        axes.errorbar(x, y, yerr=error, marker="o", capsize=3, label=label)
    axes.set_xlabel("devices")
    axes.set_ylabel("images / s (median, min-max)")
    axes.set_xticks(sorted({r["devices"] for r in rows}))
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def run_mixed(mnist_dir) -> None:
    from tfdp.bench import mixed as bench_mixed
    from tfdp.devices import canonical_name, parse_slowdown

    slowdown = parse_slowdown(FLAGS.slowdown)
    factor = max(slowdown.values(), default=1.0)
    job = {
        "suite": "mixed",
        "devices": FLAGS.mixed_devices,
        "slowdown": FLAGS.slowdown,
        "batch_size": FLAGS.batch_size,
        "iterations": FLAGS.iterations,
        "warmup": FLAGS.warmup,
        "synthetic": FLAGS.synthetic,
        "mnist_dir": mnist_dir,
        "delays": None,
    }
    if slowdown:
        job["delays"] = measure_in_subprocess(None, {**job, "calibrate": True})["delays"]
    data = "synthetic images" if FLAGS.synthetic else "MNIST"
    print(
        f"LeNet on {data}, batch {FLAGS.batch_size}, {FLAGS.iterations} timed iterations after "
        f"{FLAGS.warmup} warm-up; {FLAGS.rounds} interleaved rounds on "
        f"{', '.join(FLAGS.mixed_devices)}"
        + (
            f"; SIMULATED slowdown {FLAGS.slowdown} (sleep per example: "
            f"{', '.join(f'{d * 1e3:.3f} ms' for d in job['delays'])})"
            if slowdown
            else ""
        ),
        flush=True,
    )
    # the device that is not slowed, alone (on really unequal devices no row: which is
    # the fastest is what the suite measures)
    fastest = next((d for d in FLAGS.mixed_devices if canonical_name(d) not in slowdown), "")
    fastest = fastest if slowdown else ""
    specs = bench_mixed.mixed_configurations(
        factor, [int(s) for s in FLAGS.sweep], FLAGS.batch_size, fastest
    )
    if FLAGS.only:
        specs = [s for s in specs if s.name in FLAGS.only or s.name == "even split"]
    measurements = {spec.name: [] for spec in specs}
    out = open(FLAGS.json, "a") if FLAGS.json else None
    for round_index in range(FLAGS.rounds):
        shift = round_index % len(specs)  # rotate the order from round to round
        order = specs[shift:] + specs[:shift]
        round_job = {**job, "specs": [dataclasses.asdict(s) for s in order]}
        for measured in measure_in_subprocess(None, round_job)["results"]:
            measurements[measured["name"]].append(measured)
            print(
                f"round {round_index + 1}: {measured['name']}: "
                f"{measured['images_per_second']:.0f} images/s, shares "
                f"{measured['start_shards']} -> {measured['final_shards']}",
                flush=True,
            )
            if out:
                record = {"round": round_index + 1, **job, **measured}
                out.write(json.dumps(record) + "\n")
    rows = bench_mixed.summarize(specs, measurements)
    print()
    print(bench_mixed.format_table(rows))
    if out:
        for row in rows:
            out.write(json.dumps({"summary": True, "suite": "mixed", **row}) + "\n")
        out.close()
    if FLAGS.plot:
        title = f"LeNet, batch {FLAGS.batch_size}, {' + '.join(FLAGS.mixed_devices)}" + (
            f", {FLAGS.slowdown} simulated" if slowdown else ""
        )
        bench_mixed.draw(rows, FLAGS.plot, title, FLAGS.batch_size)
        print(f"chart: {FLAGS.plot}")


def run_streaming() -> None:
    """`--suite=streaming` (tfdp/bench/streaming.py), with its own batch and timed steps
    unless --batch_size or --iterations is given."""
    from tfdp.bench import streaming as bench_streaming

    job = {
        "suite": "streaming",
        "examples": FLAGS.stream_examples,
        "shuffle_buffer": FLAGS.stream_shuffle,
        "batch_size": FLAGS.batch_size
        if FLAGS["batch_size"].present
        else bench_streaming.BATCH_SIZE,
        "iterations": FLAGS.iterations
        if FLAGS["iterations"].present
        else bench_streaming.ITERATIONS,
        "warmup": FLAGS.warmup,
    }
    for flag, value, least in (
        ("warmup", job["warmup"], 1),  # the clock starts at the end of the last warm-up step
        ("iterations", job["iterations"], 1),
        ("stream_shuffle", job["shuffle_buffer"], 1),
        ("stream_examples", job["examples"], job["batch_size"]),  # a full batch at least
    ):
        if value < least:
            print(f"tfdp-bench: error: --{flag}={value}: must be {least} or more", file=sys.stderr)
            sys.exit(2)
    bench_streaming.run(job, FLAGS.rounds, FLAGS.json, measure_in_subprocess, FLAGS.only)


def check_plotting() -> None:
    """--plot needs matplotlib, an optional extra: a clear line and exit 2 without it."""
    import importlib.util

    if importlib.util.find_spec("matplotlib") is None:
        print(
            f"tfdp-bench: error: --plot={FLAGS.plot}: needs matplotlib; "
            "pip install 'tfdp[plot]' (or matplotlib)",
            file=sys.stderr,
        )
        sys.exit(2)


def main(argv) -> None:
    if FLAGS.worker:
        print(json.dumps(run_worker(json.loads(FLAGS.worker))))
        return
    if FLAGS.plot:
        check_plotting()  # before minutes of measuring
    if FLAGS.model != "lenet" and not FLAGS.worker:
        from tfdp.data import sources
        from tfdp.errors import ConfigError

        try:
            sources.load_function(FLAGS.model, "model")
        except ConfigError as error:
            print(f"tfdp-bench: error: --model={FLAGS.model}: {error.reason}", file=sys.stderr)
            sys.exit(2)
    mnist_dir = FLAGS.mnist_dir or os.environ.get("TFDP_MNIST_DIR")
    if FLAGS.suite == "mixed":
        run_mixed(mnist_dir)
        return
    if FLAGS.suite == "streaming":
        run_streaming()
        return
    if FLAGS.suite == "elastic":
        from tfdp.bench import elastic as bench_elastic

        bench_elastic.run(
            mnist_dir, FLAGS.rounds, FLAGS.batch_size, FLAGS.elastic_checkpoint_every, FLAGS.json
        )
        return
    counts = [int(c) for c in FLAGS.device_counts]
    job = {
        "kind": None,
        "batch_size": FLAGS.batch_size,
        "iterations": FLAGS.iterations,
        "warmup": FLAGS.warmup,
        "synthetic": FLAGS.synthetic,
        "mnist_dir": mnist_dir,
        "model": FLAGS.model,
    }
    if FLAGS.suite == "cluster":
        from tfdp.bench import cluster as bench_cluster

        job["settle"] = FLAGS.settle
        bench_cluster.run(
            job,
            FLAGS.rounds,
            FLAGS.cluster_slowdown,
            FLAGS.json,
            measure_in_subprocess,
            FLAGS.only,
        )
        return
    if FLAGS.suite == "gpu":
        from tfdp.bench import gpu as bench_gpu

        gpus = count_gpus()
        job["kind"] = "gpu" if gpus else "cpu"
        job["stand_in"] = None if gpus else bench_gpu.stand_in()
        specs = bench_gpu.gpu_configurations(gpus or bench_gpu.STAND_IN_GPUS)
        where = bench_gpu.header(job, gpus)
    else:
        job["kind"] = detect_kind() if FLAGS.devices == "auto" else FLAGS.devices
        where = f"{job['kind'].upper()} devices"
    if FLAGS.suite == "switches":
        specs = switch_configurations(counts)
    elif FLAGS.suite == "scaling":
        specs = configurations(
            counts,
            [float(p) for p in FLAGS.uneven_powers],
            [int(n) for n in FLAGS.workers],
            [int(n) for n in FLAGS.keras_onednn],
            [int(n) for n in FLAGS.worker_threads],
        )
    if FLAGS.only:
        specs = [s for s in specs if s.name in FLAGS.only or s.system == "matmul"]
    data = (
        "synthetic images" if FLAGS.synthetic else f"MNIST ({mnist_dir or 'tensorflow-datasets'})"
    )
    name = "LeNet" if FLAGS.model == "lenet" else FLAGS.model
    flops = (
        f"; training counted as {TRAIN_FLOPS / 1e6:.1f} MFLOP/image "
        f"(3 x {FORWARD_FLOPS / 1e6:.2f} forward)"
        if FLAGS.model == "lenet"
        else ""
    )
    print(
        f"{name} on {data}, batch {FLAGS.batch_size}, {FLAGS.iterations} timed iterations after "
        f"{FLAGS.warmup} warm-up; {FLAGS.rounds} interleaved rounds on {where}" + flops,
        flush=True,
    )
    measurements = {spec.name: [] for spec in specs}
    out = open(FLAGS.json, "a") if FLAGS.json else None
    for round_index in range(FLAGS.rounds):
        for spec in specs:
            measured = measure_in_subprocess(spec, job)
            measurements[spec.name].append(measured)
            shown = (
                f"{measured['flops_per_second'] / 1e9:.1f} GFLOP/s"
                if spec.system == "matmul"
                else f"{measured['images_per_second']:.0f} images/s"
            )
            print(f"round {round_index + 1}: {spec.name}: {shown}", flush=True)
            if out:
                record = {"round": round_index + 1, **dataclasses.asdict(spec), **job, **measured}
                out.write(json.dumps(record) + "\n")
    rows = summarize(specs, measurements, FLAGS.batch_size, FLAGS.iterations, FLAGS.model)
    print()
    print(format_table(rows, FLAGS.iterations))
    if out:
        for row in rows:
            record = {"summary": True, "suite": FLAGS.suite, **row}
            if FLAGS.suite == "gpu":
                record["stand_in"] = job["stand_in"] is not None
            out.write(json.dumps(record) + "\n")
        out.close()
    if FLAGS.plot:
        draw(rows, FLAGS.plot, f"{name}, batch {FLAGS.batch_size}, {where}")
        print(f"chart: {FLAGS.plot}")


def run() -> None:
    """Console-script entry point."""
    define_flags()
    if any(arg in ("--help", "-h", "--helpshort", "-?") for arg in sys.argv[1:]):
        # absl's --help lists only __main__'s key flags, which a console script has none of.
        print(__doc__.strip() + "\n\nflags (all: --helpfull):\n" + FLAGS.module_help(__name__))
        return
    app.run(main)


if __name__ == "__main__":
    run()
