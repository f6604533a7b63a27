"""The command line, end to end: click's runner against a real cluster, and real processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import dask
import pandas as pd
import pytest
from click.testing import CliRunner
from loadaware import scaled, wait_until

from blockflow.scheduling.view import workers_info
from blockflow.cli import cli
from blockflow.cluster.connection import gpu_status
from blockflow.workloads.reference import flights_reference

EXISTS = ("Error: Output {path!r} already exists; pass --overwrite (overwrite=True in Python) "
          "to replace it, or choose another output folder.\n")
FOREIGN = ("Error: Output {path!r} exists and is a folder blockflow did not write (no "
           "manifest.json), which blockflow never replaces, even with --overwrite "
           "(overwrite=True): choose another output folder, or move or remove it yourself.\n")
BAD_SCALE = ("Error: flights: scale must be an integer >= 1 (copies of the 336,776-row 2013 NYC "
             "flights table), got {scale}.\n")

#: pytest's own bound on each test here: above every load-scaled subprocess bound below
#: (``scaled`` stretches up to 10x on a loaded machine), so that the scaled bound, which
#: says what was waited for, is the one that fails.
pytestmark = pytest.mark.timeout(3600)


def invoke(*args: str):
    return CliRunner().invoke(cli, list(args), catch_exceptions=False)


def _blockflow(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """``python -m blockflow ARGS`` in a fresh process, dashboard on a free port; ``timeout``
    seconds on an idle machine, stretched by its load."""
    env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"}
    return subprocess.run([sys.executable, "-m", "blockflow", *args], capture_output=True,
                          text=True, timeout=scaled(timeout), env=env)


def _assert_flights_output(out, expected: dict[str, pd.DataFrame]) -> None:
    assert sorted(os.listdir(out)) == ["by_carrier.parquet", "by_origin_month.parquet",
                                       "manifest.json"]
    for name, table in expected.items():
        got = pd.read_parquet(out / f"{name}.parquet")
        pd.testing.assert_frame_equal(got, table, check_dtype=False, check_exact=False,
                                      rtol=1e-9)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["input_rows"] == 336_776 and manifest["clean_rows"] == 328_521


@pytest.fixture(scope="module")
def reference_1():
    return flights_reference(1)


# --- help and bad input (no cluster is started) ----------------------------------------------


JOBS = ["flights", "array-stats", "train", "tune", "infer", "pipeline"]


def test_run_help_lists_every_job():
    result = invoke("run", "--help")
    assert result.exit_code == 0
    commands = result.output.split("Commands:")[1].split()
    assert all(job in commands for job in JOBS)
    assert "(flights, array-stats, train, tune, infer, pipeline)" in result.output


def test_top_level_help_lists_every_job_the_run_group_has():
    from blockflow.cli import run_group

    assert sorted(run_group.commands) == sorted(JOBS)
    result = invoke("--help")
    assert result.exit_code == 0
    jobs = result.output.split("Jobs (blockflow run JOB --help for each):")[1]
    listed = [line.split()[0] for line in jobs.split("Options:")[0].splitlines()
              if line.strip()]
    assert listed == JOBS


def _no_large_files():
    """In the child, before exec: files may not grow past 2 KiB (writes fail with EFBIG,
    "File too large", as on a full disk), the signal that would kill it ignored."""
    import resource
    import signal

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2048, resource.RLIM_INFINITY))


@pytest.mark.slow
@pytest.mark.parametrize("job, args, first", [
    ("flights", ["--scale", "1", "--no-progress"], "by_carrier.parquet"),
    ("train", ["--epochs", "1", "--batch-size", "400000", "--no-progress"], "model.pt"),
    ("tune", ["--configs", "1", "--max-epochs", "1"], "trials.parquet"),
    ("infer", ["--scale", "1", "--blocks", "2", "--no-progress"], "predictions.parquet"),
])
def test_an_output_that_cannot_be_written_is_one_error_line_for_every_job(tmp_path, job,
                                                                          args, first):
    # tune and infer printed a traceback where flights and train printed one line
    pytest.importorskip("torch" if job == "train" else "sklearn")
    out = tmp_path / "out"
    env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0",
           "PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", "blockflow", "run", job, "--n-workers", "1",
                           "--output", str(out), *args], capture_output=True, text=True,
                          timeout=scaled(180), env=env, preexec_fn=_no_large_files)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.splitlines()[-1] == (
        f"Error: Could not write output {str(out)!r}: [Errno 27] File too large (writing "
        f"{first}); nothing was written. Raise the file size limit (ulimit -f) or choose "
        f"another output folder (--output).")
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder


def test_flights_help_lists_options():
    result = invoke("run", "flights", "--help")
    assert result.exit_code == 0
    for option in ("--scale", "--output", "--overwrite", "--address", "--gpu", "--n-workers",
                   "--threads-per-worker", "--policy", "--partitions-per-copy",
                   "--no-progress", "[default: blockflow-flights-out]"):
        assert option in result.output


@pytest.mark.parametrize("scale", ["0", "-3"])
def test_bad_scale_is_a_one_line_error(scale):
    result = invoke("run", "flights", "--scale", scale)
    assert result.exit_code == 2  # a bad option, as click's own checks
    assert result.output == BAD_SCALE.format(scale=scale)


def test_bad_partitions_per_copy():
    result = invoke("run", "flights", "--partitions-per-copy", "0")
    assert result.exit_code == 2
    assert result.output == ("Error: flights: partitions_per_copy must be an integer >= 1 "
                             "(partitions per copy of the table), got 0.\n")


@pytest.mark.parametrize("job", ["flights", "array-stats"])
def test_existing_output_is_a_one_line_error(tmp_path, job):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old result")
    (out / "manifest.json").write_text("{}")  # an earlier blockflow run's
    result = invoke("run", job, "--output", str(out))
    assert result.exit_code == 1
    assert result.output == EXISTS.format(path=str(out))
    assert sorted(os.listdir(out)) == ["manifest.json", "old.txt"]


def test_existing_folder_of_other_data_says_the_real_way_out_first(tmp_path):
    """Not "pass --overwrite", which would then be refused: the same error either way."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "thesis.tex").write_text("years of work")
    for extra in ([], ["--overwrite"]):
        result = invoke("run", "flights", "--output", str(out), *extra)
        assert result.exit_code == 1
        assert result.output == FOREIGN.format(path=str(out))
    assert os.listdir(out) == ["thesis.tex"]


def test_unreachable_address_is_a_one_line_error():
    with dask.config.set({"blockflow.cluster.connect-timeout": "1s"}):
        result = invoke("info", "--address", "tcp://127.0.0.1:1")
    assert result.exit_code == 1
    assert result.output.startswith(
        "Error: blockflow.connect: nothing is listening at 'tcp://127.0.0.1:1' (connection "
        "refused for 1 s). ")
    assert result.output.count("\n") == 1


@pytest.mark.parametrize("command", [["info"], ["run", "flights"], ["run", "array-stats"]])
@pytest.mark.slow
def test_timeout_sets_how_long_a_refused_address_is_retried(command, tmp_path):
    result = invoke(*command, "--address", "tcp://127.0.0.1:1", "--timeout", "1.5s",
                    *(["--output", str(tmp_path / "o")] if command[0] == "run" else []))
    assert result.exit_code == 1
    assert result.output.startswith(
        "Error: blockflow.connect: nothing is listening at 'tcp://127.0.0.1:1' (connection "
        "refused for 1.5 s). ")
    assert "--timeout" in result.output and result.output.count("\n") == 1


def test_bad_timeout_values_are_refused():
    result = invoke("info", "--address", "tcp://127.0.0.1:1", "--timeout", "0")
    assert result.exit_code == 2
    assert "Invalid value for '--timeout': '0' is not a duration above 0" in result.output
    result = invoke("run", "flights", "--timeout", "10")
    assert result.exit_code == 2
    assert result.output == ("Error: --timeout only applies with --address (how long to wait "
                             "for that scheduler); the embedded cluster is started here.\n")


def test_info_without_an_address_starts_no_cluster_and_says_how_to_point_it():
    with dask.config.set({"scheduler-address": None}):
        result = invoke("info")
    assert result.exit_code == 2
    assert result.output == (
        "Error: blockflow info shows a running cluster: point it at one with --address "
        "tcp://host:8786 (or DASK_SCHEDULER_ADDRESS=tcp://host:8786). `blockflow run` starts "
        "an embedded cluster only for the length of its job.\n")
    assert "--gpu" not in invoke("info", "--help").output  # no embedded cluster to size


def test_a_variable_that_looks_like_a_setting_but_is_not_read_is_one_warning_line(monkeypatch):
    from blockflow import config

    monkeypatch.setattr(config, "_warned", set())
    result = CliRunner().invoke(cli, ["info"], env={"DASK_BLOCKFLOW_CLUSTER__POLICY": "off"})
    assert result.output.startswith(
        "Warning: blockflow: the environment variable DASK_BLOCKFLOW_CLUSTER__POLICY='off' is "
        "not read, so it sets nothing (")
    assert result.output.splitlines()[0].endswith(
        "; did you mean DASK_BLOCKFLOW__CLUSTER__POLICY?")


def test_the_exit_statuses_are_those_the_readme_states(tmp_path):
    """The statuses the clusters guide states (moved there from the README)."""
    readme = " ".join(open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir,
                                        "docs", "guide", "clusters.md")).read().split())
    assert "Exit status 2 means a bad option: click's own checks" in readme
    assert "Exit status 1 means the job could not run or failed" in readme
    with dask.config.set({"scheduler-address": None}):
        for args in (["run", "flights", "--bogus"], ["run", "flights", "--n-workers", "0"],
                     ["run", "flights", "--scale", "0"], ["run", "array-stats", "--size", "xl"],
                     ["run", "flights", "--address", "notaurl"], ["info"],
                     ["run", "flights", "--address", "tcp://127.0.0.1:1", "--n-workers", "2"]):
            assert invoke(*args).exit_code == 2, args
    old = tmp_path / "old"
    old.mkdir()
    (old / "manifest.json").write_text("{}")
    for args in (["run", "flights", "--output", str(old)],
                 ["info", "--address", "tcp://127.0.0.1:1", "--timeout", "0.5"]):
        assert invoke(*args).exit_code == 1, args


def test_embedded_cluster_options_with_address_are_refused():
    result = invoke("run", "flights", "--address", "tcp://127.0.0.1:1", "--n-workers", "2")
    assert result.exit_code == 2
    assert result.output == ("Error: --n-workers only applies to the embedded cluster and "
                             "cannot be combined with --address; size the workers of "
                             "tcp://127.0.0.1:1 where they are started.\n")
    result = invoke("run", "array-stats", "--address", "tcp://127.0.0.1:1", "--gpu", "false",
                    "--threads-per-worker", "1")
    assert result.exit_code == 2
    assert result.output.startswith("Error: --gpu, --threads-per-worker only apply to the "
                                    "embedded cluster")


@pytest.mark.skipif(gpu_status()[0], reason="this machine can start GPU workers")
def test_gpu_true_without_gpu_is_a_one_line_error(tmp_path):
    result = invoke("run", "flights", "--gpu", "true", "--output", str(tmp_path / "out"))
    assert result.exit_code == 1
    assert result.output.startswith(
        "Error: blockflow.connect(gpu=True): this machine cannot start GPU workers: ")
    assert result.output.count("\n") == 1
    assert not (tmp_path / "out").exists()


# --- runs against the test cluster (--address) -------------------------------------------------


@pytest.mark.slow
def test_flights_on_a_running_cluster(client, tmp_path, reference_1):
    out = tmp_path / "flights-out"
    address = client.scheduler.address
    result = invoke("run", "flights", "--address", address, "--output", str(out),
                    "--no-progress")
    assert result.exit_code == 0, result.output
    text = result.output
    assert "<blockflow.Inventory: 2 workers, 2 threads, 0 GPUs>" in text
    assert "Delays per carrier (minutes):" in text and "JetBlue Airways" in text
    assert "Tasks per worker (this run):" in text
    assert "Wall time: " in text and " rows/s" in text
    # blockflow's page, at the start and (the cluster keeps running) at the end
    page = client.dashboard_link.rsplit(":", 1)[1].replace("/status", "/blockflow")
    assert text.startswith("Dashboard (while the job runs): http://")
    assert text.splitlines()[0].endswith(f":{page}")
    assert text.splitlines()[-1].endswith(f":{page} (the cluster at {address} keeps running)")
    assert text.count("Dashboard") == 2 and "/status" not in text
    assert f"Output: {out}" in text
    _assert_flights_output(out, reference_1)
    # the manifest's link is the page the command line prints (it was .../status)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["dashboard_link"].endswith(f":{page}")
    # The cluster was not ours to stop.
    assert client.submit(sum, [1, 2]).result() == 3

    again = invoke("run", "flights", "--address", address, "--output", str(out),
                   "--overwrite", "--no-progress")
    assert again.exit_code == 0, again.output
    assert sorted(os.listdir(tmp_path)) == ["flights-out"]


def test_array_stats_on_a_running_cluster(client, tmp_path):
    out = tmp_path / "stats-out"
    result = invoke("run", "array-stats", "--address", client.scheduler.address, "--size",
                    "small", "--output", str(out), "--no-progress")
    assert result.exit_code == 0, result.output
    assert "<blockflow.Inventory: 2 workers" in result.output
    assert "blockflow array-stats: size small" in result.output
    assert "Wall time: " in result.output and "Dashboard: " in result.output
    assert result.output.splitlines()[-1].endswith("keeps running)")
    assert sorted(os.listdir(out)) == ["manifest.json", "stats.parquet"]


def test_info_on_a_running_cluster(client):
    result = invoke("info", "--address", client.scheduler.address)
    assert result.exit_code == 0, result.output
    assert result.output.startswith("<blockflow.Inventory: 2 workers, 2 threads, 0 GPUs>")
    for worker in workers_info(client):
        assert worker in result.output
    assert result.output.splitlines()[-1].endswith("/blockflow")
    with dask.config.set({"scheduler-address": client.scheduler.address}):  # the Dask way
        assert invoke("info").output == result.output


# --- real processes ------------------------------------------------------------------------------


@pytest.mark.slow
def test_python_m_blockflow_runs_flights_end_to_end(tmp_path, reference_1):
    """An embedded LocalCluster started and shut down by the CLI in its own process."""
    out = tmp_path / "flights-out"
    proc = _blockflow("run", "flights", "--scale", "1", "--n-workers", "2",
                      "--threads-per-worker", "1", "--gpu", "false", "--output", str(out))
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout
    assert "<blockflow.Inventory: 2 workers, 2 threads, 0 GPUs>" in text
    assert "tcp://127.0.0.1:" in text
    assert "Delays per carrier (minutes):" in text and "United Air Lines Inc." in text
    assert "Tasks per worker (this run):" in text
    assert "Wall time: " in text and " rows/s" in text
    # The page's URL while the job runs; none at the end, when the cluster is gone.
    assert text.startswith("Dashboard (while the job runs): http://127.0.0.1:")
    assert text.splitlines()[0].endswith("/blockflow") and "/status" not in text
    assert text.splitlines()[-1] == (
        "Dashboard: closed (the embedded cluster has stopped; to keep a dashboard after the "
        "job, run it on a cluster of your own with --address)")
    assert "Traceback" not in proc.stderr
    _assert_flights_output(out, reference_1)
    assert sorted(os.listdir(tmp_path)) == ["flights-out"]  # no temporary folder left


@pytest.mark.slow
def test_python_m_blockflow_bad_input_exits_2_with_one_line(tmp_path):
    proc = _blockflow("run", "flights", "--scale", "0", "--output", str(tmp_path / "o"))
    assert proc.returncode == 2
    assert proc.stderr == BAD_SCALE.format(scale=0)
    assert proc.stdout == ""
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_dask_blockflow_entry_point():
    proc = subprocess.run(
        [sys.executable, "-c", "from dask.cli import run_cli; run_cli()", "blockflow", "run",
         "--help"], capture_output=True, text=True, timeout=scaled(60))
    assert proc.returncode == 0, proc.stderr
    assert "flights" in proc.stdout and "array-stats" in proc.stdout


@pytest.mark.parametrize("address", ["notaurl", "tcp://localhost", "http://127.0.0.1:8786"])
def test_malformed_address_is_one_clear_line(address, tmp_path):
    from click.testing import CliRunner

    from blockflow.cli import cli as blockflow_cli

    result = CliRunner().invoke(blockflow_cli, ["run", "flights", "--address", address,
                                                "--output", str(tmp_path / "out")])
    assert result.exit_code == 2
    assert result.output.strip() == (
        f"Error: --address {address!r} is not a scheduler address; give tcp://host:port "
        f"(or tls://host:port), e.g. tcp://10.0.0.5:8786.")


def test_overwrite_refuses_a_folder_blockflow_did_not_write(tmp_path):
    from click.testing import CliRunner

    from blockflow.cli import cli as blockflow_cli

    (tmp_path / "thesis.tex").write_text("years of work")
    result = CliRunner().invoke(blockflow_cli, ["run", "flights", "--output", str(tmp_path),
                                                "--overwrite"])
    assert result.exit_code == 1
    assert "is a folder blockflow did not write (no manifest.json)" in result.output
    assert (tmp_path / "thesis.tex").read_text() == "years of work"


@pytest.mark.slow
def test_sigterm_mid_run_leaves_no_temporary_folder(tmp_path):
    import signal
    import subprocess
    import sys

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockflow", "run", "flights", "--scale", "20", "--n-workers",
         "2", "--output", str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def started():
        if any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()):
            return True
        assert proc.poll() is None, proc.stdout.read()
        return False

    wait_until(started, timeout=60, interval=0.1,
               message=lambda: f"the temporary output folder; output: {proc.stdout.read()}")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=scaled(60)) == 143
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder
    output = proc.stdout.read()
    # the cluster is stopped on purpose: no warnings about the work its workers take along
    assert "Removing worker" not in output and "lose" not in output, output


@pytest.mark.slow
@pytest.mark.parametrize("after", [0.0, 1.0, 3.0])
def test_ctrl_c_to_the_whole_process_group_prints_one_line(tmp_path, after):
    """As a terminal sends it: SIGINT to blockflow and every worker it started. Workers
    must not print their own KeyboardInterrupt tracebacks."""
    import os
    import signal
    import time

    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockflow", "run", "train", "--n-workers", "2", "--output",
         str(out), "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"})
    first = proc.stdout.readline()  # the dashboard line: the cluster is up
    assert first.startswith("Dashboard (while the job runs):"), first
    time.sleep(after)
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=scaled(120))
    assert proc.returncode == 130, stderr[-3000:]
    assert stderr.splitlines() == [
        f"Interrupted (Ctrl-C): the run was stopped and nothing was written to {str(out)!r}."
    ], stderr[-3000:]
    assert "Traceback" not in stdout
    assert list(tmp_path.iterdir()) == []


def _run_command(tmp_path, body: str):
    """Run ``blockflow boom`` (a command whose body is ``body``) under ``python -m``."""
    import subprocess
    import sys
    import textwrap

    (tmp_path / "interrupted.py").write_text(f"""
import gc, os, signal, sys, time
import blockflow.cli as cli

@cli.cli.command("boom")
def boom():
{textwrap.indent(textwrap.dedent(body), "    ")}

cli.main()
""")
    return subprocess.run([sys.executable, "-m", "interrupted", "boom"], capture_output=True,
                          text=True, timeout=scaled(120), cwd=tmp_path)


def test_an_interrupt_during_a_garbage_collection_callback_is_not_lost(tmp_path):
    # Ctrl-C while the main thread runs a GC callback (distributed's GCDiagnosis): an
    # exception raised there is swallowed by Python ("Exception ignored in ..."), so an
    # interrupt that raised would be lost and the run would go on to exit 0. The CLI's
    # handler raises nothing: the command still ends with its one line and 130, and any
    # other unraisable exception is reported as Python reports it.
    out = _run_command(tmp_path, """
        def callback(phase, info):
            if phase == "start":
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)
        gc.callbacks.append(callback)
        gc.collect()
        gc.callbacks.remove(callback)
        class Odd:
            def __del__(self):
                raise ValueError("someone else's")
        Odd()
        """)
    assert out.returncode == 130, out.stderr
    assert "callback" not in out.stderr, out.stderr  # nothing swallowed, nothing reported
    assert "someone else's" in out.stderr, out.stderr  # anything else still reported
    assert out.stderr.endswith("\nInterrupted (Ctrl-C).\n"), out.stderr


@pytest.mark.parametrize("caught_by", ["blockflow", "the command"])
def test_an_interrupt_during_exec_of_a_string_keeps_the_exit_status(tmp_path, caught_by):
    # Ctrl-C landing while a namedtuple or dataclass is built (exec of a string, as when a
    # job imports PyTorch): a KeyboardInterrupt leaving it is marked "unhandled" by CPython
    # even once caught, and under `python -m` ended the process by SIGINT at exit (status
    # -2, no message). The CLI's handler raises none: a command that would have caught it
    # has nothing to catch, and every command ends with 130 and its one line.
    sigint = 'exec("import os, signal, time; os.kill(os.getpid(), signal.SIGINT); time.sleep(0.1)")'
    body = sigint if caught_by == "blockflow" else f"""
        try:
            {sigint}
        except KeyboardInterrupt:
            print("caught")
        """
    out = _run_command(tmp_path, body)
    assert out.returncode == 130, (out.returncode, out.stderr)
    assert out.stderr == "Interrupted (Ctrl-C).\n", out.stderr
    assert out.stdout == ""


def test_a_second_ctrl_c_ends_a_command_that_has_not_stopped(tmp_path):
    # The first Ctrl-C asks the command to stop (it may still be cleaning up); a second
    # one gets Python's own handling, a KeyboardInterrupt where the command is, and the
    # command still ends with its one line and 130.
    out = _run_command(tmp_path, """
        os.kill(os.getpid(), signal.SIGINT)  # the first: recorded, nothing raised
        time.sleep(0.1)
        print("after the first", flush=True)
        os.kill(os.getpid(), signal.SIGINT)  # the user's second Ctrl-C
        time.sleep(5)
        print("not reached", flush=True)
        """)
    assert out.stdout == "after the first\n", (out.stdout, out.stderr)
    assert out.returncode == 130, out.stderr
    assert out.stderr == "Interrupted (Ctrl-C).\n", out.stderr


#: Each bad combination of --objective, --deadline and --budget, and its one line.
OBJECTIVE_MISUSES = [
    (["--objective", "cost"], "Error: --objective cost needs --deadline (the cheapest run "
                              "that meets it), e.g. --deadline 10m."),
    (["--objective", "makespan", "--deadline", "10m"],
     "Error: --deadline goes with --objective cost (the cheapest run that meets it); for the "
     "fastest run leave --deadline out, or give --budget."),
    (["--objective", "cost", "--deadline", "10m", "--budget", "3"],
     "Error: --budget goes with --objective makespan (the fastest run within it); with "
     "--objective cost give a --deadline only."),
    (["--deadline", "10m", "--budget", "3"],
     "Error: --deadline and --budget ask for two objectives (the cheapest run by a deadline, "
     "the fastest within a budget); give one of them."),
    (["--objective", "cost", "--deadline", "soon"],
     "Error: --deadline 'soon' is not a duration above 0; give seconds or a time with a unit, "
     "e.g. 10m or 90s."),
    (["--objective", "makespan", "--budget", "-3"],
     "Error: --budget '-3' is not a number of dollars above 0; give e.g. --budget 2.5."),
    (["--budget", "inf"],
     "Error: --budget 'inf' is not a number of dollars above 0; give e.g. --budget 2.5."),
]


@pytest.mark.parametrize("job", JOBS)
@pytest.mark.parametrize("args, message", OBJECTIVE_MISUSES)
def test_every_job_refuses_a_bad_objective_in_one_line_before_it_starts(job, args, message,
                                                                        tmp_path):
    # only flights had --objective; its messages named Python's deadline=, budget=
    result = invoke("run", job, *args, "--output", str(tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert result.output == message + "\n"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("job", JOBS)
def test_every_job_that_runs_tasks_takes_an_objective(job):
    result = invoke("run", job, "--help")
    assert result.exit_code == 0
    for option in ("--objective [makespan|cost]", "--deadline DURATION", "--budget DOLLARS"):
        assert option in result.output, (job, option)


# --- first-minute friction -------------------------------------------------------------------

#: Libraries a job imports (seconds on a loaded machine): a bad argument is refused first.
HEAVY = ("distributed", "pandas", "dask.dataframe", "torch", "sklearn")


@pytest.mark.parametrize("args, message", [
    (["run", "flights", "--scale", "0"], BAD_SCALE.format(scale=0).strip()),
    (["run", "flights", "--address", "notaurl"],
     "Error: --address 'notaurl' is not a scheduler address; give tcp://host:port (or "
     "tls://host:port), e.g. tcp://10.0.0.5:8786."),
    (["run", "train", "--address", "tcp://localhost"],
     "Error: --address 'tcp://localhost' is not a scheduler address; give tcp://host:port "
     "(or tls://host:port), e.g. tcp://10.0.0.5:8786."),
    (["run", "pipeline", "--address", "tcp://10.0.0.5:99999"],
     "Error: --address 'tcp://10.0.0.5:99999' has port 99999, outside 1-65535; give the "
     "port the scheduler listens on, e.g. tcp://10.0.0.5:8786."),
    (["run", "tune", "--timeout", "10"],
     "Error: --timeout only applies with --address (how long to wait for that scheduler); "
     "the embedded cluster is started here."),
    (["run", "infer", "--n-workers", "2", "--address", "tcp://127.0.0.1:1"],
     "Error: --n-workers only applies to the embedded cluster and cannot be combined with "
     "--address; size the workers of tcp://127.0.0.1:1 where they are started."),
])
def test_a_bad_argument_is_refused_before_the_heavy_imports(args, message, tmp_path):
    # `--scale 0` and a malformed address were refused only after distributed,
    # dask.dataframe (and PyTorch) were imported: 4-8 s on a loaded machine
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1"}
    proc = subprocess.run([sys.executable, "-m", "blockflow", *args, "--output",
                           str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=scaled(60), env=env)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines()
                if line.startswith("import time:")}
    lines = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert lines == [message] and proc.stdout == ""
    assert not imported & set(HEAVY), sorted(imported & set(HEAVY))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:8786", "tls://[::1]:8786", "host:1",
                                     "inproc://10.0.0.5/1/2"])
def test_a_well_formed_address_passes_the_early_check(address):
    from blockflow.cli.options import _check_address

    _check_address(address)  # no error: connecting is the next step's business


@pytest.mark.parametrize("job", JOBS)
def test_every_job_takes_no_progress(job):
    # tune and pipeline had no --no-progress
    result = invoke("run", job, "--help")
    assert result.exit_code == 0
    assert "--no-progress" in result.output, job


@pytest.mark.slow
def test_a_taken_dashboard_port_is_one_warning_line(tmp_path):
    """Another cluster holds the dashboard's port: one line naming the port taken instead,
    not distributed's three-line UserWarning with its source line."""
    import re
    import socket

    with socket.socket() as held:  # another program's dashboard
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": f"127.0.0.1:{port}"}
        proc = subprocess.run(
            [sys.executable, "-m", "blockflow", "run", "array-stats", "--n-workers", "1",
             "--threads-per-worker", "1", "--no-progress", "--output", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=scaled(120), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = proc.stderr.splitlines()
    taken = re.fullmatch(
        rf"Warning: blockflow.connect: the dashboard's port {port} is taken \(another Dask "
        rf"cluster on this machine\?\), so this cluster's dashboard is on port (\d+) instead; "
        rf"choose one with dashboard_address= \(setting blockflow.cluster.dashboard-address, "
        rf"':0' for any free port\).", line)
    assert taken, line
    assert proc.stdout.splitlines()[0] == (
        f"Dashboard (while the job runs): http://127.0.0.1:{taken[1]}/blockflow")


def test_connect_says_a_taken_dashboard_port_in_one_warning():
    import socket

    import blockflow
    from blockflow.cluster.connection import connect

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.warns(blockflow.BlockflowWarning, match=f"port {port} is taken") as w:
            client = connect(gpu=False, n_workers=1, threads_per_worker=1, processes=False,
                             dashboard_address=f"127.0.0.1:{port}")
        with client:
            assert f":{port}/" not in client.dashboard_link
            client.cluster.close()
    assert [str(x.message) for x in w if "already in use" in str(x.message)] == []
    ours = [x for x in w if issubclass(x.category, blockflow.BlockflowWarning)]
    assert len(ours) == 1 and ours[0].filename == __file__  # the caller's line


@pytest.mark.slow
def test_run_pipeline_counts_its_tasks(tmp_path):
    """The scheduler runs blockflow's plugin: the pipeline's tasks are this run's (it said
    "the scheduler runs no blockflow plugin")."""
    pytest.importorskip("torch")
    out = tmp_path / "out"
    proc = _blockflow("run", "pipeline", "--n-train", "40", "--epochs", "1", "--batch-size",
                      "20", "--micro-batches", "2", "--n-workers", "2",
                      "--threads-per-worker", "1", "--no-progress", "--output", str(out),
                      timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "no blockflow plugin" not in proc.stdout
    assert "Tasks per worker (this run):" in proc.stdout
    manifest = json.loads((out / "manifest.json").read_text())
    assert sum(manifest["task_counts"].values()) > 0
    assert proc.stderr == "", proc.stderr[-3000:]


@pytest.mark.slow
def test_ctrl_c_to_the_process_group_in_the_second_stage_of_flights_prints_one_line(tmp_path):
    """A terminal's Ctrl-C (SIGINT to the whole process group) while `flights` runs its
    second stage: the worker processes, which receive it too, print nothing (a distributed
    worker traceback came before the promised line)."""
    import fcntl
    import pty
    import select
    import signal
    import struct
    import termios

    out = tmp_path / "out"
    main, child = pty.openpty()  # a terminal: the stages' bars say which one runs
    fcntl.ioctl(child, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "blockflow", "run", "flights", "--scale", "4", "--n-workers",
         "2", "--threads-per-worker", "1", "--output", str(out)],
        stdin=child, stdout=child, stderr=child, start_new_session=True, close_fds=True,
        env={**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"})
    os.close(child)
    text, after = b"", None
    try:
        while True:
            ready, _, _ = select.select([main], [], [], scaled(120))
            assert ready, f"no output for {scaled(120):.0f} s: {text[-3000:]!r}"
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the command closed the terminal
                break
            if not chunk:
                break
            text += chunk
            if after is None and b"flights [2/2]" in text:
                os.killpg(proc.pid, signal.SIGINT)
                after = len(text)
        status = proc.wait(timeout=scaled(60))
    finally:
        os.close(main)
        if proc.poll() is None:
            proc.kill()
    assert after is not None, text[-3000:]
    tail = text[after:].decode(errors="replace").replace("\r", "\n")
    lines = [line for line in tail.splitlines()  # less the bars' redrawings
             if line.strip() and not line.startswith("flights [")]
    assert status == 130, tail[-3000:]
    assert lines == [
        f"Interrupted (Ctrl-C): the run was stopped and nothing was written to {str(out)!r}."
    ], tail[-3000:]
    assert list(tmp_path.iterdir()) == []
