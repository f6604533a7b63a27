"""Progress of the ready workloads: one labelled bar per stage, in a real terminal (a
pseudo-terminal around the real CLI) and without blockflow's scheduler plugin.

The notebook side (an ipywidgets bar, no text or escape codes in the cell) is checked in
``tests/test_notebooks.py``.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import pty
import re
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest
from distributed import Client, LocalCluster
from loadaware import scaled

from blockflow.workloads import array_stats
from blockflow.workloads._runner import show_progress

ROOT = Path(__file__).resolve().parents[2]

# A tqdm bar line: "<label>: <percent>%|<bar>| <done>/<total> [...]"
BAR = re.compile(r"(?P<label>[^\r\n]*?):\s+(?P<pct>\d+)%\|[^|]*\|\s*(?P<done>\d+)/(?P<total>\d+)")


#: pytest's own bound on each test here: above the load-scaled subprocess bounds (``scaled``
#: stretches up to 10x), so that the scaled bound, which says what was waited for, fails.
pytestmark = pytest.mark.timeout(3600)


def run_in_terminal(args: list[str], cwd, timeout: float = 240) -> tuple[int, str]:
    """Run ``python -m blockflow <args>`` with stdout and stderr on a pseudo-terminal, as in
    an interactive shell; return its exit status and everything it wrote."""
    env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"}
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 120 columns
    proc = subprocess.Popen([sys.executable, "-m", "blockflow", *args], stdin=child,
                            stdout=child, stderr=child, cwd=cwd, env=env, close_fds=True)
    os.close(child)
    timeout = scaled(timeout)
    out, deadline = b"", time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if ready:
                try:
                    chunk = os.read(main, 65536)
                except OSError:  # the child closed the terminal
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        else:
            proc.kill()
            pytest.fail(f"blockflow {' '.join(args)} still running after {timeout:.0f} s:\n"
                        + out.decode(errors="replace")[-3000:])
        return proc.wait(timeout=30), out.decode(errors="replace")
    finally:
        os.close(main)


def bars(output: str) -> list[dict]:
    """Every drawing of every bar, in order: label, percent, done, total."""
    return [{"label": m["label"].strip(), "pct": int(m["pct"]), "done": int(m["done"]),
             "total": int(m["total"])} for m in BAR.finditer(output)]


def _task_counts(output: str) -> dict[str, int]:
    lines = output.replace("\r", "").splitlines()
    i = lines.index("Tasks per worker (this run):")
    counts = {}
    for line in lines[i + 1:]:
        parts = line.split()
        if len(parts) != 2 or not parts[1].replace(",", "").isdigit():
            break
        counts[parts[0]] = int(parts[1].replace(",", ""))
    return counts


def _check_stages(output: str, labels: list[str], manifest: dict) -> None:
    drawn = bars(output)
    assert drawn, output[-3000:]
    # every bar is labelled, with one of the job's stages, and the stages come in order
    assert [b["label"] for b in drawn if b["label"] not in labels] == []
    order = [b["label"] for b in drawn]
    assert sorted(set(order), key=order.index) == labels
    totals = []
    for label in labels:
        stage = [b for b in drawn if b["label"] == label]
        assert stage[0]["pct"] == 0, stage[:3]  # starts at 0 %, not at earlier stages' work
        assert stage[-1]["pct"] == 100 and stage[-1]["done"] == stage[-1]["total"], stage[-1]
        totals.append(stage[-1]["total"])
    # the stages' tasks add up to the run's: the report, the manifest, the bars agree
    assert sum(totals) == manifest["n_tasks"] == sum(manifest["task_counts"].values())
    assert _task_counts(output) == manifest["task_counts"]


@pytest.mark.slow
def test_array_stats_in_a_terminal_shows_a_labelled_bar(tmp_path):
    rc, output = run_in_terminal(
        ["run", "array-stats", "--output", "out", "--n-workers", "2",
         "--threads-per-worker", "1"], cwd=tmp_path)
    assert rc == 0, output[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    _check_stages(output, ["array-stats (small) generate, anomalies, moments"], manifest)


FLIGHTS_STAGES = ["flights [1/2] load, clean, persist", "flights [2/2] delay statistics"]


@pytest.mark.slow
def test_flights_in_a_terminal_labels_both_stages(tmp_path):
    rc, output = run_in_terminal(
        ["run", "flights", "--output", "out", "--n-workers", "2", "--threads-per-worker", "1"],
        cwd=tmp_path)
    assert rc == 0, output[-3000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    _check_stages(output, FLIGHTS_STAGES, manifest)


@pytest.mark.slow
def test_readme_shows_the_progress_of_a_workload(client, capsys):
    """The clusters guide's ready-workloads section (moved there from the README): its
    workload example runs, and the bars it shows carry the stage labels the job draws
    (checked in a terminal above)."""
    readme = (ROOT / "docs" / "guide" / "clusters.md").read_text()
    example = next(b for b in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
                   if "flights.run(client" in b)
    exec(compile(example, "docs/guide/clusters.md", "exec"), {"client": client})
    assert "Tasks per worker (this run):" in capsys.readouterr().out
    shown = re.search(r"```text\n(flights \[1/2\].*?)```", readme, flags=re.S).group(1)
    assert [b["label"] for b in bars(shown)] == FLIGHTS_STAGES


def test_no_bars_unless_asked_or_on_a_terminal(client, capsys):
    assert show_progress(True) and not show_progress(False)
    assert not show_progress(None)  # pytest captures stderr: not a terminal, not Jupyter
    array_stats.run(client, size="small", progress=False)
    assert capsys.readouterr() == ("", "")


def test_bar_without_blockflow_plugin(capsys):
    """A plain distributed cluster: the bar counts with distributed's own progress feed."""
    with LocalCluster(n_workers=1, threads_per_worker=1, processes=False,
                      dashboard_address=":0", silence_logs=logging.CRITICAL) as cluster, \
            Client(cluster) as c:
        result = array_stats.run(c, size="small", progress=True)
    assert result.task_counts is None and result.n_tasks is None
    drawn = bars(capsys.readouterr().err)
    label = "array-stats (small) generate, anomalies, moments"
    assert drawn and {b["label"] for b in drawn} == {label}
    assert drawn[-1]["pct"] == 100 and drawn[-1]["done"] == drawn[-1]["total"] > 0


@pytest.mark.parametrize("rows, columns", [(0, 120), (0, 0), (40, 0)])
def test_bars_show_in_a_terminal_that_reports_no_size(rows, columns, tmp_path):
    """A pseudo-terminal that reports 0 rows (or 0 columns), as a fresh one does: tqdm drew
    nothing at all with 0 rows."""
    main, child = pty.openpty()
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    code = ("from blockflow.workloads._runner import StepProgress\n"
            "bar = StepProgress('train [2/2] steps', 5)\n"
            "for _ in range(5):\n"
            "    bar.advance(1)\n"
            "bar.finish()\n")
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=child, stdout=child,
                            stderr=child, env=env, close_fds=True)
    os.close(child)
    out = b""
    try:
        while True:
            ready, _, _ = select.select([main], [], [], scaled(60))
            if not ready:
                proc.kill()
                pytest.fail(f"no output for {scaled(60):.0f} s: {out[-3000:]!r}")
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
        assert proc.wait(timeout=scaled(30)) == 0, out[-3000:]
    finally:
        os.close(main)
    drawn = bars(out.decode(errors="replace"))
    assert drawn, out[-3000:]
    assert {b["label"] for b in drawn} == {"train [2/2] steps"}
    assert drawn[-1]["pct"] == 100 and drawn[-1]["done"] == drawn[-1]["total"] == 5
