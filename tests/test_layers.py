"""The package's layers, checked on its source: no module imports a module of a higher layer.

The layer order is the table in ``docs/guide/architecture.md`` (its one source: this test
reads it). Every ``blockflow/**/*.py`` is parsed (AST), imports at module level and inside
functions alike; the package root ``blockflow/__init__.py`` is exempt (it maps public names
to their modules lazily). A test of the test feeds a synthetic package that breaks the rule.
"""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

#: ast.parse of the sources with the collector paused (conftest.gc_paused).
pytestmark = pytest.mark.usefixtures("gc_paused")

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE = "blockflow"
ARCHITECTURE = REPO / "docs" / "guide" / "architecture.md"


def read_layers(text: str) -> dict[str, int]:
    """Module name (``blockflow.x.y``) -> layer, from the rows ``| n | `a`, `b` | ... |``
    between the page's ``<!-- layers`` and ``<!-- end of layers -->`` markers."""
    block = re.search(r"<!-- layers.*?-->(.*?)<!-- end of layers -->", text, flags=re.S)
    assert block, "the layer table's markers are missing from architecture.md"
    layers: dict[str, int] = {}
    for row in re.finditer(r"^\|\s*(\d+)\s*\|([^|]*)\|", block.group(1), flags=re.M):
        for name in re.findall(r"`([\w.]+)`", row.group(2)):
            assert f"{PACKAGE}.{name}" not in layers, f"{name} is in two layers"
            layers[f"{PACKAGE}.{name}"] = int(row.group(1))
    return layers


def module_names(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Every module of the package under ``root`` by dotted name (a package by its own)."""
    found = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def layer_of(module: str, layers: dict[str, int]) -> int | None:
    """The layer of the most specific entry naming ``module`` or a package above it."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in layers:
            return layers[".".join(parts[:n])]
    return None


def _lazy_map(path: pathlib.Path) -> dict[str, str]:
    """A package's ``_LAZY = {"name": "module", ...}`` (public name -> defining module)."""
    for node in ast.parse(path.read_text()).body:
        if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict)
                and any(isinstance(t, ast.Name) and t.id == "_LAZY" for t in node.targets)):
            return ast.literal_eval(node.value)
    return {}


def imported_modules(module: str, path: pathlib.Path,
                     modules: dict[str, pathlib.Path]) -> list[tuple[int, str]]:
    """(line, module) for every blockflow module ``module`` imports, anywhere in its file.

    ``from package import x`` is ``package.x`` when x is a module, the module defining x when
    the package maps x lazily (``_LAZY``), else ``package``. ``import blockflow`` followed by
    ``blockflow.x`` is resolved the same way.
    """
    is_package = path.name == "__init__.py"
    tree = ast.parse(path.read_text(), filename=str(path))

    def resolve(package: str, name: str) -> str:
        if f"{package}.{name}" in modules:
            return f"{package}.{name}"
        if package in modules and modules[package].name == "__init__.py":
            return _lazy_map(modules[package]).get(name, package)
        return package

    found: list[tuple[int, str]] = []
    imports_root = False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == PACKAGE:
                    imports_root = True
                elif alias.name.startswith(PACKAGE + "."):
                    found.append((node.lineno, alias.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's own package upwards
                anchor = module.split(".")[: len(module.split(".")) + is_package - node.level]
                base = ".".join(anchor + ([base] if base else []))
            if base == PACKAGE or base.startswith(PACKAGE + "."):
                found.extend((node.lineno, resolve(base, a.name)) for a in node.names)
    if imports_root:
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == PACKAGE):
                found.append((node.lineno, resolve(PACKAGE, node.attr)))
    return [(line, name) for line, name in found if name != PACKAGE]


def upward_imports(root: pathlib.Path, layers: dict[str, int]) -> list[str]:
    """One line per import of a higher layer's module, ``file:line: a (n) -> b (m)``."""
    modules = module_names(root)
    bad = []
    for module, path in modules.items():
        if module == PACKAGE:
            continue
        own = layer_of(module, layers)
        for line, target in imported_modules(module, path, modules):
            theirs = layer_of(target, layers)
            if own is not None and theirs is not None and theirs > own:
                bad.append(f"{path.relative_to(root)}:{line}: {module} (layer {own}) imports "
                           f"{target} (layer {theirs})")
    return bad


@pytest.fixture(scope="module")
def layers() -> dict[str, int]:
    return read_layers(ARCHITECTURE.read_text())


def test_every_module_has_a_layer(layers):
    modules = module_names(REPO)
    missing = [m for m in modules if m != PACKAGE and layer_of(m, layers) is None]
    assert not missing, f"add these to the layer table of architecture.md: {missing}"
    stale = [m for m in layers if m not in modules]
    assert not stale, f"the layer table names modules that do not exist: {stale}"


def test_no_module_imports_a_higher_layer(layers):
    bad = upward_imports(REPO, layers)
    assert not bad, "imports that run up the layers:\n" + "\n".join(bad)


# -- the test of the test --------------------------------------------------------------------


def _package(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for name, text in {"__init__.py": "", **files}.items():
        path = tmp_path / PACKAGE / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return tmp_path


TABLE = """
<!-- layers -->
| layer | modules | why |
|---|---|---|
| 0 | `errors` | base |
| 1 | `pools` | model |
| 2 | `pools.cluster`, `cli` | top |
<!-- end of layers -->
"""


def test_the_table_is_read_most_specific_first():
    layers = read_layers(TABLE)
    assert layers == {"blockflow.errors": 0, "blockflow.pools": 1,
                      "blockflow.pools.cluster": 2, "blockflow.cli": 2}
    assert layer_of("blockflow.pools.plan", layers) == 1
    assert layer_of("blockflow.pools.cluster", layers) == 2
    assert layer_of("blockflow.pools.cluster.spec", layers) == 2
    assert layer_of("blockflow.other", layers) is None


@pytest.mark.parametrize("importer, line", [
    ("errors.py", "from blockflow.cli import main"),
    ("errors.py", "def f():\n    from blockflow import cli\n"),  # function-local
    ("errors.py", "import blockflow.pools.cluster"),
    ("pools/plan.py", "from .cluster import PoolCluster"),  # relative
    ("pools/plan.py", "from blockflow.pools import PoolCluster"),  # lazily mapped name
    ("errors.py", "import blockflow\n\ndef f():\n    return blockflow.main\n"),
])
def test_an_upward_import_is_flagged(tmp_path, importer, line):
    files = {"errors.py": "", "cli.py": "def main(): pass\n", "pools/__init__.py":
             '_LAZY = {"PoolCluster": "blockflow.pools.cluster"}\n', "pools/plan.py": "",
             "pools/cluster.py": "class PoolCluster: pass\n",
             "__init__.py": '_LAZY = {"main": "blockflow.cli"}\n'}
    files[importer] = line
    bad = upward_imports(_package(tmp_path, files), read_layers(TABLE))
    assert len(bad) == 1 and bad[0].startswith(f"{PACKAGE}/{importer}:"), bad


def test_downward_and_same_layer_imports_pass(tmp_path):
    root = _package(tmp_path, {
        "__init__.py": "from blockflow import cli\n",  # the root is exempt
        "errors.py": "import os\n",
        "pools/__init__.py": "from blockflow.errors import x\n",
        "pools/plan.py": "from blockflow import errors\nfrom . import __name__\n",
        "pools/cluster.py": "from blockflow.pools import plan\nimport blockflow.cli\n",
        "cli.py": "def main():\n    from blockflow.pools.cluster import PoolCluster\n",
    })
    assert upward_imports(root, read_layers(TABLE)) == []
