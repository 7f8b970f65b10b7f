"""Dependencies run one way — models → core → backends → commands — checked on the import statements
of every module, including imports inside functions (a lazy import is still a dependency)."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# folder → module prefixes its code must never import
FORBIDDEN = {
    "models": ("npumoe.core.runtime", "npumoe.backends", "npumoe.commands", "npumoe.cli", "click"),
    "core": ("npumoe.backends", "npumoe.commands", "npumoe.cli", "click"),
    "luts": ("npumoe.core.runtime", "npumoe.backends", "npumoe.commands", "npumoe.cli", "click"),
    "backends": ("npumoe.commands", "npumoe.cli"),
}


def imported_modules(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module)
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_no_module_imports_a_layer_above_its_own(folder):
    offences = [f"{path.relative_to(ROOT)} imports {module}"
                for path in sorted((ROOT / folder).rglob("*.py"))
                for module in sorted(imported_modules(path))
                if (module + ".").startswith(tuple(prefix + "." for prefix in FORBIDDEN[folder]))]
    assert not offences, "\n".join(offences)


def test_the_check_sees_lazy_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from npumoe.backends.cpu import CpuBackend\n    import click\n")
    assert imported_modules(module) == {"npumoe.backends.cpu", "click"}
