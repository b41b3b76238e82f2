"""A device's shard cut into side-by-side chains gives the shard's gradient and logs."""

import pytest


@pytest.mark.parametrize("examples, chains", [(64, 2), (63, 4), (2, 3)])
def test_chains_sum_to_the_whole_shard(examples, chains):
    """The model's train_step on a shard cut into chains hands over the gradient of the
    shard's part of a 1024-example batch's mean loss, recomputed here with a tape."""
    import tensorflow as tf

    from tfdp.config import Config
    from tfdp.data.mnist import synthetic_mnist
    from tfdp.engine import shards
    from tfdp.engine.steps import DeviceWork
    from tfdp.models import built_in

    arrays = synthetic_mnist(num_examples=examples)
    x = tf.constant(arrays.images / 255.0, tf.float32)
    y = tf.constant(arrays.labels, tf.int32)
    model = built_in(Config(), build=True)

    def gradients(pieces):
        work = DeviceWork(model, pieces)

        @tf.function(autograph=False)
        def step():
            with shards.handing_over(model):
                return work.train((x, y), 1024)[1]

        model.reset_metrics()
        return step(), model.get_metrics_result()

    whole, whole_logs = gradients(1)
    parts, logs = gradients(chains)
    with tf.GradientTape() as tape:
        mean = tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=y, logits=model(x))
        )
        loss = mean * examples / 1024
    expected = tape.gradient(loss, model.trainable_variables)
    for a, b, c in zip(whole, parts, expected):
        assert float(tf.reduce_max(tf.abs(c))) > 1e-6  # not vacuous
        scale = float(tf.reduce_max(tf.abs(c)))
        assert float(tf.reduce_max(tf.abs(a - c))) <= 1e-5 * scale
        assert float(tf.reduce_max(tf.abs(b - c))) <= 1e-5 * scale
    # the logs: the shard's mean loss and accuracy, however it was cut
    assert float(logs["loss"]) == pytest.approx(float(mean), rel=1e-5)
    assert float(whole_logs["loss"]) == pytest.approx(float(mean), rel=1e-5)
    assert float(logs["accuracy"]) == pytest.approx(float(whole_logs["accuracy"]), abs=1e-7)


def test_cut_sizes_differ_by_at_most_one():
    import tensorflow as tf

    from tfdp.engine.pieces import cut_evenly as cut

    pieces = cut(tf.range(10), 4)
    assert [int(tf.size(p)) for p in pieces] == [3, 3, 2, 2]
    assert tf.concat(pieces, 0).numpy().tolist() == list(range(10))


def test_cut_cuts_every_leaf_of_a_nested_batch_alike():
    import tensorflow as tf

    from tfdp.engine.pieces import cut_evenly as cut

    batch = ({"a": tf.range(10), "b": tf.reshape(tf.range(20), [10, 2])}, tf.range(10) * 10)
    pieces = cut(batch, 3)
    assert [int(p[0]["a"].shape[0]) for p in pieces] == [4, 3, 3]
    assert pieces[1][0]["b"].numpy().tolist() == [[8, 9], [10, 11], [12, 13]]
    assert pieces[2][1].numpy().tolist() == [70, 80, 90]
