"""tfdp-bench: its FLOP count, and a smoke run (speed is never asserted here)."""

import json

import pytest
from helpers import environment, plotting_environment

from tfdp.bench.flops import FORWARD_FLOPS, LENET_FORWARD_MACS, TRAIN_FLOPS
from tfdp.bench.table import configurations
from tfdp.models import build_model


def x86_64():
    import platform

    return platform.machine().lower() in ("x86_64", "amd64")


def tensorflow_default_onednn():
    """Whether a process that leaves TF_ENABLE_ONEDNN_OPTS unset runs oneDNN's kernels,
    as TensorFlow's own start-up log says."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("TF_ENABLE_ONEDNN_OPTS", "TFDP_ONEDNN")}
    env["TF_CPP_MIN_LOG_LEVEL"] = "0"
    out = subprocess.run(
        [sys.executable, "-c", "import tensorflow"], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return "oneDNN custom operations are on" in out.stderr


# LeNet's FLOPs per training image, by hand: 2 FLOPs per multiply-add.
#   conv1 5x5, 1 -> 20 channels, 24x24 outputs: 2 * 5*5*1*20 * 24*24 =   576,000
#   conv2 5x5, 20 -> 50 channels, 8x8 outputs:  2 * 5*5*20*50 * 8*8  = 3,200,000
#   dense 800 -> 500:                           2 * 800*500          =   800,000
#   dense 500 -> 10:                            2 * 500*10           =    10,000
#   forward                                                          = 4,586,000
# and the bench counts training as 3 forward passes (forward, gradients of the
# inputs, gradients of the weights): 3 * 4,586,000 = 13,758,000.
LENET_FORWARD_FLOPS_BY_HAND = 4_586_000
LENET_TRAIN_FLOPS_BY_HAND = 13_758_000


def test_flop_count_follows_the_model():
    flops = 0
    model = build_model("lenet")
    for layer in model.layers:
        if hasattr(layer, "kernel"):
            kernel = layer.kernel.shape
            if len(kernel) == 4:  # conv: 2 * k * k * cin * cout per output position
                height, width = layer.output.shape[1:3]
                flops += 2 * kernel[0] * kernel[1] * kernel[2] * kernel[3] * height * width
            else:  # dense: 2 * in * out
                flops += 2 * kernel[0] * kernel[1]
    assert flops == LENET_FORWARD_FLOPS_BY_HAND
    assert 2 * LENET_FORWARD_MACS == FORWARD_FLOPS == LENET_FORWARD_FLOPS_BY_HAND
    assert TRAIN_FLOPS == LENET_TRAIN_FLOPS_BY_HAND


def test_configurations_cover_the_table():
    specs = configurations([1, 2, 4], [1.0, 3.0], keras_onednn=[1])
    assert [spec.name for spec in specs] == [
        "matmul peak",
        "tfdp single",
        "keras fit",
        "keras fit, oneDNN",
        "tfdp mirrored x2",
        "tfdp weighted x2",
        "keras fit mirrored x2",
        "tfdp mirrored x4",
        "tfdp weighted x4",
        "keras fit mirrored x4",
        "tfdp weighted 1:3",
    ]
    # The Keras baseline runs as TensorFlow comes; its oneDNN twin and tfdp run as tfdp does.
    assert {s.name for s in specs if s.onednn == "tensorflow"} == {
        "keras fit",
        "keras fit mirrored x2",
        "keras fit mirrored x4",
    }


def fake_measurements(specs, rounds=3):
    """Made-up measurements of `specs`: every configuration and round at its own rate."""
    measurements = {}
    for k, spec in enumerate(specs):
        if spec.system == "matmul":
            measurements[spec.name] = [{"flops_per_second": 1e11 * (1 + r)} for r in range(rounds)]
            continue
        measurements[spec.name] = [
            {
                "images_per_second": 1000.0 * (k + 1) + 10 * r,
                "seconds": 1.0 + 0.1 * r,
                "onednn": True,
                "steal_fraction": 0.01 * r,
                "device_list": ["CPU:0"],
            }
            for r in range(rounds)
        ]
    return measurements


def test_the_table_is_the_arithmetic_of_the_measurements():
    from tfdp.bench.table import format_table, summarize

    specs = configurations([1, 2], [1.0, 3.0], keras_onednn=[1])
    measurements = fake_measurements(specs)
    rows = summarize(specs, measurements, batch_size=32, iterations=2)
    median = {
        name: sorted(m["images_per_second"] for m in runs)[1]
        for name, runs in measurements.items()
        if name != "matmul peak"
    }
    peak = 2e11  # the median of 1e11, 2e11, 3e11
    by_name = {row["configuration"]: row for row in rows}
    assert list(by_name) == [s.name for s in specs if s.system != "matmul"]
    keras_of = {
        "tfdp single": "keras fit",
        "keras fit": "keras fit",
        "keras fit, oneDNN": "keras fit",
        "tfdp mirrored x2": "keras fit mirrored x2",
        "tfdp weighted x2": "keras fit mirrored x2",
        "keras fit mirrored x2": "keras fit mirrored x2",
        "tfdp weighted 1:3": "keras fit mirrored x2",
    }
    for name, row in by_name.items():
        assert row["images_per_second"] == median[name]
        assert row["vs_tfdp_single"] == pytest.approx(median[name] / median["tfdp single"])
        assert row["keras_same_devices"] == keras_of[name]
        assert row["vs_keras_same_devices"] == pytest.approx(median[name] / median[keras_of[name]])
        # LeNet's FLOPs per training image, counted by hand above
        assert row["fraction_of_peak"] == pytest.approx(
            median[name] * LENET_TRAIN_FLOPS_BY_HAND / peak
        )
        assert row["steal_fraction_max"] == pytest.approx(0.02)
    assert by_name["tfdp single"]["vs_keras_onednn_same_devices"] == pytest.approx(
        median["tfdp single"] / median["keras fit, oneDNN"]
    )
    # every ratio tells the rows apart: a ratio taken against the wrong row shows
    assert len({row["vs_tfdp_single"] for row in rows}) == len(rows)
    table = format_table(rows, 2)
    assert f"| tfdp weighted 1:3 | 2 | {median['tfdp weighted 1:3']:.0f} " in table


class CountedLoss:
    """A step's loss that counts the times it was waited for (read as a float)."""

    def __init__(self):
        self.reads = 0

    def __float__(self):
        self.reads += 1
        return 0.5


def test_the_window_waits_for_its_first_and_last_step_only():
    from tfdp.bench.timed import Window

    window = Window(warmup=3, iterations=4, middle=True)
    losses = [CountedLoss() for _ in range(7)]
    for step, loss in enumerate(losses):
        window.step_done(step, loss)
    # the warm-up's last step (2), the first half's last (4) and the last (6)
    assert [loss.reads for loss in losses] == [0, 0, 1, 0, 1, 0, 1]
    assert window.ends[0] <= window.middle_end <= window.ends[1]
    assert window.seconds == window.ends[1] - window.ends[0] > 0
    assert "cpu_seconds" in window.cpu or not window.cpu  # (no /proc: no CPU accounting)
    short = Window(warmup=3, iterations=4)
    for step in range(5):
        short.step_done(step, CountedLoss())
    with pytest.raises(RuntimeError, match="ended before step 7"):
        short.seconds


def test_a_timed_run_is_the_commands_run_timed_after_its_warmup():
    """`bench.timed.run`: the command's run (its result, split and evaluation), the clock
    over its last steps only."""
    from tfdp import Config
    from tfdp.bench import timed

    config = Config(
        mode="weighted", model="toy", dataset="toy", devices="cpu:0,cpu:1", powers=(1.0, 3.0),
        batch_size=64,
    )
    result = timed.run(config, warmup=2, iterations=3, halves_asked=True)
    assert result["iterations"] == 5 and result["shards"] == [16, 48]
    assert result["mode"] == "weighted" and 0 <= result["test_accuracy"] <= 1
    assert result["images_per_second"] == pytest.approx(3 * 64 / result["seconds"], rel=1e-9)
    # the run's own clock covers all 5 steps; the bench's the last 3
    assert 0 < result["seconds"] < result["run_seconds"]
    assert 0 < result["set_up_seconds"] < result["warmup_seconds"]
    assert result["images_per_second_second_half"] > 0
    with pytest.raises(ValueError, match="warmup=0"):
        timed.run(config, warmup=0, iterations=3)


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    """The scaling suite's smallest run: the parent, a matmul, tfdp single, Keras fit and
    a weighted split, each measured in its own process."""
    import subprocess
    import sys

    jsonl, png = tmp_path / "bench.jsonl", tmp_path / "bench.png"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdp.bench",
            "--synthetic",
            "--rounds=1",
            "--iterations=2",
            "--warmup=1",
            "--batch_size=32",
            "--device_counts=1,2",
            "--devices=cpu",
            "--keras_onednn=",
            "--only=tfdp single,keras fit,tfdp weighted 1:3",
            f"--json={jsonl}",
            f"--plot={png}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=plotting_environment(),
    )
    assert process.returncode == 0, process.stderr[-3000:]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = [r for r in records if r.get("summary")]
    assert [r["configuration"] for r in rows] == ["tfdp single", "keras fit", "tfdp weighted 1:3"]
    measured = [r for r in records if not r.get("summary")]
    assert {r["name"] for r in measured} == {"matmul peak", *(r["configuration"] for r in rows)}
    # One round: each row's figures follow from its one measurement's raw time.
    by_name = {r["name"]: r for r in measured}
    assert len(by_name) == len(measured) == len(rows) + 1
    # images/s: 2 iterations x 32 images over the timed steps' seconds
    rate = {name: 2 * 32 / r["seconds"] for name, r in by_name.items() if name != "matmul peak"}
    peak = by_name["matmul peak"]["flops_per_second"]
    assert peak > 0
    for row in rows:
        name = row["configuration"]
        assert row["images_per_second"] == pytest.approx(rate[name], rel=1e-9)
        assert row["vs_tfdp_single"] == pytest.approx(rate[name] / rate["tfdp single"], rel=1e-9)
        assert row["fraction_of_peak"] == pytest.approx(
            rate[name] * LENET_TRAIN_FLOPS_BY_HAND / peak, rel=1e-9
        )
    # Against the right row: the other rows' rates differ from tfdp single's.
    assert all(rate[name] != rate["tfdp single"] for name in rate if name != "tfdp single")
    assert [r["shards"] for r in measured if r["name"] == "tfdp weighted 1:3"] == [[8, 24]]
    assert "| tfdp weighted 1:3 | 2 |" in process.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # Each measurement says whether oneDNN was on, and how much time the machine lost.
    onednn = {r["name"]: r["onednn"] for r in measured}
    assert onednn["keras fit"] == tensorflow_default_onednn()
    if x86_64():
        assert onednn["tfdp single"] is True
    for record in measured:
        if record["name"] != "matmul peak":
            assert 0 <= record["steal_fraction"] <= 1 and record["cpu_seconds"] > 0
    # tfdp's rows are runs of the command: set up, then the warm-up step, then the clock
    for name in ("tfdp single", "tfdp weighted 1:3"):
        run = by_name[name]
        assert 0 < run["set_up_seconds"] < run["warmup_seconds"]
        assert run["warmup_iterations"] == 1 and run["device_list"] == (
            ["CPU:0"] if name == "tfdp single" else ["CPU:0", "CPU:1"]
        )


@pytest.mark.slow
def test_mixed_suite_smoke(tmp_path):
    import subprocess
    import sys

    jsonl, png = tmp_path / "mixed.jsonl", tmp_path / "mixed.png"
    process = subprocess.run(
        [
            sys.executable,
            "-m",
            "tfdp.bench",
            "--suite=mixed",
            "--synthetic",
            "--rounds=1",
            "--iterations=6",
            "--warmup=1",
            "--batch_size=64",
            "--sweep=16",
            "--only=auto,share 16,cpu:0 alone",
            f"--json={jsonl}",
            f"--plot={png}",
        ],
        capture_output=True,
        text=True,
        timeout=900,
        env=plotting_environment(),
    )
    assert process.returncode == 0, process.stderr[-3000:]
    assert "SIMULATED slowdown cpu:1=4" in process.stdout.splitlines()[0]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = {r["configuration"]: r for r in records if r.get("summary")}
    assert list(rows) == ["even split", "auto", "share 16", "cpu:0 alone"]
    # the device that is not slowed, alone: the whole batch, and the rows' ratios to it
    assert rows["cpu:0 alone"]["start_shards"] == [64] and rows["cpu:0 alone"]["vs_alone"] == 1.0
    assert rows["auto"]["vs_alone"] > 0 and "| vs fastest alone |" in process.stdout
    assert rows["even split"]["vs_even"] == 1.0
    assert rows["even split"]["start_shards"] == [32, 32]
    # The slowed device is measured slower, so auto gives it less.
    assert rows["auto"]["start_shards"][1] < 32
    # auto's set-up probes the devices: longer than a row that starts from its powers
    assert rows["auto"]["set_up_seconds"] > rows["share 16"]["set_up_seconds"]
    measured = [r for r in records if not r.get("summary")]
    assert all(r["delays"][0] == 0 and r["delays"][1] > 0 for r in measured)
    # The second half of the iterations is timed on its own too (3 of 6 here).
    for r in measured:
        assert 0 < 3 * 64 / r["images_per_second_second_half"] < r["seconds"]
    assert rows["share 16"]["vs_best_sweep_second_half"] == 1.0
    assert all(row["vs_best_sweep_second_half"] > 0 for row in rows.values())
    assert "| second half vs best |" in process.stdout
    # every run faced the slow device of the one calibration, not one of its own; the
    # device alone runs without it
    for r in measured:
        if r["name"] == "cpu:0 alone":
            assert r["simulated_slowdown"] is None
            continue
        [slowed] = r["simulated_slowdown"].values()
        assert slowed["sleep_seconds_per_example"] == r["delays"][1]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_a_command_that_draws_finds_matplotlib():
    """The processes the tests start find neither matplotlib nor IPython (conftest.py), so
    that Keras does not import them at each start-up; a command that draws finds matplotlib."""
    import subprocess
    import sys

    def imports(module, env):
        return subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            check=False,
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )

    for module in ("matplotlib", "IPython"):
        hidden = imports(module, environment())
        assert hidden.returncode == 1
        assert f"ModuleNotFoundError: {module} is hidden from this test process" in hidden.stderr
    shown = imports("matplotlib", plotting_environment())
    assert shown.returncode == 0, shown.stderr[-2000:]


def run_bench(*flags):
    import subprocess
    import sys

    process = subprocess.run(
        [sys.executable, "-m", "tfdp.bench", *flags],
        check=False,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert process.returncode == 0, process.stderr[-3000:]
    return process


def test_gpu_suite_rows_and_their_stand_ins():
    """Without a GPU, logical CPUs stand in: CPU:0 and CPU:1 for two GPUs, CPU:2 for the CPU."""
    from tfdp.bench import gpu
    from tfdp.devices import canonical_name

    specs = gpu.gpu_configurations(gpu.STAND_IN_GPUS)
    assert [(s.name, list(s.device_list)) for s in specs] == [
        ("matmul peak", []),
        ("tfdp single", ["GPU:0"]),
        ("keras fit", ["GPU:0"]),
        ("tfdp mirrored x2", ["GPU:0", "GPU:1"]),
        ("keras fit mirrored x2", ["GPU:0", "GPU:1"]),
        ("tfdp weighted gpu+cpu auto", ["GPU:0", "CPU:0"]),
        ("keras fit mirrored gpu+cpu", ["GPU:0", "CPU:0"]),
    ]
    stand_in = gpu.stand_in()
    assert stand_in["logical_cpus"] == 3
    assert {name: canonical_name(cpu) for name, cpu in stand_in["devices"].items()} == {
        "GPU:0": "/device:CPU:0",
        "GPU:1": "/device:CPU:1",
        "CPU:0": "/device:CPU:2",
    }


def test_the_gpu_table_sets_each_row_beside_keras_on_the_same_devices():
    from tfdp.bench import gpu
    from tfdp.bench.table import summarize

    specs = gpu.gpu_configurations(gpu.STAND_IN_GPUS)
    measurements = fake_measurements(specs)
    rows = {row["configuration"]: row for row in summarize(specs, measurements, 32, 2)}
    median = {
        name: sorted(m["images_per_second"] for m in runs)[1]
        for name, runs in measurements.items()
        if name != "matmul peak"
    }
    # each tfdp row beside Keras fit on the same devices, found by their names
    assert {name: row["keras_same_devices"] for name, row in rows.items() if "tfdp" in name} == {
        "tfdp single": "keras fit",
        "tfdp mirrored x2": "keras fit mirrored x2",
        "tfdp weighted gpu+cpu auto": "keras fit mirrored gpu+cpu",
    }
    for name, row in rows.items():
        assert row["vs_keras_same_devices"] == pytest.approx(
            median[name] / median[row["keras_same_devices"]]
        )
        assert row["stands_for"] == [list(s.device_list) for s in specs if s.name == name][0]


@pytest.mark.slow
def test_gpu_suite_smoke_on_stand_ins(tmp_path):
    """The gpu suite's smallest run that measures a GPU+CPU split: weighted with auto
    powers, on the logical CPUs that stand in for a GPU and the CPU."""
    from tfdp.bench.table import count_gpus

    if count_gpus():
        pytest.skip("a GPU host runs the suite on its GPUs, not on stand-ins")
    jsonl = tmp_path / "gpu.jsonl"
    process = run_bench(
        "--suite=gpu",
        "--synthetic",
        "--rounds=1",
        "--iterations=2",
        "--warmup=1",
        "--batch_size=32",
        "--only=tfdp weighted gpu+cpu auto",
        f"--json={jsonl}",
    )
    assert (
        "STAND-IN, no GPU here: logical CPUs CPU:0 for GPU:0, CPU:1 for GPU:1, "
        in (process.stdout.splitlines()[0])
    )
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    [row] = [r for r in records if r.get("summary")]
    assert row["configuration"] == "tfdp weighted gpu+cpu auto"
    assert row["stand_in"] is True and row["suite"] == "gpu"
    # the devices it ran on, and the ones they stand for
    assert row["device_list"] == ["CPU:0", "CPU:2"]
    assert row["stands_for"] == ["GPU:0", "CPU:0"]
    assert "| tfdp weighted gpu+cpu auto | GPU:0, CPU:0 (as CPU:0, CPU:2) |" in process.stdout
    measured = {r["name"]: r for r in records if not r.get("summary")}
    assert set(measured) == {"matmul peak", "tfdp weighted gpu+cpu auto"}
    assert all(r["stand_in"]["logical_cpus"] == 3 for r in measured.values())
    # auto powers were measured (a probe ran) and split the 32 examples over both devices,
    # unless the step was faster without one (whether it is, is a timing)
    auto = measured["tfdp weighted gpu+cpu auto"]
    left = [tried for tried in auto["auto_powers"]["left_out"] if tried["left_out"]]
    assert sum(auto["shards"]) == 32 and (min(auto["shards"]) > 0 or left)
    # One round: the rate follows from the raw seconds (2 iterations x 32 images).
    assert row["images_per_second"] == pytest.approx(2 * 32 / auto["seconds"], rel=1e-9)


def test_the_cluster_suite_rotates_its_rounds_and_divides_by_the_even_split(capsys):
    """`bench.cluster.run` with made-up measurements: the order of the rows rotates from
    round to round, and each ratio is the round's rate over that round's even split."""
    from tfdp.bench import cluster

    order = []

    def measure(spec, job):
        order.append(spec.name)
        k = len(order)
        return {
            "images_per_second": 100.0 * k,
            "timed_shards": [32, 32],
            "final_shards": [40, 24],
            "device_seconds": [0.1, 0.2],
        }

    job = {"batch_size": 64, "iterations": 3, "warmup": 1, "settle": 8}
    rows = cluster.run(job, 2, "worker:1=4", None, measure)
    names = ["even split", "rebalanced (every 5)", "auto + rebalanced (every 5)"]
    assert order == names + names[1:] + names[:1]  # round 1 A B C, round 2 B C A
    measured = {
        (r, name): 100.0 * (k + 1)
        for k, (r, name) in enumerate(
            [(1, n) for n in names] + [(2, n) for n in names[1:] + names[:1]]
        )
    }
    by_name = {row["configuration"]: row for row in rows}
    for name in names:
        per_round = [measured[(r, name)] / measured[(r, "even split")] for r in (1, 2)]
        assert by_name[name]["vs_even_per_round"] == pytest.approx(per_round)
        assert by_name[name]["vs_even"] == pytest.approx(sum(per_round) / 2)
    assert by_name["even split"]["vs_even"] == 1.0
    assert "| even split |" in capsys.readouterr().out


@pytest.mark.slow
def test_cluster_suite_smoke(tmp_path):
    """2 workers with worker:1 slowed 4x: the even split keeps 32/32, rebalancing re-splits
    before the clock starts (one round of the two rows)."""
    jsonl = tmp_path / "cluster.jsonl"
    process = run_bench(
        "--suite=cluster",
        "--synthetic",
        "--rounds=1",
        "--iterations=3",
        "--warmup=1",
        "--settle=8",
        "--batch_size=64",
        "--only=rebalanced (every 5)",
        f"--json={jsonl}",
    )
    assert "SIMULATED slowdown worker:1=4" in process.stdout.splitlines()[0]
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    rows = {r["configuration"]: r for r in records if r.get("summary")}
    assert list(rows) == ["even split", "rebalanced (every 5)"]
    measured = [r for r in records if not r.get("summary")]
    assert [(r["round"], r["name"]) for r in measured] == [
        (1, "even split"),
        (1, "rebalanced (every 5)"),
    ]
    for r in measured:
        assert r["warmup_iterations"] == 9 and r["simulated_slowdown"]["worker:1"]["factor"] == 4
    even, rebalanced = measured
    assert even["timed_shards"] == [32, 32] and even["resplits_before_timing"] == 0
    # the clock starts after rebalancing moved the split (which way is timing, on a
    # shared machine with 64 examples: not asserted)
    assert rebalanced["resplits_before_timing"] >= 1 and sum(rebalanced["timed_shards"]) == 64
    # vs_even: the timed steps' images/s (3 iterations x 64 over their seconds) against
    # the even split's
    rate = {r["name"]: 3 * 64 / r["seconds"] for r in measured}
    for name, row in rows.items():
        assert row["vs_even"] == pytest.approx(rate[name] / rate["even split"], rel=1e-9)
    assert rows["even split"]["vs_even"] == 1.0
    # each worker's seconds per step, the slowed worker's with its sleep
    assert all(len(r["device_seconds"]) == 2 for r in measured)


def test_multiworker_rows_per_thread_count():
    specs = configurations([1], [], worker_counts=[2], worker_threads=[0, 1])
    assert [(s.name, s.devices, s.intra_op_threads) for s in specs if s.mode == "multiworker"] == [
        ("tfdp multiworker x2", 2, 0),
        ("tfdp multiworker x2 (1 thread per kernel)", 2, 1),
    ]


def test_the_streaming_rows_can_each_be_named_by_only():
    from tfdp.bench import streaming

    specs = streaming.configurations()
    assert [(s.name, s.system, s.mode, s.devices, s.source, s.augmented) for s in specs] == [
        ("keras fit", "keras", "fit", 1, "stream", True),
        ("tfdp single", "tfdp", "single", 1, "stream", True),
        ("tfdp single no augmentation", "tfdp", "single", 1, "stream", False),
        ("tfdp single in memory", "tfdp", "single", 1, "arrays", True),
        ("keras fit mirrored x2", "keras", "fit", 2, "stream", True),
        ("tfdp mirrored x2", "tfdp", "mirrored", 2, "stream", True),
        ("tfdp weighted x2", "tfdp", "weighted", 2, "stream", True),
        ("tfdp mirrored x2 replica statistics", "tfdp", "mirrored", 2, "stream", True),
        ("tfdp weighted x2 replica statistics", "tfdp", "weighted", 2, "stream", True),
    ]
    assert [s.powers for s in specs if s.mode == "weighted"] == [(1.0, 1.0)] * 2
    assert [s.batch_statistics for s in specs if "x2" in s.name and s.system == "tfdp"] == [
        "whole", "whole", "replica", "replica"]
    assert all("," not in s.name for s in specs)  # --only is a comma list
    # every row runs oneDNN's kernels, as tfdp does: the Keras rows too
    assert {s.onednn for s in specs} == {"tfdp"}


def test_the_streaming_table_is_the_arithmetic_of_the_measurements():
    """`streaming.summarize` on made-up measurements: medians over the rounds, each ratio
    the division of two medians, the input share the median of each measurement's."""
    from tfdp.bench import streaming

    specs = streaming.configurations()
    measurements = {
        spec.name: [
            {
                "images_per_second": 100.0 * (k + 1) + 7 * r,
                "step_seconds": 0.1 * (k + 1) + 0.01 * r,
                "input_images_per_second": 5000.0 + 100 * k + r,
                "input_share": 0.01 * (k + 1) + 0.001 * r * r,
                "loop_seconds_per_step": 0.001 * (k + 1) + 0.0001 * r,
                "cores_used": 1.5 + 0.1 * r,
                "others_cores_used": 0.2 * r,
                "steal_fraction": 0.01 * r,
                "device_list": ["CPU:0"] if spec.devices == 1 else ["CPU:0", "CPU:1"],
                "onednn": True,
            }
            for r in (2, 0, 1)  # the rounds out of order: the median is not the first
        ]
        for k, spec in enumerate(specs)
    }
    median = {
        name: sorted(m["images_per_second"] for m in runs)[1] for name, runs in measurements.items()
    }
    rows = {row["configuration"]: row for row in streaming.summarize(specs, measurements)}
    assert list(rows) == [s.name for s in specs]
    keras_of = {
        "keras fit": "keras fit",
        "tfdp single": "keras fit",
        "tfdp single no augmentation": None,  # another input than Keras': no ratio
        "tfdp single in memory": None,
        "keras fit mirrored x2": "keras fit mirrored x2",
        "tfdp mirrored x2": "keras fit mirrored x2",
        "tfdp weighted x2": "keras fit mirrored x2",
        "tfdp mirrored x2 replica statistics": "keras fit mirrored x2",
        "tfdp weighted x2 replica statistics": "keras fit mirrored x2",
    }
    for name, row in rows.items():
        assert row["images_per_second"] == median[name]
        assert row["keras_same_devices"] == keras_of[name]
        if keras_of[name] is None:
            assert row["vs_keras_same_devices"] is None
        else:
            assert row["vs_keras_same_devices"] == pytest.approx(
                median[name] / median[keras_of[name]]
            )
        shares = [m["input_share"] for m in measurements[name]]
        assert row["input_share"] == sorted(shares)[1]
        assert row["input_share_per_round"] == shares
        loops = sorted(m["loop_seconds_per_step"] for m in measurements[name])
        assert row["loop_seconds_per_step"] == loops[1]
        assert row["cores_used"] == pytest.approx(1.6)
        assert row["others_cores_used"] == pytest.approx(0.2)
        assert row["steal_fraction_max"] == pytest.approx(0.02)
    assert rows["tfdp single"]["vs_in_memory"] == pytest.approx(
        median["tfdp single"] / median["tfdp single in memory"]
    )
    assert rows["tfdp single"]["in_memory"] == "tfdp single in memory"
    assert rows["tfdp single no augmentation"]["vs_in_memory"] == pytest.approx(
        median["tfdp single no augmentation"] / median["tfdp single in memory"]
    )
    assert [name for name, row in rows.items() if row["vs_in_memory"] is not None] == [
        "tfdp single",
        "tfdp single no augmentation",
    ]
    table = streaming.format_table(list(rows.values()))
    single = rows["tfdp single"]
    assert (
        f"| tfdp single | 1 | {single['images_per_second']:.0f} "
        f"({single['images_per_second_min']:.0f}-{single['images_per_second_max']:.0f}) "
        f"| {single['vs_keras_same_devices']:.2f} | {single['vs_in_memory']:.2f} "
        f"| {single['input_images_per_second']:.0f} | {single['input_share']:.1%} "
        "| 2.10 | 1.60 (0.20) |"
    ) in table
    assert "| tfdp single in memory | 1 | 407 (400-414) | - | - |" in table
    # only some rows measured: the ratios to rows left out are None, not an error
    some = [s for s in specs if s.name in ("tfdp single", "tfdp mirrored x2")]
    rows = streaming.summarize(some, {s.name: measurements[s.name] for s in some})
    assert all(r["vs_keras_same_devices"] is None and r["vs_in_memory"] is None for r in rows)


def test_the_loop_per_step_is_the_time_between_step_ends_outside_the_step_call():
    """`CallClock`: a step's loop time is the time from the previous step's end to its
    own end less its call; the warm-up steps are left out, the median is taken."""
    from tfdp.bench import streaming

    clock = streaming.CallClock()
    clock.calls = [(0.0, 0.5), (1.0, 1.5), (2.0, 2.5), (3.0, 3.9), (4.0, 4.2), (5.0, 5.1)]
    ends = [0.6, 1.7, 2.6, 4.0, 4.3, 5.9]  # each step's end as the clock callback saw it
    # timed steps 2..5: (2.6-1.7)-0.5, (4.0-2.6)-0.9, (4.3-4.0)-0.2, (5.9-4.3)-0.1
    assert clock.loop_seconds(ends, warmup=2) == pytest.approx(0.45)  # median of the four
    clock.calls = [(-9.0, -8.0), *clock.calls]  # an untimed call before: only the last count
    assert clock.loop_seconds(ends, warmup=2) == pytest.approx(0.45)


def test_the_streaming_pipeline_reads_what_was_written_the_same_way_every_time(tmp_path):
    """The files hold the examples written; the pipeline makes full batches of crops and
    flips of them that are the same on every run (stateless ops, seeded shuffle)."""
    import numpy as np

    from tfdp.bench import streaming

    paths = streaming.write_records(str(tmp_path), 24)
    assert len(paths) == streaming.FILES
    images, labels = streaming.decoded_arrays(paths)
    assert images.shape == (24, 32, 32, 3) and images.dtype == np.float32
    assert 0 <= images.min() and images.max() <= 1 and set(labels) <= set(range(10))
    rng = np.random.default_rng(0)  # what write_records wrote, example i in file i % 8
    written = rng.integers(0, 256, (24, 32, 32, 3), dtype=np.uint8)
    order = [i for f in range(streaming.FILES) for i in range(f, 24, streaming.FILES)]
    np.testing.assert_array_equal(images, written[order] / np.float32(255))

    def batches():
        data = streaming.pipeline(paths, 8, shuffle_buffer=24)
        return [(x.numpy(), y.numpy()) for x, y in data.take(6)]  # 2 passes of 3 batches

    first, again = batches(), batches()
    assert all(x.shape == (8, 32, 32, 3) and y.shape == (8,) for x, y in first)
    for (x, y), (x2, y2) in zip(first, again):
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    # each pass reads every example once, cropped and flipped anew (a new order, new seeds)
    passes = [np.concatenate([x for x, _ in first[p : p + 3]]) for p in (0, 3)]
    assert not np.array_equal(passes[0], passes[1])
    assert sorted(np.concatenate([y for _, y in first[:3]])) == sorted(labels)
    # without augmentation: a pass holds the decoded examples themselves, shuffled
    plain = streaming.pipeline(paths, 8, shuffle_buffer=24, augmented=False)
    x = np.concatenate([x.numpy() for x, _ in plain.take(3)])
    key = lambda images: sorted(map(bytes, images))  # noqa: E731
    assert key(x) == key(images) and not np.array_equal(x, images)


@pytest.mark.slow
def test_streaming_suite_smoke(tmp_path):
    """The streaming suite's smallest run: the TFRecord files, then Keras fit and tfdp
    single on them, each in its own process; the table and the JSON from the raw times
    (the in-memory row: `test_the_in_memory_row_trains_on_the_decoded_examples`)."""
    jsonl = tmp_path / "streaming.jsonl"
    process = run_bench(
        "--suite=streaming",
        "--rounds=1",
        "--warmup=2",
        "--iterations=2",
        "--stream_examples=128",
        "--stream_shuffle=64",
        "--batch_size=16",
        "--only=keras fit,tfdp single",
        f"--json={jsonl}",
    )
    assert (
        "on 128 CIFAR-shaped examples in 8 TFRecord files, batch 16, 2 timed steps after 2"
        in (process.stdout.splitlines()[0])
    )
    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    measured = {r["name"]: r for r in records if not r.get("summary")}
    rows = {r["configuration"]: r for r in records if r.get("summary")}
    assert list(measured) == list(rows) == ["keras fit", "tfdp single"]
    assert all(r["suite"] == "streaming" and r["round"] == 1 for r in measured.values())
    for r in measured.values():
        # images/s: 2 timed steps x 16 images over the timed seconds
        assert r["images_per_second"] == pytest.approx(2 * 16 / r["seconds"], rel=1e-9)
        assert r["step_seconds"] == pytest.approx(r["seconds"] / 2, rel=1e-9)
        # the input alone, against the step
        assert r["input_images_per_second"] == pytest.approx(
            16 / r["input_seconds_per_batch"], rel=1e-9
        )
        assert r["input_share"] == pytest.approx(
            r["input_seconds_per_batch"] / r["step_seconds"], rel=1e-9
        )
        assert 0 < r["seconds"] < r["fit_seconds"] and r["warmup_seconds"] > 0
        assert r["device_list"] == ["CPU:0"] and r["cpu_seconds"] > 0
        assert r["cores_used"] == pytest.approx(r["cpu_seconds"] / r["seconds"], rel=1e-9)
        assert r["others_cores_used"] >= 0
        assert 0 <= r["loop_seconds_per_step"] < r["step_seconds"]
        if x86_64():
            assert r["onednn"] is True  # the Keras row too
    rate = {name: r["images_per_second"] for name, r in measured.items()}
    assert rows["tfdp single"]["vs_keras_same_devices"] == pytest.approx(
        rate["tfdp single"] / rate["keras fit"], rel=1e-9
    )
    assert rows["keras fit"]["vs_keras_same_devices"] == 1.0
    for name, row in rows.items():
        assert row["vs_in_memory"] is None  # the in-memory row was not measured
        assert row["images_per_second"] == rate[name]
        assert row["input_share"] == measured[name]["input_share"]
        assert f"| {name} | 1 | {rate[name]:.0f} ({rate[name]:.0f}-{rate[name]:.0f}) |" in (
            process.stdout
        )


@pytest.mark.slow
def test_the_in_memory_row_trains_on_the_decoded_examples(tmp_path):
    """The in-memory row in this process, on CPU:0: tfdp.fit on the arrays, its warm-up
    and timed steps seen by the clock, then tfdp's batches of the arrays alone."""
    from tfdp.bench import streaming

    [spec] = [s for s in streaming.configurations() if s.source == "arrays"]
    paths = streaming.write_records(str(tmp_path), 32)
    job = {"paths": paths, "batch_size": 8, "warmup": 1, "iterations": 2, "shuffle_buffer": 8}
    r = streaming.measure_on(spec, ["/device:CPU:0"], job)
    assert r["name"] == "tfdp single in memory" and r["device_list"] == ["CPU:0"]
    assert r["images_per_second"] == pytest.approx(2 * 8 / r["seconds"], rel=1e-9)
    assert r["input_share"] == pytest.approx(
        r["input_seconds_per_batch"] / r["step_seconds"], rel=1e-9
    )
    assert 0 < r["seconds"] < r["fit_seconds"]
