"""`tfdp.fit` takes data as `model.fit` does, in every mode, and ends where `model.fit` on
one device ends: the same History, the same weights, the batch hooks called at the same
batches with the weights current at each.

The cases a Keras user meets: a batch larger than the data, a short last batch, a batch
with fewer examples than devices (a device gets none), inputs as a tuple, list or dict,
validation data in each form `fit` takes, class weights on a PyDataset or a generator, a
stream of unknown length, epochs that end at a pass's end, a non-finite loss (trained on,
as Keras does; TerminateOnNaN stops it), batches whose shape changes every step (a
`padded_batch` of text, a generator), an optional input given None (in arrays, by a
generator, by a Dataset), ragged batches from a generator, a dict of mixed
dtypes with a string, and what the model was compiled with
(`steps_per_execution`, `run_eagerly`, `jit_compile`, `loss_weights`)."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from helpers import with_an_optional_input

import tfdp
from tfdp import internals

FEATURES, CLASSES = 4, 3
MODES = {
    "single": {"mode": "single"},
    "mirrored 2": {"mode": "mirrored", "devices": "cpu:0,cpu:1"},
    "weighted [1, 3]": {"mode": "weighted", "devices": "cpu:0,cpu:1", "powers": (1, 3)},
}


def examples(n, seed=3):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, FEATURES)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int32) + (x[:, 1] > 0).astype(np.int32)
    return x, y


def classifier(**compiled):
    keras.utils.set_random_seed(2)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2, momentum=0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
        **compiled,
    )
    return model


def one_hot_with_f1():
    """A classifier on one-hot targets whose F1Score logs one value per class."""
    keras.utils.set_random_seed(2)
    inputs = keras.Input((FEATURES,))
    model = keras.Model(inputs, keras.layers.Dense(CLASSES, activation="softmax")(inputs))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss="categorical_crossentropy",
        metrics=[keras.metrics.F1Score()],
    )
    return model


def two_inputs(named=False):
    keras.utils.set_random_seed(2)
    a = keras.Input((2,), name="a")
    b = keras.Input((2,), name="b")
    joined = keras.layers.Concatenate()([keras.layers.Dense(5)(a), keras.layers.Dense(5)(b)])
    model = keras.Model({"a": a, "b": b} if named else [a, b], keras.layers.Dense(CLASSES)(joined))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def two_outputs():
    keras.utils.set_random_seed(2)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(8, activation="tanh")(inputs)
    model = keras.Model(
        inputs,
        {
            "kind": keras.layers.Dense(CLASSES, name="kind")(hidden),
            "size": keras.layers.Dense(1, name="size")(hidden),
        },
    )
    model.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss={"kind": keras.losses.SparseCategoricalCrossentropy(from_logits=True), "size": "mse"},
        loss_weights={"kind": 1.0, "size": 0.25},
        metrics={"kind": ["accuracy"], "size": ["mae"]},
    )
    return model


class Batches(keras.utils.PyDataset):
    """A PyDataset of (x, y) batches."""

    def __init__(self, x, y, size):
        super().__init__()
        self.x, self.y, self.size = x, y, size

    def __len__(self):
        return -(-len(self.x) // self.size)

    def __getitem__(self, index):
        rows = slice(index * self.size, (index + 1) * self.size)
        return self.x[rows], self.y[rows]


def forever(x, y, size, weights=None):
    """An endless generator of (x, y) batches, or (x, y, sample weights) ones where
    `weights` maps a class to its weight."""
    while True:
        for start in range(0, len(x), size):
            batch = x[start : start + size], y[start : start + size]
            if weights:
                batch = (*batch, np.array([weights[c] for c in batch[1]], np.float32))
            yield batch


def unknown_length(x, y, size):
    """A finite, batched tf.data pipeline whose length TensorFlow does not know."""
    return tf.data.Dataset.from_tensor_slices((x, y)).filter(lambda *_: True).batch(size)


def with_a_nan(x, y):
    x = x.copy()
    x[37, 1] = np.nan  # in the third batch of 16
    return x, y


VALIDATION = examples(40, seed=9)
CLASS_WEIGHT = {0: 2.0, 1: 1.0, 2: 0.5}
TRAIN = examples(100)


def text_classifier(ragged=False):
    """Token sequences of any length, averaged over their own tokens: padded (0 pads,
    masked), or ragged."""

    class MeanOfTokens(keras.layers.Layer):
        def call(self, embedded):
            return tf.reduce_mean(embedded, axis=1)  # a ragged mean: each row's own tokens

    keras.utils.set_random_seed(2)
    inputs = keras.Input((None,), dtype="int32", ragged=ragged)
    embedded = keras.layers.Embedding(20, 6, mask_zero=not ragged)(inputs)
    pool = MeanOfTokens() if ragged else keras.layers.GlobalAveragePooling1D()
    model = keras.Model(inputs, keras.layers.Dense(CLASSES)(pool(embedded)))
    model.compile(
        optimizer=keras.optimizers.SGD(0.5),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def without_the_optional(x, y, size):
    """A generator of batches whose optional input "o" is given None."""
    for start in range(0, len(x), size):
        yield {"x": x[start : start + size], "o": None}, y[start : start + size]


def with_a_word():
    """Dict inputs of mixed dtypes: numbers, and a word looked up in a vocabulary."""
    keras.utils.set_random_seed(2)
    numbers = keras.Input((FEATURES,), name="numbers")
    word = keras.Input((1,), dtype="string", name="word")
    looked_up = keras.layers.StringLookup(
        vocabulary=["red", "green", "blue"], output_mode="multi_hot"
    )(word)
    hidden = keras.layers.Dense(8, activation="tanh")(
        keras.layers.Concatenate()([numbers, looked_up])
    )
    model = keras.Model({"numbers": numbers, "word": word}, keras.layers.Dense(CLASSES)(hidden))
    model.compile(
        optimizer=keras.optimizers.SGD(0.2),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return model


def words(x):
    """A word for each example, one of them not in the vocabulary."""
    kinds = (x[:, 2] > 0) * 2 + (x[:, 3] > 0)
    return np.array([["red", "green", "blue", "pink"][int(k)] for k in kinds])[:, None]


def ragged_batches(n, batch, seed):
    """A generator of batches of ragged token sequences."""
    tokens, labels = sentences(n, seed)
    for start in range(0, n, batch):
        yield tf.ragged.constant(tokens[start : start + batch]), labels[start : start + batch]


def sentences(n, seed):
    """n token sequences of 2 to 8 tokens, and a class of each."""
    rng = np.random.default_rng(seed)
    tokens = [rng.integers(1, 20, length) for length in rng.integers(2, 9, n)]
    return tokens, np.array([t.sum() % CLASSES for t in tokens], np.int32)


def padded_text(n, batch, seed):
    """A tf.data pipeline of `padded_batch`es: each batch as long as its longest sequence,
    a shape the pipeline decides as it reads (`TensorSpec(shape=(None, None))`)."""
    tokens, labels = sentences(n, seed)
    ragged, labels = tf.ragged.constant(tokens), tf.constant(labels)
    rows = tf.data.Dataset.range(n).map(lambda i: (ragged[i], labels[i]))
    return rows.padded_batch(batch)


def padded_batches(n, batch, seed):
    """A generator of the same kind of batches."""
    tokens, labels = sentences(n, seed)
    for start in range(0, n, batch):
        rows = tokens[start : start + batch]
        width = max(map(len, rows))
        padded = np.array([np.pad(r, (0, width - len(r))) for r in rows], np.int32)
        yield padded, labels[start : start + batch]


def case_data(name):
    """(model factory, tfdp.fit's arguments, model.fit's if they differ) for each case;
    data made fresh per call."""
    x, y = TRAIN
    vx, vy = VALIDATION
    plain = dict(x=x, y=y, batch_size=16, epochs=2, shuffle=False)
    cases = {
        "a batch larger than the data": (
            classifier,
            dict(x=x[:20], y=y[:20], batch_size=64, epochs=3, shuffle=False),
        ),
        "a short last batch": (classifier, plain),  # 100 = 6 x 16 + 4
        "fewer examples than devices": (
            classifier,
            dict(x=x[:9], y=y[:9], batch_size=4, epochs=2, shuffle=False),
        ),
        "x a tuple": (
            two_inputs,
            dict(x=(x[:, :2], x[:, 2:]), y=y, batch_size=16, epochs=2, shuffle=False),
        ),
        "x a list": (
            two_inputs,
            dict(x=[x[:, :2], x[:, 2:]], y=y, batch_size=16, epochs=2, shuffle=False),
        ),
        "x a dict": (
            functools.partial(two_inputs, named=True),
            dict(x={"a": x[:, :2], "b": x[:, 2:]}, y=y, batch_size=16, epochs=2, shuffle=False),
        ),
        "validation a tuple of 3": (
            classifier,
            {**plain, "validation_data": (vx, vy, np.linspace(0.5, 2, 40).astype(np.float32))},
        ),
        "validation a batched Dataset": (
            classifier,
            {**plain, "validation_data": tf.data.Dataset.from_tensor_slices((vx, vy)).batch(7)},
        ),
        "validation a PyDataset": (classifier, {**plain, "validation_data": Batches(vx, vy, 6)}),
        # Keras reads a generator ahead and drops what it read ahead at each evaluation's
        # end; tfdp reads on from where it stopped: a generator of one batch, the same for both
        "validation a generator": (
            classifier,
            {**plain, "validation_data": forever(vx, vy, 40), "validation_steps": 2},
        ),
        # with validation_steps, each of Keras' validations reads from the start again
        "validation an endless Dataset in steps": (
            classifier,
            {**plain, "epochs": 3, "validation_steps": 2,
             "validation_data": tf.data.Dataset.from_tensor_slices((vx, vy)).batch(8).repeat()},
        ),
        "validation a Dataset in steps": (
            classifier,
            {**plain, "epochs": 3, "validation_steps": 3,
             "validation_data": tf.data.Dataset.from_tensor_slices((vx, vy)).batch(10)},
        ),
        "class_weight on a PyDataset": (
            classifier,
            dict(
                x=Batches(x, y, 16), epochs=2, shuffle=False, class_weight={0: 1.0, 1: 3.0, 2: 0.5}
            ),
        ),
        # Keras refuses class_weight on a generator: its sample weights, made by the test
        "class_weight on a generator": (
            classifier,
            dict(x=forever(x, y, 20), steps_per_epoch=5, epochs=2, class_weight=CLASS_WEIGHT),
            dict(x=forever(x, y, 20, CLASS_WEIGHT), steps_per_epoch=5, epochs=2),
        ),
        "a stream of unknown length": (classifier, dict(x=unknown_length(x, y, 16), epochs=2)),
        "epochs that end at the pass's end": (
            classifier,
            dict(x=x, y=y, batch_size=20, steps_per_epoch=4, epochs=3, shuffle=False),
        ),
        "a non-finite loss is trained on": (
            classifier,
            dict(zip(("x", "y"), with_a_nan(x, y)), batch_size=16, epochs=1, shuffle=False),
        ),
        "TerminateOnNaN stops it": (
            classifier,
            dict(
                zip(("x", "y"), with_a_nan(x, y)),
                batch_size=16,
                epochs=2,
                shuffle=False,
                callbacks=[keras.callbacks.TerminateOnNaN()],
            ),
        ),
        "an optional input given None": (
            with_an_optional_input,
            dict(x={"x": x, "o": None}, y=y, batch_size=16, epochs=2, shuffle=False,
                 validation_data=({"x": vx, "o": None}, vy)),
        ),
        "an optional input given None by a generator": (
            with_an_optional_input,
            dict(x=without_the_optional(x, y, 16), epochs=1),
        ),
        "an optional input given None by a Dataset": (
            with_an_optional_input,
            dict(
                x=tf.data.Dataset.from_tensor_slices((x, y))
                .map(lambda features, label: ({"x": features, "o": None}, label))
                .batch(16),
                epochs=2,
            ),
        ),
        "a padded_batch whose length changes every batch": (
            text_classifier,
            dict(x=padded_text(60, 16, 5), epochs=2, validation_data=padded_text(20, 8, 6)),
        ),
        "a generator whose batches change length": (
            text_classifier,
            dict(x=padded_batches(60, 16, 5), epochs=1),
        ),
        "a generator of ragged batches": (
            functools.partial(text_classifier, ragged=True),
            dict(x=ragged_batches(60, 16, 5), epochs=1),
        ),
        "a dict of mixed dtypes with a string": (
            with_a_word,
            dict(
                x=tf.data.Dataset.from_tensor_slices(({"numbers": x, "word": words(x)}, y))
                .batch(16),
                epochs=2,
            ),
        ),
        "steps_per_execution 3": (functools.partial(classifier, steps_per_execution=3), plain),
        "run_eagerly": (functools.partial(classifier, run_eagerly=True), plain),
        "jit_compile": (functools.partial(classifier, jit_compile=True), plain),
        "a metric of one value per class": (
            one_hot_with_f1,
            dict(x=x, y=np.eye(CLASSES, dtype=np.float32)[y], batch_size=16, epochs=2,
                 shuffle=False, validation_data=(vx, np.eye(CLASSES, dtype=np.float32)[vy])),
        ),
        "loss_weights on dict outputs": (
            two_outputs,
            dict(
                x=x,
                y={"kind": y, "size": x[:, :1] * 2},
                batch_size=16,
                epochs=2,
                shuffle=False,
                validation_data=(vx, {"kind": vy, "size": vx[:, :1] * 2}),
                validation_batch_size=7,
            ),
        ),
    }
    return cases[name]


CASES = [
    "a batch larger than the data",
    "a short last batch",
    "fewer examples than devices",
    "x a tuple",
    "x a list",
    "x a dict",
    "validation a tuple of 3",
    "validation a batched Dataset",
    "validation a PyDataset",
    "validation a generator",
    "validation an endless Dataset in steps",
    "validation a Dataset in steps",
    "class_weight on a PyDataset",
    "class_weight on a generator",
    "a stream of unknown length",
    "epochs that end at the pass's end",
    "a non-finite loss is trained on",
    "TerminateOnNaN stops it",
    "an optional input given None",
    "an optional input given None by a generator",
    "an optional input given None by a Dataset",
    "a padded_batch whose length changes every batch",
    "a generator whose batches change length",
    "a generator of ragged batches",
    "a dict of mixed dtypes with a string",
    "steps_per_execution 3",
    "run_eagerly",
    "jit_compile",
    "a metric of one value per class",
    "loss_weights on dict outputs",
]


class Watch(keras.callbacks.Callback):
    """Each batch hook Keras calls, with its batch index and the model's weights then."""

    def __init__(self):
        super().__init__()
        self.calls, self.weights = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.calls.append(("epoch", epoch))

    def on_train_batch_end(self, batch, logs=None):
        self.calls.append(("batch", batch))
        self.weights.append(self.model.get_weights())


def fit(train, make, arguments):
    model, watch = make(), Watch()
    arguments = dict(arguments)
    arguments["callbacks"] = [*arguments.get("callbacks", []), watch]
    history = train(model, **arguments, verbose=0)
    return model, history.history, watch


@functools.cache
def keras_run(name):
    make, arguments, *keras_arguments = case_data(name)
    return fit(lambda model, **a: model.fit(**a), make, (keras_arguments or [arguments])[0])


# What the oldest Keras tfdp runs on cannot do in its own fit: nothing to compare with there.
KERAS_FIT_LACKS = {"an optional input given None": (3, 12)}  # 3.10-3.11: "Missing data for input"


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", CASES)
def test_data_is_taken_as_model_fit_takes_it(name, mode):
    lacking = [since for case, since in KERAS_FIT_LACKS.items() if name.startswith(case)]
    if lacking and internals.keras_release() < lacking[0]:
        pytest.skip(f"Keras' own fit takes {name} from Keras {'.'.join(map(str, lacking[0]))}")
    want_model, want_history, want_watch = keras_run(name)
    make, arguments, *_ = case_data(name)
    model, history, watch = fit(
        lambda model, **a: tfdp.fit(model, **a, **MODES[mode]), make, arguments
    )
    assert watch.model is model  # the callbacks hold the object passed
    assert watch.calls == want_watch.calls
    assert sorted(history) == sorted(want_history)
    for key, values in want_history.items():
        np.testing.assert_allclose(history[key], values, rtol=1e-5, atol=1e-6, err_msg=key)
    for have, want in zip(watch.weights, want_watch.weights, strict=True):
        for a, b in zip(have, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    for a, b in zip(model.get_weights(), want_model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    # the comparison is not vacuous: the weights moved (or went non-finite, as Keras')
    start = make().get_weights()
    assert any(not np.allclose(a, b) for a, b in zip(model.get_weights(), start))


def test_auto_powers_on_shapes_decided_while_reading_time_the_first_batch_read_ahead():
    """Where a pipeline decides a shape as it reads, auto powers time the devices on its
    first batch, read once ahead, and say so: a reshuffling pipeline then trains on its
    second order, as model.fit does after one iteration of it."""
    if internals.keras_release() < (3, 15):
        # timing one device alone traces the others on no rows, where Keras' masked
        # GlobalAveragePooling1D fails before 3.15 (BUILD_NOTES, "Versions")
        pytest.skip("a masked pooling layer on an empty piece needs Keras 3.15")

    def shuffled():
        return padded_text(60, 16, 5).unbatch().shuffle(60, seed=4).padded_batch(16)

    lines = []
    model = text_classifier()
    tfdp.fit(model, shuffled(), epochs=1, verbose=0, log=lines.append,
             **{**MODES["weighted [1, 3]"], "powers": "auto"})
    assert any("first batch, read once ahead" in line for line in lines), lines

    want, pipeline = text_classifier(), shuffled()
    next(iter(pipeline))  # the read ahead
    want.fit(pipeline, epochs=1, verbose=0)
    for a, b in zip(model.get_weights(), want.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    unread = text_classifier()
    unread.fit(shuffled(), epochs=1, verbose=0)  # the comparison tells the orders apart
    assert any(
        not np.allclose(a, b) for a, b in zip(unread.get_weights(), want.get_weights())
    )


def test_a_dataset_a_strategy_distributed_trains_on_its_global_batches():
    """`strategy.experimental_distribute_dataset(ds)`, as Keras' fit takes it under a
    strategy: tfdp.fit trains on ds's global batches, cut for its own devices."""
    x, y = TRAIN
    want = classifier()
    want.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(16), epochs=2, verbose=0)
    for strategy in (
        tf.distribute.MirroredStrategy(["cpu:0", "cpu:1"]),
        tfdp.MirroredStrategy(["cpu:0", "cpu:1"], powers=[1, 3]),
    ):
        distributed = strategy.experimental_distribute_dataset(
            tf.data.Dataset.from_tensor_slices((x, y)).batch(16)
        )
        got = classifier()
        tfdp.fit(got, distributed, epochs=2, verbose=0, **MODES["weighted [1, 3]"])
        for a, b in zip(got.get_weights(), want.get_weights(), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
