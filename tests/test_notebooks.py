"""The notebooks in notebooks/ run top to bottom within a time bound, show what they promise,
and are committed without outputs."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from loadaware import scaled

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOK_DIR = Path(__file__).resolve().parents[1] / "notebooks"
NOTEBOOKS = ["01-quickstart", "02-etl-flights", "03-xarray", "04-heterogeneous-gpus",
             "05-training-and-tuning", "06-inference-and-model-parallelism",
             "07-pools-and-cost"]

CELL_TIMEOUT = 120  # seconds, per cell (nbclient)
NOTEBOOK_BUDGET = 120  # seconds, per notebook, kernel start included (idle machine; scaled)

# Appended to the in-memory copy of a notebook: report the kernel's interpreter and values
# the notebook computed, as one JSON line.
PROBES = {
    "01-quickstart": "{'makespan': report.makespan,"
                     " 'tasks': sum(report.tasks_per_worker.values())}",
    "02-etl-flights": "{'carriers': len(by_carrier), 'rows': manifest['input_rows']}",
    "03-xarray": "{'corr': float(xr.corr(moments['mean'], wave))}",
    "04-heterogeneous-gpus": (
        "{'plain_makespan': plain['makespan'],"
        " 'plain_oom': int(plain['per_worker'].oom_errors.sum()),"
        " 'plain_failed': plain['failed'],"
        " 'dynamic_makespan': dynamic['makespan'],"
        " 'dynamic_oom': int(dynamic['per_worker'].oom_errors.sum()),"
        " 'dynamic_failed': dynamic['failed'], 'dynamic_correct': dynamic['correct'],"
        " 'dynamic_tasks': list(dynamic['per_worker'].tasks),"
        " 'actions': sorted(set(decisions.action))}"
    ),
    "05-training-and-tuning": (
        "{'accuracy': accuracy, 'max_rel': max_rel, 'glm_rel': glm_rel,"
        " 'tune_best': result.best_score, 'sync_best': sync.best_score,"
        " 'tune_tasks': len(result.history), 'sync_tasks': len(sync.history),"
        " 'statuses': sorted(set(result.trials.status))}"
    ),
    "07-pools-and-cost": (
        "{'result_ok': result_ok, 'sizes': sizes,"
        " 'retired': sorted(scaling[scaling.action == 'retire'].target),"
        " 'where': sorted(set(where.values()))}"
    ),
    "06-inference-and-model-parallelism": (
        "{'agree': agree, 'accuracy': accuracy, 'routed_ok': routed_ok, 'tp_rel': tp_rel,"
        " 'widths': list(tp.widths.values()), 'pipe_rel': pipe_rel,"
        " 'stages': result.n_stages, 'bubble': result.bubble,"
        " 'peaks': result.peak_activations, 'pipe_accuracy': pipe_accuracy}"
    ),
}


def _read(name: str):
    return nbformat.read(NOTEBOOK_DIR / f"{name}.ipynb", as_version=4)


def _outputs(nb) -> list[tuple[str, str]]:
    """(cell source, text of all its outputs) for each code cell."""
    rows = []
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        texts = []
        for out in cell.get("outputs", []):
            if "text" in out:
                texts.append(out["text"])
            for value in out.get("data", {}).values():
                texts.append(value if isinstance(value, str) else json.dumps(value))
        rows.append((cell.source, "\n".join(texts)))
    return rows


def _output_of(nb, startswith: str) -> str:
    return next(text for source, text in _outputs(nb) if source.startswith(startswith))


def test_the_notebooks_are_there():
    assert sorted(p.stem for p in NOTEBOOK_DIR.glob("*.ipynb")) == NOTEBOOKS


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_no_outputs(name):
    nb = _read(name)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and any(c.cell_type == "markdown" for c in nb.cells)
    assert all(c.outputs == [] and c.execution_count is None for c in code), (
        f"{name}.ipynb has outputs; clear them before committing")


@pytest.mark.slow
@pytest.mark.timeout(NOTEBOOK_BUDGET * 6)  # above the load-scaled budget, checked below
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs(name, tmp_path):
    nb = _read(name)
    nb.cells.append(nbformat.v4.new_code_cell(
        f"import json as _json, sys as _sys\n"
        f"print(_json.dumps({{'prefix': _sys.prefix, 'values': {PROBES[name]}}}))"))
    client = nbclient.NotebookClient(
        nb, timeout=CELL_TIMEOUT, kernel_name="python3",
        # The kernel's working directory: nothing the notebook writes lands in the repository.
        resources={"metadata": {"path": str(tmp_path)}},
    )
    kernel_tmp = tmp_path / "tmp"  # the kernel's temporary folder (notebook 02's output)
    kernel_tmp.mkdir()
    # CPU workers even on a GPU machine, so the checks below hold everywhere.
    env = {**os.environ, "TMPDIR": str(kernel_tmp), "DASK_BLOCKFLOW__CLUSTER__GPU": "false"}
    start = time.monotonic()
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    elapsed = time.monotonic() - start
    assert elapsed < scaled(NOTEBOOK_BUDGET), f"{name} took {elapsed:.0f} s"

    probe = json.loads(_outputs(nb)[-1][1].strip().splitlines()[-1])
    # "python3" resolved to this interpreter's environment, not some other Python.
    assert probe["prefix"] == sys.prefix
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "error"]
    assert not errors
    # Nothing on stderr: no warnings, no worker logs in a reader's notebook.
    stderr = [o.text for c in nb.cells if c.cell_type == "code" for o in c.outputs
              if o.output_type == "stream" and o.name == "stderr"]
    assert not stderr, stderr
    assert [p.name for p in tmp_path.iterdir()] == ["tmp"]  # nothing in the working directory
    CHECKS[name](nb, probe["values"])


@pytest.mark.slow
@pytest.mark.timeout(CELL_TIMEOUT + 60)
def test_workload_progress_is_one_labelled_widget_per_stage(tmp_path):
    """In Jupyter a workload shows its progress by default, as an ipywidgets bar named after
    the stage, full at the end, and writes no text lines or escape codes into the cell."""
    pytest.importorskip("ipywidgets")
    label = "array-stats (small) generate, anomalies, moments"
    nb = nbformat.v4.new_notebook(
        metadata={"kernelspec": {"name": "python3", "display_name": "Python 3"}})
    nb.cells = [nbformat.v4.new_code_cell(c) for c in (
        "import blockflow\nfrom blockflow.workloads import array_stats\n"
        "client = blockflow.connect(n_workers=2, threads_per_worker=1, processes=False,\n"
        "                           dashboard_address='127.0.0.1:0')",
        "result = array_stats.run(client)",  # progress: default
        "print(result.n_tasks)",
        "client.shutdown()",
    )]
    nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute(
        env={**os.environ, "DASK_BLOCKFLOW__CLUSTER__GPU": "false"})
    outputs = nb.cells[1].outputs
    streams = [o for c in nb.cells for o in c.outputs if o.output_type == "stream"]
    assert [o.text for o in streams if o.name == "stderr"] == []
    assert not [o.text for o in outputs if o.output_type == "stream"]  # no text bar lines
    assert not any("\x1b" in o.text or "\r" in o.text for o in streams)
    widgets = [o.data["application/vnd.jupyter.widget-view+json"]["model_id"]
               for o in outputs if o.output_type == "display_data"
               and "application/vnd.jupyter.widget-view+json" in o.data]
    assert len(widgets) == 1, outputs
    n_tasks = int(nb.cells[2].outputs[0].text)
    # the widget's saved state: a box holding the stage's label and a full progress bar
    state = nb.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    box = state[widgets[0]]["state"]
    parts = [state[ref.removeprefix("IPY_MODEL_")] for ref in box["children"]]
    texts = " ".join(str(p["state"].get("value", "")) for p in parts
                     if p["model_name"] == "HTMLModel").replace("\u2007", " ")  # tqdm's spaces
    bar = next(p["state"] for p in parts if p["model_name"] == "FloatProgressModel")
    assert label in texts and f"{n_tasks}/{n_tasks}" in texts
    assert bar["value"] == bar["max"] == n_tasks > 0


def _check_quickstart(nb, values):
    assert "<b>blockflow inventory</b>: 2 workers, 2 threads" in _output_of(
        nb, "blockflow.inventory(client)")
    assert "Dashboard: http://" in _output_of(nb, "client = blockflow.connect")
    assert "<b>blockflow run report</b>" in _output_of(nb, "report = blockflow.run_report")
    assert "column sums: largest difference from NumPy" in _output_of(nb, "x_np = x.compute()")
    assert values["tasks"] >= 8 and values["makespan"] > 0  # at least one task per block


def _check_flights(nb, values):
    assert values == {"carriers": 16, "rows": 336_776}
    assert "Hawaiian Airlines Inc." in _output_of(nb, "result.summary()")
    assert "application/vnd.bokehjs_exec.v0+json" in json.dumps(
        [c.outputs for c in nb.cells if c.cell_type == "code" and c.source.startswith("table =")])
    assert "16 carriers x 11 statistics agree with pandas" in _output_of(
        nb, "expected = flights_reference")


def _check_xarray(nb, values):
    assert values["corr"] > 0.8
    assert "largest |difference|" in _output_of(nb, "xr_mean, xr_max, xr_warm")


def _check_heterogeneous(nb, values):
    # blockflow avoids the nearly full device and runs every block, correctly ...
    assert values["dynamic_oom"] == 0 and values["dynamic_failed"] == 0
    assert values["dynamic_correct"] is True
    assert values["dynamic_tasks"][1] == 0
    assert "pause" in values["actions"]
    # ... where plain Dask sends worker 1's blocks into out-of-memory errors,
    assert values["plain_oom"] > 0
    # and it is not slower than plain Dask by more than noise (0.5 s of startup jitter on a
    # busy 2-core machine; it is usually clearly faster).
    assert values["dynamic_makespan"] <= values["plain_makespan"] * 1.1 + 0.5, values


def _check_training(nb, values):
    assert values["accuracy"] >= 0.95 and values["max_rel"] <= 1e-5, values
    assert values["glm_rel"] <= 1e-4, values
    assert "largest relative difference from single-process PyTorch" in _output_of(
        nb, "opt = torch.optim.Adam")
    # ASHA finds a trial at least as good as synchronous SH's best, doing no more than a
    # few speculative tasks beyond SH's 27 + 9 + 3
    assert values["tune_best"] >= values["sync_best"] >= 0.9, values
    assert values["sync_tasks"] == 39 and 39 <= values["tune_tasks"] <= 45, values
    assert values["statuses"] == ["completed", "stopped"], values
    assert "best validation accuracy" in _output_of(nb, "from blockflow.ml.tune import tune")


def _check_parallelism(nb, values):
    assert values["agree"] == 1.0 and values["accuracy"] >= 0.9, values
    assert values["routed_ok"] is True
    assert values["tp_rel"] <= 1e-10 and len(values["widths"]) == 3, values
    assert values["pipe_rel"] <= 1e-10 and values["stages"] == 3, values
    assert 0 < values["bubble"] < 1
    assert values["peaks"] == [3, 2, 1] and values["pipe_accuracy"] >= 0.8, values
    assert "largest relative difference from single-device PyTorch" in _output_of(
        nb, "torch.manual_seed(0)\nmlp")
    assert "application/vnd.bokehjs_exec.v0+json" in json.dumps(
        [c.outputs for c in nb.cells if c.cell_type == "code" and c.source.startswith("show(")])
    assert "pipeline &#x27;digits-convnet&#x27;: 3 stages, 12 micro-batches" in _output_of(
        nb, "report = blockflow.run_report")


def _check_pools(nb, values):
    assert values["result_ok"] is True
    assert values["where"] == ["fast", "slow"]
    # the slow pool shrank by its own idle workers; the fast pool kept its one
    assert values["sizes"] == {"fast": 1, "slow": 0}
    assert values["retired"] == ["slow", "slow"]
    assert "cheapest" in _output_of(nb, "decisions = blockflow.decisions") or \
        "no work left" in _output_of(nb, "decisions = blockflow.decisions")


CHECKS = {
    "01-quickstart": _check_quickstart,
    "02-etl-flights": _check_flights,
    "03-xarray": _check_xarray,
    "04-heterogeneous-gpus": _check_heterogeneous,
    "05-training-and-tuning": _check_training,
    "06-inference-and-model-parallelism": _check_parallelism,
    "07-pools-and-cost": _check_pools,
}
