"""tfdp.MirroredStrategy as a tf.distribute strategy: TensorFlow's own ways of writing a
distributed loop (a `tf.function` handed to `run`, composite arguments, the distributed
dataset's type and static shapes, graph mode, `tf.nn.compute_average_loss`,
`distribute_datasets_from_function`, `reduce`, BatchNormalization, assignments in a
replica) behave as under TensorFlow's MirroredStrategy, and give one device's numbers
with uneven shares (1:3 on two logical CPUs).

Each test compares with TensorFlow's own strategy, with the same code on one device, or
with a value recomputed by hand.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from test_strategy import (
    CLASSES,
    DEVICES,
    assert_same_results,
    batch_normalized,
    examples,
    functional,
    strategy,
    tensorflows_strategy,
)
from test_strategy import run as fit_and_read

import tfdp

_tensorflows = []


def tensorflows():
    """One TensorFlow MirroredStrategy for this module (collective keys of its own)."""
    if not _tensorflows:
        _tensorflows.append(tensorflows_strategy())
    return _tensorflows[0]


SHARES = {"tensorflow": None, "even": None, "uneven": (1, 3)}


def under(kind):
    return tensorflows() if kind == "tensorflow" else strategy(SHARES[kind])


# -- run -----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["tensorflow", "even", "uneven"])
def test_a_tf_function_step_handed_to_run_trains(kind):
    """The everyday form: a @tf.function step that applies its gradients, handed to `run`.
    TensorFlow lifts the function over the replicas (its optimizer's sync point works in
    it): each replica's gradient 2 is summed, 1 - 0.1 * 4 = 0.6."""
    made = under(kind)
    with made.scope():
        v = tf.Variable(1.0)
        optimizer = keras.optimizers.SGD(0.1)
        optimizer.build([v])

    @tf.function
    def step():
        with tf.GradientTape() as tape:
            loss = 2.0 * v
        optimizer.apply_gradients(zip(tape.gradient(loss, [v]), [v]))
        return loss

    made.run(step)
    assert v.numpy() == pytest.approx(0.6)


@pytest.mark.parametrize("kind", ["tensorflow", "uneven"])
def test_a_tf_function_reads_each_replicas_own_value(kind):
    """Inside a lifted tf.function every replica reads its own value of a per-replica
    argument, and a merge_call (a sync point) works."""
    made = under(kind)
    values = made.experimental_distribute_values_from_function(
        lambda context: tf.constant(float(context.replica_id_in_sync_group + 1))
    )

    @tf.function
    def doubled(x):
        context = tf.distribute.get_replica_context()
        total = context.merge_call(lambda s, v: s.reduce("SUM", v, axis=None), args=(x,))
        return 2.0 * x + 0.0 * total

    got = made.experimental_local_results(made.run(doubled, args=(values,)))
    assert [float(g) for g in got] == [2.0, 4.0]


@pytest.mark.parametrize("kind", ["tensorflow", "uneven"])
def test_a_composite_argument_is_handed_on_intact(kind):
    """An IndexedSlices whose dense_shape is a Python tuple (a scatter's update): not a
    batch; it reaches the replica as it is."""
    made = under(kind)
    with made.scope():
        table = tf.Variable(tf.zeros([4]), aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA)
    rows = tf.IndexedSlices(tf.constant([1.0, 2.0]), tf.constant([0, 2]), (4,))

    def scatter(update):
        table.scatter_add(update)
        return update.values

    made.run(scatter, args=(rows,))
    np.testing.assert_array_equal(table.numpy(), [1.0, 0.0, 2.0, 0.0])


# -- the distributed dataset ---------------------------------------------------------------


@pytest.mark.parametrize("kind", ["even", "uneven"])
def test_the_distributed_dataset_is_tensorflows_kind(kind):
    """A DistributedDataset, as TensorFlow's strategy returns: two iterators of it have equal
    type specs (a tf.function taking one traces once), it keeps its cloned datasets."""
    made = under(kind)
    dataset = tf.data.Dataset.range(32).batch(8, drop_remainder=True)
    distributed = made.experimental_distribute_dataset(dataset)
    assert type(distributed) is type(tensorflows().experimental_distribute_dataset(dataset))
    assert iter(distributed)._type_spec == iter(distributed)._type_spec  # noqa: SLF001
    assert len(distributed._cloned_datasets) == 1  # noqa: SLF001

    traces = []

    @tf.function
    def first(iterator):
        traces.append(1)
        return made.experimental_local_results(next(iterator))

    for _ in range(3):
        first(iter(distributed))
    assert len(traces) == 1


def test_even_shares_keep_tensorflows_static_shapes():
    """A drop_remainder batch keeps its static size per replica, as TensorFlow's cut gives
    it (what XLA and a GPU's kernels are compiled for); a SparseTensor's other dimensions too."""
    dataset = tf.data.Dataset.range(32).map(lambda i: (tf.fill([3], i), tf.sparse.eye(2, 5)))
    dataset = dataset.batch(8, drop_remainder=True)
    ours = strategy(None).experimental_distribute_dataset(dataset)
    theirs = tensorflows().experimental_distribute_dataset(dataset)
    assert ours.element_spec == theirs.element_spec
    assert ours.element_spec[0]._value_specs[0].shape == [4, 3]  # noqa: SLF001


def test_graph_mode_makes_no_variable_in_the_users_graph():
    """In a tf.compat.v1 graph, the strategy adds nothing to the graph: a user's unnamed
    variable is still `Variable:0`, and a dataset distributes."""
    with tf.Graph().as_default():
        made = tfdp.MirroredStrategy(DEVICES)
        assert tf.compat.v1.global_variables() == []
        assert tf.Variable(1.0).name == "Variable:0"
        distributed = made.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(4))
        assert distributed is not None


# -- TensorFlow's loss arithmetic ------------------------------------------------------------


def tutorial_loop(made, data, average="without global batch"):
    """TensorFlow's custom-training tutorial: a distributed dataset (or a dataset function),
    `compute_average_loss`, `scale_regularization_loss`, `run`, `reduce`. Returns the
    weights after 2 epochs and the losses it reduced."""
    global_batch = 64
    with made.scope():
        keras.utils.set_random_seed(2)
        model = functional()
        model.build((None, 4))
        optimizer = keras.optimizers.SGD(0.2)
        optimizer.build(model.trainable_variables)
        per_example = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    x, y = examples(200)  # the last batch holds 8 rows

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            logits = model(features, training=True)
            if average == "without global batch":
                loss = tf.nn.compute_average_loss(per_example(labels, logits))
            else:
                loss = tf.nn.compute_average_loss(per_example(labels, logits),
                                                  global_batch_size=global_batch)
            loss += tf.nn.scale_regularization_loss(tf.add_n(model.losses))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    @tf.function
    def train_step(inputs):
        return made.reduce(tf.distribute.ReduceOp.SUM, made.run(step, args=(inputs,)), axis=None)

    if data == "dataset":
        batches = made.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(global_batch))
    else:  # data == "dataset function"
        def dataset_fn(context):
            size = context.get_per_replica_batch_size(global_batch)
            return tf.data.Dataset.from_tensor_slices((x, y)).batch(size)

        batches = made.distribute_datasets_from_function(dataset_fn)
    losses = [float(train_step(batch)) for _ in range(2) for batch in batches]
    return model.get_weights(), losses


def one_device(average="without global batch"):
    return tutorial_loop(tf.distribute.OneDeviceStrategy("/cpu:0"), "dataset", average)


@pytest.mark.parametrize("data", ["dataset", "dataset function"])
def test_the_tutorials_loop_without_a_global_batch_is_one_device(data):
    """`tf.nn.compute_average_loss` without `global_batch_size` divides by the replica's
    rows times the replicas: under tfdp's strategy it is the replica's part of the whole
    batch's mean, so the tutorial's loop gives one device's weights and losses whatever
    the pieces (and a short last batch)."""
    expected = one_device()
    got = tutorial_loop(strategy(), data)
    for e, g in zip(expected[0], got[0]):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-5)


def test_without_the_replacement_the_tutorials_loop_is_not_one_device(monkeypatch):
    """The check above can fail: TensorFlow's own division is off under uneven pieces."""
    from tfdp.engine.patches import ORIGINALS

    expected = one_device()
    original = ORIGINALS["compute_average_loss"]
    monkeypatch.setattr(tf.nn, "compute_average_loss", original)
    got = tutorial_loop(strategy(), "dataset")
    assert max(np.abs(e - g).max() for e, g in zip(expected[0], got[0])) > 1e-4


def test_a_given_global_batch_is_tensorflows_arithmetic():
    """With `global_batch_size`, TensorFlow's arithmetic, as on one device (the short last
    batch divided by 64 there too)."""
    expected = one_device(average="global batch")
    got = tutorial_loop(strategy(), "dataset", average="global batch")
    for e, g in zip(expected[0], got[0]):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)


def test_a_dataset_function_is_cut_by_share():
    """`distribute_datasets_from_function` under powers [1, 3]: 16 and 48 of a global 64."""
    made = strategy()

    def dataset_fn(context):
        return tf.data.Dataset.range(128).batch(context.get_per_replica_batch_size(64))

    pieces = [[len(p) for p in made.experimental_local_results(batch)]
              for batch in made.distribute_datasets_from_function(dataset_fn)]
    assert pieces == [[16, 48], [16, 48]]


def test_a_dataset_functions_batches_make_the_global_batch_cut_by_share():
    """Without `get_per_replica_batch_size`: the replicas' batches taken together (3 + 3,
    then 3 + 1 at the end) are the global batch, cut 1:3."""
    made = strategy()
    batches = made.distribute_datasets_from_function(lambda context: tf.data.Dataset.range(10).batch(3))
    pieces = [[list(p.numpy()) for p in made.experimental_local_results(b)] for b in batches]
    assert pieces == [[[0, 1], [2, 3, 4, 5]], [[6], [7, 8, 9]]]


@pytest.mark.parametrize("lazy", ["model", "optimizer"])
def test_variables_built_inside_a_distributed_function_are_one_line(lazy):
    """The tutorial as published builds the model on its first call and the optimizer on
    its first apply_gradients, inside the step, which TensorFlow cannot run on several
    replicas (its own strategy fails when the step runs): one line names the fix."""
    made = strategy()
    with made.scope():
        model = keras.Sequential([keras.layers.Dense(CLASSES)])
        optimizer = keras.optimizers.SGD(0.1) if lazy == "model" else keras.optimizers.Adam()
        if lazy == "optimizer":
            model.build((None, 4))
    x, y = examples(32)

    def step(inputs):
        features, labels = inputs
        with tf.GradientTape() as tape:
            loss = tf.nn.compute_average_loss(
                keras.losses.sparse_categorical_crossentropy(labels, model(features), from_logits=True))
        optimizer.apply_gradients(zip(tape.gradient(loss, model.trainable_variables),
                                      model.trainable_variables))
        return loss

    @tf.function
    def train_step(inputs):
        return made.run(step, args=(inputs,))

    batches = made.experimental_distribute_dataset(tf.data.Dataset.from_tensor_slices((x, y)).batch(16))
    named = "layer='dense" if lazy == "model" else "optimizer='adam"
    with pytest.raises(Exception, match=named + r".*model.build\(input_shape\); "
                                        r"optimizer.build\(model.trainable_variables\)"):
        train_step(next(iter(batches)))


# -- reduce --------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["SUM", "MEAN"])
def test_reduce_of_uneven_pieces_is_the_batch_eagerly_and_in_a_function(op):
    """Per-example values whose pieces differ in rows, reduced with axis=None: the batch they
    were cut from, the same eagerly and in a tf.function (TensorFlow's AddN cannot add them)."""
    made = strategy()
    batch = next(iter(made.experimental_distribute_dataset(tf.data.Dataset.range(8).batch(8))))
    eager = made.reduce(op, batch, axis=None)
    traced = tf.function(lambda b: made.reduce(op, b, axis=None))(batch)
    np.testing.assert_array_equal(eager, np.arange(8))
    np.testing.assert_array_equal(traced, np.arange(8))


def test_reduce_of_equal_pieces_is_tensorflows():
    dataset = tf.data.Dataset.range(8).batch(8)
    sums = []
    for made in (tensorflows(), strategy(None)):
        batch = next(iter(made.experimental_distribute_dataset(dataset)))
        sums.append(tf.function(lambda b, s=made: s.reduce("SUM", b, axis=None))(batch).numpy())
    np.testing.assert_array_equal(sums[1], sums[0])
    np.testing.assert_array_equal(sums[1], [4, 6, 8, 10])


# -- BatchNormalization and assignments in a replica ---------------------------------------


def test_batch_normalization_uses_the_whole_batchs_statistics():
    """By default a BatchNormalization layer (not synchronized) normalizes each piece by
    the whole batch's statistics: fit, evaluate and predict are one device's."""
    make = batch_normalized()
    x, y = examples(193)
    arguments = lambda: dict(x=x, y=y, batch_size=64, epochs=2, shuffle=False)  # noqa: E731
    assert_same_results(fit_and_read(make, arguments()), fit_and_read(make, arguments(), strategy()))


def test_fine_tuning_with_batch_normalization_trainable_again_is_one_device():
    """keras.io's fine-tuning recipe: a base with BatchNormalization frozen, then trainable
    again (the layer called in training mode), under uneven shares."""

    def make():
        keras.utils.set_random_seed(4)
        base = keras.Sequential([keras.layers.Dense(6), keras.layers.BatchNormalization(momentum=0.5)])
        base.build((None, 4))
        base.trainable = False  # first frozen (its statistics too), then trained again
        inputs = keras.Input((4,))
        model = keras.Model(inputs, keras.layers.Dense(CLASSES)(base(inputs)))
        base.trainable = True
        model.compile(keras.optimizers.SGD(0.1), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = examples(128)
    arguments = lambda: dict(x=x, y=y, batch_size=64, epochs=2, shuffle=False)  # noqa: E731
    assert_same_results(fit_and_read(make, arguments()), fit_and_read(make, arguments(), strategy()))


def test_batch_statistics_by_replica_stay_as_an_option():
    """batch_statistics="replica": each piece's own statistics (as TensorFlow's strategy),
    which with pieces of 16 and 48 rows is not one device's update."""
    make = batch_normalized()
    x, y = examples(64)
    arguments = lambda: dict(x=x, y=y, batch_size=64, epochs=1, shuffle=False)  # noqa: E731
    by_replica = tfdp.MirroredStrategy(DEVICES, powers=[1, 3], batch_statistics="replica")
    expected = fit_and_read(make, arguments())
    got = fit_and_read(make, arguments(), by_replica)
    assert max(np.abs(e - g).max() for e, g in zip(expected["weights"], got["weights"])) > 1e-4
    with pytest.raises(tfdp.ConfigError, match=r"batch_statistics='pieces'.*whole, replica"):
        tfdp.MirroredStrategy(DEVICES, batch_statistics="pieces")


def test_other_assignments_in_a_replica_keep_each_replicas_value():
    """Only BatchNormalization's moving statistics are combined by share: any other
    variable a replica assigns keeps each replica's own value, as TensorFlow keeps it."""
    results = []
    for made in (tensorflows(), strategy()):
        with made.scope():
            seen = tf.Variable(0.0, trainable=False)
        rows = made.experimental_distribute_dataset(tf.data.Dataset.range(1, 5).map(
            lambda i: tf.cast(i, tf.float32)).batch(4))

        @tf.function
        def note(batch, s=made, v=seen):
            def replica(piece):
                v.assign(tf.reduce_sum(piece))
                return piece

            s.run(replica, args=(batch,))

        note(next(iter(rows)))
        results.append([float(x) for x in made.experimental_local_results(seen)])
    assert results[0] == [3.0, 7.0]  # TensorFlow: [1, 2] and [3, 4]
    assert results[1] == [1.0, 9.0]  # tfdp, 1:3: [1] and [2, 3, 4], each its own


@pytest.mark.parametrize("rate", [0.0, 0.5])
def test_random_layers_draw_other_masks_than_one_device(rate):
    """What cannot be one device's: a Dropout layer's masks are drawn per piece. At rate 0
    the same model is one device's, so the difference is the masks alone."""

    def make():
        keras.utils.set_random_seed(5)
        model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(16, activation="relu"),
                                  keras.layers.Dropout(rate, seed=1), keras.layers.Dense(CLASSES)])
        model.compile(keras.optimizers.SGD(0.2), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        return model

    x, y = examples(64)
    arguments = lambda: dict(x=x, y=y, batch_size=64, epochs=1, shuffle=False)  # noqa: E731
    expected, got = fit_and_read(make, arguments()), fit_and_read(make, arguments(), strategy())
    difference = max(np.abs(e - g).max() for e, g in zip(expected["weights"], got["weights"]))
    if rate:
        assert difference > 1e-4
    else:
        assert difference < 1e-5
