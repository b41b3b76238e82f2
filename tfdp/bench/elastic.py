"""`tfdp-bench --suite=elastic`: what a change of the cluster's members costs.

    tfdp-bench --suite=elastic --rounds=3 --mnist_dir=DIR --json=bench_elastic.jsonl

Each round runs LeNet (batch `--batch_size`, powers auto, a checkpoint every
`--elastic_checkpoint_every` steps) under `tfdp-launch --discover` on this
machine, through a schedule of changes:

  start          2 workers, from nothing
  announced      discovery then offers 1: the workers save their step and stop,
                 one starts
  failure        the one worker is SIGKILLed, discovery offering 2 again: two start
                 from the checkpoint before the kill

and reads, from the run's membership history, the seconds from each change (as
the launcher saw it) to the first step trained after it. The round ends with
SIGTERM to the launcher once the last start has trained. Rows: the median,
least and most over rounds of each change's seconds; `--json` appends every
round's history and the rows.
"""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time

CHANGES = ("start", "announced", "failure")


def latest_step(model_dir: str) -> int:
    steps = [
        int(re.search(r"ckpt-(\d+)\.index$", path).group(1))
        for path in glob.glob(os.path.join(model_dir, "checkpoints", "ckpt-*.index"))
    ]
    return max(steps, default=0)


def history(model_dir: str) -> list[dict]:
    try:
        with open(os.path.join(model_dir, "membership.json")) as file:
            return json.load(file)
    except (OSError, ValueError):
        return []


def workers_of(pid: int) -> list[int]:
    """The pids of the workers a launcher started (its children with a TF_CONFIG)."""
    found = []
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        for child in file.read().split():
            try:
                with open(f"/proc/{child}/environ", "rb") as env:
                    if b"TF_CONFIG=" in env.read():
                        found.append(int(child))
            except OSError:
                continue
    return found


def one_round(mnist_dir, batch_size: int, every: int, timeout: float = 600) -> list[dict]:
    """The membership history of one run through the schedule."""
    with tempfile.TemporaryDirectory(prefix="tfdp-elastic-") as root:
        hosts, model_dir = os.path.join(root, "hosts"), os.path.join(root, "run")
        with open(hosts, "w") as file:
            file.write("localhost:2\n")
        command = [
            sys.executable,
            "-m",
            "tfdp.cluster.launch",
            f"--discover=cat {hosts}",
            "--discover_every=0.5",
            f"--batch_size={batch_size}",
            "--iterations=100000",
            f"--checkpoint_every={every}",
            "--powers=auto",
            "--log_every=0",
            "--progress=never",
            f"--model_dir={model_dir}",
            *([f"--mnist_dir={mnist_dir}"] if mnist_dir else []),
        ]
        launcher = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout

        def wait(ready, what):
            while not ready():
                if launcher.poll() is not None:
                    raise RuntimeError(
                        f"the launcher ended before {what}: {launcher.stderr.read()[-2000:]}"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no {what} in {timeout:g} s")
                time.sleep(0.05)

        def trained(starts):
            return lambda: (
                len(history(model_dir)) >= starts
                and all(entry["step"] is not None for entry in history(model_dir)[:starts])
            )

        try:
            wait(lambda: latest_step(model_dir) >= every, "a checkpoint on 2 workers")
            with open(hosts, "w") as file:
                file.write("localhost:1\n")
            wait(trained(2), "a step on 1 worker")
            start = latest_step(model_dir)
            wait(lambda: latest_step(model_dir) > start, "a checkpoint on 1 worker")
            with open(hosts, "w") as file:
                file.write("localhost:2\n")
            for pid in workers_of(launcher.pid):
                os.kill(pid, signal.SIGKILL)
            wait(trained(3), "a step after the kill")
        finally:
            launcher.send_signal(signal.SIGTERM)
            try:
                launcher.communicate(timeout=120)
            except subprocess.TimeoutExpired:
                launcher.kill()
                launcher.communicate()
        return history(model_dir)


def summarize(rounds: list[list[dict]]) -> list[dict]:
    rows = []
    for i, change in enumerate(CHANGES):
        seconds = [entries[i]["seconds_to_step"] for entries in rounds]
        rows.append(
            {
                "change": change,
                "cause": rounds[0][i]["cause"],
                "workers": rounds[0][i]["workers"],
                "seconds_median": statistics.median(seconds),
                "seconds_min": min(seconds),
                "seconds_max": max(seconds),
                "seconds": seconds,
            }
        )
    return rows


def run(mnist_dir, rounds: int, batch_size: int, every: int, json_path=None) -> None:
    print(
        f"LeNet, batch {batch_size}, powers auto, a checkpoint every {every} steps; "
        f"{rounds} round(s) on {os.cpu_count()} cores: seconds from a change of members "
        "to the next trained step"
    )
    histories = []
    for r in range(rounds):
        entries = one_round(mnist_dir, batch_size, every)
        histories.append(entries)
        print(
            f"round {r + 1}: "
            + ", ".join(f"{e['cause']} -> {e['seconds_to_step']:.1f} s" for e in entries)
        )
        if json_path:
            with open(json_path, "a") as out:
                out.write(
                    json.dumps({"suite": "elastic", "round": r + 1, "history": entries}) + "\n"
                )
    rows = summarize(histories)
    print(f"{'change':<10} {'workers':>7} {'median s':>9} {'min':>6} {'max':>6}")
    for row in rows:
        print(
            f"{row['change']:<10} {row['workers']:>7} {row['seconds_median']:>9.1f} "
            f"{row['seconds_min']:>6.1f} {row['seconds_max']:>6.1f}"
        )
    if json_path:
        with open(json_path, "a") as out:
            for row in rows:
                out.write(json.dumps({"summary": True, "suite": "elastic", **row}) + "\n")
