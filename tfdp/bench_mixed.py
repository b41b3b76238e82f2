"""`tfdp-bench --suite=mixed`: splitting one batch over devices of unequal speed.

Two devices, one of them slower: on a CPU+GPU machine for real
(`--mixed_devices=cpu:0,gpu:0 --slowdown=`), on logical CPUs by the simulated
slowdown (`--slowdown=cpu:1=4`, the default there). Rows:

  even split          what tf.distribute would do
  static a:b          the tutorial's way: powers guessed once (the nominal factor)
  auto                --powers=auto: each device timed alone, then fixed
  auto, allreduce     the same shares on MirroredStrategy replicas
  dynamic             an even start, re-split every 5 steps (--rebalance_every=5)
  auto + dynamic      both
  share s             a sweep of static splits: the slow device gets s examples

The slowdown's sleep per example is calibrated once, in the parent, and the
same value is given to every configuration, so that all of them face the same
slow device. Auto's probe is timed separately (it runs once per run, before
training); the rows time the training steps only.
"""

from __future__ import annotations

import dataclasses
import statistics
import time

EVERY = 5  # the dynamic rows' --rebalance_every


@dataclasses.dataclass(frozen=True)
class MixedSpec:
    """One way of splitting the batch."""

    name: str
    powers: tuple[float, ...] | str = ()  # (): even; "auto": measured
    reduce: str = "device0"
    rebalance_every: int = 0


def mixed_configurations(factor: float, sweep, batch_size: int) -> list[MixedSpec]:
    specs = [
        MixedSpec("even split", (1.0, 1.0)),
        MixedSpec(f"static {factor:g}:1", (factor, 1.0)),
        MixedSpec("auto", "auto"),
        MixedSpec("auto, allreduce", "auto", reduce="allreduce"),
        MixedSpec(f"dynamic (every {EVERY})", (1.0, 1.0), rebalance_every=EVERY),
        MixedSpec(f"auto + dynamic (every {EVERY})", "auto", rebalance_every=EVERY),
    ]
    for share in sweep:
        specs.append(MixedSpec(f"share {share}", (float(batch_size - share), float(share))))
    return specs


def load_arrays(job: dict):
    from tfdp import data

    if job["synthetic"]:
        return data.synthetic_mnist()
    return data.load_mnist("train", mnist_dir=job["mnist_dir"])


def logical_cpus_for(devices: list[str]) -> int:
    """How many logical CPUs the device list needs (0: leave the CPU whole)."""
    indices = [int(d.split(":")[-1]) for d in devices if d.lower().startswith("cpu")]
    return max(indices) + 1 if indices and max(indices) > 0 else 0


def _config(spec: MixedSpec, job: dict):
    from tfdp import Config

    return Config(
        mode="weighted",
        devices=",".join(job["devices"]),
        powers=spec.powers,
        batch_size=job["batch_size"],
        reduce=spec.reduce,
        rebalance_every=spec.rebalance_every,
        simulate_slowdown=job["slowdown"],
    )


def _set_up(spec: MixedSpec, job: dict):
    from tfdp import configure_logical_devices
    from tfdp.devices import (
        available_devices,
        parse_devices,
        parse_slowdown,
        reserve_sleeping_threads,
    )
    from tfdp.training import build_trainer, partition

    config = _config(spec, job)
    reserve_sleeping_threads(len(parse_slowdown(config.simulate_slowdown)))
    configure_logical_devices(logical_cpus=logical_cpus_for(job["devices"]))
    devices = parse_devices(config.devices, available_devices())
    trainer = build_trainer(config, devices, partition(config, devices))
    return config, devices, trainer


def calibrate(job: dict) -> dict:
    """The sleep per example that makes each slowed device `factor` times slower alone."""
    from tfdp.balance import calibrate_slowdown
    from tfdp.data import first_examples
    from tfdp.devices import parse_slowdown

    config, devices, trainer = _set_up(MixedSpec("calibration"), job)
    slowdown = parse_slowdown(config.simulate_slowdown)
    arrays = load_arrays(job)
    x, y = first_examples(arrays, config.batch_size // len(devices))
    factors = [slowdown.get(d, 1.0) for d in devices]
    return {"delays": calibrate_slowdown(trainer, x, y, factors)}


def measure(spec: MixedSpec, job: dict) -> dict:
    """Warm up, then time `iterations` steps from the starting split."""
    from tfdp.balance import Rebalancing, measure_powers, whole_shares
    from tfdp.data import first_examples, train_dataset

    config, devices, trainer = _set_up(spec, job)
    if job["delays"]:
        trainer.set_delays(job["delays"])
    arrays = load_arrays(job)
    probe_seconds, powers = 0.0, None
    if spec.powers == "auto":
        start = time.perf_counter()
        x, y = first_examples(arrays, config.batch_size // len(devices))
        powers = measure_powers(trainer, x, y)
        trainer.set_shards(whole_shares(config.batch_size, powers))
        probe_seconds = time.perf_counter() - start
    start_shards = list(trainer.shards)
    initial = trainer.get_weights()

    def run(iterations, rebalancing=None):
        iterator = trainer.distribute(train_dataset(arrays, config.batch_size, config.seed))
        for i in range(iterations):
            metrics = trainer.train_step(iterator)
            if rebalancing:
                rebalancing.observe(i, metrics["device_seconds"])
        float(metrics["loss_sum"])  # wait for the last step

    run(job["warmup"])
    trainer.set_weights(initial)
    trainer.set_shards(start_shards)
    rebalancing = Rebalancing(trainer, spec.rebalance_every, log=lambda line: None)
    start = time.perf_counter()
    run(job["iterations"], rebalancing)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "images_per_second": job["iterations"] * config.batch_size / seconds,
        "start_shards": start_shards,
        "final_shards": list(trainer.shards),
        "resplits": len(rebalancing.resplits),
        "auto_powers": powers,
        "probe_seconds": probe_seconds,
        "device_seconds": rebalancing.seconds(),
    }


def summarize(specs, measurements) -> list[dict]:
    """Medians over the rounds; ratios to the even split and to the best swept split."""
    median = {
        s.name: statistics.median(m["images_per_second"] for m in measurements[s.name])
        for s in specs
    }
    swept = [s.name for s in specs if s.name.startswith("share ")]
    best = max(swept, key=median.get) if swept else None
    rows = []
    for spec in specs:
        runs = measurements[spec.name]
        rates = [m["images_per_second"] for m in runs]
        rows.append(
            {
                "configuration": spec.name,
                "powers": spec.powers if spec.powers == "auto" else list(spec.powers),
                "reduce": spec.reduce,
                "rebalance_every": spec.rebalance_every,
                "start_shards": runs[-1]["start_shards"],
                "final_shards": runs[-1]["final_shards"],
                "images_per_second": median[spec.name],
                "images_per_second_min": min(rates),
                "images_per_second_max": max(rates),
                "vs_even": median[spec.name] / median["even split"],
                "vs_best_sweep": median[spec.name] / median[best] if best else None,
                "best_sweep": best,
                "probe_seconds": statistics.median(m["probe_seconds"] for m in runs),
                "rounds": len(runs),
            }
        )
    return rows


def format_table(rows) -> str:
    def shares(row):
        start, end = row["start_shards"], row["final_shards"]
        return f"{start}" if start == end else f"{start} -> {end}"

    lines = [
        "| configuration | shares (start -> end of the last round) | images/s (min-max) "
        "| vs even split | vs best swept split | probe s |",
        "|" + " --- |" * 6,
    ]
    for r in rows:
        best = "-" if r["vs_best_sweep"] is None else f"{r['vs_best_sweep']:.2f}"
        lines.append(
            f"| {r['configuration']} | {shares(r)} | {r['images_per_second']:.0f} "
            f"({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f}) "
            f"| {r['vs_even']:.2f} | {best} | {r['probe_seconds']:.1f} |"
        )
    return "\n".join(lines)


def draw(rows, path: str, title: str, batch_size: int) -> None:
    """The sweep as a curve over the slow device's share; the other rows as lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7.5, 4.5))
    sweep = sorted(
        (r for r in rows if r["configuration"].startswith("share ")),
        key=lambda r: r["start_shards"][1],
    )
    if sweep:
        axes.errorbar(
            [r["start_shards"][1] for r in sweep],
            [r["images_per_second"] for r in sweep],
            yerr=[
                [r["images_per_second"] - r["images_per_second_min"] for r in sweep],
                [r["images_per_second_max"] - r["images_per_second"] for r in sweep],
            ],
            marker="o",
            capsize=3,
            color="black",
            label="static splits (sweep)",
        )
    others = [r for r in rows if not r["configuration"].startswith("share ")]
    for i, r in enumerate(others):
        color = f"C{i}"
        axes.axhline(r["images_per_second"], linestyle="--", linewidth=1, color=color)
        axes.plot(
            [r["final_shards"][1]],
            [r["images_per_second"]],
            marker="s",
            color=color,
            label=f"{r['configuration']} (ends at {r['final_shards'][1]})",
        )
    axes.set_xlabel(f"examples on the slow device (of {batch_size})")
    axes.set_ylabel("images / s (median)")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
