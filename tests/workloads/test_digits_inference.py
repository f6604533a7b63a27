"""`blockflow run infer`: the real CLI in a subprocess, its files and numbers."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest

pytest.importorskip("sklearn")


@pytest.mark.slow
def test_run_infer_writes_predictions_and_ships_the_model_once_per_worker(tmp_path):
    out = tmp_path / "infer"
    proc = subprocess.run(
        [sys.executable, "-m", "blockflow", "run", "infer", "--scale", "2", "--blocks", "6",
         "--n-workers", "2", "--output", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "shipped" in proc.stdout and "Held-out accuracy" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workload"] == "infer" and manifest["n_blocks"] == 6
    assert manifest["held_out_accuracy"] > 0.9
    workers = manifest["workers"]
    assert len(workers) == 2
    assert manifest["model_bytes_shipped"] == 2 * manifest["model_bytes"]
    # each block predicted once, plus at most once more where a backup copy of a straggling
    # block finished too (under load; the copy's rows are dropped, never written twice)
    copies = manifest["backup_copies"]
    assert 6 <= sum(w["blocks"] for w in workers.values()) <= 6 + copies
    assert all(w["loads"] <= 1 for w in workers.values())
    frame = pd.read_parquet(out / "predictions.parquet")
    assert len(frame) == manifest["n_rows"] == 2 * 1797
    assert frame["probability"].between(0, 1).all()

    again = subprocess.run(
        [sys.executable, "-m", "blockflow", "run", "infer", "--scale", "1",
         "--n-workers", "1", "--output", str(out), "--no-progress"],
        capture_output=True, text=True, timeout=240)
    assert again.returncode == 1 and "exists" in again.stderr
