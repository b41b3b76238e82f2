"""What reaches the disk: a corrupt checkpoint falls back to the previous one,
writers never replace a link or a stream and leave no temporary file, a full
disk during a save keeps the last good checkpoint, and files honour the umask.

Resumes run in this process (`tfdp.train`) with the toy model; the command
runs in a subprocess where its one line and exit status are the test. Full and
read-only filesystems are tiny tmpfs mounts (the tests run as root); where
mounting is not allowed, those tests are skipped and say why.
"""

import json
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest
from helpers import (
    assert_same_run,
    cli_in_process,
    environment,
    launch,
    own_stderr_lines,
    result,
    tfdp,
    tmpfs,
    toy_config,
    train,
    worker_lines,
)

from tfdp.config import Config
from tfdp.errors import ConfigError
from tfdp.run.checkpoints import Checkpointer
from tfdp.storage import StorageError, export_model, write_atomically

TOY = ["--model=toy", "--batch_size=100", "--progress=never", "--checkpoint_every=10"]


def checkpoints(model_dir):
    return os.path.join(model_dir, "checkpoints")


def toy_run(model_dir, iterations, **changes):
    """The toy run of these tests (TOY's flags) in this process: the lines it logged."""
    config = toy_config(
        checkpoint_every=10, iterations=iterations, model_dir=str(model_dir), **changes
    )
    return train(config)[1]


def index_names(model_dir):
    """The checkpoint names of the index file, latest first."""
    with open(os.path.join(checkpoints(model_dir), "checkpoint")) as f:
        return [line.split('"')[1] for line in f if "checkpoint_path" in line]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """A straight run of 30 iterations, and one of 20 (checkpoints 10 and 20) to damage."""
    straight = str(tmp_path_factory.mktemp("straight"))
    twenty = str(tmp_path_factory.mktemp("twenty"))
    for model_dir, iterations in ((straight, 30), (twenty, 20)):
        toy_run(model_dir, iterations)
    return straight, twenty


def copy_run(source, tmp_path):
    model_dir = str(tmp_path / "run")
    shutil.copytree(source, model_dir)
    return model_dir


def truncate_data(model_dir, step):
    path = os.path.join(checkpoints(model_dir), f"ckpt-{step}.data-00000-of-00001")
    os.truncate(path, os.path.getsize(path) // 2)


def delete_index(model_dir, step):
    os.remove(os.path.join(checkpoints(model_dir), f"ckpt-{step}.index"))


@pytest.mark.parametrize(
    "damage, reason",
    [
        (truncate_data, "its data file is truncated"),
        (delete_index, "its index file is missing"),
    ],
)
def test_a_damaged_latest_checkpoint_resumes_from_the_previous_one(runs, tmp_path, damage, reason):
    straight, twenty = runs
    model_dir = copy_run(twenty, tmp_path)
    damage(model_dir, 20)

    lines = toy_run(model_dir, 30)
    bad, good = (os.path.join(checkpoints(model_dir), f"ckpt-{s}") for s in (20, 10))
    aside = os.path.join(checkpoints(model_dir), "unreadable", "ckpt-20")
    [skipped] = [line for line in lines if line.startswith("skipped")]
    assert skipped.startswith(f"skipped checkpoint {bad}: {reason}")
    assert skipped.endswith(f"; moved its files to {aside}; resuming from {good}")
    assert any("resuming at iteration 10" in line for line in lines)
    assert result(model_dir)["start_iteration"] == 10
    assert_same_run(straight, model_dir)
    # The damaged files are kept aside; the new ckpt-20 is the resumed run's own.
    assert os.listdir(aside)
    assert index_names(model_dir) == ["ckpt-30", "ckpt-10", "ckpt-20", "ckpt-30"]


def test_a_garbled_index_resumes_from_the_newest_checkpoint(runs, tmp_path):
    straight, twenty = runs
    model_dir = copy_run(twenty, tmp_path)
    index = os.path.join(checkpoints(model_dir), "checkpoint")
    with open(index, "w") as f:
        f.write('model_checkpoint_path: "ckpt-2\x00\x17garbage')

    lines = toy_run(model_dir, 30)
    assert any(f"the checkpoint index {index} is unreadable (" in line for line in lines)
    assert any("resuming at iteration 20" in line for line in lines)
    assert result(model_dir)["start_iteration"] == 20
    assert_same_run(straight, model_dir)
    assert index_names(model_dir)[0] == "ckpt-30"


def test_no_checkpoint_that_reads_back_is_an_error(runs, tmp_path):
    _, twenty = runs
    model_dir = copy_run(twenty, tmp_path)
    truncate_data(model_dir, 20)
    delete_index(model_dir, 10)
    before = sorted(os.listdir(checkpoints(model_dir)))

    with pytest.raises(ConfigError) as refused:
        toy_run(model_dir, 30)
    assert (refused.value.field, refused.value.value) == ("model_dir", model_dir)
    reason = refused.value.reason
    assert reason.startswith("none of its checkpoints reads back (ckpt-20: "), reason
    assert "ckpt-10: its index file is missing" in reason
    assert sorted(os.listdir(checkpoints(model_dir))) == before  # nothing moved, nothing written


# --- writers ---------------------------------------------------------------


def test_through_a_symlink_the_link_stays_and_its_file_gets_the_text(tmp_path):
    target = tmp_path / "runs" / "result.json"
    target.parent.mkdir()
    target.write_text("old")
    link = tmp_path / "latest.json"
    link.symlink_to(target)

    write_atomically(str(link), "new\n")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new\n"
    assert not [name for name in os.listdir(target.parent) if name.startswith(".tmp-")]


@pytest.mark.parametrize("through_link", [False, True])
def test_a_fifo_is_written_through_not_replaced(tmp_path, through_link):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = tmp_path / "link" if through_link else fifo
    if through_link:
        path.symlink_to(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets the writer open at once
    try:
        write_atomically(str(path), '{"a": 1}\n')
        assert os.read(reader, 100) == b'{"a": 1}\n'
    finally:
        os.close(reader)
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert path.is_symlink() == through_link
    assert sorted(os.listdir(tmp_path)) == sorted({"fifo", path.name})


WRITE_TO_STDOUT = (
    "import sys; from tfdp.storage import write_atomically; "
    "print('before', flush=True); write_atomically('/dev/stdout', 'TEXT\\n'); print('after')"
)


def test_dev_stdout_prints_into_a_pipe_and_into_a_redirected_file(tmp_path):
    env = environment()
    piped = subprocess.run(
        [sys.executable, "-c", WRITE_TO_STDOUT],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == "before\nTEXT\nafter\n"

    # Redirected to a file, /dev/stdout resolves to that file: it must be
    # neither replaced (the rest of stdout would be lost) nor truncated.
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        redirected = subprocess.run(
            [sys.executable, "-c", WRITE_TO_STDOUT], check=False, stdout=f, env=env, timeout=120
        )
    assert redirected.returncode == 0
    assert out.read_text() == "before\nTEXT\nafter\n"
    assert os.listdir(tmp_path) == ["out.txt"]


def tiny_model(units=4):
    import keras

    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(units)])
    model.compile(optimizer="sgd", loss="mse")
    return model


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002], ids=oct)
def test_files_honour_the_umask(tmp_path, umask):
    model_dir = str(tmp_path)
    previous = os.umask(umask)
    try:
        write_atomically(os.path.join(model_dir, "result.json"), "{}\n")
        export_model(tiny_model(), os.path.join(model_dir, "model.keras"))
        checkpointer = Checkpointer(
            checkpointed_config(model_dir), **run_parts(tiny_model(), balanced=True)
        )
        checkpointer.save(1)
    finally:
        os.umask(previous)
    for name in ("result.json", "model.keras", "run.json", "shares.json", "checkpoints/checkpoint"):
        mode = stat.S_IMODE(os.stat(os.path.join(model_dir, name)).st_mode)
        assert mode == 0o666 & ~umask, f"{name}: {oct(mode)}"


# --- full and read-only filesystems ----------------------------------------


@pytest.mark.parametrize(
    "options, text, errno_text",
    [
        ("ro,size=64k", "{}\n", "[Errno 30] Read-only file system"),
        ("size=64k", "x" * 300_000, "[Errno 28] No space left on device"),
    ],
    ids=["read-only", "full"],
)
def test_a_write_that_fails_names_the_path_and_leaves_no_temporary_file(
    tmp_path, options, text, errno_text
):
    with tmpfs(tmp_path / "mnt", options) as directory:
        path = os.path.join(directory, "result.json")
        with pytest.raises(StorageError) as raised:
            write_atomically(path, text)
        assert str(raised.value) == f"could not write {path}: {errno_text}"
        assert raised.value.path == path
        assert os.listdir(directory) == []


def test_an_export_to_a_full_disk_leaves_no_temporary_file(tmp_path):
    with tmpfs(tmp_path / "mnt", "size=64k") as directory:
        path = os.path.join(directory, "model.keras")
        with pytest.raises(StorageError) as raised:
            export_model(tiny_model(units=20_000), path)  # 320 KB of weights
        assert str(raised.value) == f"could not write {path}: [Errno 28] No space left on device"
        assert os.listdir(directory) == []


def test_an_export_never_replaces_a_fifo(tmp_path):
    fifo = tmp_path / "model.keras"
    os.mkfifo(fifo)
    with pytest.raises(StorageError, match="it is not a regular file"):
        export_model(tiny_model(), str(fifo))
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)
    assert os.listdir(tmp_path) == ["model.keras"]


def checkpointed_config(model_dir, **changes):
    return Config(model="toy", model_dir=model_dir, **changes)


def run_parts(model, balanced=False):
    """What a Checkpointer is handed: the model (compiled), the split, the exchange."""
    import keras

    from tfdp.cluster.exchange import LOCAL
    from tfdp.engine.split import Split

    if getattr(model, "optimizer", None) is None:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    return dict(model=model, split=Split(["/device:CPU:0"], [100], balanced=balanced), exchange=LOCAL)


def test_a_full_disk_during_a_save_keeps_the_last_good_checkpoint(tmp_path):
    from tfdp.models import toy_mlp

    with tmpfs(tmp_path / "mnt", "size=300k") as model_dir:
        config = checkpointed_config(
            model_dir, hidden_units=200, keep_checkpoints=10
        )  # ~110 KB a save
        checkpointer = Checkpointer(config, **run_parts(toy_mlp(hidden_units=200)))
        model = checkpointer.model
        rng = np.random.default_rng(0)
        saved = {}
        for step in range(10, 110, 10):
            model.set_weights([rng.normal(size=w.shape) for w in model.get_weights()])
            try:
                checkpointer.save(step)
            except StorageError as error:
                failed, failure = step, error
                break
            saved[step] = model.get_weights()
        else:
            pytest.fail("every save fitted on the 300 KiB disk")
        assert failed >= 20, "not even the first checkpoint fitted"
        assert failure.path == os.path.join(model_dir, "checkpoints", f"ckpt-{failed}")
        assert str(failure).startswith(f"could not write {failure.path}: ")
        assert "No space left on device" in str(failure)
        names = os.listdir(os.path.join(model_dir, "checkpoints"))
        assert not [name for name in names if name.startswith(f"ckpt-{failed}")], names
        last = failed - 10
        assert checkpointer.manager.latest_checkpoint.endswith(f"ckpt-{last}")

        # A fresh model restores the last good checkpoint, without falling back.
        fresh = Checkpointer(config, **run_parts(toy_mlp(hidden_units=200, seed=1)))
        lines = []
        assert fresh.restore(log=lines.append) == last
        assert lines == []
        for x, y in zip(fresh.model.get_weights(), saved[last], strict=True):
            np.testing.assert_array_equal(x, y)


def test_after_a_fallback_the_next_saves_continue_cleanly(tmp_path):
    model_dir = str(tmp_path)
    config = checkpointed_config(model_dir, keep_checkpoints=5)
    checkpointer = Checkpointer(config, **run_parts(tiny_model()))
    model = checkpointer.model
    rng = np.random.default_rng(0)
    saved = {}
    for step in (10, 20, 30):
        model.set_weights([rng.normal(size=w.shape) for w in model.get_weights()])
        checkpointer.save(step)
        saved[step] = model.get_weights()
    truncate_data(model_dir, 30)
    delete_index(model_dir, 20)

    fresh = Checkpointer(config, **run_parts(tiny_model()))
    lines = []
    assert fresh.restore(log=lines.append) == 10
    for x, y in zip(fresh.model.get_weights(), saved[10], strict=True):
        np.testing.assert_array_equal(x, y)
    assert [line.split(":")[0] for line in lines] == [
        f"skipped checkpoint {checkpoints(model_dir)}/ckpt-30",
        f"skipped checkpoint {checkpoints(model_dir)}/ckpt-20",
    ]
    assert fresh.manager.latest_checkpoint == f"{checkpoints(model_dir)}/ckpt-10"
    assert index_names(model_dir) == ["ckpt-10", "ckpt-10"]
    assert sorted(os.listdir(os.path.join(checkpoints(model_dir), "unreadable"))) == [
        "ckpt-20",
        "ckpt-30",
    ]

    # The same steps are saved again, over nothing of the damaged ones.
    fresh.save(20)
    fresh.save(30)
    assert index_names(model_dir) == ["ckpt-30", "ckpt-10", "ckpt-20", "ckpt-30"]
    again = Checkpointer(config, **run_parts(tiny_model()))
    lines = []
    assert again.restore(log=lines.append) == 30
    assert lines == []


def test_without_an_index_file_the_checkpoints_are_found_by_their_files(tmp_path):
    model_dir = str(tmp_path)
    config = checkpointed_config(model_dir)
    checkpointer = Checkpointer(config, **run_parts(tiny_model()))
    model = checkpointer.model
    for step in (10, 20):
        model.set_weights([np.full(w.shape, step) for w in model.get_weights()])
        checkpointer.save(step)
    expected = model.get_weights()
    os.remove(os.path.join(checkpoints(model_dir), "checkpoint"))

    fresh = Checkpointer(config, **run_parts(tiny_model()))
    lines = []
    assert fresh.restore(log=lines.append) == 20
    index = os.path.join(checkpoints(model_dir), "checkpoint")
    resuming = f"resuming from {checkpoints(model_dir)}/ckpt-20"
    assert lines == [
        f"the checkpoint index {index} is missing; found the checkpoints by their files; {resuming}"
    ]
    for x, y in zip(fresh.model.get_weights(), expected, strict=True):
        np.testing.assert_array_equal(x, y)
    assert index_names(model_dir) == ["ckpt-20", "ckpt-10", "ckpt-20"]


@pytest.mark.slow
def test_the_cli_on_a_full_disk_stops_in_one_line_and_the_last_checkpoint_resumes(tmp_path):
    # Each checkpoint of this model takes 144 KB: the first fits in 200 KiB, the second not.
    # the threads of this process's runs, which the resume continues with
    args = [*TOY, "--hidden_units=256", "--checkpoint_every=5", "--iterations=20"]
    args.append("--intra_op_threads=0")
    settings = dict(hidden_units=256, checkpoint_every=5, iterations=20)
    straight = str(tmp_path / "straight")
    train(toy_config(**settings, model_dir=straight))
    with tmpfs(tmp_path / "mnt", "size=200k") as disk:
        model_dir = os.path.join(disk, "run")
        process = tfdp(*args, f"--model_dir={model_dir}")
        assert process.returncode == 1, process.stderr
        [line] = own_stderr_lines(process)
        assert line.startswith(f"tfdp: error: could not write {model_dir}/checkpoints/ckpt-10: ")
        assert "No space left on device" in line and "Traceback" not in process.stderr
        assert sorted(os.listdir(checkpoints(model_dir))) == [
            "checkpoint",
            "ckpt-5.data-00000-of-00001",
            "ckpt-5.index",
        ]
        moved = copy_run(model_dir, tmp_path)  # to a disk with room
    _, lines = train(toy_config(**settings, model_dir=moved))
    assert any("resuming at iteration 5" in line for line in lines)
    assert not any("skipped" in line for line in lines)  # the last good one reads back as it is
    assert_same_run(straight, moved)


@pytest.mark.slow
def test_result_json_goes_to_stdout_and_through_a_symlink(tmp_path):
    args = ["--model=toy", "--logical_cpus=2", "--batch_size=100", "--iterations=2"]
    printed = tfdp(*args, "--progress=never", "--result_json=/dev/stdout")
    assert printed.returncode == 0, printed.stderr
    saved = json.loads(printed.stdout[printed.stdout.index("{\n") :])
    assert saved["iterations"] == 2 and saved["batch_size"] == 100
    assert not os.path.exists("/dev/stdout.tmp") and os.path.islink("/dev/stdout")

    (tmp_path / "results").mkdir()
    os.symlink("results/latest.json", tmp_path / "link.json")
    # the command's main function, in this process (which has its logical CPUs already)
    flags = [a for a in args if not a.startswith("--logical_cpus")] + ["--intra_op_threads=0"]
    assert cli_in_process(*flags, f"--result_json={tmp_path / 'link.json'}") == 0
    assert os.path.islink(tmp_path / "link.json")
    assert json.loads((tmp_path / "results" / "latest.json").read_text())["iterations"] == 2


@pytest.mark.slow
def test_a_chief_that_cannot_write_says_so_in_a_cluster(tmp_path):
    args = [*TOY, "--hidden_units=256", "--checkpoint_every=5", "--iterations=20"]
    with tmpfs(tmp_path / "mnt", "size=200k") as disk:
        model_dir = os.path.join(disk, "run")
        process = launch(*args, f"--model_dir={model_dir}")
        assert process.returncode == 1, process.stderr
        [line] = [line for line in worker_lines(process.stderr, 0) if line.startswith("tfdp: ")]
        assert line.startswith(f"tfdp: error: could not write {model_dir}/checkpoints/ckpt-10: ")
        assert "lost the cluster" not in line
        assert sorted(os.listdir(checkpoints(model_dir))) == [
            "checkpoint",
            "ckpt-5.data-00000-of-00001",
            "ckpt-5.index",
        ]
