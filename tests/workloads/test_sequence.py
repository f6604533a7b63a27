"""``blockflow run pipeline``: the transformer trained pipeline-parallel on a cluster of worker
processes, its output written atomically."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
from loadaware import scaled

pytest.importorskip("torch")


@pytest.mark.slow
@pytest.mark.timeout(3600)  # above the load-scaled bound below (24 pipeline steps on worker
# processes: minutes on a loaded machine)
def test_run_pipeline_trains_the_transformer_in_stages(tmp_path):
    import torch

    from blockflow.workloads.models import transformer

    out = tmp_path / "pipe"
    proc = subprocess.run(
        [sys.executable, "-m", "blockflow", "run", "pipeline", "--n-train", "800",
         "--epochs", "3", "--n-workers", "3", "--output", str(out)],
        capture_output=True, text=True, timeout=scaled(600))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "a transformer in 3 stages (1f1b)" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workload"] == "pipeline" and len(manifest["stages"]) == 3
    assert manifest["held_out_accuracy"] >= 0.9, manifest
    assert len({s["worker"] for s in manifest["stages"]}) == 3
    history = pd.read_parquet(out / "history.parquet")
    assert len(history) == manifest["steps"] == 24
    model = transformer()
    model.load_state_dict(torch.load(out / "model.pt"))  # the whole model, reassembled


@pytest.mark.slow
def test_run_pipeline_refuses_more_micro_batches_than_rows(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "blockflow", "run", "pipeline", "--batch-size", "4",
         "--micro-batches", "5", "--output", str(tmp_path / "x")],
        capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 2
    assert "5 micro-batches for batches of 4 rows; pass at most --batch-size." in proc.stderr
