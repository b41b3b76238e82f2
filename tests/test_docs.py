"""The docs cannot drift from the code.

Every fenced shell command of README.md and docs/*.md that runs `tfdp`,
`tfdp-launch`, `tfdp-bench` or `python -m tfdp...` (in ```sh blocks; in
```console blocks, the lines after a `$ ` prompt, the lines below being its
output) is checked:

- every `--flag` it uses is one its module defines (absl's FLAGS of
  tfdp.cli, tfdp.bench.table, tfdp.bench.steps or tfdp.bench.memory; tfdp.cluster.launch's own flags
  plus tfdp's, which it passes on);
- the quick ones are run from the repository root, as CI runs the tests
  (`.ci/run`), with `--model_dir` and `--result_json` moved into a
  temporary directory: they must exit 0, print the workload partition and
  batch line the docs show (where the split is not measured), or print the
  documented error line with exit 2.

Quick means the toy model, or LeNet (or a named model) for at most 100
iterations at a batch of at most 1024. Only the flag check, by
`why_flags_only`, for: `tfdp-bench` and `python -m tfdp.bench...` runs
(minutes to hours of interleaved rounds), epochs of MNIST, GPU devices,
real-host `TF_CONFIG` clusters, data directories that do not exist here, and
shell loops with `$variables`.

Also: every title cited as (BUILD_NOTES, "...") in tfdp/ and tests/ is a heading of
BUILD_NOTES.md; every test the README's promises table names exists; and
`tfdp --help` leads with the flags a first run needs.
"""

import glob
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))
)
SHELL_LANGUAGES = {"sh", "bash", "shell"}
MNIST_AS_DOCUMENTED = "../shared/data/mnist"  # relative to the repository root, as in the README
QUICK_ITERATIONS, QUICK_BATCH = 100, 1024
SEPARATORS = {"&&", "||", "|", ";"}

# The module whose flags each command takes; tfdp-launch also passes tfdp's flags on.
MODULES = {
    "tfdp": "tfdp.cli",
    "tfdp-bench": "tfdp.bench.table",
    "tfdp-launch": "tfdp.cluster.launch",
    "tfdp.bench": "tfdp.bench.table",
}


def blocks(path):
    """(language, text) of each fenced block of a Markdown file."""
    with open(os.path.join(ROOT, path)) as f:
        text = f.read()
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.MULTILINE | re.DOTALL)


def commands_of(segment):
    """The tfdp commands in one shell line: each as its argument list (env assignments dropped)."""
    try:
        tokens = shlex.split(segment, comments=True)
    except ValueError:
        return []
    found, current = [], []
    for token in tokens + [";"]:
        if token in SEPARATORS:
            while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                current.pop(0)
            if current and current[0] == "srun":  # srun [its options] COMMAND
                current.pop(0)
                while current and current[0].startswith("-"):
                    current.pop(0)
            if current and program(current):
                found.append(current)
            current = []
        else:
            current.append(token)
    return found


def program(args):
    """`tfdp`, `tfdp-bench`, `tfdp-launch`, or the module of `python -m tfdp...`; else None."""
    if args[0] in ("tfdp", "tfdp-bench", "tfdp-launch"):
        return args[0]
    python = len(args) >= 3 and re.match(r"python3?$", args[0]) and args[1] == "-m"
    if python and (args[2] == "tfdp" or args[2].startswith("tfdp.")):
        return {"tfdp": "tfdp", "tfdp.cluster.launch": "tfdp-launch"}.get(args[2], args[2])
    return None


def documented_commands():
    """(doc, command args, expected output lines or None) for every command of the docs."""
    found = []
    for doc in DOC_FILES:
        for language, text in blocks(doc):
            text = re.sub(r"\\\n\s*", " ", text)  # continuation lines
            if language in SHELL_LANGUAGES:
                for line in text.splitlines():
                    if line.strip() and not line.strip().startswith("#"):
                        found += [(doc, args, None) for args in commands_of(line.strip())]
            elif language == "console":
                lines = text.splitlines()
                for i, line in enumerate(lines):
                    if line.startswith("$ "):
                        output = []
                        for later in lines[i + 1 :]:
                            if later.startswith("$ "):
                                break
                            output.append(later)
                        found += [(doc, args, output) for args in commands_of(line[2:])]
    unique, seen = [], set()
    for doc, args, output in found:
        key = " ".join(args)
        if key not in seen:
            seen.add(key)
            unique.append((doc, args, output))
    return unique


COMMANDS = documented_commands()


def ids(commands):
    return [" ".join(args)[:90] for _, args, _ in commands]


def flag_value(args, name):
    for arg in args:
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
    return None


def why_flags_only(args):
    """Why a documented command is only flag-checked, or None when it is run."""
    text = " ".join(args)
    name = program(args)
    if "$" in text:
        return "a shell loop's line"
    if name not in ("tfdp", "tfdp-launch"):
        return "a benchmark: minutes to hours"
    if "gpu" in (flag_value(args, "devices") or "").lower():
        return "needs a GPU"
    if name == "tfdp" and flag_value(args, "mode") == "multiworker":
        return "needs a TF_CONFIG cluster of real hosts"
    mnist = flag_value(args, "mnist_dir")
    if mnist and not os.path.isdir(os.path.join(ROOT, mnist)):
        return f"--mnist_dir={mnist} is not on this machine"
    if flag_value(args, "epochs") is not None:
        return "whole epochs: minutes"
    model = flag_value(args, "model") or "lenet"
    if model != "toy":
        iterations = int(flag_value(args, "iterations") or 50)
        batch = int(flag_value(args, "batch_size") or 1024)
        if iterations > QUICK_ITERATIONS or batch > QUICK_BATCH:
            return "too long to run in the tests"
    return None


@pytest.fixture(scope="session")
def module_flags():
    """{module: the flag names it takes}, read in fresh processes (the modules share absl's FLAGS)."""
    script = r"""
import importlib, json, re, sys
from absl import flags
name = sys.argv[1]
module = importlib.import_module(name)
getattr(module, "define_flags", lambda: None)()  # the bench commands define theirs when run
if name == "tfdp.cluster.launch":
    own = re.findall(r"--(\w+)", module.USAGE)
    importlib.import_module("tfdp.cli")
    names = own + [f.name for f in flags.FLAGS.get_flags_for_module("tfdp.cli")]
else:
    names = [f.name for f in flags.FLAGS.get_flags_for_module(name)]
booleans = [n for n in names if n in flags.FLAGS and flags.FLAGS[n].boolean]
absl = [n for n, f in flags.FLAGS.flags_by_module_dict().items() if n.startswith("absl")]
absl = [f.name for m in absl for f in flags.FLAGS.get_flags_for_module(m)]
print(json.dumps({"names": names + absl + ["flagfile"], "booleans": booleans}))
"""
    found = {}
    for module in sorted(
        set(MODULES.values()) | {"tfdp.bench.steps", "tfdp.bench.memory", "tfdp.bench.strategy"}
    ):
        process = subprocess.run(
            [sys.executable, "-c", script, module],
            capture_output=True,
            check=False,
            text=True,
            cwd=ROOT,
            env=environment(),
            timeout=120,
        )
        assert process.returncode == 0, process.stderr
        found[module] = json.loads(process.stdout.splitlines()[-1])
    return found


def environment():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2")
    env.pop("TFDP_MNIST_DIR", None)  # every documented command names its data
    return env


def test_the_docs_have_commands_to_check():
    assert len(COMMANDS) >= 20, ids(COMMANDS)
    assert any(why_flags_only(args) is None for _, args, _ in COMMANDS)


@pytest.mark.parametrize("doc,args,output", COMMANDS, ids=ids(COMMANDS))
def test_every_documented_flag_exists(doc, args, output, module_flags):
    name = program(args)
    module = MODULES.get(name, name)
    known = module_flags[module]
    for arg in args:
        if not arg.startswith("--"):
            continue
        flag = arg[2:].split("=", 1)[0]
        negated = flag.startswith("no") and flag[2:] in known["booleans"]
        assert flag in known["names"] or negated, (
            f"{doc}: {' '.join(args)}: --{flag} is not a flag of {module}"
        )


RUNNABLE = [command for command in COMMANDS if why_flags_only(command[1]) is None]


def relocated(args, tmp_path):
    """The command as a subprocess argument list, its outputs moved into tmp_path."""
    out = []
    for arg in args:
        for flag in ("model_dir", "result_json"):
            if arg.startswith(f"--{flag}="):
                arg = f"--{flag}={tmp_path / os.path.basename(arg.split('=', 1)[1])}"
        out.append(arg)
    name = program(args)
    head = 3 if args[0].startswith("python") else 1
    module = {"tfdp": "tfdp", "tfdp-launch": "tfdp.cluster.launch"}[name]
    return [sys.executable, "-m", module, *out[head:]]


@pytest.mark.slow
@pytest.mark.parametrize("doc,args,output", RUNNABLE, ids=ids(RUNNABLE))
def test_quick_documented_commands_run(doc, args, output, tmp_path):
    if flag_value(args, "mnist_dir") == MNIST_AS_DOCUMENTED:
        assert os.path.isdir(os.path.join(ROOT, MNIST_AS_DOCUMENTED)), "MNIST beside the clone"
    process = subprocess.run(
        relocated(args, tmp_path),
        capture_output=True,
        check=False,
        text=True,
        cwd=ROOT,
        env=environment(),
        timeout=600,
    )
    errors = [line for line in output or [] if re.match(r"tfdp(-launch)?: error: ", line)]
    if errors:
        assert process.returncode == 2, process.stderr[-2000:]
        assert errors[0] in process.stderr.splitlines(), process.stderr[-2000:]
        return
    assert process.returncode == 0, f"{doc}: {' '.join(args)}\n{process.stderr[-3000:]}"
    measured = "auto" in (flag_value(args, "powers") or "") or flag_value(args, "rebalance_every")
    if output and not measured:
        shown = [
            line
            for line in output
            if re.sub(r"^\[worker \d+\] ", "", line).startswith(
                ("workload partition", "global batch")
            )
        ]
        assert shown, output
        for line in shown:
            assert line in process.stdout.splitlines(), f"{doc}: {line!r} not in\n{process.stdout}"


def headings(path):
    with open(os.path.join(ROOT, path)) as f:
        return [line.lstrip("#").strip() for line in f if re.match(r"#{2,3} ", line)]


def test_build_notes_titles_cited_in_the_code_and_docs_are_headings():
    cited = []
    for path in (
        glob.glob(os.path.join(ROOT, "tfdp", "**", "*.py"), recursive=True)
        + glob.glob(os.path.join(ROOT, "tests", "*.py"))
        + glob.glob(os.path.join(ROOT, "docs", "*.md"))
        + [os.path.join(ROOT, "README.md")]
    ):
        with open(path) as f:
            text = re.sub(r"\s*\n\s*(#\s*)?", " ", f.read())
        if os.path.abspath(path) != os.path.abspath(__file__):
            cited += [(path, title) for title in re.findall(r'BUILD_NOTES[,:] "([^"]+)"', text)]
    assert cited
    titles = headings("BUILD_NOTES.md")
    for path, title in cited:
        assert any(heading.startswith(title) for heading in titles), (path, title)


def test_the_promised_tests_exist():
    with open(os.path.join(ROOT, "README.md")) as f:
        rows = [line for line in f if line.startswith("| ") and "test_" in line]
    assert len(rows) >= 10
    for row in rows:
        file = None
        for token in re.findall(r"`([^`]+)`", row):
            match = re.match(r"(test_\w+\.py)?(?:::(\w+))?$", token)
            if not match:
                continue
            file = match.group(1) or file
            with open(os.path.join(ROOT, "tests", file)) as f:
                source = f.read()
            if match.group(2):
                assert f"def {match.group(2)}(" in source, (file, match.group(2))


def test_help_leads_with_what_a_first_run_needs():
    process = subprocess.run(
        [sys.executable, "-m", "tfdp", "--help"],
        capture_output=True,
        check=False,
        text=True,
        cwd=ROOT,
        env=environment(),
        timeout=120,
    )
    assert process.returncode == 0, process.stderr
    listed = re.findall(r"^  --(?:\[no\])?(\w+):", process.stdout, flags=re.MULTILINE)
    assert listed[:4] == ["mode", "devices", "powers", "batch_size"], listed
    assert len(listed) == len(set(listed)) >= 30, listed
    for name in ("tfdp.bench", "tfdp.cluster.launch"):
        process = subprocess.run(
            [sys.executable, "-m", name, "--help"],
            capture_output=True,
            check=False,
            text=True,
            cwd=ROOT,
            env=environment(),
            timeout=120,
        )
        assert process.returncode == 0 and "--" in process.stdout, (name, process.stderr)
        assert ("--rounds" if name == "tfdp.bench" else "--workers=N") in process.stdout, name
