"""`python -m tfdp.bench.steps`: variants of one single-device training step, timed.

The figures in BUILD_NOTES ("oneDNN's CPU kernels: on by default") come from this: LeNet,
batch 1024, one variant per process, warm-up first, then `--iterations` timed
steps. Run the variants interleaved, one process each:

  for round in 1 2; do for v in bare clocks loop10 inter_op1 xla_update micro256 halves channels_first fit; do
    python -m tfdp.bench.steps --variant=$v --mnist_dir=../shared/data/mnist
  done; done

Set TF_ENABLE_ONEDNN_OPTS=0 (or TFDP_ONEDNN=tensorflow) to time them without
oneDNN's kernels.

`--profile_dir=DIR` traces the timed steps with TensorFlow's profiler (the trace
is in DIR, for TensorBoard's profile plugin) and adds the milliseconds per step
of each kernel, summed over the trace, to the result (`kernel_ms_per_step`).
Kernels that run at the same time on different threads each count in full.
It also adds a bound (`if_only_arithmetic`): the step if its convolution and
matmul kernels, the ones that do LeNet's counted FLOPs, kept every core busy
and everything else took no time, and the speed-up that would be; tfdp-bench's
fraction of peak times that speed-up is as high as this step could go with
these kernels.
"""

from __future__ import annotations

import collections
import contextlib
import glob
import json
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from absl import app, flags  # noqa: E402

from tfdp import onednn  # noqa: E402

onednn.enable_by_default()  # an entry point: before TensorFlow is imported

VARIANTS = {
    "bare": "tf.function step: forward, backward, SGD",
    "clocks": "the same, with the host clock read around the work (engine/clock.py), as timed",
    "loop10": "10 steps per tf.function call, in a tf.range loop",
    "inter_op1": "the bare step with inter_op_parallelism_threads=1",
    "xla": "the bare step with jit_compile=True",
    "xla_update": "jit_compile=True on forward, backward and SGD; the input read outside it",
    "micro256": "4 micro-batches of 256 per step, one after another (a tf.range loop), gradients summed",
    "halves": "2 micro-batches of 512 per step, side by side (independent ops), gradients summed",
    "channels_first": "the bare step on an NCHW copy of LeNet (Keras data_format='channels_first')",
    "pool_first": "halves, on a copy of LeNet with each max-pooling before its tanh (the same function)",
    "fit": "Keras model.fit on the same model, data and batch",
}

FLAGS = flags.FLAGS


def define_flags() -> None:
    """The command's flags, defined when it runs (a module that imports this one for its
    functions, a test among them, gets none of them, so no flag of tfdp's is redefined)."""
    if "variant" in FLAGS:
        return
    flags.DEFINE_enum("variant", "bare", list(VARIANTS), "Which step to time.")
    flags.DEFINE_integer("iterations", 50, "Timed steps.")
    flags.DEFINE_integer("warmup", 5, "Untimed steps first.")
    flags.DEFINE_string("mnist_dir", None, "MNIST IDX files (default: $TFDP_MNIST_DIR, else tfds).")
    flags.DEFINE_string(
        "profile_dir", None, "Trace the timed steps here and report time per kernel."
    )
    flags.DEFINE_integer("top_kernels", 12, "With --profile_dir: how many kernels to report.")
    flags.DEFINE_string(
        "weights_out",
        None,
        "Save the model's weights after the last step here (.npz), to check them.",
    )


def main(argv) -> None:
    import tensorflow as tf

    from tfdp.data.mnist import load_mnist

    if FLAGS.variant == "inter_op1":
        tf.config.threading.set_inter_op_parallelism_threads(1)
    arrays = load_mnist("train", mnist_dir=FLAGS.mnist_dir or os.environ.get("TFDP_MNIST_DIR"))
    result, model = measure(
        FLAGS.variant, arrays, FLAGS.iterations, FLAGS.warmup, FLAGS.profile_dir, FLAGS.top_kernels
    )
    if FLAGS.weights_out:
        import numpy as np

        np.savez(FLAGS.weights_out, *model.get_weights())
    print(json.dumps(result))


def batch_gradients(model, batch, pieces=1, side_by_side=True):
    """(gradients, loss) of the model's compiled loss on `batch` (its mean over the batch),
    from `pieces` equal micro-batches whose losses are weighed by their examples and whose
    gradients are summed: the whole batch's, to float rounding.

    side_by_side: the micro-batches' ops are independent, and TensorFlow may run them at
    the same time; else they run one after another (a tf.range loop).
    """
    import tensorflow as tf

    def piece(x, y):
        with tf.GradientTape() as tape:
            loss = model.compute_loss(x, y, model(x, training=True)) / pieces
        return tape.gradient(loss, model.trainable_variables), loss

    x, y = batch
    if pieces == 1:
        return piece(x, y)
    if side_by_side:
        results = [piece(xp, yp) for xp, yp in zip(tf.split(x, pieces), tf.split(y, pieces))]
        gradients = [tf.add_n(list(g)) for g in zip(*[g for g, _ in results])]
        return gradients, tf.add_n([loss for _, loss in results])
    xs = tf.reshape(x, [pieces, -1, *x.shape[1:]])
    ys = tf.reshape(y, [pieces, -1, *y.shape[1:]])
    gradients = [tf.zeros_like(v) for v in model.trainable_variables]
    loss = tf.constant(0.0)
    for i in tf.range(pieces):
        part_gradients, part_loss = piece(xs[i], ys[i])
        gradients = [g + p for g, p in zip(gradients, part_gradients)]
        loss += part_loss
    return gradients, loss


def measure(variant, arrays, iterations, warmup, profile_dir=None, top_kernels=12):
    """Times `iterations` steps of `variant` on `arrays` (batches of 1024) after `warmup`
    untimed ones; returns (the result line's fields, the model after the last step)."""
    import keras
    import tensorflow as tf

    from tfdp.data.arrays import train_dataset
    from tfdp.engine import clock, shards
    from tfdp.engine.steps import DeviceWork
    from tfdp.models import (
        build_model,
        channels_first_lenet,
        initial_weights,
        pool_first_lenet,
    )

    batch = 1024
    dataset = train_dataset(arrays, batch, 0)
    model = build_model("lenet")
    model.set_weights(initial_weights("lenet"))
    if variant == "channels_first":
        model = channels_first_lenet(model)
    if variant == "pool_first":
        model = pool_first_lenet(model)
    model.compile(  # LeNet's compiled loss, as tfdp trains it
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=False,
    )
    optimizer = model.optimizer
    optimizer.build(model.trainable_variables)
    work = DeviceWork(model)

    def update(batch_data):
        if variant == "clocks":  # the host clock read around the work, as a timed step reads it
            start = clock.read_after(tf.nest.flatten(batch_data)[0])
            with tf.control_dependencies([start]):
                batch_data = tf.nest.map_structure(tf.identity, batch_data)
            with shards.handing_over(model):
                _, gradients, _ = work.train(batch_data, batch)
            end = clock.read_after(*gradients)
            with tf.control_dependencies([end]):
                gradients = [tf.identity(g) for g in gradients]
            loss = model.get_metrics_result()["loss"]
        elif variant == "micro256":
            gradients, loss = batch_gradients(model, batch_data, 4, side_by_side=False)
        elif variant in ("halves", "pool_first"):
            gradients, loss = batch_gradients(model, batch_data, 2, side_by_side=True)
        else:
            gradients, loss = batch_gradients(model, batch_data)
        optimizer.apply_gradients(zip(gradients, model.trainable_variables))
        return {"loss": loss}

    if variant == "xla_update":
        update = tf.function(update, jit_compile=True)

    def step(iterator):
        return update(next(iterator))

    steps_per_call = 10 if variant == "loop10" else 1

    def steps(iterator):
        metrics = step(iterator)
        for _ in tf.range(steps_per_call - 1):
            metrics = step(iterator)
        return metrics

    if variant == "fit":
        model.fit(dataset, steps_per_epoch=warmup, epochs=1, verbose=0)
        steps_run = warmup + iterations
        with profiled(profile_dir):
            start = time.perf_counter()
            model.fit(dataset, steps_per_epoch=iterations, epochs=1, verbose=0)
            seconds = time.perf_counter() - start
    else:
        call = tf.function(steps, jit_compile=True if variant == "xla" else None)
        iterator = iter(dataset)
        warmup_calls = max(1, warmup // steps_per_call)
        for _ in range(warmup_calls):
            metrics = call(iterator)
        float(metrics["loss"])
        calls = max(1, iterations // steps_per_call)
        steps_run = (warmup_calls + calls) * steps_per_call
        with profiled(profile_dir):
            start = time.perf_counter()
            for _ in range(calls):
                metrics = call(iterator)
            float(metrics["loss"])
            seconds = time.perf_counter() - start
        iterations = calls * steps_per_call
    result = {
        "variant": variant,
        "what": VARIANTS[variant],
        "onednn": onednn.enabled(),
        "images_per_second": iterations * batch / seconds,
        "seconds": seconds,  # of the timed steps
        "steps": steps_run,  # all of them, the warm-up's too: the updates the weights saw
    }
    if profile_dir:
        totals = kernel_seconds(profile_dir)
        top = sorted(totals.items(), key=lambda item: -item[1])[:top_kernels]
        result["kernel_ms_per_step"] = {k: round(1000 * s / iterations, 2) for k, s in top}
        result["if_only_arithmetic"] = arithmetic_bound(totals, seconds / iterations, iterations)
    return result, model


@contextlib.contextmanager
def profiled(logdir):
    """TensorFlow's profiler around the block, when `logdir` is given."""
    import tensorflow as tf

    if logdir:
        tf.profiler.experimental.start(logdir)
    try:
        yield
    finally:
        if logdir:
            tf.profiler.experimental.stop()


def arithmetic_bound(kernel_totals: dict[str, float], step_seconds: float, steps: int) -> dict:
    """The step if only its convolution and matmul kernels ran, on every core at once.

    `kernel_totals` are seconds per kernel type over the `steps` timed steps
    (`kernel_seconds`), `step_seconds` the measured time per step.
    """
    arithmetic = sum(s for k, s in kernel_totals.items() if "Conv2D" in k or "MatMul" in k)
    cores = len(os.sched_getaffinity(0))
    bound = arithmetic / steps / cores
    return {
        "conv_and_matmul_ms_per_step": round(1000 * arithmetic / steps, 2),
        "all_kernels_ms_per_step": round(1000 * sum(kernel_totals.values()) / steps, 2),
        "cores": cores,
        "step_ms": round(1000 * step_seconds, 2),
        "bound_step_ms": round(1000 * bound, 2),
        "speedup": round(step_seconds / bound, 3),
    }


def kernel_seconds(logdir) -> dict[str, float]:
    """Seconds per kernel type in the newest trace under `logdir`, summed over threads.

    The executor's events are named "node:KernelType"; events of TensorFlow's own
    machinery ("ExecutorState::Process", ...) and whole function calls are left out.
    """
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    paths = glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)
    space = xplane_pb2.XSpace()
    with open(max(paths, key=os.path.getmtime), "rb") as f:
        space.ParseFromString(f.read())
    totals = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                kernel = name.rsplit(":", 1)[-1]
                if ":" in name and "::" not in name and kernel.isidentifier():
                    if not kernel.startswith("__inference"):  # a whole tf.function call
                        totals[kernel] += event.duration_ps / 1e12
    return dict(totals)


if __name__ == "__main__":
    define_flags()
    app.run(main)
