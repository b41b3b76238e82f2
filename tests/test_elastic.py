"""tfdp-launch as an elastic supervisor: discovery, restarts, hosts left out, ssh, membership.

Most tests run the supervisor in this process on workers that are small Python
commands (`-- COMMAND`), which start in milliseconds and do what a test needs
from the TF_CONFIG and the history they are given. The one slow test runs the
tfdp toy model through a schedule of 2 workers, a SIGKILL, 1, then 3, and
compares the end with an unbroken run on one device.
"""

import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from helpers import environment, latest_step, load_weights, refusal, result, train

from tfdp import Config
from tfdp.cluster.hosts import Discovery, DiscoveryError, Health, members, parse_hosts
from tfdp.cluster.launch import Settings, UsageError, check_resumable, parse_args, supervise
from tfdp.run.hooks.membership import FILE, Membership, after_a_change, changes

# A worker: writes what it was given (start, index, TF_CONFIG, its parent's command
# line) to a file of its own, then acts as ACTS says for its start and index.
WORKER = """
import json, os, signal, sys, time
history = json.loads(os.environ["TFDP_MEMBERSHIP"])
start = history[-1]["restart"]
config = json.loads(os.environ["TF_CONFIG"])
index = config["task"]["index"]
out = os.path.join(sys.argv[1], f"start{start}-worker{index}.json")
with open(f"/proc/{os.getppid()}/cmdline", "rb") as file:
    parent = file.read().split(b"\\0")
seen = []
def note(signum, frame):
    seen.append(signal.Signals(signum).name)
    dump()
    os._exit(128 + signum)
def dump():
    with open(out + ".part", "w") as file:
        json.dump({"history": history, "tf_config": config, "signals": seen,
                   "remote": b"tfdp.cluster.remote" in parent}, file)
    os.replace(out + ".part", out)
signal.signal(signal.SIGINT, note)
dump()
act = json.loads(sys.argv[2]).get(f"{start}/{index}", "exit 0")
if act.startswith("exit"):
    sys.exit(int(act.split()[1]))
if act.startswith("kill"):  # "kill", or "kill offering HOSTS": first offers HOSTS
    if " offering " in act:
        with open(os.path.join(sys.argv[1], "hosts"), "w") as file:
            file.write(act.split(" offering ")[1] + "\\n")
    os.kill(os.getpid(), signal.SIGKILL)
if act == "ignore":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:  # "wait": until a signal, or a file named go
    if os.path.exists(os.path.join(sys.argv[1], "go")):
        sys.exit(0)
    time.sleep(0.02)
sys.exit(99)
"""


@pytest.fixture
def workers(tmp_path):
    """(the command of a WORKER acting as `acts` {"start/index": act}, the hosts file
    discovery reads, and what worker `index` of start `start` wrote)."""
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    hosts = tmp_path / "hosts"

    def command(acts):
        return [sys.executable, str(script), str(tmp_path), json.dumps(acts)]

    def seen(start, index):
        path = tmp_path / f"start{start}-worker{index}.json"
        return json.loads(path.read_text()) if path.exists() else None

    return command, hosts, seen


def settings(hosts, **changes):
    """An elastic launcher's settings: discovery reads `hosts` every 0.1 s."""
    return Settings(
        **{"discover": f"cat {hosts}", "discover_every": 0.1, "grace_seconds": 5, **changes}
    )


def own_lines(err):
    return [line for line in err.splitlines() if line.startswith("tfdp-launch: ")]


def test_discovery_lines_name_hosts_and_slots():
    assert parse_hosts("localhost:2\n# comment\n\nnode1\nnode2:0\nnode1:3\n") == [
        ("localhost", 2),
        ("node1", 4),
    ]
    for bad in ("node 1", "node1:two", "node1:-1", ":3"):
        with pytest.raises(DiscoveryError, match="expected HOST or HOST:SLOTS"):
            parse_hosts(f"localhost\n{bad}\n")


def test_members_take_slots_in_order_up_to_max_without_hosts_left_out():
    offered = [("a", 2), ("b", 1), ("c", 2)]
    assert members(offered, None) == ["a", "a", "b", "c", "c"]
    assert members(offered, 4) == ["a", "a", "b", "c"]
    health = Health(cooldown=10)
    assert health.failed("a", now=0) == 0  # a first failure: not left out
    assert members(offered, None, health, now=1) == ["a", "a", "b", "c", "c"]
    assert health.failed("a", now=1) == 10  # the second: left out 10 s
    assert members(offered, 4, health, now=2) == ["b", "c", "c"]
    assert members(offered, 4, health, now=11.5) == ["a", "a", "b", "c"]
    assert health.failed("a", now=12) == 20  # twice as long after each further failure


@pytest.mark.parametrize(
    "args, message",
    [
        (["--min_workers=2"], "--min_workers=2: needs --discover"),
        (["--max_workers=2"], "--max_workers=2: needs --discover"),
        (["--wait_seconds=5"], "--wait_seconds=5: needs --discover"),
        (["--discover=cat h", "--workers=2"], "--workers=2: with --discover, discovery says"),
        (["--discover=cat h", "--min_workers=3", "--max_workers=2"], "--max_workers=2: is less"),
        (["--discover="], "--discover=: needs a command"),
        (["--max_restarts=-1"], "--max_restarts=-1: must be an integer, 0 or more"),
        (["--discover_every=0"], "--discover_every=0: must be a number of seconds, 0.1 or more"),
        (["--ssh="], "--ssh=: needs a command"),
    ],
)
def test_bad_elastic_flags_are_named(args, message):
    with pytest.raises(UsageError) as error:
        parse_args(args)
    assert str(error.value).startswith(message)


def test_restarts_need_a_model_dir_to_resume_from():
    with pytest.raises(UsageError, match="--discover=cat h: needs --model_dir"):
        check_resumable(parse_args(["--discover=cat h", "--model=toy"]))
    with pytest.raises(UsageError, match="--max_restarts=2: needs --model_dir"):
        check_resumable(parse_args(["--max_restarts=2"]))
    with pytest.raises(UsageError, match="--powers=1,3: gives each worker a power"):
        check_resumable(parse_args(["--discover=cat h", "--model_dir=/m", "--powers=1,3"]))
    check_resumable(parse_args(["--discover=cat h", "--model_dir=/m", "--powers=auto"]))
    check_resumable(parse_args(["--max_restarts=1", "--model_dir=/m", "--powers=1,3"]))
    check_resumable(parse_args(["--workers=2"]))  # a fixed cluster that is not restarted
    assert parse_args(["--discover=cat h"]).policy().max_restarts == 3
    assert parse_args(["--workers=2"]).policy().max_restarts == 0


def test_a_killed_worker_restarts_the_cluster_with_what_discovery_offers_then(workers, capsys):
    command, hosts, seen = workers
    hosts.write_text("localhost:2\n")
    # start 0: worker 1 is killed, once discovery offers one worker; start 1 ends well
    acts = {"0/0": "wait", "0/1": "kill offering localhost:1"}
    # discovery's own round comes every 60 s: the restart asks it again, now
    status = supervise(settings(hosts, max_restarts=1, discover_every=60), command=command(acts))
    err = capsys.readouterr().err
    assert status == 0, err
    assert own_lines(err) == [
        "tfdp-launch: worker 1 failed (killed by SIGKILL); stopping the others, to start again",
        "tfdp-launch: restart 1, after worker 1 failed (killed by SIGKILL): "
        "starting 1 worker(s) (localhost)",
    ]
    first, again = seen(0, 0), seen(1, 0)
    assert [c["cause"] for c in again["history"]] == [
        "start",
        "worker 1 failed (killed by SIGKILL)",
    ]
    assert [c["members"] for c in again["history"]] == [["localhost"] * 2, ["localhost"]]
    assert len(first["tf_config"]["cluster"]["worker"]) == 2
    assert again["tf_config"] == {
        "cluster": {"worker": [again["tf_config"]["cluster"]["worker"][0]]},
        "task": {"type": "worker", "index": 0},
    }
    assert again["tf_config"]["cluster"]["worker"][0] not in first["tf_config"]["cluster"]["worker"]


def test_failures_past_max_restarts_end_the_run_with_one_line(workers, capsys):
    command, hosts, seen = workers
    hosts.write_text("localhost:2\n")
    acts = {"0/1": "kill", "1/1": "kill", "0/0": "wait", "1/0": "wait"}
    status = supervise(settings(hosts, max_restarts=1, grace_seconds=1), command=command(acts))
    err = capsys.readouterr().err
    assert status == 128 + signal.SIGKILL
    assert own_lines(err)[-2:] == [
        "tfdp-launch: localhost has failed 2 times: left out for 60 s",
        "tfdp-launch: error: worker 1 failed (killed by SIGKILL); not restarted: failure 2, "
        "and --max_restarts=1; the latest checkpoint stands",
    ]
    assert seen(2, 0) is None


def test_a_runs_own_error_is_not_restarted(workers, capsys):
    command, hosts, seen = workers
    hosts.write_text("localhost:2\n")
    acts = {"0/0": "exit 2", "0/1": "wait"}
    status = supervise(settings(hosts, grace_seconds=1), command=command(acts))
    err = capsys.readouterr().err
    assert status == 2
    assert own_lines(err)[0] == (
        "tfdp-launch: worker 0 failed (exit status 2); the others are stopped if still running in 1 s"
    )
    assert seen(1, 0) is None and seen(0, 1)["signals"] == ["SIGINT"]


def test_a_change_that_discovery_announces_stops_the_workers_and_starts_the_new_members(
    workers, capsys, tmp_path
):
    command, hosts, seen = workers
    hosts.write_text("localhost:1\n")
    acts = {"0/0": "wait", "1/0": "wait", "1/1": "wait", "1/2": "wait"}

    def offer_three_then_finish():
        deadline = time.monotonic() + 60
        while seen(0, 0) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        hosts.write_text("localhost:3\n")
        while seen(1, 2) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        (tmp_path / "go").touch()

    helper = threading.Thread(target=offer_three_then_finish)
    helper.start()
    status = supervise(settings(hosts, max_restarts=0), command=command(acts))
    helper.join()
    err = capsys.readouterr().err
    assert status == 0, err
    assert own_lines(err) == [
        "tfdp-launch: discovery offers localhost x3: the workers save their step and stop, "
        "to start again with the new members",
        "tfdp-launch: restart 1, after discovery offered localhost x3: "
        "starting 3 worker(s) (localhost x3)",
    ]
    assert seen(0, 0)["signals"] == ["SIGINT"]  # as on SIGTERM: tfdp saves the step and stops
    # --max_restarts=0, yet restarted: a change that discovery announces is not a failure
    assert [len(seen(1, i)["history"]) for i in range(3)] == [2, 2, 2]


def test_below_min_workers_the_launcher_waits_then_gives_up_naming_the_timeout(workers, capsys):
    command, hosts, _ = workers
    hosts.write_text("localhost:1\n")
    started = time.monotonic()
    status = supervise(settings(hosts, min_workers=2, wait_seconds=1), command=command({}))
    err = capsys.readouterr().err
    assert status == 1 and 1 <= time.monotonic() - started < 30
    assert own_lines(err) == [
        "tfdp-launch: waiting for workers: discovery offers 1, and --min_workers=2; "
        "waiting up to 1 s (--wait_seconds)",
        "tfdp-launch: error: discovery offered fewer than --min_workers=2 workers for 1 s "
        "(--wait_seconds=1); last offered: localhost; the latest checkpoint stands",
    ]


def test_a_worker_that_stops_responding_is_the_one_blamed(workers, capsys):
    """Worker 0 lost the cluster (138) while worker 1 runs on, ignoring SIGINT: frozen."""
    command, hosts, seen = workers
    hosts.write_text("localhost:2\n")
    acts = {"0/0": "exit 138", "0/1": "ignore"}
    status = supervise(settings(hosts, grace_seconds=1, max_restarts=1), command=command(acts))
    err = capsys.readouterr().err
    assert status == 0, err
    lines = own_lines(err)
    assert lines[0] == (
        "tfdp-launch: worker 0 failed (exit status 138, it lost the cluster); "
        "the others are stopped if still running in 1 s"
    )
    assert lines[-1] == (
        "tfdp-launch: restart 1, after worker 1 stopped responding: "
        "starting 2 worker(s) (localhost x2)"
    )


FAKE_SSH = """
import os, sys
# ssh [options] HOST COMMAND: runs COMMAND with the shell, here (HOST is only noted)
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "hosts_reached"), "a") as f:
    f.write(sys.argv[-2] + "\\n")
os.execvp("sh", ["sh", "-c", sys.argv[-1]])
"""


def test_workers_on_other_hosts_start_over_ssh_and_take_signals_through_it(
    workers, capsys, tmp_path
):
    command, hosts, seen = workers
    ssh = tmp_path / "ssh.py"
    ssh.write_text(FAKE_SSH)
    hosts.write_text("localhost:1\nnode-a:1\n")
    acts = {"0/0": "wait", "0/1": "wait", "1/0": "exit 0"}

    def offer_one_when_both_run():
        deadline = time.monotonic() + 60
        while seen(0, 0) is None or seen(0, 1) is None:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        hosts.write_text("localhost:1\n")

    helper = threading.Thread(target=offer_one_when_both_run)
    helper.start()
    status = supervise(
        settings(hosts, network="host", ssh=f"{sys.executable} {ssh}"), command=command(acts)
    )
    helper.join()
    err = capsys.readouterr().err
    assert status == 0, err
    here, there = seen(0, 0), seen(0, 1)
    assert (here["remote"], there["remote"]) == (False, True)
    addresses = here["tf_config"]["cluster"]["worker"]
    assert addresses[0].startswith(f"{os.uname().nodename}:") and addresses[1].startswith("node-a:")
    assert there["signals"] == ["SIGINT"]  # from the launcher, through ssh's standard input
    # node-a: asked for a free port, then the worker started
    assert (tmp_path / "hosts_reached").read_text().split() == ["node-a", "node-a"]
    assert seen(1, 0)["history"][-1]["members"] == ["localhost"]


def test_other_hosts_under_an_isolated_network_are_refused_at_the_start(workers, capsys):
    command, hosts, _ = workers
    hosts.write_text("localhost:1\nnode-a:2\n")
    status = supervise(settings(hosts, network="isolated"), command=command({}))
    err = capsys.readouterr().err
    assert status == 2
    assert own_lines(err) == [
        f"tfdp-launch: error: --discover=cat {hosts}: offers node-a, which workers in an "
        "isolated network cannot reach; --network=host runs them on this machine's network"
    ]


class FakeRun:
    def __init__(self, start_step):
        self.start_step, self.result = start_step, {}


def test_the_history_keeps_each_starts_step_and_seconds_and_starts_that_trained_none(tmp_path):
    now = time.time()
    history = [
        {"restart": 0, "at": now - 30, "cause": "start", "members": ["a", "b"]},
        {"restart": 1, "at": now - 20, "cause": "worker 1 failed", "members": ["a"]},
    ]
    Membership(history[:1], str(tmp_path), chief=True).on_step_end(FakeRun(0), 1)
    history.append(
        {"restart": 2, "at": now - 2, "cause": "discovery offered a x3", "members": ["a"] * 3}
    )
    run = FakeRun(40)
    Membership(history, str(tmp_path), chief=True).on_step_end(run, 41)
    entries = run.result["membership"]
    kept = json.loads((tmp_path / FILE).read_text())
    assert entries == kept
    assert [(e["restart"], e["workers"], e["step"]) for e in entries] == [
        (0, 2, 0),  # recorded by its own start, at its first step
        (1, 1, None),  # its workers trained no step
        (2, 3, 40),
    ]
    assert entries[0]["seconds_to_step"] >= 30 and entries[1]["seconds_to_step"] is None
    assert 2 <= entries[2]["seconds_to_step"] < 20
    assert not (tmp_path / "other").exists()
    Membership(history, str(tmp_path / "other"), chief=False).on_step_end(FakeRun(40), 41)
    assert not (tmp_path / "other").exists()  # only the chief writes


def test_the_history_is_read_from_the_launchers_variable():
    assert changes({}) is None and not after_a_change({})
    one = [{"restart": 0, "at": 1.0, "cause": "start", "members": ["a"]}]
    two = [*one, {"restart": 1, "at": 2.0, "cause": "x", "members": ["a"]}]
    assert changes({"TFDP_MEMBERSHIP": json.dumps(one)}) == one
    assert not after_a_change({"TFDP_MEMBERSHIP": json.dumps(one)})
    assert after_a_change({"TFDP_MEMBERSHIP": json.dumps(two)})


TOY = ["--model=toy", "--batch_size=256", "--progress=never", "--log_every=500"]
STEPS, EVERY = 1500, 50


def children(pid):
    """{task index: pid} of the workers a launcher started."""
    found = {}
    with open(f"/proc/{pid}/task/{pid}/children") as file:
        for child in file.read().split():
            try:
                with open(f"/proc/{child}/environ", "rb") as env:
                    variables = env.read().split(b"\0")
            except OSError:
                continue
            for variable in variables:
                if variable.startswith(b"TF_CONFIG="):
                    found[json.loads(variable[10:])["task"]["index"]] = int(child)
    return found


def wait_until(ready, launcher, what, seconds=180):
    deadline = time.monotonic() + seconds
    while not ready():
        assert launcher.poll() is None, (
            f"the launcher ended before {what}: {launcher.communicate()}"
        )
        assert time.monotonic() < deadline, f"no {what} in {seconds} s"
        time.sleep(0.02)


def history(model_dir):
    try:
        with open(os.path.join(model_dir, FILE)) as file:
            return json.load(file)
    except (OSError, ValueError):
        return []


@pytest.mark.slow
def test_two_workers_a_sigkill_one_then_three_is_the_run_of_one_device(tmp_path):
    """The schedule: 2 workers; worker 1 SIGKILLed, discovery then offering 1; later 3.

    How the test knows that no batch was trained twice and none skipped: the weights
    are those of one device over the same 1500 global batches, to rtol 1e-5, and one
    step more or fewer is far outside that (checked beside it). Each start resumed at
    a saved step: after the kill, at the checkpoint before it (at most EVERY steps are
    trained again); after discovery's change, at the step the workers stopped at.
    """
    hosts, model_dir = tmp_path / "hosts", str(tmp_path / "run")
    hosts.write_text("localhost:2\n")
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tfdp.cluster.launch",
            f"--discover=cat {hosts}",
            "--discover_every=0.5",
            "--max_workers=3",
            *TOY,
            f"--iterations={STEPS}",
            f"--checkpoint_every={EVERY}",
            "--powers=auto",
            f"--model_dir={model_dir}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
    )
    try:
        wait_until(lambda: (latest_step(model_dir) or 0) >= 4 * EVERY, launcher, "a checkpoint")
        saved_before_kill = latest_step(model_dir)
        hosts.write_text("localhost:1\n")
        os.kill(children(launcher.pid)[1], signal.SIGKILL)
        wait_until(lambda: len(history(model_dir)) == 2, launcher, "a first step on one worker")
        resumed = history(model_dir)[1]["step"]
        wait_until(
            lambda: latest_step(model_dir) >= resumed + 2 * EVERY, launcher, "one worker's steps"
        )
        hosts.write_text("localhost:3\n")
        stdout, stderr = launcher.communicate(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate()
    assert launcher.returncode == 0, stderr[-3000:]

    changes = result(model_dir)["membership"]
    assert [(c["restart"], c["workers"]) for c in changes] == [(0, 2), (1, 1), (2, 3)]
    assert [c["cause"] for c in changes] == [
        "start",
        "worker 1 failed (killed by SIGKILL)",
        "discovery offered localhost x3",
    ]
    assert all(0 < c["seconds_to_step"] < 60 for c in changes)
    # the kill: resumed from the checkpoint before it (or one the chief finished saving)
    assert changes[1]["step"] % EVERY == 0
    assert saved_before_kill <= changes[1]["step"] <= saved_before_kill + EVERY
    # discovery's change: resumed at the very step the one worker saved and stopped after
    [stop] = [line for line in stderr.splitlines() if "tfdp: stopped by SIGINT" in line]
    assert f"stopped by SIGINT after iteration {changes[2]['step']}; saved" in stop
    assert result(model_dir)["start_iteration"] == changes[2]["step"]
    assert result(model_dir)["iterations"] == STEPS
    assert len(result(model_dir)["shards"]) == 3 and sum(result(model_dir)["shards"]) == 256
    assert len(result(model_dir)["auto_powers"]["powers"]) == 3  # measured again for 3

    one_device, single = {}, str(tmp_path / "single")
    for steps in (STEPS, STEPS + 1):  # the step after STEPS: resumed from its checkpoint
        config = Config(model="toy", batch_size=256, iterations=steps, log_every=500)
        resumed, _ = train(dataclasses.replace(config, model_dir=single))
        assert resumed["start_iteration"] == (0 if steps == STEPS else STEPS)
        one_device[steps] = load_weights(single)
    for got, expected in zip(load_weights(model_dir), one_device[STEPS], strict=True):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-7)
    assert not all(
        np.allclose(later, expected, rtol=1e-5, atol=1e-7)
        for later, expected in zip(one_device[STEPS + 1], one_device[STEPS], strict=True)
    )


def test_rebalancing_one_device_is_refused_where_the_user_chose_the_devices():
    # (one worker of a cluster trains on: the platform chose its size; see the Slurm requeue
    # in test_cluster_sources.py)
    _, line = refusal("--mode=weighted", "--model=toy", "--devices=CPU:0", "--rebalance_every=2")
    assert line == "tfdp: error: --rebalance_every=2: needs at least two devices to balance"


def test_this_machines_slots_are_capped_by_its_gpus():
    said = []
    discovery = Discovery("echo localhost:4; echo node-a:2", 60, say=said.append, local_slots=2)
    discovery.close()
    assert discovery.latest() == ([("localhost", 2), ("node-a", 2)], None)
    assert said == [
        "warning: discovery offers localhost:4; this machine's GPUs make room for 2 "
        "worker(s) (--gpus_per_worker)"
    ]


def test_a_start_that_resumes_at_the_runs_end_is_listed_without_seconds(tmp_path):
    history = [{"restart": 0, "at": time.time(), "cause": "start", "members": ["a"]}]
    run = FakeRun(300)
    Membership(history, str(tmp_path), chief=True).on_train_end(run)
    [entry] = run.result["membership"]
    assert (entry["step"], entry["seconds_to_step"]) == (300, None)
