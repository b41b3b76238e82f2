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

The slowdown's sleep per example is calibrated once, in a process of its
own, and the same value is given to every configuration, so that all of them
face the same slow device. Each round is one process that measures every
configuration (in an order rotated from round to round), and ratios are
taken within a round. Auto's probe is timed separately (it runs once per
run, before training); the rows time the training steps only.
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
    from tfdp.data import mnist

    if job["synthetic"]:
        return mnist.synthetic_mnist()
    return mnist.load_mnist("train", mnist_dir=job["mnist_dir"])


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


def _set_up_process(job: dict) -> None:
    """Threads and logical devices: once per process, before TensorFlow starts."""
    from tfdp import configure_logical_devices
    from tfdp.devices import parse_slowdown, reserve_sleeping_threads

    reserve_sleeping_threads(len(parse_slowdown(job["slowdown"])))
    configure_logical_devices(logical_cpus=logical_cpus_for(job["devices"]))


def _build(reduce: str, job: dict):
    """A weighted trainer (even shares to start), with the job's slowdown."""
    from tfdp.devices import available_devices, parse_devices
    from tfdp.engine.modes import build_trainer
    from tfdp.run.training import partition

    config = _config(MixedSpec("", (), reduce=reduce), job)
    devices = parse_devices(config.devices, available_devices())
    trainer = build_trainer(config, devices, partition(config, devices))
    if job.get("delays"):
        trainer.balancer.probes.set_delays(job["delays"])
    return config, trainer


def calibrate(job: dict) -> dict:
    """The sleep per example that makes each slowed device `factor` times slower in a step
    at the even split (`balance.calibrate_slowdown`)."""
    from tfdp.balance import calibrate_slowdown
    from tfdp.data.arrays import first_examples
    from tfdp.devices import parse_slowdown

    _set_up_process(job)
    config, trainer = _build("device0", {**job, "delays": None})
    slowdown = parse_slowdown(config.simulate_slowdown)
    batch = first_examples(load_arrays(job), config.batch_size)
    factors = [slowdown.get(d, 1.0) for d in trainer.split.devices]
    return {"delays": calibrate_slowdown(trainer.balancer.probes, batch, factors)}


def measure_round(job: dict) -> list[dict]:
    """Every configuration once, in one process, in the order given.

    A process on a shared machine can run at one of several speeds for its
    whole life; measuring all configurations in the same process lets the
    ratios between them cancel that out. The trainers (one per reduction) are
    built once; each configuration resets the weights and its shares.
    """
    _set_up_process(job)
    arrays = load_arrays(job)
    trainers = {}
    results = []
    for fields in job["specs"]:
        spec = MixedSpec(**{**fields, "powers": _powers(fields["powers"])})
        if spec.reduce not in trainers:
            trainers[spec.reduce] = _build(spec.reduce, job)
        config, trainer = trainers[spec.reduce]
        results.append({"name": spec.name, **measure(spec, config, trainer, arrays, job)})
    return results


def _powers(value):
    return value if value == "auto" else tuple(value)


def measure(spec: MixedSpec, config, trainer, arrays, job: dict) -> dict:
    """From the initial weights and the spec's starting split: warm up, then time."""
    from tfdp.balance import Rebalancing, measure_powers, settle_under_load, whole_shares
    from tfdp.data.arrays import first_examples, train_dataset
    from tfdp.devices import split_batch
    from tfdp.models import initial_weights
    from tfdp.run.observe import CpuAccounting

    batch = config.batch_size
    probe_seconds, powers, alone_shards = 0.0, None, None
    if spec.powers == "auto":
        start = time.perf_counter()
        probes = trainer.balancer.probes
        powers = measure_powers(probes, first_examples(arrays, batch // len(trainer.split.devices)))
        alone_shards = whole_shares(batch, powers)
        trainer.split.set(alone_shards)
        probe = settle_under_load(probes, first_examples(arrays, batch), log=lambda line: None)
        start_shards = list(trainer.split.shards)
        probe_seconds = time.perf_counter() - start
    else:
        start_shards = split_batch(batch, spec.powers)

    def run(iterations, rebalancing=None):
        """Returns the clock when the second half of the iterations began."""
        iterator = trainer.distribute(train_dataset(arrays, batch, config.seed))
        middle, metrics = None, None
        for i in range(iterations):
            if i and i == iterations // 2:
                float(metrics["logs"]["loss"])  # wait for the first half
                middle = time.perf_counter()
            metrics = trainer.train_step(iterator)
            if rebalancing:
                rebalancing.observe(i, metrics["device_seconds"])
        float(metrics["logs"]["loss"])  # wait for the last step
        return middle

    trainer.split.set(start_shards)
    run(job["warmup"])  # also warms the kernels for these shard shapes
    trainer.model.set_weights(initial_weights(config.model, config.init, config.seed))
    trainer.split.set(start_shards)
    rebalancing = Rebalancing(trainer.balancer.probes, spec.rebalance_every, log=lambda line: None)
    if spec.powers == "auto":
        rebalancing.carry_over(probe)
    accounting = CpuAccounting()
    start = time.perf_counter()
    middle = run(job["iterations"], rebalancing) or start  # one iteration: no halves
    end = time.perf_counter()
    seconds = end - start
    second_half = job["iterations"] - job["iterations"] // 2 if middle != start else 1
    return {
        **accounting.stop(),
        "seconds": seconds,
        "images_per_second": job["iterations"] * batch / seconds,
        "images_per_second_second_half": second_half * batch / (end - middle),
        "start_shards": start_shards,
        "final_shards": list(trainer.split.shards),
        "resplits": len(rebalancing.resplits),
        "auto_powers": powers,
        "auto_shards_alone": alone_shards,
        "probe_seconds": probe_seconds,
        "device_seconds": rebalancing.seconds(),
    }


def start_bound(start_rate: float, best_rate: float, iterations: int) -> float:
    """The most a run that starts at one split can get of the best split's rate.

    A rebalancer measures its starting split by running it: at best, its first
    step runs at `start_rate` and the other `iterations - 1` at `best_rate`.
    """
    return iterations / (best_rate / start_rate + iterations - 1)


def summarize(specs, measurements, iterations: int | None = None) -> list[dict]:
    """Medians over the rounds. Ratios are taken within each round (one process),
    then their median is reported.

    A rebalanced row that starts from the split of a static row also gets
    `start_bound` (with `iterations` given): the median over rounds of
    `start_bound` at that row's rate.
    """
    median = {
        s.name: statistics.median(m["images_per_second"] for m in measurements[s.name])
        for s in specs
    }
    swept = [s.name for s in specs if s.name.startswith("share ")]
    best = max(swept, key=median.get) if swept else None

    def ratio_to(name, other, key="images_per_second"):
        return statistics.median(
            m[key] / o[key] for m, o in zip(measurements[name], measurements[other])
        )

    static = {s.powers: s.name for s in specs if not s.rebalance_every and s.powers != "auto"}
    rows = []
    for spec in specs:
        runs = measurements[spec.name]
        start = static.get(spec.powers) if spec.rebalance_every and spec.powers != "auto" else None
        bound = None
        if start and best and iterations:
            bound = statistics.median(
                start_bound(m["images_per_second"], b["images_per_second"], iterations)
                for m, b in zip(measurements[start], measurements[best])
            )
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
                "start_bound": bound,
                "start_bound_from": start if bound is not None else None,
                "start_bound_iterations": iterations if bound is not None else None,
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
        "| vs even split | vs best swept split | second half vs best | probe s |",
        "|" + " --- |" * 7,
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
            f"| {r['vs_even']:.2f} | {best} | {half} | {r['probe_seconds']:.1f} |"
        )
    for r in rows:
        if r.get("start_bound") is not None:
            lines.append(
                f"\n{r['configuration']}: its first step runs at the shares of "
                f"'{r['start_bound_from']}', which caps it at {r['start_bound']:.2f} of the best "
                f"swept split over {r['start_bound_iterations']} iterations."
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
