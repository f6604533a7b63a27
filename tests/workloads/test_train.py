"""``blockflow run train``: the real CLI, a real embedded cluster, real files."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from blockflow.cli import cli  # noqa: E402


@pytest.fixture(scope="module")
def train_run(tmp_path_factory):
    """One ``blockflow run train`` with the default arguments, in a subprocess whose
    progress bars are on (as on a terminal): the two tests below read its output folder and
    its streams (one job instead of two: the job is a minute of a loaded machine)."""
    import os
    import subprocess
    import sys

    root = tmp_path_factory.mktemp("train")
    out = root / "train-out"
    proc = subprocess.run(
        [sys.executable, "-c", "import sys, blockflow.workloads._runner as r; "
         "r.show_progress = lambda p: True; from blockflow.cli import cli; "
         "cli(sys.argv[1:], prog_name='blockflow')", "run", "train", "--n-workers", "2",
         "--output", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"})
    return root, out, proc


@pytest.mark.slow
def test_run_train_writes_model_metrics_and_loss_curve(train_run):
    root, out, proc = train_run
    assert proc.returncode == 0, proc.stderr[-3000:]
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
            f"{metrics['majority_baseline_accuracy']:.4f})") in proc.stdout
    # no warnings about the cluster's end
    assert "Removing worker" not in proc.stdout + proc.stderr
    # no temporary folder left beside the output
    assert [p.name for p in root.iterdir()] == ["train-out"]


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
def test_run_train_shows_a_bar_for_the_features_and_one_for_the_steps(train_run):
    """Progress like the other jobs: the runner's bars, on stderr when asked."""
    _, out, proc = train_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = json.loads((out / "metrics.json").read_text())["steps"]
    assert "train [1/2] load flights, features" in proc.stderr
    assert "train [2/2] 2 epochs: 100%" in proc.stderr
    assert f"{steps}/{steps}" in proc.stderr
