"""A bad record costs one rerun: the run stops on one line in TensorFlow's words, naming
the file; the same command resumes exactly once the file is repaired.

The data: four TFRecord files of RECORDS fixed-size records each, read in order in
batches of BATCH; the bad file has 64 bytes overwritten in its middle.
"""

import os
import shutil

import numpy as np
import pytest
import tensorflow as tf
from helpers import cli_in_process, launch, load_weights, result, worker_lines

FILES, RECORDS, BATCH, FEATURES = 4, 40, 16, 8

SCRIPT = """
import glob
import keras
import tensorflow as tf

FEATURES = {features}

def parse(record):
    f = tf.io.parse_single_example(record, {{
        "x": tf.io.FixedLenFeature([FEATURES], tf.float32),
        "y": tf.io.FixedLenFeature([], tf.int64)}})
    return f["x"], f["y"]

def records(directory):
    return tf.data.TFRecordDataset(sorted(glob.glob(directory + "/part-*.tfrecord"))).map(parse)

def make_model():
    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((FEATURES,)), keras.layers.Dense(16, activation="tanh"),
                          keras.layers.Dense(2)])
    m.compile(optimizer=keras.optimizers.Adam(0.01),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m

def data():
    return records({train!r}).repeat().batch({batch}), None

def data_on_hosts():  # worker 1 reads its own host's copy of the files
    import json, os
    task = json.loads(os.environ.get("TF_CONFIG", "{{}}")).get("task", {{}})
    return records({train!r} + ("-host1" if task.get("index") else "")).repeat().batch({batch}), None

def data_validated():
    return records({train!r}).repeat().batch({batch}), records({validation!r})
"""


def write_records(directory, files=FILES, seed=0):
    """`files` TFRecord files of RECORDS tf.train.Examples of the same size each."""
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(files):
        with tf.io.TFRecordWriter(os.path.join(directory, f"part-{i}.tfrecord")) as writer:
            for _ in range(RECORDS):
                x = rng.normal(size=FEATURES).astype(np.float32)
                example = tf.train.Example(
                    features=tf.train.Features(
                        feature={
                            "x": tf.train.Feature(float_list=tf.train.FloatList(value=x)),
                            "y": tf.train.Feature(
                                int64_list=tf.train.Int64List(value=[int(x[:3].sum() > 0)])
                            ),
                        }
                    )
                )
                writer.write(example.SerializeToString())


def corrupt(path) -> int:
    """Overwrites 64 bytes in the middle of `path`; returns the index of the record hit."""
    data = bytearray(open(path, "rb").read())
    middle = len(data) // 2
    data[middle : middle + 64] = b"\xff" * 64
    with open(path, "wb") as f:
        f.write(data)
    return middle // (len(data) // RECORDS)  # every record is the same size


def plain_tensorflow_error(path) -> tuple[str, str]:
    """(class, message) of reading `path` through in plain TensorFlow, eagerly."""
    try:
        for _ in tf.data.TFRecordDataset(path):
            pass
    except tf.errors.OpError as error:
        message = error.message.split("}} ", 1)[-1].split(" [Op:")[0].strip()
        return type(error).__name__, message
    raise AssertionError(f"{path} reads through")


@pytest.fixture
def bad_run(tmp_path):
    """A data script over good files (train/) whose third file is then corrupted; the
    repaired copy is kept in good/. Returns (script, the bad file, the failing step)."""
    train, validation, good = tmp_path / "train", tmp_path / "validation", tmp_path / "good"
    write_records(str(train))
    write_records(str(validation), files=1, seed=1)
    shutil.copytree(train, good)
    script = tmp_path / "data.py"
    script.write_text(
        SCRIPT.format(features=FEATURES, train=str(train), validation=str(validation), batch=BATCH)
    )
    bad = train / "part-2.tfrecord"
    hit = corrupt(bad)
    failing_step = (2 * RECORDS + hit) // BATCH  # the batch that holds the record hit
    return script, bad, good / "part-2.tfrecord", failing_step


def keras_weights(script, steps):
    """Plain Keras: model.fit on the script's (good) pipeline, `steps` steps."""
    spec = {"__name__": "data_script"}
    exec(script.read_text(), spec)  # noqa: S102  (the same functions, built here)
    model = spec["make_model"]()
    train, _ = spec["data"]()
    model.fit(train, epochs=1, steps_per_epoch=steps, verbose=0)
    return model.get_weights()


MODES = {
    "single": ["--mode=single", "--devices=cpu:0"],
    "weighted": ["--mode=weighted", "--devices=cpu:0,cpu:1", "--powers=1,3"],
    "mirrored": ["--mode=mirrored", "--devices=cpu:0,cpu:1"],
}


@pytest.mark.parametrize(
    "broken, repaired", [("single", "weighted"), ("weighted", "mirrored"), ("mirrored", "single")]
)
def test_a_corrupt_record_costs_one_rerun(broken, repaired, bad_run, tmp_path, capsys):
    """The run stops at the bad record's step in one line: TensorFlow's class and words,
    the file, the checkpoint that stands; run again on the bad file: the same line; once
    the file is repaired, the same command (in another mode) ends with Keras' weights of
    an unbroken run."""
    script, bad, good, failing_step = bad_run
    steps = failing_step + 6
    model_dir = tmp_path / "run"
    common = [
        f"--model={script}:make_model",
        f"--dataset={script}:data",
        f"--iterations={steps}",
        "--checkpoint_every=2",
        "--log_every=0",
        f"--model_dir={model_dir}",
    ]
    kind, words = plain_tensorflow_error(str(bad))
    latest = model_dir / "checkpoints" / f"ckpt-{failing_step - failing_step % 2}"
    expected = (
        f"tfdp: error: the training data (tf.data.Dataset) failed ({kind}: {words}) at step "
        f"{failing_step}; each of its {FILES} TFRecord file(s) read again: {bad} ({kind}: "
        f"{words}); {latest} stands: run again to resume from it"
    )
    assert cli_in_process(*common, *MODES[broken]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    if broken == "single":  # run again on the bad file: the same step, the same line
        assert cli_in_process(*common, *MODES[broken]) == 1
        assert capsys.readouterr().err.strip().splitlines()[-1] == expected
    shutil.copy(good, bad)
    assert cli_in_process(*common, *MODES[repaired]) == 0
    out = capsys.readouterr().out
    assert (
        f"resuming at iteration {failing_step - failing_step % 2} from {model_dir} (the "
        "tf.data.Dataset is read again from its start" in out
    )
    assert result(model_dir)["iterations"] == steps
    for got, want in zip(load_weights(model_dir), keras_weights(script, steps), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("bad_on", ["every host", "one host"])
def test_two_workers_stop_at_a_bad_record_and_resume_once_repaired(bad_on, bad_run, tmp_path):
    """multiworker, each worker reading its own host's copy of the files. Bad on every
    host: both stop at the bad record's step with the line. Bad on one host: that worker
    stops with the line, the other as for a worker that died. Repaired, a relaunch
    resumes both from the chief's checkpoint and ends with Keras' weights of an unbroken
    run."""
    script, chiefs, good, failing_step = bad_run
    host1 = chiefs.parent.with_name("train-host1")
    shutil.copytree(chiefs.parent, host1)
    if bad_on == "one host":
        shutil.copy(good, chiefs)
    bad = (
        {0: chiefs, 1: host1 / chiefs.name} if bad_on == "every host" else {1: host1 / chiefs.name}
    )
    steps = failing_step + 4
    model_dir = tmp_path / "run"
    common = [
        f"--model={script}:make_model",
        f"--dataset={script}:data_on_hosts",
        f"--iterations={steps}",
        "--checkpoint_every=2",
        "--log_every=0",
        "--progress=never",
        f"--model_dir={model_dir}",
    ]
    kind, words = plain_tensorflow_error(str(host1 / chiefs.name))
    latest = model_dir / "checkpoints" / f"ckpt-{failing_step - failing_step % 2}"
    stopped = launch(*common, timeout=180)
    assert stopped.returncode == 1
    for worker, path in bad.items():
        assert worker_lines(stopped.stderr, worker)[-1] == (
            f"tfdp: error: the training data (tf.data.Dataset) failed ({kind}: {words}) at "
            f"step {failing_step}; each of its {FILES} TFRecord file(s) read again: {path} "
            f"({kind}: {words}); {latest} stands: run again to resume from it"
        )
    if bad_on == "one host":
        line = worker_lines(stopped.stderr, 0)[-1]
        assert line.startswith("tfdp: error: worker:0 lost the cluster, a worker died"), line
        assert line.endswith(f"restart every worker with the same flags to resume from {latest}")
    for path in bad.values():
        shutil.copy(good, path)
    resumed = launch(*common, timeout=180)
    assert resumed.returncode == 0, resumed.stderr
    # Bad on the chief's host, its saved position holds the failure: read again.
    position = "is read again from its start" if bad_on == "every host" else "at the position saved"
    for worker in (0, 1):
        assert (
            f"resuming at iteration {failing_step - failing_step % 2} from {model_dir} (the "
            f"tf.data.Dataset {position}" in "\n".join(worker_lines(resumed.stdout, worker))
        )
    assert result(model_dir)["iterations"] == steps
    for got, want in zip(load_weights(model_dir), keras_weights(script, steps), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_bad_validation_data_stops_the_run_and_the_rerun_resumes(bad_run, tmp_path, capsys):
    """A corrupt validation file: one line naming it at the evaluation's step, exit 1;
    the checkpoint before stands; repaired, the rerun ends with Keras' weights and
    Keras' evaluation of the repaired file."""
    script, bad, good, _ = bad_run
    shutil.copy(good, bad)  # the training data is good here
    validation = tmp_path / "validation" / "part-0.tfrecord"
    saved = tmp_path / "validation-good.tfrecord"
    shutil.copy(validation, saved)
    corrupt(validation)
    kind, words = plain_tensorflow_error(str(validation))
    model_dir = tmp_path / "run"
    common = [
        f"--model={script}:make_model",
        f"--dataset={script}:data_validated",
        "--iterations=8",
        "--eval_every=4",
        "--checkpoint_every=2",
        "--log_every=0",
        f"--model_dir={model_dir}",
        *MODES["weighted"],
    ]
    assert cli_in_process(*common) == 1
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (
        f"tfdp: error: the validation data (tf.data.Dataset) failed ({kind}: {words}) in the "
        f"evaluation at step 4; each of its 1 TFRecord file(s) read again: {validation} "
        f"({kind}: {words}); {model_dir / 'checkpoints' / 'ckpt-2'} stands: run again to "
        "resume from it"
    )
    shutil.copy(saved, validation)
    assert cli_in_process(*common) == 0
    assert "resuming at iteration 2" in capsys.readouterr().out
    spec = {"__name__": "data_script"}
    exec(script.read_text(), spec)  # noqa: S102
    reference = spec["make_model"]()
    train, test = spec["data_validated"]()
    reference.fit(train, epochs=1, steps_per_epoch=8, verbose=0)
    for got, want in zip(load_weights(model_dir), reference.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    _, accuracy = reference.evaluate(test.batch(1024), verbose=0)
    assert result(model_dir)["test_metrics"]["accuracy"] == pytest.approx(accuracy, abs=1e-6)


def test_the_words_are_tensorflows_own_from_a_graph_and_from_python(tmp_path):
    """An error raised inside a tf.function comes wrapped in "Graph execution error",
    the stack where the op was made and the node: the line keeps TensorFlow's message
    only; a Python error raised in a generator keeps its own class and message."""
    from tfdp.data import bad_data

    write_records(str(tmp_path), files=1)
    path = str(tmp_path / "part-0.tfrecord")
    corrupt(path)
    kind, words = plain_tensorflow_error(path)
    assert (kind, words.split(" at ")[0]) == ("DataLossError", "corrupted record")

    @tf.function
    def read(iterator):
        return next(iterator)

    with pytest.raises(tf.errors.DataLossError) as raised:
        read(iter(tf.data.TFRecordDataset(path).batch(RECORDS)))
    assert "Graph execution error" in str(raised.value)  # the wrapping is there to drop
    assert bad_data.described(raised.value) == f"{kind}: {words}"

    def batches():
        yield np.zeros((2, FEATURES), np.float32), np.zeros(2, np.int64)
        raise ValueError("row 3 has no label")

    dataset = tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec((None, FEATURES), tf.float32),
            tf.TensorSpec((None,), tf.int64),
        ),
    )
    with pytest.raises(tf.errors.OpError) as raised:
        list(dataset)
    assert bad_data.described(raised.value) == "ValueError: row 3 has no label"


def test_a_worker_names_the_checkpoint_it_saved_not_what_the_chief_has_written(tmp_path):
    """A worker that is not the chief saves to scratch; the chief may still be writing
    that save when the worker stops on bad data. The checkpoint its line names is the
    one of its last save, whatever the directory holds yet."""
    import types

    import keras

    from tfdp import Config
    from tfdp.engine.split import Split
    from tfdp.run.checkpoints import Checkpointer

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(), loss="mse")
    worker = types.SimpleNamespace(is_chief=False, worker="worker:1")  # a cluster's exchange
    split = Split(["worker:0", "worker:1"], [4, 4])
    checkpointer = Checkpointer(Config(model_dir=str(tmp_path)), model, split, worker)
    assert checkpointer.standing is None
    checkpointer.save(6)
    assert tf.train.latest_checkpoint(checkpointer.directory) is None  # the chief's is not there
    assert checkpointer.standing == str(tmp_path / "checkpoints" / "ckpt-6")
