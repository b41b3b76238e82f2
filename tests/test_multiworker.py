"""Mode multiworker on loopback: tfdp-launch, and worker processes started by hand.

Every run is the toy model, so that the time goes to starting the workers; the
`single` runs they are compared with run in this process. Each subprocess has a
timeout: a hang fails the test instead of CI.
"""

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import (
    environment,
    latest_step,
    launch,
    load_weights,
    own_stderr_lines,
    refusal,
    result,
    start_workers,
    train,
    wait_for,
    worker_lines,
)

from tfdp import Config, split_batch
from tfdp.cluster.workers import free_ports, tf_configs

TOY = ["--model=toy", "--batch_size=256", "--progress=never"]


def single(model_dir, **changes):
    """The toy run of TOY's flags (with `changes`) in mode single, in this process: the
    lines it logged."""
    config = Config(**{"model": "toy", "batch_size": 256, **changes}, model_dir=str(model_dir))
    return train(config)[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Four runs of the same 3 steps: single, 2 workers with powers auto, with 1,3, and
    with caps that make each update two micro-steps."""
    root = tmp_path_factory.mktemp("runs")
    steps = [*TOY, "--iterations=3", "--log_every=1"]
    single_lines = single(root / "single", iterations=3, log_every=1)
    scratch = root / "tmp"
    scratch.mkdir()
    auto = launch(*steps, "--powers=auto", f"--model_dir={root / 'auto'}")
    assert auto.returncode == 0, auto.stderr
    uneven = launch(
        *steps,
        "--powers=1,3",
        f"--model_dir={root / 'uneven'}",
        f"--result_json={root / 'uneven.json'}",
        env=environment(TMPDIR=str(scratch)),
    )
    assert uneven.returncode == 0, uneven.stderr
    # caps of 64 per worker: each update of 256 is two micro-steps of 64 + 64
    micro = launch(*steps, "--max_rows=64,64", f"--model_dir={root / 'micro'}")
    assert micro.returncode == 0, micro.stderr
    return {"root": root, "single": single_lines, "auto": auto, "uneven": uneven, "micro": micro}


@pytest.mark.slow
@pytest.mark.parametrize("name", ["auto", "uneven", "micro"])
def test_two_workers_make_the_update_of_single(runs, name):
    root = runs["root"]
    for got, expected in zip(load_weights(root / name), load_weights(root / "single"), strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    single_log = [line for line in runs["single"] if "accuracy" in line]
    for worker in (0, 1):
        log = [line for line in worker_lines(runs[name].stdout, worker) if "accuracy" in line]
        assert [line.split(", loss")[0] for line in log] == [
            line.split(", loss")[0] for line in single_log
        ]
    for got, expected in zip(
        result(str(root / name))["log"], result(str(root / "single"))["log"], strict=True
    ):
        assert got == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_each_worker_takes_its_cap_in_each_micro_step(runs):
    for worker in (0, 1):
        lines = worker_lines(runs["micro"].stdout, worker)
        assert lines[0] == "workload partition: [('worker:0', 64), ('worker:1', 64)]"
        assert lines[1].startswith(
            "global batch 256 = 2 micro-steps of at most 64 + 64 (max_rows [64, 64]) over 2 worker(s)"
        )


@pytest.mark.slow
def test_powers_give_each_worker_its_share(runs):
    output = runs["uneven"].stdout
    for worker in (0, 1):
        lines = worker_lines(output, worker)
        assert lines[0] == "workload partition: [('worker:0', 64), ('worker:1', 192)]"
        assert lines[1].startswith("global batch 256 = 64 + 192 over 2 worker(s), mode multiworker")
    saved = json.loads((runs["root"] / "uneven.json").read_text())
    assert saved["shards"] == [64, 192] and saved["powers"] == [1.0, 3.0]
    assert saved["devices"] == ["worker:0", "worker:1"]
    assert (saved["worker"], saved["chief"], saved["worker_batch"]) == ("worker:0", True, 64)


@pytest.mark.slow
def test_auto_powers_are_measured_and_agreed(runs):
    saved = result(str(runs["root"] / "auto"))
    measured = saved["auto_powers"]
    assert measured["devices"] == saved["devices"] == ["worker:0", "worker:1"]
    assert all(rate > 0 for rate in measured["images_per_second"])
    assert max(measured["powers"]) == 1.0
    assert saved["shards"] == split_batch(256, measured["powers"])
    assert saved["worker_batch"] == saved["shards"][0]
    rates = ", ".join(
        f"{w} {r:.0f}" for w, r in zip(measured["devices"], measured["images_per_second"])
    )
    for worker in (0, 1):  # every worker measured the same figures and split the same way
        lines = worker_lines(runs["auto"].stdout, worker)
        assert lines[0] == f"auto powers: measured images/sec {rates}; powers {measured['powers']}"
        assert lines[1] == f"workload partition: [('worker:0', {saved['shards'][0]}), " + (
            f"('worker:1', {saved['shards'][1]})]"
        )


@pytest.mark.slow
def test_only_the_chief_writes(runs):
    model_dir = runs["root"] / "uneven"
    assert sorted(os.listdir(model_dir)) == [
        "checkpoints",
        "eval",
        "lock",
        "model.keras",
        "result.json",
        "run.json",
        "train",
    ]
    assert sorted(os.listdir(model_dir / "checkpoints")) == [
        "checkpoint",
        "ckpt-3.data-00000-of-00001",
        "ckpt-3.index",
    ]
    # One summary writer (two would leave two event files), and the chief's result.
    assert len(os.listdir(model_dir / "train")) == len(os.listdir(model_dir / "eval")) == 1
    assert result(str(model_dir))["worker"] == "worker:0"
    # Worker 1 saved its checkpoints in the temporary directory and removed them.
    assert os.listdir(runs["root"] / "tmp") == []


@pytest.mark.slow
def test_rebalancing_workers_make_the_update_of_single_and_keep_the_split(tmp_path):
    # worker:1 sleeps 7x its own compute time: the split moves off 128 + 128.
    steps = [*TOY, "--log_every=1", "--rebalance_every=2", "--simulate_slowdown=worker:1=8"]
    model_dir = tmp_path / "rebalanced"
    rebalanced = launch(*steps, "--iterations=12", f"--model_dir={model_dir}")
    assert rebalanced.returncode == 0, rebalanced.stderr
    single(tmp_path / "single", iterations=12)

    saved = result(str(model_dir))
    assert saved["rebalances"], "no re-split happened: the test shows nothing"
    assert saved["final_shards"] != [128, 128] and sum(saved["final_shards"]) == 256
    assert len(saved["device_seconds"]) == 2
    for worker in (0, 1):  # every worker printed the same re-splits
        lines = [line for line in worker_lines(rebalanced.stdout, worker) if "rebalanced" in line]
        assert len(lines) == len(saved["rebalances"])
        assert [line.split(" (")[0] for line in lines] == [
            f"rebalanced after iteration {r['iteration']}: shares {r['old']} -> {r['new']}"
            for r in saved["rebalances"]
        ]
    for got, want in zip(load_weights(model_dir), load_weights(tmp_path / "single"), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

    # The split survives a resume: the workers start from it instead of 128 + 128.
    with open(model_dir / "shares.json") as f:
        shares = json.load(f)
    assert shares["step"] == 12 and shares["shards"] == saved["final_shards"]
    resumed = launch(*steps, "--iterations=14", f"--model_dir={model_dir}")
    assert resumed.returncode == 0, resumed.stderr
    for worker in (0, 1):
        assert f"shares {shares['shards']}: the split at iteration 12, from " in "\n".join(
            worker_lines(resumed.stdout, worker)
        )
    assert result(str(model_dir))["shards"] == shares["shards"]


LONG = [*TOY, "--iterations=600", "--checkpoint_every=50", "--log_every=100"]


@pytest.fixture(scope="module")
def straight_600(tmp_path_factory):
    """The weights of 600 steps straight through on one device, in this process: what an
    interrupted 2-worker run must end with (to rtol 1e-5, the workers' own sum against one
    device's), and that tolerance tells one step more or fewer apart (checked here)."""
    weights = {}
    for steps in (599, 600):
        model_dir = tmp_path_factory.mktemp(f"single{steps}")
        single(model_dir, iterations=steps, log_every=100)
        weights[steps] = load_weights(model_dir)
    assert not all(
        np.allclose(fewer, expected, rtol=1e-5, atol=1e-7)
        for fewer, expected in zip(weights[599], weights[600], strict=True)
    )
    return weights[600]


def assert_the_weights_of_600_steps(model_dir, straight):
    for got, expected in zip(load_weights(model_dir), straight, strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)


def two_workers(args, model_dir):
    """Two workers started by hand, each with its own TF_CONFIG."""
    return start_workers([*args, f"--model_dir={model_dir}"], tf_configs(free_ports(2)))


@pytest.mark.slow
def test_a_killed_worker_stops_the_other_and_a_restart_resumes(tmp_path, straight_600):
    """As a Kubernetes TFJob with `restartPolicy: ExitCode` runs it: a killed pod (137) and
    the pod that lost its peer (138) are both retryable for the operator, which starts
    them again with the same TF_CONFIG; the run resumes from the latest checkpoint."""
    args, straight = LONG, straight_600
    model_dir = str(tmp_path / "killed")
    configs = tf_configs(free_ports(2))
    workers = start_workers([*args, f"--model_dir={model_dir}"], configs)
    try:
        wait_for(lambda: (latest_step(model_dir) or 0) >= 150, workers, "a checkpoint", 120)
        workers[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        _, stderr = workers[0].communicate(timeout=120)
        seconds = time.monotonic() - killed_at
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()

    # 138 = 128 + 10: the status the training operator keeps for a retryable error of one's own
    assert workers[0].returncode == 138 and seconds < 120
    stopped_at = latest_step(model_dir)
    assert 150 <= stopped_at < 600
    last = [line for line in stderr.splitlines() if line.startswith("tfdp: ")][-1]
    assert last.startswith("tfdp: error: worker:0 lost the cluster, a worker died"), stderr
    assert last.endswith(
        f"restart every worker with the same flags to resume from "
        f"{model_dir}/checkpoints/ckpt-{stopped_at}"
    )
    assert "Traceback" not in stderr
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))

    restarted = start_workers([*args, f"--model_dir={model_dir}"], configs)  # the same TF_CONFIGs
    outputs = [worker.communicate(timeout=240) for worker in restarted]
    assert [worker.returncode for worker in restarted] == [0, 0], outputs
    for stdout, _ in outputs:
        assert f"resuming at iteration {stopped_at} from" in stdout.splitlines()[1]
    assert result(model_dir)["start_iteration"] == stopped_at
    assert result(model_dir)["iterations"] == latest_step(model_dir) == 600
    assert_the_weights_of_600_steps(model_dir, straight)


@pytest.mark.slow
def test_sigterm_to_one_worker_stops_both_at_the_same_saved_step(tmp_path, straight_600):
    model_dir = str(tmp_path / "stopped")
    workers = two_workers(LONG, model_dir)
    try:
        wait_for(lambda: (latest_step(model_dir) or 0) >= 100, workers, "a checkpoint", 120)
        workers[1].send_signal(signal.SIGTERM)  # as a scheduler preempting one machine
        outputs = [w.communicate(timeout=120) for w in workers]
    finally:
        for worker in workers:
            worker.kill()
            worker.wait()

    assert [w.returncode for w in workers] == [143, 143], outputs  # both were running
    stopped_at = latest_step(model_dir)
    assert 100 <= stopped_at < 600
    for _, stderr in outputs:
        [line] = [line for line in stderr.splitlines() if line.startswith("tfdp: ")]
        assert line == (
            f"tfdp: stopped by SIGTERM after iteration {stopped_at}; saved "
            f"{model_dir}/checkpoints/ckpt-{stopped_at}; run the same command again to resume"
        )
    assert not os.path.exists(os.path.join(model_dir, "model.keras"))

    resumed = launch(*LONG, f"--model_dir={model_dir}")
    assert resumed.returncode == 0, resumed.stderr
    assert result(model_dir)["start_iteration"] == stopped_at
    assert_the_weights_of_600_steps(model_dir, straight_600)


READ_A_WORKER_ITERATOR = """
import json
from tfdp import Config
from tfdp.data import arrays as in_memory
from tfdp.data import mnist
from tfdp.cluster.spec import read_cluster
from tfdp.engine.cluster_strategy import join_cluster
from tfdp.engine.modes import build_trainer
config = Config(mode="multiworker", model="toy", batch_size=8)
workers = list(read_cluster().workers)
join_cluster(config)
trainer = build_trainer(config, workers, [8])
arrays = mnist.make_toy_data(0, num_examples=50)
iterator = trainer.distribute(in_memory.train_dataset(arrays, 8, 1))
loss = float(trainer.train_step(iterator)["logs"]["loss"])
dataset = iterator._dataset
read = {"iterator": type(iterator).__name__, "autotune": dataset.options().autotune.enabled}
# arrays: the iterator gives example indices; the step gathers the worker's slice of them
import numpy as np, tensorflow as tf
gathered, gather = [], in_memory.gatherer(arrays)
def count(indices):
    gathered.append(len(indices))
    return np.int64(0)
def counted(indices):
    tf.numpy_function(count, [indices], tf.int64)
    return gather(indices)
iterator = trainer.distribute(in_memory.train_indices(arrays, 8, 1), gather=counted)
read["first"] = next(iter(iterator._dataset)).numpy().tolist()
loss = float(trainer.train_step(iterator)["logs"]["loss"])
read["gathered"] = gathered
print(json.dumps(read))
"""


@pytest.mark.slow
def test_a_worker_reads_its_batches_with_a_plain_iterator_without_autotuning():
    # tf.distribute's per-device iterators turn tf.data's autotuning back on, and deleting
    # one could wait over a second for its background thread at the end of every run
    # (MultiWorkerTrainer.distribute); a worker reads the host pipeline's own iterator.
    (tf_config,) = tf_configs(free_ports(1))
    process = subprocess.run(
        [sys.executable, "-c", READ_A_WORKER_ITERATOR],
        capture_output=True,
        text=True,
        env=environment(TF_CONFIG=tf_config),
        timeout=120,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    read = json.loads(process.stdout.strip().splitlines()[-1])
    first = read.pop("first")  # example indices of the shuffled toy data
    assert len(set(first)) == 8 and all(0 <= i < 50 for i in first)
    assert read == {"iterator": "OwnedIterator", "autotune": False, "gathered": [8]}


EXAMPLE = {"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}}
BAD_TF_CONFIGS = [
    (None, "is not set; mode multiworker reads the cluster"),
    ("{not json", "is not valid JSON"),
    (json.dumps({"task": {"type": "worker", "index": 0}}), 'needs "cluster"'),
    (json.dumps({**EXAMPLE, "task": {"type": "worker", "index": 2}}), "task worker:2 is not in"),
    (json.dumps({**EXAMPLE, "task": {"type": "ps", "index": 0}}), '"task" must name a type'),
    (
        json.dumps({"cluster": {"worker": ["127.0.0.1"]}, "task": {"type": "worker", "index": 0}}),
        "host:port addresses",
    ),
]


@pytest.mark.parametrize("tf_config, reason", BAD_TF_CONFIGS)
def test_bad_tf_config_fails_early(tf_config, reason, tmp_path, monkeypatch):
    if tf_config is None:
        monkeypatch.delenv("TF_CONFIG", raising=False)
    else:
        monkeypatch.setenv("TF_CONFIG", tf_config)
    monkeypatch.chdir(tmp_path)
    error, line = refusal("--mode=multiworker", "--model=toy", "--cluster=tf_config")
    assert (error.field, error.value) == ("TF_CONFIG", tf_config or "")
    assert line.startswith(f"tfdp: error: TF_CONFIG={tf_config or ''}: ")
    assert reason in line
    assert list(tmp_path.iterdir()) == []


def test_no_cluster_is_one_line_and_exit_2_before_tensorflow(tmp_path):
    process = subprocess.run(
        [sys.executable, "-m", "tfdp", "--mode=multiworker", "--model=toy"],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=tmp_path,
        timeout=120,
    )
    assert process.returncode == 2
    [line] = own_stderr_lines(process)
    assert line.startswith(
        "tfdp: error: --cluster=auto: found neither TF_CONFIG nor a Slurm step (SLURM_PROCID is "
        'not set); mode multiworker needs one: TF_CONFIG=\'{"cluster": '
    )
    assert process.stdout == "" and list(tmp_path.iterdir()) == []


TF_CONFIG = json.dumps({**EXAMPLE, "task": {"type": "worker", "index": 0}})
BAD_FLAGS = [
    (["--logical_cpus=2"], "--logical_cpus=2: MultiWorkerMirroredStrategy runs one replica"),
    (["--devices=cpu:0"], "--devices=cpu:0: mode multiworker uses each worker's own devices"),
    (["--powers=1,2,3"], "--powers=1,2,3: has 3 values for 2 devices (worker:0, worker:1)"),
    (["--collective=mpi"], "--collective"),
    (["--collective_timeout=-1"], "--collective_timeout=-1"),
]


@pytest.mark.parametrize("args, message", BAD_FLAGS)
def test_bad_multiworker_flags(args, message, tmp_path, monkeypatch):
    # every one is found before the worker joins the cluster
    monkeypatch.setenv("TF_CONFIG", TF_CONFIG)
    monkeypatch.chdir(tmp_path)
    _, line = refusal("--mode=multiworker", "--model=toy", *args)
    assert line.startswith("tfdp: error: ") and message in line, line
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "args, message",
    [
        (["--workers=0"], "--workers=0: must be a positive integer"),
        (["--workers=two"], "--workers=two: must be a positive integer"),
        (["--workers=2", "--mode=single"], "--mode=single: tfdp-launch runs mode multiworker"),
        (["--workers=2", "extra"], "extra: unexpected argument"),
        (["--grace_seconds=-1"], "--grace_seconds=-1: must be"),
    ],
)
def test_bad_launch_flags(args, message):
    process = subprocess.run(
        [sys.executable, "-m", "tfdp.cluster.launch", *args],
        capture_output=True,
        text=True,
        env=environment(),
        timeout=60,
    )
    assert process.returncode == 2
    [line] = process.stderr.splitlines()
    assert line.startswith(f"tfdp-launch: error: {message}")
    assert process.stdout == ""


@pytest.mark.slow
def test_launch_fails_when_a_worker_fails(tmp_path):
    # Every worker refuses the data directory, after TensorFlow has started: status 2 comes back.
    missing = tmp_path / "no_mnist_here"
    process = launch(f"--mnist_dir={missing}", "--batch_size=64", timeout=120)
    assert process.returncode == 2
    for worker in (0, 1):
        assert any(
            line.startswith(f"tfdp: error: --mnist_dir={missing}: MNIST directory not found")
            for line in worker_lines(process.stderr, worker)
        )
    assert "tfdp-launch: worker " in process.stderr


USER_MODEL = """
import keras
import numpy as np


def model():
    keras.utils.set_random_seed(7)
    a, b = keras.Input((6,), name="a"), keras.Input((4,), name="b")
    # a frozen base called with training=False (keras.io's transfer learning): its
    # weights and batch statistics stay as they are
    base = keras.Sequential([keras.layers.Dense(8), keras.layers.BatchNormalization()])
    base.build((None, 4))
    base.trainable = False
    h = keras.layers.Concatenate()([
        keras.layers.Dense(16, activation="tanh", kernel_regularizer="l2")(a),
        keras.layers.Dense(8, activation="relu")(base(b, training=False)),
    ])
    out = keras.layers.Dense(3, kernel_regularizer=keras.regularizers.L2(0.05))(h)
    m = keras.Model({"a": a, "b": b}, out, name="two_inputs")
    m.compile(optimizer=keras.optimizers.Adam(0.01, global_clipnorm=0.05),
              loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
              metrics=["accuracy"])
    return m


def data():
    rng = np.random.default_rng(0)
    x = {"a": rng.normal(size=(250, 6)).astype(np.float32),
         "b": rng.normal(size=(250, 4)).astype(np.float32)}
    y = rng.integers(0, 3, 250).astype(np.int32)
    weights = rng.uniform(0.2, 2.0, 250).astype(np.float32)
    return (x, y, weights), (x, y)
"""


@pytest.mark.slow
def test_two_workers_make_the_single_update_for_a_user_model(tmp_path):
    """Dict inputs, L2, Adam with global clipping, sample weights and a frozen base with
    batch normalization, over 2 workers;
    250 examples in batches of 60, so the fifth step is an epoch's last 10."""
    source = tmp_path / "user.py"
    source.write_text(USER_MODEL)
    steps = [
        f"--model={source}:model",
        f"--dataset={source}:data",
        "--batch_size=60",
        "--iterations=6",
        "--progress=never",
    ]
    train(
        Config(
            model=f"{source}:model",
            dataset=f"{source}:data",
            batch_size=60,
            iterations=6,
            model_dir=str(tmp_path / "single"),
        )
    )
    workers = launch(*steps, "--powers=1,3", f"--model_dir={tmp_path / 'workers'}")
    assert workers.returncode == 0, workers.stderr
    assert "global batch 60 = 15 + 45 over 2 worker(s)" in workers.stdout
    got, expected = load_weights(tmp_path / "workers"), load_weights(tmp_path / "single")
    start = initial_weights_of(source)
    moved = [np.abs(w - w0).max() > 1e-4 for w, w0 in zip(expected, start, strict=True)]
    assert moved.count(False) == 6  # the frozen base's kernel, bias and batch normalization
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-6)
    assert result(str(tmp_path / "workers"))["test_metrics"] == pytest.approx(
        result(str(tmp_path / "single"))["test_metrics"], rel=1e-5
    )


def initial_weights_of(source):
    """The weights the user's model function builds."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("two_inputs_user", source)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.model().get_weights()


OWN_STEP_MODEL = """
import keras
import numpy as np
import tensorflow as tf


@keras.saving.register_keras_serializable(package="tfdp_tests")
class OwnStep(keras.Model):
    # keras.io's lower-level train_step: its own mean loss and its own Mean of it
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.hidden = keras.layers.Dense(8, activation="tanh")
        self.out = keras.layers.Dense(2)
        self.tracker = keras.metrics.Mean(name="loss")

    def call(self, x):
        return self.out(self.hidden(x))

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean(keras.ops.square(y - self(x, training=True)))
        gradients = tape.gradient(loss, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}

    @property
    def metrics(self):
        return [self.tracker]


def model():
    keras.utils.set_random_seed(3)
    m = OwnStep()
    m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    m.build((None, 5))
    return m


def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(200, 5)).astype(np.float32)
    y = np.stack([x[:, 0] * x[:, 1], np.sin(x[:, 2])], 1).astype(np.float32)
    return (x, y), (x, y)
"""


@pytest.mark.slow
def test_two_workers_run_a_models_own_train_step_as_single_runs_it(tmp_path):
    """keras.io's lower-level train_step over uneven workers: the update and the logged
    loss (its own Mean of its own mean loss) are single's, each worker's loss counted
    by its share of the batch."""
    source = tmp_path / "own.py"
    source.write_text(OWN_STEP_MODEL)
    steps = [f"--model={source}:model", f"--dataset={source}:data", "--batch_size=40",
             "--iterations=4", "--log_every=1", "--progress=never"]
    single_lines = single(tmp_path / "single", model=f"{source}:model",
                          dataset=f"{source}:data", batch_size=40, iterations=4, log_every=1)
    workers = launch(*steps, "--powers=1,3", f"--model_dir={tmp_path / 'workers'}")
    assert workers.returncode == 0, workers.stderr
    initial_weights_of(source)  # (registers the model's class, to load it)
    for got, want in zip(load_weights(tmp_path / "workers"), load_weights(tmp_path / "single"),
                         strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)

    def losses(lines):
        return [float(line.split("loss ")[1].split()[0]) for line in lines
                if line.startswith("iteration ") and "test" not in line]

    want = losses(single_lines)
    assert len(want) == 4  # iterations 0 to 3
    for worker in (0, 1):
        got = losses(worker_lines(workers.stdout, worker))
        np.testing.assert_allclose(got, want, rtol=1e-5)
