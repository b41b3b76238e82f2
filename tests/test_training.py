"""The tutorial's runs, end to end through `tfdp.train`."""

import numpy as np
import pytest

import tfdp
from tfdp import Config


def test_toy_run_weighted_cpu_gpu_powers():
    # The tutorial's first example: [cpu, gpu] with powers [1, 5], batch 100, 50 iterations.
    lines = []
    result = tfdp.train(
        Config(mode="weighted", model="toy", devices="cpu:0,cpu:1", powers=(1, 5), batch_size=100),
        log=lines.append,
    )
    assert lines[0] == "workload partition: [('CPU:0', 17), ('CPU:1', 83)]"
    assert lines[1].startswith("global batch 100 = 17 + 83 over 2 device(s)")
    assert [line.split(",")[0] for line in lines[2:7]] == [
        f"iteration {i}" for i in (0, 10, 20, 30, 40)
    ]
    assert lines[7].startswith("time for 50 iterations")
    assert lines[8].startswith("iteration 50, test accuracy")
    assert result["shards"] == [17, 83]
    assert result["log"][0]["accuracy"] < 0.5  # it starts near chance...
    assert result["final_accuracy"] >= 0.95  # ...and learns, as the tutorial asserts
    assert result["log"][-1]["loss"] < result["log"][0]["loss"] / 2


def test_result_is_what_result_json_writes():
    import json

    result = tfdp.train(
        Config(model="toy", batch_size=20, iterations=3, log_every=1), log=lambda line: None
    )
    assert json.loads(json.dumps(result)) == result
    assert set(result) >= {
        "mode",
        "devices",
        "shards",
        "log",
        "final_loss",
        "seconds",
        "images_per_second",
    }
    assert [entry["iteration"] for entry in result["log"]] == [0, 1, 2]
    assert result["devices"] == ["CPU:0"] and result["shards"] == [20]


def test_the_final_metrics_are_the_last_batchs():
    """As the tutorial's last line: the last step's own batch, not a mean since the last
    logged step (independent value: the same run logging every step)."""
    settings = dict(model="toy", batch_size=20, iterations=12)
    sparse = tfdp.train(Config(**settings, log_every=10), log=lambda line: None)
    every = tfdp.train(Config(**settings, log_every=1), log=lambda line: None)
    assert [e["iteration"] for e in sparse["log"]] == [0, 10]
    assert sparse["final_metrics"] == pytest.approx(
        {k: v for k, v in every["log"][-1].items() if k != "iteration"}, rel=1e-6
    )
    assert every["log"][-1]["iteration"] == 11


# LeNet on real MNIST, as in the tutorial: batch 1024, 50 iterations on one device; the
# other device sets train the first 21 (logs at 0, 10, 20), which must be the same.
LENET_RUNS = {
    "mirrored on 1": dict(mode="mirrored", devices="cpu:0"),
    "mirrored on 4": dict(mode="mirrored", devices="all", iterations=21),
    "weighted [1, 5] on 2": dict(
        mode="weighted", devices="cpu:0,cpu:1", powers=(1, 5), iterations=21
    ),
}


@pytest.fixture(scope="module")
def lenet_results(mnist_dir):
    return {
        name: tfdp.train(Config(mnist_dir=mnist_dir, **changes), log=print)
        for name, changes in LENET_RUNS.items()
    }


@pytest.mark.slow
@pytest.mark.mnist
def test_lenet_learns_like_the_tutorial(lenet_results):
    accuracy = {e["iteration"]: e["accuracy"] for e in lenet_results["mirrored on 1"]["log"]}
    assert sorted(accuracy) == [0, 10, 20, 30, 40]
    assert accuracy[40] >= 0.85
    assert accuracy[0] < 0.2
    assert lenet_results["mirrored on 1"]["test_accuracy"] >= 0.85


@pytest.mark.slow
@pytest.mark.mnist
def test_lenet_log_is_the_same_on_every_device_set(lenet_results):
    # Same seed, same batches, same update: only float rounding differs.
    reference = lenet_results["mirrored on 1"]["log"]
    for name, result in lenet_results.items():
        assert [e["iteration"] for e in result["log"]][:3] == [0, 10, 20], name
        for got, expected in zip(result["log"], reference[: len(result["log"])], strict=True):
            assert abs(got["accuracy"] - expected["accuracy"]) <= 3 / 1024, name
            np.testing.assert_allclose(got["loss"], expected["loss"], rtol=1e-3, err_msg=name)


def test_epochs_count_whole_passes_over_the_data():
    result = tfdp.train(Config(model="toy", epochs=2, batch_size=1000), log=lambda line: None)
    assert result["steps_per_epoch"] == 10  # 10,000 toy examples
    assert result["iterations"] == 20
    assert [e["iteration"] for e in result["evals"]] == [20]


@pytest.mark.mnist
def test_evaluation_is_the_same_on_every_device_set(mnist_dir):
    import tensorflow as tf
    from helpers import CPUS

    from tfdp.data.arrays import as_eval_stream
    from tfdp.data.mnist import load_mnist_idx
    from tfdp.engine.modes import build_trainer
    from tfdp.models import build_model
    from tfdp.run.training import evaluate, partition

    test = load_mnist_idx(mnist_dir, "test")
    model = build_model("lenet", seed=1)
    logits = model.predict(test.images / np.float32(255), verbose=0)
    expected = np.mean(np.argmax(logits, -1) == test.labels)
    expected_loss = float(
        tf.reduce_mean(
            tf.nn.sparse_softmax_cross_entropy_with_logits(labels=test.labels, logits=logits)
        )
    )
    for mode, devices, powers in [
        ("single", CPUS[:1], ()),
        ("mirrored", CPUS[:4], ()),
        ("mirrored", CPUS[:3], ()),  # 10,000 = 9 x 1024 + 784: uneven last batch
        ("weighted", CPUS[:2], (1, 5)),
    ]:
        config = Config(
            mode=mode, devices=",".join(devices), powers=powers, seed=1, batch_size=1024
        )
        trainer = build_trainer(config, devices, partition(config, devices))
        values = evaluate(trainer, as_eval_stream(test), config.batch_size)
        trainer.close()
        assert values["accuracy"] == pytest.approx(expected, abs=1e-6), (
            mode,
            devices,
        )  # 1 example: 1e-4
        assert values["loss"] == pytest.approx(expected_loss, rel=1e-5), (mode, devices)


@pytest.mark.slow
@pytest.mark.mnist
def test_lenet_two_epochs_on_two_devices_reaches_98_percent(mnist_dir):
    result = tfdp.train(
        Config(
            mode="mirrored",
            devices="cpu:0,cpu:1",
            batch_size=128,
            epochs=2,
            learning_rate=0.1,
            log_every=100,
            mnist_dir=mnist_dir,
        ),
        log=print,
    )
    assert result["iterations"] == 938  # 2 x ceil(60,000 / 128): every example, twice
    assert result["test_accuracy"] >= 0.98
