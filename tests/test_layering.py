"""The layers of docs/architecture.md, enforced: every import in the tree (lazy ones inside functions included)
goes from a layer to one it is allowed to use, and no two files import each other in a loop."""

import ast
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]

# package prefix → layer (the longest prefix wins); the order is the one docs/architecture.md draws, bottom first
LAYER_OF = {
    "npumoe.core": "base",  # an empty package
    "npumoe.core.base": "base",
    "npumoe.core.ir": "ir",
    "npumoe.luts": "luts",
    "npumoe.models": "models",
    "npumoe.core.compiler": "compiler",
    "npumoe.core.planning": "planning",
    "npumoe.core.runtime": "runtime",
    "npumoe.backends": "backends",
    "npumoe.core.tools": "tools",
    "npumoe": "cli",  # the facade, the CLI, its commands and benchmarks
}
MAY_IMPORT = {
    "base": set(),
    "ir": {"base"},
    "luts": {"base", "ir"},
    "models": {"base", "ir", "luts"},
    "compiler": {"base", "ir", "luts"},
    "planning": {"base", "ir", "compiler"},
    "runtime": {"base", "ir", "luts", "compiler", "planning"},
    "backends": {"base", "ir", "luts", "models", "compiler", "planning", "runtime"},
    "tools": {"base", "ir", "luts", "models", "compiler", "planning", "runtime"},
    "cli": {"base", "ir", "luts", "models", "compiler", "planning", "runtime", "backends", "tools"},
}
# third-party packages only some layers may use: the CLI's toolkit stays out of the library
THIRD_PARTY = {"click": {"cli", "backends"}}  # a backend brings its own commands (BackendPlugin.commands)


def source_files() -> dict[str, Path]:
    """Every module of the installed package by dotted name, from pyproject's folder mapping."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    folders = config["package-dir"]
    modules = {}
    for package in config["packages"]:
        top = max((p for p in folders if package == p or package.startswith(p + ".")), key=len)
        folder = ROOT / folders[top] / Path(*package[len(top):].strip(".").split(".") if package != top else ())
        for path in folder.glob("*.py"):
            modules[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return modules


MODULES = source_files()


def layer(module: str) -> str:
    return LAYER_OF[max((p for p in LAYER_OF if module == p or module.startswith(p + ".")), key=len)]


def imports(module: str, path: Path) -> set[str]:
    """Every module ``module`` imports, anywhere in its body: npumoe's own resolved to the file that runs."""
    package = module if path.stem == "__init__" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parent + ([node.module] if node.module else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES)
    return found


def own(name: str) -> str | None:
    """The npumoe file an imported name runs (``a.b.c`` → ``a.b`` when c is a name in module a.b)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


GRAPH = {m: {own(n) for n in imports(m, p) if own(n) not in (None, m)} for m, p in MODULES.items()}
EXTERNAL = {m: {n.partition(".")[0] for n in imports(m, p) if own(n) is None} for m, p in MODULES.items()}


def test_every_module_has_a_layer_and_the_tree_is_seen():
    assert {"npumoe.cli", "npumoe.core.runtime.engine", "npumoe.luts.kernels", "npumoe.backends.qualcomm_htp.backend",
            "npumoe.models.loader", "npumoe.core.ir.spec"} <= set(MODULES)
    assert {layer(m) for m in MODULES} == set(MAY_IMPORT)


@pytest.mark.parametrize("name", sorted(MAY_IMPORT))
def test_a_layer_imports_only_the_layers_below_it(name):
    offences = [f"{MODULES[m].relative_to(ROOT)} ({name}) imports {target} ({layer(target)})"
                for m in sorted(MODULES) if layer(m) == name
                for target in sorted(GRAPH[m]) if layer(target) != name and layer(target) not in MAY_IMPORT[name]]
    offences += [f"{MODULES[m].relative_to(ROOT)} ({name}) imports {package}"
                 for m in sorted(MODULES) if layer(m) == name
                 for package in sorted(EXTERNAL[m]) if package in THIRD_PARTY and name not in THIRD_PARTY[package]]
    assert not offences, "\n".join(offences)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph.get(child, ())))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def test_no_files_import_each_other_in_a_loop():
    assert cycles(GRAPH) == []


def test_the_checks_see_lazy_imports_and_loops(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from npumoe.backends.cpu.backend import CpuBackend\n    import click\n")
    assert imports("npumoe.core.x", module) == {"npumoe.backends.cpu.backend", "click"}
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_docs_architecture_states_these_layers():
    """The allow-list here and the table in docs/architecture.md are the same: the doc is the project's record."""
    table = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`npumoe"):
            table[cells[0]] = set() if cells[2].startswith("nothing") or cells[2] == "everything" else {
                c.strip() for c in cells[2].split(",")}
    expected = {name: (set() if name == "cli" else allowed) for name, allowed in MAY_IMPORT.items()}
    assert table == expected
