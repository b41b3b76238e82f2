"""A device's shard cut into side-by-side chains gives the shard's gradient."""

import numpy as np
import pytest


@pytest.mark.parametrize("examples, chains", [(64, 2), (63, 4), (2, 3)])
def test_chains_sum_to_the_whole_shard(examples, chains):
    import tensorflow as tf

    from tfdp.config import Config
    from tfdp.data import synthetic_mnist
    from tfdp.models import build_model, built_in_spec
    from tfdp.steps import replica_gradients

    arrays = synthetic_mnist(num_examples=examples)
    x = tf.constant(arrays.images / 255.0, tf.float32)
    y = tf.constant(arrays.labels, tf.int32)
    model = build_model("lenet")
    objective = built_in_spec(Config()).objective
    step = tf.function(replica_gradients)
    whole, whole_loss, whole_outputs = step(model, objective, (x, y), 1024)
    parts, loss, outputs = step(model, objective, (x, y), 1024, chains)
    for a, b in zip(whole, parts):
        assert float(tf.reduce_max(tf.abs(a))) > 1e-6  # not vacuous
        assert float(tf.reduce_max(tf.abs(a - b))) <= 1e-5 * float(tf.reduce_max(tf.abs(a)))
    np.testing.assert_allclose(outputs.numpy(), whole_outputs.numpy(), rtol=1e-5, atol=1e-6)
    assert float(loss) == pytest.approx(float(whole_loss), rel=1e-6)
    # the loss is the batch's summed cross-entropy over 1024, recomputed from the logits
    expected = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=whole_outputs)
    assert float(loss) == pytest.approx(float(tf.reduce_sum(expected)) / 1024, rel=1e-5)


def test_cut_sizes_differ_by_at_most_one():
    import tensorflow as tf

    from tfdp.steps import cut

    pieces = cut(tf.range(10), 4)
    assert [int(tf.size(p)) for p in pieces] == [3, 3, 2, 2]
    assert tf.concat(pieces, 0).numpy().tolist() == list(range(10))


def test_cut_cuts_every_leaf_of_a_nested_batch_alike():
    import tensorflow as tf

    from tfdp.steps import cut

    batch = ({"a": tf.range(10), "b": tf.reshape(tf.range(20), [10, 2])}, tf.range(10) * 10)
    pieces = cut(batch, 3)
    assert [int(p[0]["a"].shape[0]) for p in pieces] == [4, 3, 3]
    assert pieces[1][0]["b"].numpy().tolist() == [[8, 9], [10, 11], [12, 13]]
    assert pieces[2][1].numpy().tolist() == [70, 80, 90]
