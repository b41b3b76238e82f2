"""tfdp-launch: the workers' network, their output, signals, failures and taken ports.

The workers run the functions of WORKERS (written to a test's tmp_path):
they report their pid and TF_CONFIG in files, and wait, fail or catch
signals, so that each test sees the cluster in the state it needs. Every wait
has a bound that fails loudly.
"""

import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from tfdp.cluster import launch as launch_module
from tfdp.cluster import workers as cluster_workers
from tfdp.cluster.workers import copy_lines

ROOT = Path(__file__).resolve().parents[1]
TOY = ["--model=toy", "--batch_size=256", "--progress=never"]
SMALL = ["--batch_size=16", "--progress=never"]  # for the 64 examples of WORKERS

WORKERS = '''
import json, os, signal, sys, time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
TASK = json.loads(os.environ["TF_CONFIG"])["task"]["index"]


def report():
    """This worker's pid and TF_CONFIG, written whole (the test polls for the file)."""
    path = os.path.join(HERE, f"worker{TASK}.json")
    with open(path + ".part", "w") as file:
        json.dump({"pid": os.getpid(), "tf_config": json.loads(os.environ["TF_CONFIG"])}, file)
    os.replace(path + ".part", path)


def model():
    import keras

    keras.utils.set_random_seed(3)
    m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    m.compile(
        optimizer=keras.optimizers.SGD(0.1),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    return m


def data():
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)
    return (x, y), (x, y)


def announce():
    """Reports, then trains once the test has created `go`: the cluster is up meanwhile."""
    report()
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(HERE, "go")):
        if time.monotonic() > deadline:
            sys.exit("no go file in 180 s")
        time.sleep(0.05)
    return model()


def fail_one():
    """Worker 1 exits with status 7; worker 0 ignores SIGINT and sleeps."""
    if TASK == 1:
        sys.exit(7)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report()
    time.sleep(600)


def catch_stop():
    """Records the stop signal that reaches this worker; worker 0 then exits as tfdp
    does (128 + N), worker 1 goes on sleeping."""

    def record(signum, frame):
        with open(os.path.join(HERE, f"signal{TASK}"), "w") as file:
            file.write(signal.Signals(signum).name)
        if TASK == 0:
            os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, record)
    report()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        time.sleep(0.05)
'''


def environment(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("TFDP_MNIST_DIR", "TF_CONFIG")}
    return dict(env, TF_CPP_MIN_LOG_LEVEL="2", **extra)


def start(*args, workers=2):
    """Starts `tfdp-launch` (python -m tfdp.cluster.launch)."""
    return subprocess.Popen(
        [sys.executable, "-m", "tfdp.cluster.launch", f"--workers={workers}", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=environment(),
        cwd=ROOT,
    )


def run(*args, timeout=240):
    """Runs `tfdp-launch` to its end."""
    launcher = start(*args)
    try:
        launcher.stdout_text, launcher.stderr_text = launcher.communicate(timeout=timeout)
    finally:
        stop(launcher)
    return launcher


def stop(launcher):
    """Kills a launcher still running (its workers die with it)."""
    if launcher.poll() is None:
        launcher.kill()
        launcher.communicate(timeout=60)


def workers_module(tmp_path):
    path = tmp_path / "workers.py"
    path.write_text(WORKERS)
    return path


def reported(directory, worker, launcher, seconds=180):
    """What worker `worker` reported, once it has: pid and TF_CONFIG."""
    path = directory / f"worker{worker}.json"
    deadline = time.monotonic() + seconds
    while not path.exists():
        if launcher.poll() is not None:
            pytest.fail(f"the launcher exited with {launcher.returncode}: {launcher.communicate()}")
        assert time.monotonic() < deadline, f"worker {worker} did not report in {seconds} s"
        time.sleep(0.05)
    return json.loads(path.read_text())


def is_running(pid):
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def connect(port):
    """'connected', or the error of a TCP connect from this process to 127.0.0.1:port."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            return "connected"
    except OSError as error:
        return type(error).__name__


def worker_lines(output, worker):
    prefix = f"[worker {worker}] "
    return [line[len(prefix) :] for line in output.splitlines() if line.startswith(prefix)]


@pytest.fixture(scope="module")
def networks(tmp_path_factory):
    """The same 4 steps launched with --network=isolated and --network=host; while the
    cluster is up, each worker's network namespace and a connect to its port."""
    runs = {}
    for network in ("isolated", "host"):
        directory = tmp_path_factory.mktemp(network)
        module = workers_module(directory)
        launcher = start(
            f"--network={network}",
            f"--model={module}:announce",
            f"--dataset={module}:data",
            "--batch_size=16",
            "--iterations=4",
            "--log_every=1",
            "--progress=never",
        )
        try:
            workers = []
            for i in (0, 1):
                report = reported(directory, i, launcher)
                port = int(report["tf_config"]["cluster"]["worker"][i].rsplit(":", 1)[1])
                namespace = os.readlink(f"/proc/{report['pid']}/ns/net")
                workers.append({"namespace": namespace, "connect": connect(port)})
            (directory / "go").touch()
            stdout, stderr = launcher.communicate(timeout=240)
        finally:
            stop(launcher)
        runs[network] = {
            "status": launcher.returncode,
            "stdout": stdout,
            "stderr": stderr,
            "workers": workers,
        }
    return runs


@pytest.mark.slow
def test_isolated_workers_cannot_be_reached_and_train(networks):
    run = networks["isolated"]
    assert run["status"] == 0, run["stderr"]
    own = os.readlink("/proc/self/ns/net")
    first, second = run["workers"]
    assert first["namespace"] != own
    assert first["namespace"] == second["namespace"]  # one namespace: they reach each other
    assert [w["connect"] for w in run["workers"]] == ["ConnectionRefusedError"] * 2
    assert "tfdp-launch: warning" not in run["stderr"]


@pytest.mark.slow
def test_host_workers_share_the_network_and_are_reachable(networks):
    run = networks["host"]
    assert run["status"] == 0, run["stderr"]
    own = os.readlink("/proc/self/ns/net")
    assert [w["namespace"] for w in run["workers"]] == [own, own]
    assert [w["connect"] for w in run["workers"]] == ["connected"] * 2


@pytest.mark.slow
def test_isolated_and_host_workers_train_the_same(networks):
    for worker in (0, 1):
        logs = [
            [line for line in worker_lines(networks[n]["stdout"], worker) if "loss" in line]
            for n in ("isolated", "host")
        ]
        assert [line.split(" ", 3)[:3] for line in logs[0]] == [
            ["iteration", f"{i},", "accuracy"] for i in range(4)
        ] + [["iteration", "4,", "test"]]
        assert logs[0] == logs[1]


REFUSE = """
import errno, os
import tfdp.cluster.launch as launch
import tfdp.cluster.network as network

def refuse(flags):
    raise PermissionError(errno.EPERM, os.strerror(errno.EPERM))

network._unshare = refuse
launch.run()
"""
WARNING = (
    "tfdp-launch: warning: the workers' ports are reachable from the network, and TensorFlow "
    "does not authenticate: cannot put them in a network namespace of their own (unshare: "
    "Operation not permitted; in a user namespace: Operation not permitted); "
    "run this only on a private network, or say so with --network=host"
)


def refused_isolation(*args, timeout=240):
    """`tfdp-launch ARGS` on a machine that refuses network namespaces."""
    return subprocess.run(
        [sys.executable, "-c", REFUSE, "--workers=2", *args],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=timeout,
    )


@pytest.mark.slow
def test_refused_isolation_warns_and_runs_on_the_host_network():
    process = refused_isolation(*TOY, "--iterations=2")
    assert process.returncode == 0, process.stderr
    assert process.stderr.splitlines()[0] == WARNING
    for worker in (0, 1):
        assert any(
            line.startswith("time for 2 iterations")
            for line in worker_lines(process.stdout, worker)
        )


def test_refused_explicit_isolation_is_an_error():
    process = refused_isolation("--network=isolated", *TOY, timeout=60)
    assert process.returncode == 2
    assert process.stderr.splitlines() == [
        (
            "tfdp-launch: error: --network=isolated: cannot isolate the workers (unshare: "
            "Operation not permitted; in a user namespace: Operation not permitted); "
            "--network=host runs them on this machine's network"
        )
    ]
    assert process.stdout == ""


ISOLATE_AS_USER = """
import importlib.util, os, socket, sys
spec = importlib.util.spec_from_file_location("launch", sys.argv[1])
launch = importlib.util.module_from_spec(spec)
spec.loader.exec_module(launch)
before = os.readlink("/proc/self/ns/net")
launch.isolate_network()
server = socket.create_server(("127.0.0.1", 0))
socket.create_connection(server.getsockname(), timeout=5).close()
interfaces = sorted(name for _, name in socket.if_nameindex())
print(os.getuid(), os.readlink("/proc/self/ns/net") != before, interfaces)
"""


@pytest.mark.skipif(os.getuid() != 0, reason="switches to user nobody")
def test_an_unprivileged_user_isolates_through_a_user_namespace(tmp_path):
    """Without CAP_SYS_ADMIN, the launcher's fallback (a user namespace) gives the same."""
    # A copy of the launcher where user nobody can read it, whatever the checkout's
    # permissions (a clone under a private directory is not readable by nobody).
    shared = tempfile.mkdtemp(prefix="tfdp-launch-")
    try:
        os.chmod(shared, 0o755)
        launcher = shutil.copy(ROOT / "tfdp" / "cluster" / "network.py", shared)
        os.chmod(launcher, 0o644)
        for python in (sys.executable, "/usr/bin/python3"):
            try:
                process = subprocess.run(
                    [python, "-c", ISOLATE_AS_USER, launcher],
                    capture_output=True,
                    text=True,
                    user=65534,
                    group=65534,
                    extra_groups=[],
                    cwd=shared,
                    timeout=60,
                )
            except (PermissionError, FileNotFoundError):
                continue  # user nobody cannot reach this Python
            if "Permission denied" not in process.stderr:
                break
        else:
            pytest.skip("no Python that user nobody can run")
    finally:
        shutil.rmtree(shared, ignore_errors=True)
    assert process.returncode == 0, process.stderr
    assert process.stdout.split() == ["65534", "True", "['lo']"]


def refused(*args):
    """`tfdp-launch ARGS` that stops before starting any worker."""
    return subprocess.run(
        [sys.executable, "-m", "tfdp.cluster.launch", *args],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=60,
    )


def test_flag_network_must_be_isolated_or_host():
    process = refused("--network=open")
    assert process.returncode == 2
    assert process.stderr.splitlines() == [
        "tfdp-launch: error: --network=open: must be one of isolated, host"
    ]


@pytest.mark.parametrize(
    "args,line",
    [
        (["--"], "tfdp-launch: error: --: needs a command after it, e.g. -- python3 train.py"),
        (
            ["--model=toy", "--", "python3", "train.py"],
            "tfdp-launch: error: --model=toy: is a tfdp flag; with -- COMMAND, give the command "
            "its own arguments",
        ),
    ],
)
def test_a_command_of_ones_own_is_refused_without_a_command_or_beside_tfdp_flags(args, line):
    process = refused(*args)
    assert process.returncode == 2
    assert process.stderr.splitlines() == [line]


def test_help_describes_the_network_flag():
    process = subprocess.run(
        [sys.executable, "-m", "tfdp.cluster.launch", "--help"],
        capture_output=True,
        text=True,
        env=environment(),
        cwd=ROOT,
        timeout=60,
    )
    assert process.returncode == 0
    assert "--network=isolated|host" in process.stdout
    assert "--network=host      the workers on this machine's network, e.g. to download" in (
        process.stdout
    )


WRITER = r"""
import sys
out = sys.stdout.buffer
out.write(b"bad \xff\xfe bytes\n")
for i in range(200000):  # 1.3 MB: far more than a pipe holds
    out.write(b"%d\n" % i)
out.write(b"last, cut \xc3")
"""


class BrokenSink:
    """A sink whose every write fails, as a closed terminal's would."""

    def __init__(self):
        self.writes = 0

    def write(self, text):
        self.writes += 1
        raise OSError(5, "Input/output error")

    def flush(self):
        pass


@pytest.mark.parametrize("sink", [io.StringIO(), BrokenSink()], ids=["sink", "broken_sink"])
def test_a_reader_copies_undecodable_output_to_its_end(sink):
    writer = subprocess.Popen([sys.executable, "-c", WRITER], stdout=subprocess.PIPE)
    reader = threading.Thread(target=copy_lines, args=(writer.stdout, sink, "[w] ", threading.Lock()))
    reader.start()
    try:
        assert writer.wait(timeout=120) == 0  # a reader that stopped early leaves it blocked
    finally:
        writer.kill()
        reader.join(timeout=60)
    assert not reader.is_alive()
    if isinstance(sink, BrokenSink):
        assert sink.writes == 200002
    else:
        lines = sink.getvalue().split("\n")
        assert lines[0] == "[w] bad \ufffd\ufffd bytes"
        assert lines[1:-2] == [f"[w] {i}" for i in range(200000)]
        assert lines[-2:] == ["[w] last, cut \ufffd", ""]


@pytest.mark.slow
def test_a_failed_worker_stops_the_others_after_the_grace_period(tmp_path):
    module = workers_module(tmp_path)
    launcher = start(
        "--grace_seconds=2", f"--model={module}:fail_one", f"--dataset={module}:data", *SMALL
    )
    try:
        pid = reported(tmp_path, 0, launcher)["pid"]
        _, stderr = launcher.communicate(timeout=180)
    finally:
        stop(launcher)
    assert launcher.returncode == 7, stderr
    own = [line for line in stderr.splitlines() if line.startswith("tfdp-launch: ")]
    assert own == [
        (
            "tfdp-launch: worker 1 failed (exit status 7); "
            "the others are stopped if still running in 2 s"
        ),
        "tfdp-launch: stopping worker(s) 0",
        "tfdp-launch: worker 0 did not stop; killing it",
    ]
    assert not is_running(pid)


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_reaches_every_worker(tmp_path, signum):
    module = workers_module(tmp_path)
    launcher = start(
        "--grace_seconds=3", f"--model={module}:catch_stop", f"--dataset={module}:data", *SMALL
    )
    try:
        pids = [reported(tmp_path, i, launcher)["pid"] for i in (0, 1)]
        launcher.send_signal(signum)
        _, stderr = launcher.communicate(timeout=120)
    finally:
        stop(launcher)
    name = signal.Signals(signum).name
    assert launcher.returncode == {"SIGTERM": 143, "SIGINT": 130}[name], stderr
    assert [(tmp_path / f"signal{i}").read_text() for i in (0, 1)] == [name, name]
    own = [line for line in stderr.splitlines() if line.startswith("tfdp-launch: ")]
    assert own == [
        (
            f"tfdp-launch: {name} received; passing it to the workers, "
            "which are killed if still running in 3 s"
        ),
        "tfdp-launch: worker 1 did not stop; killing it",
    ]
    assert [is_running(pid) for pid in pids] == [False, False]


@pytest.mark.slow
def test_a_taken_port_starts_the_workers_again(monkeypatch, capsys):
    """--network=host: a port taken between choosing and binding it costs one more start."""
    taken = socket.create_server(("0.0.0.0", 0))
    port = taken.getsockname()[1]
    chosen = []

    def ports(n):
        fresh = free_ports(n)
        chosen.append([port, *fresh[1:]] if not chosen else fresh)
        return chosen[-1]

    free_ports = cluster_workers.free_ports
    monkeypatch.setattr(cluster_workers, "free_ports", ports)
    with taken:
        status = launch_module.launch(2, ["--mode=multiworker", *TOY, "--iterations=2"], 30)
    out, err = capsys.readouterr()
    assert status == 0, err
    assert len(chosen) == 2 and chosen[0][0] == port != chosen[1][0]
    own = [line for line in err.splitlines() if line.startswith("tfdp-launch: ")]
    assert own == [
        (
            "tfdp-launch: worker 0 could not listen on its port, taken since it was chosen; "
            "starting the workers again on new ports"
        )
    ]
    for worker in (0, 1):
        assert any(line.startswith("time for 2 iterations") for line in worker_lines(out, worker))
