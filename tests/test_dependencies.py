"""What the scheduler side imports is what ``pip install blockflow`` installs, and no more.

The scheduler plugin (:mod:`blockflow.scheduling`) and the pools it plans for
(:mod:`blockflow.pools`: the LP of every objective) run on the scheduler of a base install
(the README's ``pip install .``). Every third-party module they import, at module level or
inside a function, must come from a distribution in pyproject.toml's ``dependencies``;
imports guarded by ``except ImportError`` (optional extras, with a message) are exempt.
A scheduler running the plugin loads none of the heavy data, ML and plotting modules
(:data:`HEAVY`): read off its ``sys.modules`` after a first task.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import tomllib

import pytest
from distributed import Client

#: ast.parse of the sources with the collector paused (conftest.gc_paused).
pytestmark = pytest.mark.usefixtures("gc_paused")

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


#: Modules a scheduler running blockflow's plugin must not load: plain Dask's scheduler loads
#: none of them, and each costs tens of MiB and a second of start-up (issue 39: pandas and
#: pyarrow through blockflow.backends took the embedded scheduler from 87 to 190 MiB). scipy
#: loads with the first plan an objective solves; Bokeh with a dashboard.
HEAVY = ("pandas", "pyarrow", "scipy", "torch", "xarray", "sklearn", "matplotlib", "numba",
         "cupy", "cudf", "dask.array", "dask.dataframe", "blockflow.ml", "blockflow.blockwise")


def _heavy(modules, heavy=HEAVY) -> list[str]:
    """The packages of ``heavy`` among ``modules`` (one entry per package)."""
    return sorted({h for m in modules for h in heavy if m == h or m.startswith(h + ".")})


#: An embedded cluster (the scheduler runs in the client's process, which imports only
#: blockflow), one task run, then the scheduler's ``sys.modules`` printed as JSON.
_EMBEDDED = """
import json, sys
import blockflow

def modules(dask_scheduler=None):
    return sorted(sys.modules)

if __name__ == "__main__":
    client = blockflow.connect(n_workers=1, threads_per_worker=1, dashboard_address=":0")
    assert client.submit(sum, [1, 2]).result() == 3
    print(json.dumps(client.run_on_scheduler(modules)))
    client.close()
    client.cluster.close()
"""


@pytest.mark.slow
def test_an_embedded_scheduler_with_the_plugin_imports_no_heavy_module(tmp_path):
    out = subprocess.run([sys.executable, "-c", _EMBEDDED], capture_output=True, text=True,
                         cwd=tmp_path, timeout=240, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    modules = json.loads(out.stdout.strip().splitlines()[-1])
    assert "blockflow.scheduling.plugin" in modules
    assert _heavy(modules) == []


@pytest.mark.slow
def test_a_preloaded_scheduler_without_dashboard_imports_no_heavy_module_nor_bokeh(tmp_path):
    dask_cli = shutil.which("dask", path=os.path.dirname(sys.executable)) or shutil.which("dask")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen(
        [dask_cli, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard",
         "--preload", "blockflow.scheduling.preload"],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    try:
        procs.append(subprocess.Popen(
            [dask_cli, "worker", f"tcp://127.0.0.1:{port}", "--nthreads", "1",
             "--no-dashboard"], cwd=tmp_path, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL))
        with Client(f"tcp://127.0.0.1:{port}", timeout=120) as client:
            client.wait_for_workers(1, timeout=120)
            assert client.submit(sum, [1, 2]).result() == 3
            # a lambda travels by value (this test module does not import over there)
            modules = client.run_on_scheduler(lambda: sorted(sys.modules))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=60)
    assert "blockflow.scheduling.plugin" in modules
    assert _heavy(modules) == []
    assert _heavy(modules, ("bokeh", "distributed.dashboard")) == []
