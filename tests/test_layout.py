"""The package's layout: its modules import one another downward, never in a circle.

Every import of a tfdp module counts, at the top of a file or inside a function (a
lazy import that closes a circle only hides it until the first call).
"""

import ast
import pathlib

import tfdp

PACKAGE = pathlib.Path(tfdp.__file__).parent


def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str, root: pathlib.Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module of the package at `root` -> the package's modules it imports (a
    package's __init__ counts for each module imported from inside it)."""
    graph = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for alias in node.names:
                    whole = f"{node.module}.{alias.name}"
                    targets.add(whole if is_module(whole, root) else node.module)
        inside = {t for t in targets if t == root.name or t.startswith(root.name + ".")}
        with_parents = {
            ".".join(t.split(".")[:i]) for t in inside for i in range(1, t.count(".") + 2)
        }
        graph[name] = {t for t in with_parents if t != name and not name.startswith(t + ".")}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph.get(node, ()):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_modules_import_one_another_without_a_circle():
    graph = imports(PACKAGE)
    assert len(graph) > 30 and "tfdp.data.streams" in graph["tfdp.data.arrays"]  # the graph is read
    assert circles(graph) == []


# What each part must never import: the engine trains whatever drives it; data, the
# cluster and balancing (which the engine holds, and which reads the data and the
# cluster's agreement) serve the engine and the run.
DRIVERS = ("tfdp.run", "tfdp.bench", "tfdp.cli", "tfdp.fitting", "tfdp.cluster.launch")
BELOW = {
    "tfdp.engine": DRIVERS,
    "tfdp.balance": ("tfdp.engine", *DRIVERS),
    "tfdp.data": ("tfdp.engine", "tfdp.balance", *DRIVERS),
    "tfdp.cluster": ("tfdp.engine", "tfdp.balance", "tfdp.data", *DRIVERS),
}


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """The imports of a part of the package (BELOW) that reach a part above it."""
    found = []
    for module, targets in sorted(graph.items()):
        for part, above in BELOW.items():
            if module == part or module.startswith(part + "."):
                found += [
                    f"{module} -> {target}"
                    for target in sorted(targets)
                    if any(target == a or target.startswith(a + ".") for a in above)
                    and target != module
                    and not (part == "tfdp.cluster" and module == "tfdp.cluster.launch")
                ]
    return found


def test_the_engine_imports_neither_the_run_nor_the_commands_nor_the_launcher():
    assert upward_imports(imports(PACKAGE)) == []


def test_an_upward_import_is_found():
    graph = {"tfdp.engine.trainer": {"tfdp.run.checkpoints"}, "tfdp.data.arrays": {"tfdp.cli"}}
    assert upward_imports(graph) == [
        "tfdp.data.arrays -> tfdp.cli",
        "tfdp.engine.trainer -> tfdp.run.checkpoints",
    ]


def test_a_circle_is_found(tmp_path):
    """The check on a package made to hold one: a imports b at the top, b imports a in a
    function; c imports a only."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg import b\n")
    (package / "b.py").write_text("def f():\n    from pkg.a import thing\n")
    (package / "c.py").write_text("import pkg.a\n")
    assert circles(imports(package)) == [["pkg.a", "pkg.b"]]


# What the rest of tfdp may use of a trainer (engine/trainer.py's docstring).
TRAINER_CONTRACT = {
    "distribute", "train_step", "test_step", "close",  # the step
    "model", "split", "balancer", "exchange",  # the objects it holds
    "info", "notes",  # what it says
}


def trainer_uses(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module outside the engine -> the attributes it reads of a trainer (a name, or
    an attribute, called `trainer`)."""
    uses = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if name.startswith(f"{root.name}.engine"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute):
                continue
            holder = node.value
            if (isinstance(holder, ast.Name) and holder.id == "trainer") or (
                isinstance(holder, ast.Attribute) and holder.attr == "trainer"
            ):
                uses.setdefault(name, set()).add(node.attr)
    return uses


def test_the_rest_of_tfdp_uses_a_trainer_through_its_contract_only():
    uses = trainer_uses(PACKAGE)
    assert {"tfdp.run.training", "tfdp.run.hooks.report"} <= set(uses)  # the uses are read
    beyond = {module: sorted(used - TRAINER_CONTRACT) for module, used in uses.items()}
    assert {module: used for module, used in beyond.items() if used} == {}


def test_a_use_beyond_the_contract_is_found(tmp_path):
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f(run, trainer):\n    run.trainer.model\n    trainer.strategy\n")
    assert trainer_uses(package) == {"pkg.a": {"model", "strategy"}}


INTERNAL = ("keras.src", "tensorflow.python")


def a_package(tmp_path, files: dict[str, str]) -> pathlib.Path:
    """A package `pkg` of `files` (name: text), with an empty __init__.py."""
    package = tmp_path / "pkg"
    package.mkdir()
    for name, text in {"__init__.py": "", **files}.items():
        (package / name).parent.mkdir(parents=True, exist_ok=True)
        (package / name).write_text(text)
    return package


def nodes_outside_internals(root: pathlib.Path):
    """(module name, AST node) of every module of the package but its internals.py."""
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if name != f"{root.name}.internals":
            for node in ast.walk(ast.parse(path.read_text())):
                yield name, node


def internal_imports(root: pathlib.Path) -> list[str]:
    """`module: name` for each import of a Keras or TensorFlow internal outside
    tfdp/internals.py, at the top of a file or inside a function."""
    found = []
    for name, node in nodes_outside_internals(root):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        found += [f"{name}: {n}" for n in names if n.startswith(INTERNAL) and n.split(".")[1:2]]
    return found


def test_keras_and_tensorflow_internals_are_imported_in_one_module_only():
    assert internal_imports(PACKAGE) == []


def test_an_internal_import_elsewhere_is_found(tmp_path):
    package = a_package(tmp_path, {
        "internals.py": "from keras.src import tree\n",
        "steps.py": "import keras\n\ndef f():\n    from keras.src.trainers import trainer\n",
    })  # fmt: skip
    assert internal_imports(package) == ["pkg.steps: keras.src.trainers"]


def private_reads(root: pathlib.Path) -> list[str]:
    """`module: attribute` for each getattr/hasattr of another library's private attribute
    (a constant name starting with one underscore, not tfdp's own `_tfdp_...`) outside
    tfdp/internals.py."""
    found = []
    for name, node in nodes_outside_internals(root):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr")
            and len(node.args) >= 2
            and isinstance(node.args[1], ast.Constant)
            and isinstance(node.args[1].value, str)
        ):
            attribute = node.args[1].value
            if attribute.startswith("_") and not attribute.startswith(("__", "_tfdp_")):
                found.append(f"{name}: {attribute}")
    return found


def test_other_libraries_private_attributes_are_read_in_internals_only():
    assert private_reads(PACKAGE) == []


def test_a_private_read_elsewhere_is_found(tmp_path):
    package = a_package(tmp_path, {
        "internals.py": "def f(m):\n    return getattr(m, '_compile_loss')\n",
        "hooks.py": "def f(m):\n    return getattr(m, '_initial_epoch', None), getattr(m, '_tfdp_x', 0)\n",
    })  # fmt: skip
    assert private_reads(package) == ["pkg.hooks: _initial_epoch"]


def private_accesses(root: pathlib.Path) -> list[str]:
    """Ruff's private-member rule (SLF001) over the package at `root`: each access to
    another object's `_member`, dotted reads included, `path:line: member`. A `noqa` for
    it is kept in internals.py, or on tfdp's own `_tfdp_` marks (`noqa_elsewhere`)."""
    import subprocess
    import sys

    ran = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--isolated", "--select", "SLF001",
         "--output-format", "concise", "--no-cache", str(root)],
        capture_output=True, text=True, check=False,
    )
    assert ran.returncode in (0, 1), ran.stderr  # 1: found some
    return [line for line in ran.stdout.splitlines() if "SLF001" in line]


def noqa_elsewhere(root: pathlib.Path) -> list[str]:
    """Lines outside internals.py that silence the private-member rule on something other
    than tfdp's own `_tfdp_` marks."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if path.name == "internals.py" and path.parent == root:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if "noqa: SLF001" in line and "._tfdp_" not in line:
                found.append(f"{path.relative_to(root)}:{number}")
    return found


def test_private_members_are_touched_in_internals_only():
    assert private_accesses(PACKAGE) == []
    assert noqa_elsewhere(PACKAGE) == []


def test_a_private_access_elsewhere_is_found(tmp_path):
    package = a_package(tmp_path, {
        "internals.py": "def f(m):\n    return m._compile_loss  # noqa: SLF001\n",
        "hooks.py": "def f(m):\n    return m.optimizer._iterations\n",
        "marks.py": "def f(d):\n    d._history = 1  # noqa: SLF001\n    d._tfdp_x = 1  # noqa: SLF001\n",
    })  # fmt: skip
    assert [line.split(":")[0].rsplit("/", 1)[-1] for line in private_accesses(package)] == ["hooks.py"]
    assert noqa_elsewhere(package) == ["marks.py:2"]


# What the rest of tfdp may use of a strategy beyond tf.distribute's public API
# (engine/strategy.py's `UnevenShares` docstring).
STRATEGY_CONTRACT = {
    "shares", "set_powers", "measured_speeds", "local_replicas",  # the shares
    "report_seconds", "last_seconds", "sleep_per_example", "set_sleep_per_example",  # timing
    "send_along", "received", "run_unweighed",  # the cluster
    "compiles_with_xla", "batch_statistics", "reduce_to", "notes", "warn_notes",  # how it runs
}
# the strategy's own modules, which may use any of its members
STRATEGYS_OWN = {"strategy", "cluster_strategy", "books", "pieces", "replica", "patches", "whole_batch"}


def strategy_uses(root: pathlib.Path) -> dict[str, set[str]]:
    """Each module but the strategy's own and internals.py -> the attributes it reads of a
    strategy (a name, or an attribute, called `strategy`)."""
    uses = {}
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if path.parent.name == "engine" and path.stem in STRATEGYS_OWN or path.stem == "internals":
            continue  # (internals.py reaches TensorFlow's private members, and only it)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and (
                (isinstance(node.value, ast.Name) and node.value.id == "strategy")
                or (isinstance(node.value, ast.Attribute) and node.value.attr == "strategy")
            ):
                uses.setdefault(name, set()).add(node.attr)
    return uses


def beyond_the_strategy_contract(uses: dict[str, set[str]]) -> dict[str, list[str]]:
    import tensorflow as tf

    public = {name for name in dir(tf.distribute.Strategy) if not name.startswith("_")}
    beyond = {module: sorted(used - public - STRATEGY_CONTRACT) for module, used in uses.items()}
    return {module: used for module, used in beyond.items() if used}


def test_the_rest_of_tfdp_uses_a_strategy_through_tensorflows_api_and_its_contract_only():
    uses = strategy_uses(PACKAGE)
    assert {"tfdp.engine.trainer", "tfdp.engine.multiworker"} <= set(uses)  # the uses are read
    assert beyond_the_strategy_contract(uses) == {}


def test_a_use_beyond_the_strategy_contract_is_found(tmp_path):
    package = a_package(tmp_path, {
        "a.py": "def f(self, strategy):\n    self.strategy.books\n    strategy.run\n    strategy.last_seconds\n",
    })  # fmt: skip
    assert beyond_the_strategy_contract(strategy_uses(package)) == {"pkg.a": ["books"]}


def clock_readers(root: pathlib.Path) -> list[str]:
    """The modules that import the host clock's ops (`engine/clock.py`), but the clock
    itself and bench/ (which times variants of a step of its own)."""
    clock = f"{root.name}.engine.clock"
    return sorted(
        name for name, targets in imports(root).items()
        if clock in targets and name != clock and not name.startswith(f"{root.name}.bench")
    )


def test_one_clock_times_every_step():
    """Every timed step, a probe's too, is timed by the strategy's clock (`StepClock`):
    the host clock's ops are read in books.py only."""
    assert clock_readers(PACKAGE) == ["tfdp.engine.books"]


def test_a_second_clock_is_found(tmp_path):
    package = a_package(tmp_path, {"engine/__init__.py": "", "engine/clock.py": "",
                                   "engine/books.py": "from pkg.engine.clock import read_after\n",
                                   "engine/steps.py": "from pkg.engine import clock\n"})
    assert clock_readers(package) == ["pkg.engine.books", "pkg.engine.steps"]
