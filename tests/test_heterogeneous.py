"""Measured powers, the simulated slowdown and rebalancing on logical CPUs.

Speeds are never asserted: the simulated slowdown sleeps a calibrated time per
example, so a slowed device is slower by construction; these tests check that
the measurement sees it and that the split follows.
"""

import pytest
from helpers import CPUS, train

from tfdp import Config
from tfdp.data.arrays import as_stream
from tfdp.engine.modes import build_trainer
from tfdp.run.training import partition


@pytest.mark.parametrize("reduce", ["device0", "allreduce"])
def test_auto_powers_see_a_device_slowed_4x(reduce, images):
    config = Config(
        mode="weighted",
        devices="cpu:0,cpu:1",
        powers="auto",
        batch_size=200,
        reduce=reduce,
        simulate_slowdown="cpu:1=4",
    )
    devices = CPUS[:2]
    shards = partition(config, devices)
    assert shards == [100, 100]  # auto starts even
    trainer = build_trainer(config, devices, shards)
    lines = []
    info, probe = trainer.balancer.set_up(config, as_stream(images, 200, 0), lines.append)
    slowed = info["simulated_slowdown"]["CPU:1"]
    assert slowed["factor"] == 4 and slowed["sleep_seconds_per_example"] > 0
    assert list(info["simulated_slowdown"]) == ["CPU:1"]
    rates = info["auto_powers"]["images_per_second"]
    # Alone, cpu:1 computes like cpu:0 and then sleeps 3x its calibrated compute time.
    assert rates[0] / rates[1] > 1.5
    assert trainer.split.shards[0] > trainer.split.shards[1] and sum(trainer.split.shards) == 200
    assert lines[0].startswith("SIMULATED SLOWDOWN (for testing")
    assert lines[1].startswith("auto powers, each device alone on 100 examples: CPU:0 ")
    # Then all devices at once on the global batch, which may re-split.
    auto = info["auto_powers"]
    assert auto["shards_alone"][0] > auto["shards_alone"][1]
    # ... and may leave the slow device out, in one line (whether it does is a timing)
    left = [tried for tried in auto["left_out"] if tried["left_out"]]
    settled = lines[-1 - len(left)]
    assert settled.startswith("auto powers, all devices at once on 200 examples for 12 probe")
    assert f"shares {auto['shards_alone']}" in settled
    assert all(line.startswith("auto powers: CPU:1 left out") for line in lines[len(lines) - len(left):])
    assert len(lines) == 3 + len(auto["probe_resplits"]) + len(left)
    assert auto["probe_resplits"] == probe.resplits
    assert trainer.split.shards == ([200, 0] if left else auto["left_out"][0]["shards"])
    assert auto["powers"] == [s / min(s for s in trainer.split.shards if s) for s in trainer.split.shards]


def test_no_balancing_options_measure_nothing(images):
    config = Config(mode="weighted", devices="cpu:0,cpu:1", batch_size=200)
    trainer = build_trainer(config, CPUS[:2], [100, 100])
    lines = []
    assert trainer.balancer.set_up(config, as_stream(images, 200, 0), lines.append) == (
        {"simulated_slowdown": None, "auto_powers": None, "measured_max_rows": None},
        None,
    )
    assert lines == [] and trainer.split.shards == [100, 100]


@pytest.mark.mnist
@pytest.mark.parametrize("reduce", ["device0", "allreduce"])
def test_rebalancing_moves_work_off_a_slowed_device(reduce, mnist_dir):
    result, lines = train(
        Config(
            mode="weighted",
            reduce=reduce,
            devices="cpu:0,cpu:1",
            simulate_slowdown="cpu:1=4",
            rebalance_every=3,
            batch_size=256,
            iterations=13,
            log_every=5,
            mnist_dir=mnist_dir,
        )
    )
    assert any("SIMULATED SLOWDOWN" in line for line in lines)
    assert result["shards"] == [128, 128]
    assert result["simulated_slowdown"]["CPU:1"]["factor"] == 4
    first = result["rebalances"][0]
    assert first["new"][1] < first["old"][1] == 128  # work moves off the slow device
    assert first["seconds"][1] > first["seconds"][0]
    assert result["final_shards"] == result["rebalances"][-1]["new"]
    assert any(
        line.startswith(f"rebalanced after iteration {first['iteration']}: shares [128, 128] -> ")
        for line in lines
    )
    assert len(result["device_seconds"]) == 2
