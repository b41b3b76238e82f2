"""Streamed training data through `tfdp.fit` against `keras.Model.fit` on one device: a
TFRecord pipeline written here (files, parse, seeded shuffle, stateless random
augmentation, batch), an unbatched and an infinite dataset, a PyDataset and a generator;
each mode's History and final weights; and the bad inputs."""

import keras
import numpy as np
import pytest
import tensorflow as tf

import tfdp
from tfdp.errors import ConfigError, DataError

EXAMPLES, FEATURES, CLASSES, BATCH = 200, 8, 3, 32


def examples():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(EXAMPLES, FEATURES)).astype(np.float32)
    y = ((x[:, 0] > 0).astype(np.int64) + (rng.random(EXAMPLES) < 0.3)) % CLASSES
    return x, y


@pytest.fixture(scope="module")
def records(tmp_path_factory):
    """The examples in 4 TFRecord files of tf.train.Example protos."""
    directory = tmp_path_factory.mktemp("records")
    x, y = examples()
    paths = []
    for shard in range(4):
        path = str(directory / f"train-{shard}.tfrecord")
        with tf.io.TFRecordWriter(path) as writer:
            for i in range(shard, EXAMPLES, 4):
                features = {
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x[i])),
                    "y": tf.train.Feature(int64_list=tf.train.Int64List(value=[y[i]])),
                }
                example = tf.train.Example(features=tf.train.Features(feature=features))
                writer.write(example.SerializeToString())
        paths.append(path)
    return paths


def parse(record):
    parsed = tf.io.parse_single_example(
        record,
        {
            "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.int64),
        },
    )
    return parsed["x"], parsed["y"]


def augment(index, example):
    """Stateless noise, seeded by the example's index: each example's own noise."""
    x, y = example
    noise = tf.random.stateless_normal([FEATURES], seed=tf.stack([index, 7]), stddev=0.1)
    return x + noise, y


def pipeline(paths, batched=True, reads=None):
    """Files read as consumed, parsed, numbered, shuffled with a seed, augmented, batched:
    a pass of 200 examples (TFRecord files do not say how many they hold: the pipeline
    does). reads: a list that gets an entry for each record parsed."""
    dataset = tf.data.TFRecordDataset(paths).map(parse)
    if reads is not None:
        dataset = dataset.map(lambda x, y: (counted(x, reads), y))
    dataset = (
        dataset.apply(tf.data.experimental.assert_cardinality(EXAMPLES))
        .enumerate()
        .shuffle(64, seed=3)
        .map(augment)
    )
    return dataset.batch(BATCH) if batched else dataset


def counted(x, reads):
    """`x`, counted in `reads` as the pipeline makes it."""

    def count(value):
        reads.append(1)
        return value

    return tf.ensure_shape(tf.numpy_function(count, [x], tf.float32, stateful=False), [FEATURES])


def model():
    keras.utils.set_random_seed(1)
    inputs = keras.Input((FEATURES,))
    hidden = keras.layers.Dense(16, activation="tanh")(inputs)
    m = keras.Model(inputs, keras.layers.Dense(CLASSES)(hidden))
    m.compile(
        optimizer=keras.optimizers.SGD(0.3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def assert_same_training(history, keras_history, trained, keras_model, rtol=1e-5):
    assert list(history.history) == list(keras_history.history)
    for key, values in keras_history.history.items():
        np.testing.assert_allclose(history.history[key], values, rtol=rtol, atol=1e-6, err_msg=key)
    for got, expected in zip(trained.get_weights(), keras_model.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=rtol, atol=1e-6)


@pytest.fixture(scope="module")
def keras_run(records):
    """Three passes over the pipeline, one after another on one stream: Keras fit on the
    repeated pipeline in epochs of a pass (7 steps). (Keras fit on the finite pipeline
    makes a spare iterator of it at each epoch's end, which moves the seeded shuffle and
    random stream on by one: its epoch e reads the pipeline's run 2e - 1.)"""
    reference = model()
    history = reference.fit(pipeline(records).repeat(), epochs=3, steps_per_epoch=7, verbose=0)
    return history, reference


@pytest.fixture(scope="module")
def keras_repeated(records):
    """The same pipeline repeated, in epochs of 5 steps (windows on one stream)."""
    reference = model()
    history = reference.fit(pipeline(records).repeat(), epochs=3, steps_per_epoch=5, verbose=0)
    return history, reference


MODES = {
    "single": dict(mode="single"),
    "mirrored 2": dict(mode="mirrored", devices="cpu:0,cpu:1"),
    "weighted [1, 3]": dict(mode="weighted", devices="cpu:0,cpu:1", powers=(1, 3)),
}


@pytest.mark.parametrize("name", MODES)
def test_a_tfrecord_pipeline_trains_as_keras_fit_trains_it(name, records, keras_run):
    keras_history, reference = keras_run
    trained = model()
    history = tfdp.fit(trained, pipeline(records), epochs=3, verbose=0, **MODES[name])
    assert_same_training(history, keras_history, trained, reference)
    # 200 examples in batches of 32: 7 steps a pass, the last of 8 examples
    assert history.result["iterations"] == 21 and history.result["steps_per_epoch"] == 7


@pytest.mark.parametrize("name", MODES)
def test_a_repeated_pipeline_trains_in_windows_as_keras_fit_does(name, records, keras_repeated):
    keras_history, reference = keras_repeated
    trained = model()
    history = tfdp.fit(
        trained, pipeline(records).repeat(), epochs=3, steps_per_epoch=5, verbose=0, **MODES[name]
    )
    assert_same_training(history, keras_history, trained, reference)
    assert history.result["iterations"] == 15


def test_the_stream_is_read_again_in_every_pass(records, keras_run):
    """The same pipeline read once and its batches replayed (a frozen stream) trains
    otherwise: the order and the noise of a pass differ from the pass before."""
    keras_history, _ = keras_run
    frozen = list(pipeline(records))
    replayed = tf.data.Dataset.from_generator(
        lambda: iter(frozen), output_signature=pipeline(records).element_spec
    )
    keras_model = model()
    replayed_history = keras_model.fit(replayed.repeat(), epochs=3, steps_per_epoch=7, verbose=0)
    assert replayed_history.history["loss"][0] == keras_history.history["loss"][0]
    assert not np.allclose(replayed_history.history["loss"][1:], keras_history.history["loss"][1:])


def test_an_unbatched_dataset_is_batched_to_batch_size(records, keras_run):
    keras_history, reference = keras_run
    trained = model()
    history = tfdp.fit(
        trained, pipeline(records, batched=False), batch_size=BATCH, epochs=3, verbose=0
    )
    assert_same_training(history, keras_history, trained, reference)


class Batches(keras.utils.PyDataset):
    """Batch i of the examples, and the epochs Keras announced."""

    def __init__(self):
        super().__init__()
        self.x, self.y = examples()
        self.ends = 0

    def __len__(self):
        return -(-EXAMPLES // BATCH)

    def __getitem__(self, index):
        part = slice(index * BATCH, (index + 1) * BATCH)
        return self.x[part], self.y[part]

    def on_epoch_end(self):
        self.ends += 1


def test_a_py_dataset_trains_as_keras_fit_trains_it():
    reference = model()
    batches = Batches()
    keras_history = reference.fit(batches, epochs=2, shuffle=False, verbose=0)
    trained = model()
    ours = Batches()
    history = tfdp.fit(
        trained, ours, epochs=2, shuffle=False, verbose=0, mode="mirrored", devices="cpu:0,cpu:1"
    )
    assert_same_training(history, keras_history, trained, reference)
    assert ours.ends >= 1  # called between passes, as Keras calls it


def generator():
    x, y = examples()
    while True:
        for begin in range(0, EXAMPLES - BATCH + 1, BATCH):
            yield x[begin : begin + BATCH], y[begin : begin + BATCH]


def assert_fits_as_keras(make, **settings):
    """tfdp.fit on a new `make()` gives Keras fit's History and weights on another."""
    reference = model()
    keras_history = reference.fit(make(), verbose=0, **settings)
    trained = model()
    history = tfdp.fit(trained, make(), verbose=0, **settings)
    assert_same_training(history, keras_history, trained, reference)


def test_a_generator_trains_as_keras_fit_trains_it():
    assert_fits_as_keras(generator, epochs=2, steps_per_epoch=4)


def test_a_generator_that_raises_names_the_step():
    def failing():
        for step, batch in enumerate(generator()):
            if step == 5:
                raise OSError("the disk went away")
            yield batch

    with pytest.raises(DataError) as failed:
        tfdp.fit(model(), failing(), epochs=2, steps_per_epoch=4, verbose=0)
    message = str(failed.value)
    assert message == (
        "the training data (generator) failed (OSError: the disk went away) at step 5; "
        "no checkpoint was saved"
    )


class Changing(Batches):
    """Batches whose batch 5 has a third part (sample weights), unlike the others."""

    def __getitem__(self, index):
        x, y = super().__getitem__(index)
        return (x, y, np.ones(len(y), np.float32)) if index == 5 else (x, y)


def changing_generator(change):
    for step, (x, y) in enumerate(generator()):
        yield change(x, y) if step == 5 else (x, y)


@pytest.mark.parametrize(
    "make, source, described",
    [
        (Changing, "PyDataset", "(float32[32, 8], int64[32], float32[32])"),
        (
            lambda: changing_generator(lambda x, y: (x[:, :5], y)),
            "generator",
            "(float32[32, 5], int64[32])",
        ),
        (
            lambda: changing_generator(lambda x, y: (np.tile(x, (2, 1)), np.tile(y, 2))),
            "generator",
            "(float32[64, 8], int64[64]): more examples than the first batch's 32",
        ),
    ],
)
def test_a_batch_unlike_the_first_is_named_and_the_checkpoint_stands(
    make, source, described, tmp_path
):
    """A source that makes its own batches and changes them later (another structure,
    shape, or more examples than a batch) stops before training on that batch."""
    model_dir = tmp_path / "run"
    with pytest.raises(DataError) as failed:
        tfdp.fit(
            model(),
            make(),
            epochs=2,
            steps_per_epoch=4,
            verbose=0,
            shuffle=False,
            model_dir=str(model_dir),
            checkpoint_every=2,
        )
    assert str(failed.value) == (
        f"the training data ({source}) failed (ValueError: its batch 5 is {described}"
        + (
            ""
            if "more examples" in described
            else ", where its first batches were (float32[?, 8], int64[?])"
        )
        + f") at step 5; {model_dir / 'checkpoints' / 'ckpt-4'} stands: run again to resume from it"
    )


@pytest.mark.parametrize(
    "data, settings, named, words",
    [
        (
            lambda paths: pipeline(paths),
            dict(batch_size=64),
            ("batch_size", 64),
            "disagrees with the tf.data.Dataset's batches of 32",
        ),
        (
            lambda paths: pipeline(paths).repeat(),
            dict(),
            ("x", "tf.data.Dataset"),
            "is infinite: give steps_per_epoch, as Keras fit needs",
        ),
        (
            lambda paths: pipeline(paths).take(0),
            dict(),
            ("x", "tf.data.Dataset"),
            "has no examples",
        ),
        (lambda paths: iter(()), dict(), ("x", "generator"), "has no examples"),
    ],
)
def test_bad_streams_are_one_line_before_training(data, settings, named, words, records):
    def as_generator(value):  # iter(()) is an iterator, not a generator: make it one
        return (item for item in value) if not isinstance(value, tf.data.Dataset) else value

    with pytest.raises(ConfigError) as bad:
        tfdp.fit(model(), as_generator(data(records)), epochs=1, verbose=0, **settings)
    assert (bad.value.field, bad.value.value) == named
    assert words in bad.value.reason


SCRIPT = """
import keras
import tensorflow as tf
import test_streams as t

def make_model():
    return t.model()

def data():
    return t.pipeline({paths!r}).repeat(), None

def validated():
    return t.pipeline({paths!r}).repeat(), t.pipeline({paths!r}, batched=False).repeat()
"""


def test_the_command_names_a_batch_size_the_dataset_disagrees_with(records, tmp_path):
    from helpers import refusal

    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT.format(paths=records))
    error, line = refusal(
        f"--model={script}:make_model",
        f"--dataset={script}:data",
        "--steps_per_epoch=5",
        "--batch_size=1024",
    )
    assert (error.field, error.value) == ("batch_size", 1024)
    assert line == (
        "tfdp: error: --batch_size=1024: disagrees with the tf.data.Dataset's batches of 32 "
        "(it is batched: leave batch_size out, or batch the dataset to it)"
    )


def test_the_command_takes_a_batched_datasets_batch_size(records, tmp_path):
    """Without --batch_size, the command trains on the dataset's own batches, and says so."""
    from absl.testing import flagsaver

    from tfdp import cli
    from tfdp.run import training

    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT.format(paths=records))
    with flagsaver.flagsaver():
        config = cli.checked_config(
            cli.FLAGS(
                ["tfdp", f"--model={script}:make_model", f"--dataset={script}:data",
                 "--iterations=2", "--mode=weighted", "--devices=cpu:0,cpu:1"]
            )
        )
    lines = []
    result = training.run(training.prepare(config), lines.append)
    assert result["batch_size"] == 32 and result["shards"] == [16, 16]
    assert "global batch 32 (the tf.data.Dataset's batches) = 16 + 16 over 2" in "\n".join(lines)


COMMAND_MODES = {
    "single": ["--mode=single"],
    "mirrored 2": ["--mode=mirrored", "--devices=cpu:0,cpu:1"],
    "weighted [1, 3]": ["--mode=weighted", "--devices=cpu:0,cpu:1", "--powers=1,3"],
}


@pytest.mark.parametrize("name", COMMAND_MODES)
def test_the_command_streams_a_dataset_function_s_pipelines(
    name, records, keras_repeated, tmp_path
):
    """--dataset=FILE:FUNCTION's pipelines, streamed: the training one gives Keras fit's
    weights; the validation one, unbatched and endless, is batched to the training
    batch and read --eval_steps batches at each evaluation, as Keras' evaluate with
    steps reads it."""
    from helpers import cli_in_process, load_weights, result

    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT.format(paths=records))
    model_dir = tmp_path / "run"
    status = cli_in_process(
        f"--model={script}:make_model",
        f"--dataset={script}:validated",
        "--batch_size=32",
        "--steps_per_epoch=5",
        "--epochs=3",
        "--eval_steps=3",
        "--log_every=0",
        f"--model_dir={model_dir}",
        *COMMAND_MODES[name],
    )
    assert status == 0
    _, reference = keras_repeated
    for got, expected in zip(load_weights(model_dir), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    validation = pipeline(records, batched=False).repeat().batch(BATCH)
    loss, accuracy = reference.evaluate(validation, steps=3, verbose=0)
    metrics = result(model_dir)["test_metrics"]
    assert metrics["loss"] == pytest.approx(loss, rel=1e-5)
    assert metrics["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_the_command_refuses_endless_validation_data_without_eval_steps(records, tmp_path):
    from helpers import refusal

    script = tmp_path / "pipeline.py"
    script.write_text(SCRIPT.format(paths=records))
    error, line = refusal(
        f"--model={script}:make_model", f"--dataset={script}:validated", "--steps_per_epoch=5"
    )
    assert (error.field, error.value) == ("eval_steps", None)
    assert line == (
        f"tfdp: error: --eval_steps (not given): the validation data of {script}:validated, a "
        "tf.data.Dataset, is infinite: give eval_steps, the batches each evaluation reads"
    )


def test_a_stopped_stream_resumes_mid_pass_on_other_devices_exactly(records, keras_run, tmp_path):
    """10 steps in single (a pass and 3 batches), then the rest in weighted [1, 3] from the
    checkpoint: the weights of three unbroken passes."""
    _, reference = keras_run
    model_dir = str(tmp_path / "run")
    tfdp.fit(model(), pipeline(records), iterations=10, verbose=0, model_dir=model_dir)
    lines = []
    trained = model()
    history = tfdp.fit(
        trained,
        pipeline(records),
        epochs=3,
        verbose=0,
        log=lines.append,
        model_dir=model_dir,
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 3),
    )
    assert history.result["start_iteration"] == 10 and history.result["iterations"] == 21
    banner = next(line for line in lines if line.startswith("global batch"))
    assert "resuming at iteration 10" in banner
    assert banner.endswith("(the tf.data.Dataset at the position saved with the checkpoint)")
    for got, expected in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_corrupt_record_file_found_mid_run_names_the_step_and_keeps_the_checkpoint(
    records, tmp_path
):
    damaged = tmp_path / "train-3.tfrecord"
    data = bytearray(open(records[3], "rb").read())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8  # its checksum no longer matches
    damaged.write_bytes(bytes(data))
    files = [*records[:3], str(damaged)]  # read in order: the damage is 3/4 into a pass
    dataset = tf.data.TFRecordDataset(files).map(parse).batch(BATCH).repeat()
    model_dir = tmp_path / "run"
    with pytest.raises(DataError) as failed:
        tfdp.fit(
            model(),
            dataset,
            epochs=2,
            steps_per_epoch=7,
            verbose=0,
            model_dir=str(model_dir),
            checkpoint_every=2,
        )
    message = str(failed.value)
    assert message.startswith("the training data (tf.data.Dataset) failed (DataLossError: ")
    step = int(message.split(" at step ")[1].split(";")[0])
    assert 4 <= step < 7  # the damage is in the 4th file, 3/4 into a pass of 7 steps
    saved = step - step % 2
    assert message.endswith(
        f"{model_dir}/checkpoints/ckpt-{saved} stands: run again to resume from it"
    )


WORKER = """
import sys

import numpy as np

import tfdp

tfdp.join_cluster()  # before any other TensorFlow op
import test_streams as t

out, paths = sys.argv[1], sys.argv[2:]
trained, reads = t.model(), []
history = tfdp.fit(
    trained, t.pipeline(paths, reads=reads).repeat(), epochs=3, steps_per_epoch=5, verbose=0,
    validation_data=t.pipeline(paths).repeat(), validation_steps=3,
    mode="multiworker", powers=(1, 3),
)
np.savez(out, *trained.get_weights(), reads=len(reads), **history.history)
"""


@pytest.mark.slow
def test_two_workers_stream_the_pipeline_as_keras_fit_on_one_device(records, tmp_path):
    """Each worker trains on its slice of every global batch and evaluates its slice
    of every validation batch: Keras fit's losses, val_ logs and weights on one device."""
    import os
    import sys

    from helpers import environment, run_together

    from tfdp.cluster.workers import free_ports, tf_configs

    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    here = os.path.dirname(os.path.abspath(__file__))
    outs = [str(tmp_path / f"worker{i}.npz") for i in (0, 1)]
    ran = run_together(
        [[sys.executable, str(script), out, *records] for out in outs],
        [environment(TF_CONFIG=c, PYTHONPATH=here) for c in tf_configs(free_ports(2))],
    )
    assert [status for status, _, _ in ran] == [0, 0], [err[-3000:] for _, _, err in ran]
    reference = model()  # and an endless validation stream, read 3 batches at a time
    keras_history = reference.fit(
        pipeline(records).repeat(), epochs=3, steps_per_epoch=5, verbose=0,
        validation_data=pipeline(records).repeat(), validation_steps=3,
    )
    for out in outs:
        saved = np.load(out)
        # A pure stream: each worker parses every record of the 15 global batches (two
        # passes of 200 and a batch of 32), not only its slice (8 or 24 of each 32), and
        # what its pipeline reads ahead (a shuffle buffer of 64, a few batches: 513-600
        # records in all were seen), never the global batches twice.
        in_batches = 2 * EXAMPLES + BATCH
        assert in_batches <= saved["reads"] < 2 * in_batches
        for key in ("loss", "val_loss", "val_accuracy"):
            np.testing.assert_allclose(saved[key], keras_history.history[key], rtol=1e-5)
        weights = [saved[f"arr_{i}"] for i in range(len(reference.get_weights()))]
        for got, expected in zip(weights, reference.get_weights(), strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_resume_reads_no_trained_batch_again(records, keras_run, tmp_path):
    """With the position saved, the resumed run reads what it trains on (11 steps: 304
    examples) and what it reads ahead (the shuffle buffer, 2 batches), not the 10 steps
    trained before; read again, they would be 320 more."""
    _, reference = keras_run
    model_dir = str(tmp_path / "run")
    first, rest = [], []
    tfdp.fit(model(), pipeline(records, reads=first), iterations=10, verbose=0, model_dir=model_dir)
    trained = model()
    tfdp.fit(trained, pipeline(records, reads=rest), epochs=3, verbose=0, model_dir=model_dir)
    assert 304 <= len(rest) <= 304 + 64 + 2 * BATCH
    for got, expected in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def generated(paths):
    """The pipeline's examples through a Python generator: a position tf.data cannot save."""
    x, y = examples()
    return (
        tf.data.Dataset.from_generator(
            lambda: zip(x, y),
            output_signature=(tf.TensorSpec([FEATURES], tf.float32), tf.TensorSpec([], tf.int64)),
        )
        .apply(tf.data.experimental.assert_cardinality(EXAMPLES))
        .batch(BATCH)
    )


def test_a_position_that_cannot_be_saved_is_said_and_the_resume_reads_again(records, tmp_path):
    straight = model()
    tfdp.fit(straight, generated(records), epochs=2, verbose=0)
    model_dir = str(tmp_path / "run")
    lines = []
    tfdp.fit(
        model(),
        generated(records),
        iterations=10,
        verbose=0,
        log=lines.append,
        model_dir=model_dir,
        checkpoint_every=4,
    )
    said = [line for line in lines if "input position" in line]
    assert len(said) == 1 and said[0].startswith("tfdp: the input position cannot be saved (")
    assert said[0].endswith(
        "a resume reads the stream again from its start and drops the trained batches"
    )
    lines, trained = [], model()
    tfdp.fit(
        trained, generated(records), epochs=2, verbose=0, log=lines.append, model_dir=model_dir
    )
    banner = next(line for line in lines if line.startswith("global batch"))
    assert "its first 10 batches dropped" in banner
    for got, expected in zip(trained.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class Counted(Batches):
    """Batches that count the batches read."""

    reads = 0

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_py_dataset_resumes_by_index_reading_no_trained_batch(shuffle, tmp_path):
    """Stopped at step 10 (pass 2, batch 3) in single, resumed in weighted [1, 3]: the
    resumed run reads its 11 batches, its first two (their shapes, as Keras' adapter
    reads them) and 2 ahead, not the 10 trained; the weights are Keras fit's (in order) or the unbroken run's
    (shuffled: tfdp's own order, a function of the seed and the pass)."""
    if shuffle:
        reference = model()
        tfdp.fit(reference, Batches(), epochs=3, verbose=0)
    else:
        reference = model()
        reference.fit(Batches(), epochs=3, shuffle=False, verbose=0)
    model_dir = str(tmp_path / "run")
    tfdp.fit(model(), Batches(), iterations=10, shuffle=shuffle, verbose=0, model_dir=model_dir)
    lines, trained, resumed = [], model(), Counted()
    tfdp.fit(
        trained,
        resumed,
        epochs=3,
        shuffle=shuffle,
        verbose=0,
        log=lines.append,
        model_dir=model_dir,
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers=(1, 3),
    )
    banner = next(line for line in lines if line.startswith("global batch"))
    assert "the PyDataset read on by index from step 10's batch" in banner
    assert 2 + 11 <= resumed.reads <= 2 + 11 + 2
    for got, expected in zip(trained.get_weights(), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_resume_with_another_pipeline_is_refused(records, tmp_path):
    model_dir = str(tmp_path / "run")
    tfdp.fit(model(), pipeline(records), iterations=10, verbose=0, model_dir=model_dir)
    other = (
        tf.data.TFRecordDataset(records)
        .map(parse)
        .apply(tf.data.experimental.assert_cardinality(EXAMPLES))
        .batch(BATCH)
    )  # no shuffle, no noise
    with pytest.raises(ConfigError) as refused:
        tfdp.fit(model(), other, epochs=3, verbose=0, model_dir=model_dir)
    assert (refused.value.field, refused.value.value) == ("model_dir", model_dir)
    assert "holds the position of another pipeline than this one" in refused.value.reason
    assert "\n" not in refused.value.reason


def test_a_pipeline_whose_randomness_is_not_saved_resumes_by_reading_again(records, tmp_path):
    """A Dataset.random stream is not restored exactly from a saved position (TensorFlow
    2.21): such a pipeline is read again from its start, and resumes exactly."""

    def noisy(index, example):
        return augment(index % 1000, example)

    def reseeded():
        parsed = tf.data.TFRecordDataset(records).map(parse)
        return (
            tf.data.Dataset.zip(
                tf.data.Dataset.random(seed=5, rerandomize_each_iteration=True), parsed
            )
            .apply(tf.data.experimental.assert_cardinality(EXAMPLES))
            .map(noisy)
            .batch(BATCH)
        )

    straight = model()
    tfdp.fit(straight, reseeded(), epochs=3, verbose=0)
    model_dir = str(tmp_path / "run")
    tfdp.fit(model(), reseeded(), iterations=10, verbose=0, model_dir=model_dir)
    lines, trained = [], model()
    tfdp.fit(trained, reseeded(), epochs=3, verbose=0, log=lines.append, model_dir=model_dir)
    banner = next(line for line in lines if line.startswith("global batch"))
    assert (
        "its first 10 batches dropped, as its Dataset.random is not saved with a position"
    ) in banner
    for got, expected in zip(trained.get_weights(), straight.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


class Endless(Batches):
    """The same batches, numbered on without end (num_batches None: infinite)."""

    @property
    def num_batches(self):
        return None

    def __getitem__(self, index):
        return super().__getitem__(index % len(self))


def test_an_infinite_py_dataset_runs_in_windows_of_steps_per_epoch():
    assert_fits_as_keras(Endless, epochs=2, steps_per_epoch=4)


# --dataset=tfds:NAME, on tensorflow-datasets' own mock data: never the network.

IMAGE_MODEL = """
import keras

def make_model():
    keras.utils.set_random_seed(2)
    m = keras.Sequential([keras.Input((28, 28, 1)), keras.layers.Flatten(), keras.layers.Dense(10)])
    m.compile(optimizer=keras.optimizers.SGD(0.5),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m
"""


@pytest.fixture
def mock_tfds(monkeypatch):
    """tensorflow-datasets' mock data (96 random examples a split, from the dataset's
    features), with this process's sockets refusing to connect meanwhile."""
    import socket

    import tensorflow_datasets as tfds

    def refuse(*args, **kwargs):
        raise OSError("this test has no network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    with tfds.testing.mock_data(num_examples=96, policy=tfds.testing.MockPolicy.USE_CODE):
        yield tfds


def test_a_tensorflow_datasets_dataset_by_name_trains_as_keras_fit_on_it(mock_tfds, tmp_path):
    """tfds:mnist: the train split shuffled through a seeded buffer of 4096, images scaled
    to [0, 1], labels int32, validation the test split: Keras fit and evaluate on that
    pipeline, built here from tfds.load, give the weights and the test accuracy."""
    from helpers import cli_in_process, load_weights, result

    script = tmp_path / "image_model.py"
    script.write_text(IMAGE_MODEL)
    model_dir = tmp_path / "run"
    tf.random.set_seed(5)  # a seeded shuffle's order follows the global seed too
    status = cli_in_process(
        "--dataset=tfds:mnist",
        f"--data_dir={tmp_path / 'tfds'}",
        f"--model={script}:make_model",
        "--batch_size=32",
        "--epochs=2",
        "--mode=mirrored",
        "--devices=cpu:0,cpu:1",
        "--log_every=0",
        f"--model_dir={model_dir}",
    )
    assert status == 0

    def scaled(image, label):
        return tf.cast(image, tf.float32) / 255.0, tf.cast(label, tf.int32)

    def split(name):
        return mock_tfds.load("mnist", split=name, as_supervised=True, shuffle_files=False)

    tf.random.set_seed(5)
    train = split("train").shuffle(4096, seed=0).map(scaled).batch(32)
    spec = {"__name__": "image_model"}
    exec(IMAGE_MODEL, spec)  # noqa: S102  (the same model function, built here)
    reference = spec["make_model"]()
    reference.fit(train.repeat(), epochs=2, steps_per_epoch=3, verbose=0)
    for got, expected in zip(load_weights(model_dir), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    _, accuracy = reference.evaluate(split("test").map(scaled).batch(32), verbose=0)
    assert result(model_dir)["test_metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize(
    "name, words",
    [
        ("tfds:no_such_dataset", "tensorflow-datasets has no dataset no_such_dataset"),
        ("tfds:", "names no dataset: tfds:NAME, e.g. tfds:mnist"),
        ("tfds:coco_captions", "has no supervised keys (input, target) to train on"),
    ],
)
def test_a_tensorflow_datasets_name_that_cannot_be_trained_on_is_one_line(
    name, words, mock_tfds, tmp_path
):
    from helpers import refusal

    error, line = refusal(f"--dataset={name}", f"--data_dir={tmp_path}")
    assert (error.field, error.value) == ("dataset", name)
    assert words in line


def test_a_tensorflow_datasets_dataset_keeps_features_that_are_not_images(mock_tfds):
    from tfdp.data.sources import load_tfds

    train, validation = load_tfds("tfds:iris", shuffle=False)
    own = mock_tfds.load("iris", split="train", as_supervised=True, shuffle_files=False)
    (x, y), (own_x, own_y) = next(iter(train.batch(96))), next(iter(own.batch(96)))
    assert x.dtype == tf.float32 and y.dtype == tf.int32
    np.testing.assert_array_equal(x.numpy(), own_x.numpy())  # not scaled: not an image
    np.testing.assert_array_equal(y.numpy(), own_y.numpy())
    assert validation is not None  # mock data has every split; iris itself has only train


def test_a_tensorflow_datasets_validation_split_is_streamed(mock_tfds, tmp_path):
    """tfds:NAME's test split is read batch by batch at each evaluation, never held."""
    from tfdp.config import Config
    from tfdp.data.streams import EvalStream
    from tfdp.data.inputs import of_dataset

    test = of_dataset(Config(dataset="tfds:mnist", data_dir=str(tmp_path / "tfds"))).validation
    assert isinstance(test, EvalStream)
    assert isinstance(test.dataset, tf.data.Dataset)
    batches = list(test.batches(32, None))
    assert sum(len(y) for _, y in batches) == 96  # the mock's examples, all of them
    assert len(batches) == 3


def test_a_tensorflow_datasets_download_that_fails_names_data_dir(tmp_path, monkeypatch):
    import tensorflow_datasets as tfds

    from tfdp.data.sources import load_tfds

    def download_fails(*args, **kwargs):
        raise ConnectionError("simulated: no route to the download server")

    monkeypatch.setattr(tfds.core.DatasetBuilder, "download_and_prepare", download_fails)
    with pytest.raises(ConfigError) as refused:
        load_tfds("tfds:mnist", data_dir=str(tmp_path))
    assert (refused.value.field, refused.value.value) == ("data_dir", str(tmp_path))
    assert refused.value.reason == (
        "mnist through tensorflow-datasets failed "
        "(ConnectionError: simulated: no route to the download server)"
    )


# SIGKILL mid-epoch: real training processes, killed.

KILLED_SCRIPT = """
import time

import test_streams as t


class Slowly(list):
    def append(self, read):  # each record read takes a millisecond: a step takes 32
        time.sleep(0.001)


def make_model():
    return t.model()


def data():
    return t.pipeline({paths!r}, reads=Slowly()), None
"""
KILLED_EPOCHS = 8  # passes of 7 steps: 56 steps, far from trained to the end


@pytest.mark.slow
def test_a_stream_killed_mid_epoch_twice_resumes_exactly_across_modes(records, tmp_path):
    """Run in single, SIGKILLed after its checkpoint at step 10 or later; resumed in
    mirrored 2 (another process), SIGKILLed again 10 or more steps on; resumed in
    weighted [1, 3] to the end: the weights of Keras fit's unbroken run on the pipeline."""
    import os

    from helpers import cli_in_process, environment, kill_when, latest_step, load_weights
    from helpers import tfdp as command

    script = tmp_path / "pipeline.py"
    script.write_text(KILLED_SCRIPT.format(paths=records))
    model_dir = str(tmp_path / "run")
    flags = [
        f"--model={script}:make_model",
        f"--dataset={script}:data",
        "--batch_size=32",
        f"--epochs={KILLED_EPOCHS}",
        "--checkpoint_every=2",
        "--log_every=0",
        f"--model_dir={model_dir}",
    ]
    tests = os.path.dirname(os.path.abspath(__file__))  # the script imports this module
    stops = []
    for mode in ("--mode=single", "--mode=mirrored"):
        start = latest_step(model_dir) or 0
        killed = command(
            *flags, mode, "--logical_cpus=2", wait=False, env=environment(PYTHONPATH=tests)
        )
        kill_when(killed, lambda start=start: (latest_step(model_dir) or 0) >= start + 10)
        stops.append(latest_step(model_dir))
    assert 10 <= stops[0] <= stops[1] - 10 and stops[1] < 7 * KILLED_EPOCHS
    assert any(step % 7 for step in stops)  # mid-epoch, at least once

    # A seeded shuffle's order follows TensorFlow's global seed too, which a fresh
    # process has unset when it makes the pipeline (model() sets it).
    tf.random.set_seed(None)
    status = cli_in_process(*flags, "--mode=weighted", "--devices=cpu:0,cpu:1", "--powers=1,3")
    assert status == 0
    reference = model()
    tf.random.set_seed(None)
    reference.fit(pipeline(records).repeat(), epochs=KILLED_EPOCHS, steps_per_epoch=7, verbose=0)
    for got, expected in zip(load_weights(model_dir), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
