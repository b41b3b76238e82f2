"""`tfdp-bench --suite=mixed`: splitting one batch over devices of unequal speed.

Two devices, one of them slower: on a CPU+GPU machine for real
(`--mixed_devices=cpu:0,gpu:0 --slowdown=`), on logical CPUs by the simulated
slowdown (`--slowdown=cpu:1=4`, the default there). Rows:

  even split          what tf.distribute would do
  static a:b          the tutorial's way: powers guessed once (the nominal factor)
  auto                --powers=auto: each device timed alone, then all together; then fixed
  auto, allreduce     the same shares on MirroredStrategy replicas
  dynamic             an even start, rebalanced in windows of up to 5 steps (--rebalance_every=5)
  auto + dynamic      both
  share s             a sweep of static splits: the slow device gets s examples
  cpu:0 alone         mode single on the device that is not slowed: what auto must not
                      fall below (a device that only slows the step is worth leaving out)

Each row is a run of the `tfdp` command with the row's settings, through
its loop and every hook of it (`bench.timed`), timed from the end of its
warm-up: a rebalanced row has begun to move its split by then, and goes on
while it is timed. The slowdown's sleep per example is calibrated once, by a
run in a process of its own, and the same value is given to every
configuration in place of each run's own calibration, so that all of them
face the same slow device. Each round is one process that measures every
configuration (in an order rotated from round to round), and ratios are
taken within a round. A run's set-up (auto's probes among it) is before its
first step, timed apart; the rows time the training steps only.
"""

from __future__ import annotations

import dataclasses
import statistics

EVERY = 5  # the dynamic rows' --rebalance_every


@dataclasses.dataclass(frozen=True)
class MixedSpec:
    """One way of splitting the batch."""

    name: str
    powers: tuple[float, ...] | str = ()  # (): even; "auto": measured
    reduce: str = "device0"
    rebalance_every: int = 0
    alone: str = ""  # a device name: mode single on it, without the slowdown


def mixed_configurations(factor: float, sweep, batch_size: int, fastest: str = "") -> list[MixedSpec]:
    """The rows; with `fastest` (the device that is not slowed), also that device alone."""
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
    if fastest:
        specs.append(MixedSpec(f"{fastest} alone", alone=fastest))
    return specs


def logical_cpus_for(devices: list[str]) -> int:
    """How many logical CPUs the device list needs (0: leave the CPU whole)."""
    indices = [int(d.split(":")[-1]) for d in devices if d.lower().startswith("cpu")]
    return max(indices) + 1 if indices and max(indices) > 0 else 0


def _config(spec: MixedSpec, job: dict):
    from tfdp import Config
    from tfdp.bench.timed import SYNTHETIC

    data = {"dataset": SYNTHETIC if job["synthetic"] else "mnist", "mnist_dir": job["mnist_dir"]}
    if spec.alone:
        return Config(mode="single", devices=spec.alone, batch_size=job["batch_size"], **data)
    return Config(
        mode="weighted",
        devices=",".join(job["devices"]),
        powers=spec.powers,
        batch_size=job["batch_size"],
        reduce=spec.reduce,
        rebalance_every=spec.rebalance_every,
        simulate_slowdown=job["slowdown"],
        **data,
    )


def _set_up_process(job: dict) -> None:
    """Threads and logical devices: once per process, before TensorFlow starts."""
    from tfdp import configure_logical_devices
    from tfdp.devices import parse_slowdown, reserve_sleeping_threads

    reserve_sleeping_threads(len(parse_slowdown(job["slowdown"])))
    configure_logical_devices(logical_cpus=logical_cpus_for(job["devices"]))


def calibrate(job: dict) -> dict:
    """The sleep per example that makes each slowed device `factor` times slower in a step
    at the even split: a run's own calibration, of a one-step run at the even split."""
    from tfdp.run import training
    from tfdp.run.plan import prepare

    _set_up_process(job)
    config = dataclasses.replace(_config(MixedSpec("", (1.0, 1.0)), job), iterations=1)
    result = training.run(prepare(config), log=lambda line: None)
    slowed = result["simulated_slowdown"] or {}
    return {
        "delays": [
            slowed.get(name, {}).get("sleep_seconds_per_example", 0.0)
            for name in result["devices"]
        ]
    }


def measure_round(job: dict) -> list[dict]:
    """Every configuration once, in one process, in the order given.

    A process on a shared machine can run at one of several speeds for its
    whole life; measuring all configurations in the same process lets the
    ratios between them cancel that out. Each is a run of the `tfdp` command
    (`bench.timed`), and each faces the same slow device: the calibration of
    the job (`calibrate`) takes the place of each run's own.
    """
    from tfdp import balance

    _set_up_process(job)
    if job.get("delays"):
        balance.calibrate_slowdown = given_slowdown(job["delays"])
    results = []
    for fields in job["specs"]:
        spec = MixedSpec(**{**fields, "powers": _powers(fields["powers"])})
        results.append({"name": spec.name, **measure(spec, job)})
    return results


def given_slowdown(delays: list[float]):
    """A stand-in for `balance.calibrate_slowdown` that sets `delays`, the seconds of
    sleep per example of each device, as the calibration sets the ones it measures."""

    def calibrated(probes, batch, factors, repeats=3):
        probes.set_delays(list(delays))
        return list(delays)

    return calibrated


def _powers(value):
    return value if value == "auto" else tuple(value)


def measure(spec: MixedSpec, job: dict) -> dict:
    """One configuration: a run from the initial weights and the spec's split, timed after
    its warm-up, its second half also on its own."""
    from tfdp.bench import timed

    result = timed.run(_config(spec, job), job["warmup"], job["iterations"], halves_asked=True)
    return {
        **timed.cpu_of(result),
        "seconds": result["seconds"],
        "images_per_second": result["images_per_second"],
        "images_per_second_second_half": result["images_per_second_second_half"],
        "start_shards": result["shards"],
        "final_shards": result["final_shards"],
        "resplits": len(result["rebalances"]),
        "auto_powers": result["auto_powers"],
        "simulated_slowdown": result["simulated_slowdown"],
        "set_up_seconds": result["set_up_seconds"],
        "device_seconds": result["device_seconds"],
    }


def summarize(specs, measurements) -> list[dict]:
    """Medians over the rounds. Ratios are taken within each round (one process),
    then their median is reported."""
    median = {
        s.name: statistics.median(m["images_per_second"] for m in measurements[s.name])
        for s in specs
    }
    swept = [s.name for s in specs if s.name.startswith("share ")]
    best = max(swept, key=median.get) if swept else None
    alone = next((s.name for s in specs if s.alone), None)

    def ratio_to(name, other, key="images_per_second"):
        return statistics.median(
            m[key] / o[key] for m, o in zip(measurements[name], measurements[other])
        )

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
                "vs_even": ratio_to(spec.name, "even split"),
                "vs_best_sweep": ratio_to(spec.name, best) if best else None,
                "vs_best_sweep_second_half": (
                    ratio_to(spec.name, best, "images_per_second_second_half") if best else None
                ),
                "best_sweep": best,
                "vs_alone": ratio_to(spec.name, alone) if alone else None,
                "set_up_seconds": statistics.median(m["set_up_seconds"] for m in runs),
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
        "| vs even split | vs best swept split | second half vs best | vs fastest alone "
        "| set-up s |",
        "|" + " --- |" * 8,
    ]
    for r in rows:
        best, half = (
            ("-", "-")
            if r["vs_best_sweep"] is None
            else (f"{r['vs_best_sweep']:.2f}", f"{r['vs_best_sweep_second_half']:.2f}")
        )
        lines.append(
            f"| {r['configuration']} | {shares(r)} | {r['images_per_second']:.0f} "
            f"({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f}) "
            f"| {r['vs_even']:.2f} | {best} | {half} | "
            + ("-" if r["vs_alone"] is None else f"{r['vs_alone']:.2f}")
            + f" | {r['set_up_seconds']:.1f} |"
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
        slow = r["final_shards"][1] if len(r["final_shards"]) > 1 else 0  # alone: none
        axes.plot(
            [slow],
            [r["images_per_second"]],
            marker="s",
            color=color,
            label=f"{r['configuration']} (ends at {slow})",
        )
    axes.set_xlabel(f"examples on the slow device (of {batch_size})")
    axes.set_ylabel("images / s (median)")
    axes.set_ylim(bottom=0)
    axes.set_title(title)
    axes.legend(fontsize=7, loc="lower right")
    figure.tight_layout()
    figure.savefig(path, dpi=100)
