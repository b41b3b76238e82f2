"""`python -m tfdp.bench.steps`: each variant runs and reports (speed is never asserted).

The variants are measured in this process (`bench.steps.measure`, what the command
runs); one run of the command itself checks its flags and its result line.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
from helpers import environment

from tfdp.bench import steps as bench_steps

ITERATIONS = 3  # timed steps of each measurement, after one warm-up step
# Steps the weights see with warmup=1 and ITERATIONS: one warm-up call and ITERATIONS
# timed ones of one step each, or for loop10 (10 steps per call) one call of each.
STEPS = {"loop10": 10 + 10}
STEPS_OTHERWISE = 1 + ITERATIONS

_reference = {}


@pytest.fixture(scope="module")
def mnist(mnist_dir):
    from tfdp.data.mnist import load_mnist

    return load_mnist("train", mnist_dir=mnist_dir)


def reference_weights(steps, channels_first, mnist):
    """LeNet's weights after `steps` plain SGD steps (learning rate 0.1) on the mean
    cross-entropy of the bench's batches of 1024, worked out here with a gradient tape."""
    key = steps, channels_first
    if key not in _reference:
        import tensorflow as tf

        from tfdp.data.arrays import train_dataset
        from tfdp.models import build_model, channels_first_lenet, initial_weights

        model = build_model("lenet")
        model.set_weights(initial_weights("lenet"))
        if channels_first:  # the same weights, read by a network that flattens NCHW
            model = channels_first_lenet(model)
        batches = iter(train_dataset(mnist, 1024, 0))
        for _ in range(steps):
            x, y = next(batches)
            with tf.GradientTape() as tape:
                logits = model(x)
                loss = tf.reduce_mean(
                    tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=logits)
                )
            gradients = tape.gradient(loss, model.trainable_variables)
            for variable, gradient in zip(model.trainable_variables, gradients):
                variable.assign(variable - 0.1 * gradient)
        _reference[key] = [v.numpy() for v in model.trainable_variables]
    return _reference[key]


@pytest.mark.slow
@pytest.mark.parametrize(
    "variant",
    ["clocks", "loop10", "xla_update", "micro256", "halves", "channels_first", "pool_first"],
)
def test_variant_makes_the_plain_sgd_update_and_reports_its_speed(variant, mnist):
    from tfdp.models import initial_weights

    result, model = bench_steps.measure(variant, mnist, ITERATIONS, warmup=1)
    assert result["variant"] == variant
    assert isinstance(result["onednn"], bool)
    steps = STEPS.get(variant, STEPS_OTHERWISE)
    assert result["steps"] == steps
    # the timed steps of 1024 images over the timed seconds
    timed = 10 if variant == "loop10" else ITERATIONS
    assert result["seconds"] > 0
    assert result["images_per_second"] == pytest.approx(timed * 1024 / result["seconds"], rel=1e-9)
    got = model.get_weights()
    start = initial_weights("lenet")
    expected = reference_weights(steps, variant == "channels_first", mnist)
    assert [w.shape for w in got] == [w.shape for w in expected]
    for initial, want, have in zip(start, expected, got):
        update = np.abs(want - initial).max()
        assert update > 1e-4  # not vacuous: the steps moved every weight tensor
        # The same updates to float rounding (seen: up to 1.3e-3 of the update over 20
        # steps); a learning rate 10% off, or a gradient scaled wrong, is off by ~1e-1.
        assert np.abs(have - want).max() <= 1e-2 * update


@pytest.mark.slow
def test_the_command_prints_its_result_and_saves_the_weights(mnist_dir, tmp_path):
    weights_out = tmp_path / "weights.npz"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdp.bench.steps",
            "--variant=bare",
            f"--iterations={ITERATIONS}",
            "--warmup=1",
            f"--mnist_dir={mnist_dir}",
            f"--weights_out={weights_out}",
        ],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=600,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    result = json.loads(process.stdout.strip().splitlines()[-1])
    assert result["variant"] == "bare" and result["steps"] == STEPS_OTHERWISE
    with np.load(weights_out) as saved:
        got = [saved[f"arr_{i}"] for i in range(len(saved.files))]
    from tfdp.data.mnist import load_mnist

    expected = reference_weights(STEPS_OTHERWISE, False, load_mnist("train", mnist_dir=mnist_dir))
    for want, have in zip(expected, got, strict=True):
        np.testing.assert_allclose(have, want, rtol=1e-2, atol=1e-5)


@pytest.mark.slow
def test_xla_on_the_whole_step_is_refused_by_tensorflow(mnist):
    # BUILD_NOTES says so: the step reads its batch from the iterator inside tf.function.
    with pytest.raises(Exception, match="IteratorGetNext"):
        bench_steps.measure("xla", mnist, 1, warmup=1)


@pytest.mark.slow
def test_profile_reports_time_per_kernel(mnist, tmp_path):
    result, _ = bench_steps.measure("bare", mnist, ITERATIONS, warmup=1, profile_dir=str(tmp_path))
    kernels = result["kernel_ms_per_step"]
    assert any("Conv2D" in name for name in kernels), kernels
    assert all(ms > 0 for ms in kernels.values())
    assert list(tmp_path.rglob("*.xplane.pb"))  # the trace stays for TensorBoard
    bound = result["if_only_arithmetic"]
    arithmetic = sum(ms for name, ms in kernels.items() if "Conv2D" in name or "MatMul" in name)
    assert bound["conv_and_matmul_ms_per_step"] == pytest.approx(arithmetic, abs=0.1)
    assert bound["conv_and_matmul_ms_per_step"] < bound["all_kernels_ms_per_step"]
    assert bound["bound_step_ms"] == pytest.approx(
        bound["conv_and_matmul_ms_per_step"] / bound["cores"], rel=1e-3
    )
    assert bound["speedup"] == pytest.approx(bound["step_ms"] / bound["bound_step_ms"], rel=1e-2)


def lenet_and_batch():
    """LeNet compiled as tfdp trains it, and 64 random MNIST-shaped examples."""
    import keras
    import tensorflow as tf

    from tfdp.data.mnist import synthetic_mnist
    from tfdp.models import build_model

    arrays = synthetic_mnist(num_examples=64)
    x = tf.constant(arrays.images / 255.0, tf.float32)
    y = tf.constant(arrays.labels, tf.int32)
    model = build_model("lenet")
    model.compile(
        optimizer="sgd", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    return model, x, y


def tape_gradients(model, x, y):
    """The gradients of the mean cross-entropy of `model`'s logits on (x, y)."""
    import tensorflow as tf

    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x))
        )
    return tape.gradient(loss, model.trainable_variables), loss


@pytest.mark.parametrize("pieces, side_by_side", [(2, True), (4, False)])
def test_micro_batches_sum_to_the_whole_batch(pieces, side_by_side):
    import tensorflow as tf

    model, x, y = lenet_and_batch()
    whole, whole_loss = tape_gradients(model, x, y)
    parts, loss = tf.function(bench_steps.batch_gradients)(model, (x, y), pieces, side_by_side)
    for a, b in zip(whole, parts):
        assert float(tf.reduce_max(tf.abs(a))) > 1e-4  # not vacuous
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-5 * float(tf.reduce_max(tf.abs(a)))
    assert abs(float(loss) - float(whole_loss)) < 1e-5


def test_pooling_before_tanh_is_the_same_network():
    import tensorflow as tf

    from tfdp.models import pool_first_lenet

    model, x, y = lenet_and_batch()
    copy = pool_first_lenet(model)
    names = [layer.__class__.__name__ for layer in copy.layers]
    assert names[:6] == ["Conv2D", "MaxPooling2D", "Activation"] * 2
    assert [layer.get_config().get("activation") for layer in copy.layers[:3]] == [
        "linear",
        None,
        "tanh",
    ]
    assert float(tf.reduce_max(tf.abs(model(x) - copy(x)))) <= 1e-5
    for a, b in zip(tape_gradients(model, x, y)[0], tape_gradients(copy, x, y)[0]):
        assert float(tf.reduce_max(tf.abs(a))) > 1e-4  # not vacuous
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-4 * float(tf.reduce_max(tf.abs(a)))
