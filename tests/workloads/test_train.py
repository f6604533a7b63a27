"""``blockflow run train``: the real CLI, a real embedded cluster, real files."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from blockflow.cli import cli  # noqa: E402


@pytest.mark.slow
def test_run_train_writes_model_metrics_and_loss_curve(tmp_path):
    out = tmp_path / "train-out"
    result = CliRunner().invoke(
        cli, ["run", "train", "--n-workers", "2", "--epochs", "1", "--output", str(out)],
        env={"DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": ":0"})
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == [
        "loss_curve.csv", "manifest.json", "metrics.json", "model.pt"]
    metrics = json.loads((out / "metrics.json").read_text())
    lines = (out / "loss_curve.csv").read_text().splitlines()
    assert lines[0] == "step,epoch,loss,samples" and len(lines) == metrics["steps"] + 1
    assert metrics["test_auc"] > 0.6  # better than chance from four kinds of feature
    first, last = float(lines[1].split(",")[2]), float(lines[-1].split(",")[2])
    assert last < first
    assert "Held-out accuracy" in result.output
    # no temporary folder left beside the output
    assert [p.name for p in tmp_path.iterdir()] == ["train-out"]


def test_run_train_refuses_an_existing_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(cli, ["run", "train", "--output", str(tmp_path / "mine")])
    assert result.exit_code != 0
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
