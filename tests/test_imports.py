"""Imports run one way: the API modules, then autopar.passes, then autopar.cost_model, then the
dependency-free leaves; and no module imports itself back through others (no cycle), whether
the import is at the top of a file or inside a function."""

import ast
import os
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "autopar"

#: Modules that import nothing of autopar's but each other: usable from every layer.
LEAVES = frozenset({"autopar.errors", "autopar._mesh", "autopar._meshspec", "autopar._sizes",
                    "autopar._compat"})
#: Highest first: a module may import its own layer or a lower one.
LAYERS = ("api", "passes", "cost_model", "leaf")


def _modules() -> dict[str, pathlib.Path]:
    found = {}
    for folder, _, files in os.walk(PACKAGE, followlinks=True):  # passes/, cost_model/ are links
        for file in files:
            if file.endswith(".py"):
                found[_name(pathlib.Path(folder, file))] = pathlib.Path(folder, file)
    assert {"autopar.passes.ir", "autopar.cost_model.hardware"} <= set(found)
    return found


def _name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    for layer in ("passes", "cost_model"):
        if module == f"autopar.{layer}" or module.startswith(f"autopar.{layer}."):
            return layer
    return "api"


def _imports(name: str, path: pathlib.Path, modules) -> set[str]:
    """Every autopar module ``name`` imports, at any depth of the file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            # `import autopar.passes.ir` imports autopar.passes too; name the deepest module.
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                found.add(target)
    return found


def _graph():
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_imports_run_one_way():
    wrong = [f"{a} ({_layer(a)}) imports {b} ({_layer(b)})"
             for a, targets in sorted(_graph().items()) for b in sorted(targets)
             if LAYERS.index(_layer(b)) < LAYERS.index(_layer(a))]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = _graph()
    cycles = []
    state: dict[str, int] = {}   # 1: on the current path, 2: done

    def visit(module, path):
        state[module] = 1
        for target in sorted(graph.get(module, ())):
            # A package's __init__ re-exporting its children is not a cycle of theirs.
            if target.startswith(module + "."):
                continue
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
    assert not cycles, "\n".join(cycles)


def test_the_check_sees_a_wrong_way_import_and_a_cycle(tmp_path):
    """The checker itself: an upward import and a two-module cycle are found."""
    modules = {"autopar.cost_model.a": tmp_path / "a.py", "autopar.passes.b": tmp_path / "b.py"}
    modules["autopar.cost_model.a"].write_text("def f():\n    from autopar.passes import b\n")
    modules["autopar.passes.b"].write_text("from autopar.cost_model.a import f\n")
    edges = {n: _imports(n, p, modules) for n, p in modules.items()}
    assert edges["autopar.cost_model.a"] == {"autopar.passes.b"}
    assert LAYERS.index(_layer("autopar.passes.b")) < LAYERS.index(_layer("autopar.cost_model.a"))
    assert "autopar.cost_model.a" in edges["autopar.passes.b"]
