"""What the scheduler side imports is what ``pip install blockflow`` installs.

The scheduler plugin (:mod:`blockflow.scheduling`) and the pools it plans for
(:mod:`blockflow.pools`: the LP of every objective) run on the scheduler of a base install
(the README's ``pip install .``). Every third-party module they import, at module level or
inside a function, must come from a distribution in pyproject.toml's ``dependencies``;
imports guarded by ``except ImportError`` (optional extras, with a message) are exempt.
"""

from __future__ import annotations

import ast
import importlib.metadata
import pathlib
import re
import sys
import tomllib

REPO = pathlib.Path(__file__).resolve().parent.parent
#: The packages whose code runs on the scheduler of a base install.
SCHEDULER_SIDE = ("blockflow/scheduling", "blockflow/pools")


def base_dependencies() -> set[str]:
    """Normalised distribution names of pyproject.toml's ``[project] dependencies``."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_normalise(re.match(r"[A-Za-z0-9_.\-]+", d).group(0))
            for d in project["dependencies"]}


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _guarded(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> bool:
    """Whether an import sits in a ``try`` that catches ImportError (an optional extra)."""
    while node in parents:
        parent = parents[node]
        if isinstance(parent, ast.Try) and node in parent.body:
            for handler in parent.handlers:
                names = handler.type.elts if isinstance(handler.type, ast.Tuple) \
                    else [handler.type]
                if any(isinstance(n, ast.Name)
                       and n.id in ("ImportError", "ModuleNotFoundError") for n in names):
                    return True
        node = parent
    return False


def third_party_imports(source: str) -> set[str]:
    """Top-level names of the non-stdlib, non-blockflow modules ``source`` imports
    unguarded, anywhere in the file."""
    tree = ast.parse(source)
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        if _guarded(node, parents):
            continue
        for name in names:
            top = name.split(".")[0]
            if top != "blockflow" and top not in sys.stdlib_module_names:
                found.add(top)
    return found


def test_the_import_scan_sees_lazy_imports_and_skips_guarded_ones():
    source = ("import numpy\n"
              "def plan():\n    from scipy.optimize import linprog\n"
              "try:\n    import dask_jobqueue\nexcept ImportError:\n    dask_jobqueue = None\n"
              "import os, blockflow.pools\n")
    assert third_party_imports(source) == {"numpy", "scipy"}


def test_the_scheduler_side_imports_only_base_dependencies():
    # scipy (the LP of every objective) was only in extras: on a base install the plugin
    # logged a "No module named 'scipy'" traceback every tick and run_report raised
    declared = base_dependencies()
    assert "scipy" in declared
    distributions = importlib.metadata.packages_distributions()
    missing = {}
    for folder in SCHEDULER_SIDE:
        for path in sorted((REPO / folder).rglob("*.py")):
            for module in third_party_imports(path.read_text()):
                dists = {_normalise(d) for d in distributions.get(module, [module])}
                if not dists & declared:
                    missing.setdefault(module, []).append(str(path.relative_to(REPO)))
    assert not missing, (f"imported on the scheduler side but not in pyproject.toml's "
                         f"dependencies: {missing}")
