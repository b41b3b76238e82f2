"""`tfdp-bench --suite=cluster`: 2 workers, one of them slowed, split evenly or rebalanced.

    tfdp-bench --suite=cluster --batch_size=512 --rounds=3 --mnist_dir=DIR --json=bench_cluster.jsonl

Each measurement is a cluster of worker processes on loopback (as
`tfdp-launch` starts them), with `--simulate_slowdown=worker:1=4` (the
`--cluster_slowdown` flag): worker 1 sleeps after its backward pass so that
alone it is 4 times slower. Rows:

  even split                   powers 1,1, no rebalancing: what tf.distribute does
  rebalanced (every 5)         powers 1,1 to start, --rebalance_every=5
  auto + rebalanced (every 5)  --powers=auto, then --rebalance_every=5

Each row is the `tfdp` command's run on every worker (`bench.timed`: its
loop and every hook of it, the rebalancing among them). Every row runs the
same untimed iterations first: `--warmup`, then `--settle` more, during which
the rebalanced rows re-split as any run does. The clock then times
`--iterations` steps from the split that rebalancing settled on, with
rebalancing still on. So the rows compare the steady rate of each split; the
few iterations rebalancing takes to settle (windows of 1, 1, 2, 4, then 5
steps) are a one-off cost of a run, recorded as `warmup_seconds` but not in
the rate.

Rounds are interleaved (the order rotated from round to round), and `vs_even`
is the median over rounds of each round's rate against that round's even
split.
"""

from __future__ import annotations

import dataclasses
import json
import statistics

from tfdp.bench.spec import Spec

EVERY = 5  # the rebalanced rows' --rebalance_every


def cluster_configurations(slowdown: str, workers: int = 2, every: int = EVERY) -> list[Spec]:
    even = (1.0,) * workers
    return [
        Spec("even split", "tfdp", "multiworker", workers, even, slowdown=slowdown),
        Spec(
            f"rebalanced (every {every})",
            "tfdp",
            "multiworker",
            workers,
            even,
            rebalance_every=every,
            slowdown=slowdown,
        ),
        Spec(
            f"auto + rebalanced (every {every})",
            "tfdp",
            "multiworker",
            workers,
            "auto",
            rebalance_every=every,
            slowdown=slowdown,
        ),
    ]


def summarize(specs, measurements) -> list[dict]:
    """Medians over the rounds; `vs_even` the median of each round's ratio to that
    round's even split (the rounds pair up by their place in the lists)."""
    even = measurements["even split"]

    def ratios(name, key):
        return [m[key] / e[key] for m, e in zip(measurements[name], even)]

    rows = []
    for spec in specs:
        runs = measurements[spec.name]
        rates = [m["images_per_second"] for m in runs]
        per_round = ratios(spec.name, "images_per_second")
        rows.append(
            {
                "configuration": spec.name,
                "workers": spec.devices,
                "powers": spec.powers if spec.powers == "auto" else list(spec.powers),
                "rebalance_every": spec.rebalance_every,
                "slowdown": spec.slowdown,
                "timed_shards": [m["timed_shards"] for m in runs],
                "final_shards": [m["final_shards"] for m in runs],
                "images_per_second": statistics.median(rates),
                "images_per_second_min": min(rates),
                "images_per_second_max": max(rates),
                "vs_even": statistics.median(per_round),
                "vs_even_per_round": per_round,
                "device_seconds": [m["device_seconds"] for m in runs],
                "rounds": len(runs),
            }
        )
    return rows


def format_table(rows) -> str:
    header = (
        "| configuration | shares timed (per round) | images/s (min-max) "
        "| vs even split (per round) |"
    )
    lines = [header, "|" + " --- |" * 4]
    for r in rows:
        lines.append(
            f"| {r['configuration']} | {', '.join(str(s) for s in r['timed_shards'])} "
            f"| {r['images_per_second']:.0f} "
            f"({r['images_per_second_min']:.0f}-{r['images_per_second_max']:.0f}) "
            f"| {r['vs_even']:.2f} ({', '.join(f'{x:.2f}' for x in r['vs_even_per_round'])}) |"
        )
    return "\n".join(lines)


def run(
    job: dict,
    rounds: int,
    slowdown: str,
    json_path: str | None,
    measure_in_subprocess,
    only=(),
) -> list[dict]:
    """Measures the rows in interleaved rounds (`measure_in_subprocess(spec, job)`:
    table.py's); prints the table; appends JSON lines. `only`: the rows to measure
    besides the even split, which the others are measured against (all when empty)."""
    specs = [
        spec
        for spec in cluster_configurations(slowdown)
        if not only or spec.name in only or spec.name == "even split"
    ]
    print(
        f"LeNet, batch {job['batch_size']}, {job['iterations']} timed iterations after "
        f"{job['warmup']} warm-up and {job['settle']} settling; {rounds} interleaved rounds "
        f"of {specs[0].devices} workers on loopback; SIMULATED slowdown {slowdown}",
        flush=True,
    )
    measurements = {spec.name: [] for spec in specs}
    records = []
    for round_index in range(rounds):
        shift = round_index % len(specs)  # rotate the order from round to round
        for spec in specs[shift:] + specs[:shift]:
            measured = measure_in_subprocess(spec, job)
            measurements[spec.name].append(measured)
            print(
                f"round {round_index + 1}: {spec.name}: "
                f"{measured['images_per_second']:.0f} images/s at shares "
                f"{measured['timed_shards']}, device seconds {measured['device_seconds']}",
                flush=True,
            )
            round_fields = {"round": round_index + 1, "suite": "cluster"}
            records.append({**round_fields, **dataclasses.asdict(spec), **job, **measured})
    rows = summarize(specs, measurements)
    print()
    print(format_table(rows))
    records += [{"summary": True, "suite": "cluster", **row} for row in rows]
    if json_path:
        with open(json_path, "a") as out:
            out.writelines(json.dumps(record) + "\n" for record in records)
    return rows
