"""A device's shard cut into side-by-side chains gives the shard's gradient."""

import pytest


@pytest.mark.parametrize("examples, chains", [(64, 2), (63, 4), (2, 3)])
def test_chains_sum_to_the_whole_shard(examples, chains):
    import tensorflow as tf

    from tfdp.data import synthetic_mnist
    from tfdp.models import build_model
    from tfdp.steps import replica_gradients

    arrays = synthetic_mnist(num_examples=examples)
    x = tf.constant(arrays.images / 255.0, tf.float32)
    y = tf.constant(arrays.labels, tf.int32)
    model = build_model("lenet")
    step = tf.function(replica_gradients)
    whole, whole_metrics = step(model, x, y, 1024)
    parts, metrics = step(model, x, y, 1024, chains)
    for a, b in zip(whole, parts):
        assert float(tf.reduce_max(tf.abs(a))) > 1e-6  # not vacuous
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-5 * float(tf.reduce_max(tf.abs(a)))
    assert float(metrics["correct"]) == float(whole_metrics["correct"])
    assert float(metrics["loss_sum"]) == pytest.approx(float(whole_metrics["loss_sum"]), rel=1e-6)


def test_cut_sizes_differ_by_at_most_one():
    import tensorflow as tf

    from tfdp.steps import cut

    pieces = cut(tf.range(10), 4)
    assert [int(tf.size(p)) for p in pieces] == [3, 3, 2, 2]
    assert tf.concat(pieces, 0).numpy().tolist() == list(range(10))
