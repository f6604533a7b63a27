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
        cli, ["run", "train", "--n-workers", "2", "--output", str(out)],
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
    # the default model is worth showing: clearly above the majority class, both printed
    assert metrics["test_accuracy"] > metrics["majority_baseline_accuracy"] + 0.1
    assert (f"Held-out accuracy {metrics['test_accuracy']:.4f} (majority class "
            f"{metrics['majority_baseline_accuracy']:.4f})") in result.output
    assert "Removing worker" not in result.output  # no warnings about the cluster's end
    # no temporary folder left beside the output
    assert [p.name for p in tmp_path.iterdir()] == ["train-out"]


def test_run_train_refuses_an_existing_foreign_folder(tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    result = CliRunner().invoke(cli, ["run", "train", "--output", str(tmp_path / "mine")])
    assert result.exit_code != 0
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"


def test_bad_train_arguments_are_refused_before_any_work(tmp_path):
    from blockflow.workloads import train

    with pytest.raises(ValueError) as e:
        train.run(None, output=str(tmp_path / "o"), holdout=1.0)
    assert str(e.value) == ("train: holdout must be a finite number > 0 and < 1 (fraction "
                            "of flight numbers held out), got 1.0.")
    with pytest.raises(ValueError) as e:
        train.run(None, batch_size=0)
    assert str(e.value) == ("train: batch_size must be an integer >= 1 (samples per step), "
                            "got 0.")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_run_train_shows_a_bar_for_the_features_and_one_for_the_steps(tmp_path):
    """Progress like the other jobs: the runner's bars, on stderr when asked."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", "import sys, blockflow.workloads._runner as r; "
         "r.show_progress = lambda p: True; from blockflow.cli import cli; "
         "cli(sys.argv[1:], prog_name='blockflow')", "run", "train", "--n-workers", "2",
         "--epochs", "1", "--batch-size", "65536", "--output", str(tmp_path / "o")],
        capture_output=True, text=True, timeout=300,
        env={**__import__("os").environ,
             "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "train [1/2] load flights, features" in proc.stderr
    assert "train [2/2] 1 epochs: 100%" in proc.stderr and "5/5" in proc.stderr
