"""The README's library example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from loadaware import scaled

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: pytest's own bound on each test here: above the load-scaled subprocess bounds (``scaled``
#: stretches up to 10x), so that the scaled bound, which says what was waited for, fails.
pytestmark = pytest.mark.timeout(3600)


def _python_blocks() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


def test_readme_starts_with_the_two_commands():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    first = re.search(r"```bash\n(.*?)```", text, flags=re.S).group(1).strip().splitlines()
    assert len(first) == 2
    assert "blockflow run flights" in first[0] and "pip install" in first[0]
    assert "pytest" in first[1] and "pip install" in first[1]


@pytest.mark.slow
def test_library_example_runs(tmp_path):
    example = _python_blocks()[0]
    assert "blockflow.connect()" in example and '__name__ == "__main__"' in example
    env = dict(os.environ, DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS=":0",
               DASK_BLOCKFLOW__CLUSTER__N_WORKERS="2")
    script = tmp_path / "example.py"  # as a user runs it: a script, worker processes
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=scaled(240))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "<blockflow.Inventory: 2 workers" in out.stdout
    numbers = re.findall(r"-?\d+\.\d+", out.stdout.splitlines()[-1])
    assert len(numbers) == 5
    assert out.stderr == "", out.stderr[-3000:]  # it ends as quietly as the command line


@pytest.mark.slow
def test_the_pools_guides_run_scope_example_runs(tmp_path):
    """The guide's example of a run (run_scope): two computations, one run, one objective."""
    with open(os.path.join(ROOT, "docs", "guide", "pools.md")) as f:
        text = f.read()
    example = re.search(r"<!-- the block below is run by tests/test_readme.py -->\n"
                        r"```python\n(.*?)```", text, flags=re.S).group(1)
    assert "run_scope(" in example and '__name__ == "__main__"' in example
    env = dict(os.environ, DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS=":0")
    script = tmp_path / "runs.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=scaled(240))
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.fullmatch(r"run 'nightly stats': 2 graphs, \d+ tasks, objective cost",
                        out.stdout.splitlines()[-1]), out.stdout
    assert out.stderr == "", out.stderr[-3000:]


def _docs_pages() -> list[str]:
    docs = os.path.join(ROOT, "docs")
    return sorted(os.path.join(d, f) for d, _, files in os.walk(docs)
                  if "_build" not in d for f in files if f.endswith(".md"))


def test_the_docs_show_the_readme_commands():
    """The site's front page repeats the README's two commands verbatim."""
    def commands(path):
        with open(path) as f:
            return re.search(r"```bash\n(.*?)```", f.read(), flags=re.S).group(1)

    assert commands(os.path.join(ROOT, "docs", "index.md")) == commands(
        os.path.join(ROOT, "README.md"))


def test_the_docs_python_snippets_parse():
    """Every Python block of the user guide is valid Python (the README's example and the
    ready-workloads one also run: above and in tests/workloads/test_progress.py)."""
    pages = _docs_pages()
    assert len(pages) >= 6
    n = 0
    for page in pages:
        with open(page) as f:
            for block in re.findall(r"```python\n(.*?)```", f.read(), flags=re.S):
                compile(block, page, "exec")
                n += 1
    assert n >= 10


@pytest.mark.slow
def test_the_ai_guides_parallelism_example_ends_quietly(tmp_path):
    """The AI guide's pipeline and tensor parallelism example, run as a script that ends
    without client.shutdown(): nothing on stderr. It ended with two warnings listing ~60
    task keys each (and an ERROR "lost scattered data") as the embedded cluster closed."""
    pytest.importorskip("torch")
    with open(os.path.join(ROOT, "docs", "guide", "ai.md")) as f:
        blocks = re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)
    (example,) = [b for b in blocks if "PipelineParallel(" in b and "pipe.close()" in b]
    env = dict(os.environ, DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS=":0",
               DASK_BLOCKFLOW__CLUSTER__N_WORKERS="2")
    script = tmp_path / "parallel.py"
    script.write_text(example)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         cwd=tmp_path, env=env, timeout=scaled(600))
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stderr == "", out.stderr[-3000:]
