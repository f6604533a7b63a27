"""Invalid settings, unwritable outputs, Ctrl-C and bad addresses: one clear line each.

Settings are checked where they are used, never when blockflow is imported: a library user
gets a ``ValueError`` from ``config.validate()`` / ``blockflow.connect()``; the command line
prints ``Error: ...`` and exits with status 2 before any cluster starts. The checks cover
durations, sizes, sections replaced by a non-mapping (even before import), misspelled keys,
the rules between settings and policy names from the policy registry. Importing blockflow
never exits and never loads ``jsonschema`` (neither in the client nor in workers). Output
folders that cannot be written fail with one line naming the folder, the OS error, that
nothing was written, and the fix. Everything runs in real processes: ``python -c "import
blockflow"``, ``python -m blockflow``, the ``blockflow`` script and ``python -m dask
blockflow``; full file systems are real OS errors (``/dev/full``, ``ulimit -f``).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import dask
import pandas as pd
import psutil
import pytest
import yaml
from distributed import LocalCluster
from loadaware import scaled, wait_until

import blockflow
from blockflow import config
from blockflow.io import OutputWriteError, atomic_output_dir, check_output_dir, write_parquet

SCHEMA = config.SCHEMA_PATH
SEE = f"See {SCHEMA} for the allowed values."
DURATION = "give a number of seconds or a time with a unit, e.g. '100ms', '30s' or '1h'"
REBALANCER_KEYS = ("interval, decision-log-size, memory-high, memory-low, hot-high, hot-low, "
                   "move-budget, move-min-gain")
MEMORY_WHY = "a worker paused at memory-high is resumed once at or below memory-low (hysteresis)"
POLICY = (f"Invalid blockflow setting 'blockflow.cluster.policy' (from the environment "
          f"variable DASK_BLOCKFLOW__CLUSTER__POLICY='fastest'): 'fastest' is not one of "
          f"['dynamic', 'memory', 'static-round-robin', 'static-capacity', 'off']. {SEE}")
NONSENSE = POLICY.replace("fastest", "nonsense")


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DASK_BLOCKFLOW")}
    env["DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS"] = "127.0.0.1:0"
    env.update({f"DASK_BLOCKFLOW__{k}": v for k, v in settings.items()})
    return env


def _python(*args: str, env: dict[str, str] | None = None, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                          timeout=timeout, env=env or _env(), **kwargs)


# Import, then check: the import itself prints nothing and never fails on a bad setting.
VALIDATE = "import blockflow; print('imported'); blockflow.config.validate()"


def _refused(out: subprocess.CompletedProcess) -> str:
    """The ``ValueError`` line of a ``VALIDATE`` process, once it is clear the import passed."""
    assert out.returncode == 1
    assert out.stdout == "imported\n", out.stderr
    return out.stderr.strip().splitlines()[-1]


def _invalid(key: str, env: str | None, raw: str | None, text: str) -> str:
    source = f" (from the environment variable {env}={raw!r})" if env else ""
    return f"Invalid blockflow setting {key!r}{source}: {text}. {SEE}"


# --- settings: checked by validate(), never at import; every message names key, value, ------
# --- source, rule, schema --------------------------------------------------------------------

IMPORT_CASES = [
    pytest.param("REBALANCER__INTERVAL", "-5", "blockflow.rebalancer.interval",
                 f"-5 is not a duration of 0 or more; {DURATION}", id="negative-interval"),
    pytest.param("REBALANCER__INTERVAL", "abc", "blockflow.rebalancer.interval",
                 f"'abc' is not a duration of 0 or more; {DURATION}", id="unparseable-interval"),
    pytest.param("REBALANCER__MOVE_MIN_GAIN", "5 parsecs", "blockflow.rebalancer.move-min-gain",
                 f"'5 parsecs' is not a duration of 0 or more; {DURATION}", id="bad-unit"),
    pytest.param("CLUSTER__WORKER_LOSS_TIMEOUT", "-1s", "blockflow.cluster.worker-loss-timeout",
                 f"'-1s' is not a duration of 0 or more; {DURATION}", id="negative-timeout"),
    pytest.param("CLUSTER__CONNECT_TIMEOUT", "0", "blockflow.cluster.connect-timeout",
                 f"0 is not a duration above 0; {DURATION}", id="zero-connect-timeout"),
    pytest.param("REDUCTION__DEFAULT_WORKER_MEMORY", "lots",
                 "blockflow.reduction.default-worker-memory",
                 "'lots' is not a size above 0; give a number of bytes or a size with a unit, "
                 "e.g. '128MiB' or '4GB'", id="unparseable-size"),
    pytest.param("CLUSTER__GPU", "maybe", "blockflow.cluster.gpu",
                 "'maybe' is not one of true, false, 'auto'", id="gpu-choice"),
    pytest.param("REBALANCER", "5", "blockflow.rebalancer",
                 f"5 is not a mapping: 'blockflow.rebalancer' is a section of settings "
                 f"({REBALANCER_KEYS}); set them one at a time, e.g. "
                 f"DASK_BLOCKFLOW__REBALANCER__INTERVAL", id="section-replaced"),
    pytest.param("REBALANCER__TYPO", "1", "blockflow.rebalancer.typo",
                 f"1 is set for an unknown key; 'blockflow.rebalancer' has the keys "
                 f"{REBALANCER_KEYS}", id="unknown-key"),
    pytest.param("REBALANCER__MEMORY_LO", "0.9", "blockflow.rebalancer.memory-lo",
                 f"0.9 is set for an unknown key (did you mean 'memory-low'?); "
                 f"'blockflow.rebalancer' has the keys {REBALANCER_KEYS}", id="misspelled-key"),
    pytest.param("REBALANCER__MEMORY_LOW", "0.99", "blockflow.rebalancer.memory-low",
                 f"0.99 must be below 'blockflow.rebalancer.memory-high' (0.85, the default); "
                 f"{MEMORY_WHY}", id="memory-low-above-high"),
    pytest.param("REBALANCER__MEMORY_HIGH", "0.5", "blockflow.rebalancer.memory-high",
                 f"0.5 must be above 'blockflow.rebalancer.memory-low' (0.7, the default); "
                 f"{MEMORY_WHY}", id="memory-high-below-low"),
    pytest.param("REBALANCER__HOT_LOW", "80", "blockflow.rebalancer.hot-low",
                 "80 must be below 'blockflow.rebalancer.hot-high' (80, the default); a worker "
                 "paused at hot-high is resumed once at or below hot-low (hysteresis)",
                 id="hot-low-equal-to-high"),
    pytest.param("REDUCTION__MIN_SPLIT_EVERY", "40", "blockflow.reduction.min-split-every",
                 "40 must be at most 'blockflow.reduction.max-split-every' (32, the default); "
                 "they bound the automatic fan-in of tree reductions", id="min-above-max"),
]


@pytest.mark.parametrize("name, raw, key, text", IMPORT_CASES)
@pytest.mark.slow
def test_invalid_environment_setting_is_refused_by_validate_not_at_import(name, raw, key, text):
    out = _python("-c", VALIDATE, env=_env(**{name: raw}))
    assert _refused(out) == "ValueError: " + _invalid(
        key, f"DASK_BLOCKFLOW__{name}", raw, text)


@pytest.mark.slow
def test_both_sides_of_a_rule_from_the_environment_are_named():
    out = _python("-c", VALIDATE, env=_env(REBALANCER__MEMORY_LOW="0.9",
                                           REBALANCER__MEMORY_HIGH="0.8"))
    assert _refused(out) == "ValueError: " + _invalid(
        "blockflow.rebalancer.memory-low", "DASK_BLOCKFLOW__REBALANCER__MEMORY_LOW", "0.9",
        f"0.9 must be below 'blockflow.rebalancer.memory-high' (0.8, from the environment "
        f"variable DASK_BLOCKFLOW__REBALANCER__MEMORY_HIGH='0.8'); {MEMORY_WHY}")


@pytest.mark.slow
def test_a_misspelled_section_names_the_variable_that_set_it():
    out = _python("-c", VALIDATE, env=_env(CLUSTR__GPU="false"))
    assert _refused(out) == "ValueError: " + _invalid(
        "blockflow.clustr", "DASK_BLOCKFLOW__CLUSTR__GPU", "false",
        "{'gpu': False} is set for an unknown key (did you mean 'cluster'?); 'blockflow' has "
        f"the keys {', '.join(_sections())}")


def _sections() -> list[str]:
    """blockflow's settings sections, in the order of its YAML of defaults."""
    path = Path(blockflow.__file__).with_name("blockflow.yaml")
    return list(yaml.safe_load(path.read_text())["blockflow"])


@pytest.mark.slow
def test_a_dask_config_file_is_named_as_the_source(tmp_path):
    (tmp_path / "blockflow.yaml").write_text("blockflow:\n  rebalancer:\n    interval: soon\n")
    env = _env()
    env["DASK_CONFIG"] = str(tmp_path)
    out = _python("-c", VALIDATE, env=env)
    assert _refused(out) == (
        f"ValueError: Invalid blockflow setting 'blockflow.rebalancer.interval' (from the Dask "
        f"config file {tmp_path / 'blockflow.yaml'}): 'soon' is not a duration of 0 or more; "
        f"{DURATION}. {SEE}")


@pytest.mark.slow
def test_edge_values_that_make_sense_are_accepted():
    settings = {"REBALANCER__INTERVAL": "0", "CLUSTER__WORKER_LOSS_TIMEOUT": "0",
                "REBALANCER__MEMORY_LOW": "0.5", "REBALANCER__MEMORY_HIGH": "0.6",
                "REDUCTION__MIN_SPLIT_EVERY": "32", "REBALANCER__MOVE_MIN_GAIN": "2 minutes"}
    keys = ["rebalancer.interval", "cluster.worker-loss-timeout", "rebalancer.memory-low",
            "rebalancer.memory-high", "reduction.min-split-every", "rebalancer.move-min-gain"]
    out = _python("-c", "import blockflow, dask; blockflow.config.validate(); "
                        "print([dask.config.get('blockflow.' + k) "
                        f"for k in {keys!r}])", env=_env(**settings))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[0, 0, 0.5, 0.6, 32, '2 minutes']"


@pytest.mark.parametrize("settings, message", [
    pytest.param({"blockflow.rebalancer.memory-low": 0.99}, _invalid(
        "blockflow.rebalancer.memory-low", None, None,
        f"0.99 must be below 'blockflow.rebalancer.memory-high' (0.85, the default); "
        f"{MEMORY_WHY}"), id="memory-low"),
    pytest.param({"blockflow.rebalancer": 5}, _invalid(
        "blockflow.rebalancer", None, None,
        f"5 is not a mapping: 'blockflow.rebalancer' is a section of settings "
        f"({REBALANCER_KEYS}); set them one at a time, e.g. "
        f"DASK_BLOCKFLOW__REBALANCER__INTERVAL"), id="section"),
    pytest.param({"blockflow.rebalancer.interval": "-5"}, _invalid(
        "blockflow.rebalancer.interval", None, None,
        f"'-5' is not a duration of 0 or more; {DURATION}"), id="interval"),
])
def test_settings_changed_after_import_are_refused_by_connect(settings, message):
    """dask.config.set after import: connect() refuses before any cluster or scheduler-side
    plugin starts (no scheduler traceback)."""
    start = time.monotonic()
    with dask.config.set(settings), pytest.raises(ValueError) as info:
        blockflow.connect(dashboard_address=":0")
    assert str(info.value) == message
    assert time.monotonic() - start < scaled(5)


# --- the command line: an invalid setting is one line and exit status 2 ---------------------


def _script(name: str) -> str:
    path = Path(sys.executable).parent / name
    if not path.exists():
        pytest.skip(f"no {name} script next to {sys.executable}")
    return str(path)


def _prefix(command: str) -> list[str]:
    return {"python -m blockflow": [sys.executable, "-m", "blockflow"],
            "blockflow": [_script("blockflow")],
            "python -m dask blockflow": [sys.executable, "-m", "dask", "blockflow"]}[command]


@pytest.mark.parametrize("command", ["python -m blockflow", "blockflow",
                                     "python -m dask blockflow"])
@pytest.mark.slow
def test_invalid_setting_is_one_line_and_exit_2_on_the_command_line(command, tmp_path):
    out = subprocess.run([*_prefix(command), "run", "flights", "--output", str(tmp_path / "x")],
                         capture_output=True, text=True, timeout=120,
                         env=_env(CLUSTER__POLICY="fastest"))
    assert out.returncode == 2
    assert out.stderr == f"Error: {POLICY}\n"
    assert out.stdout == ""
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["python -m blockflow", "blockflow",
                                     "python -m dask blockflow"])
@pytest.mark.slow
def test_unknown_policy_from_the_environment_stops_the_cli_before_any_cluster(command,
                                                                             tmp_path):
    out = subprocess.run([*_prefix(command), "run", "flights", "--scale", "1", "--output",
                          str(tmp_path / "x")], capture_output=True, text=True, timeout=120,
                         env=_env(CLUSTER__POLICY="nonsense"))
    assert out.returncode == 2
    assert out.stderr == f"Error: {NONSENSE}\n"
    assert "cluster.policy" in out.stderr and "DASK_BLOCKFLOW__CLUSTER__POLICY" in out.stderr
    assert out.stdout == ""  # no inventory, no dashboard line: no cluster was started
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args", [["info"], ["run", "array-stats", "--output", "x"],
                                  ["info", "--address", "tcp://127.0.0.1:1"]],
                         ids=["info", "array-stats", "info-address"])
@pytest.mark.slow
def test_every_command_checks_the_settings_first(args, tmp_path):
    out = _python("-m", "blockflow", *args, env=_env(CLUSTER__POLICY="nonsense"), cwd=tmp_path)
    assert (out.returncode, out.stdout, out.stderr) == (2, "", f"Error: {NONSENSE}\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_help_works_whatever_the_settings():
    out = _python("-m", "blockflow", "--help", env=_env(CLUSTER__POLICY="nonsense"))
    assert out.returncode == 0 and out.stdout.startswith("Usage: blockflow"), out.stderr


@pytest.mark.slow
def test_importing_blockflow_never_fails_exits_or_prints_on_a_bad_setting():
    for settings in ({"CLUSTER__POLICY": "nonsense"}, {"REBALANCER": "5"},
                     {"REBALANCER__INTERVAL": "-5"}):
        out = _python("-c", "import blockflow", env=_env(**settings))
        assert (out.returncode, out.stdout, out.stderr) == (0, "", ""), settings


@pytest.mark.slow
def test_importing_blockflow_does_not_load_jsonschema():
    out = _python("-c", "import blockflow, sys; assert 'jsonschema' not in sys.modules",
                  env=_env(CLUSTER__POLICY="nonsense"))
    assert (out.returncode, out.stderr) == (0, "")


@pytest.mark.slow
def test_library_user_gets_the_error_from_connect_not_from_import():
    """Same message as the command line's, as a ``ValueError`` raised by ``connect()``."""
    code = ("import blockflow\n"
            "print('imported')\n"
            "try:\n"
            "    blockflow.connect(dashboard_address=':0')\n"
            "except ValueError as e:\n"
            "    print('ValueError:', e)\n")
    for value, message in (("fastest", POLICY), ("nonsense", NONSENSE)):
        out = _python("-c", code, env=_env(CLUSTER__POLICY=value))
        assert out.returncode == 0, out.stderr
        assert out.stdout.splitlines() == ["imported", f"ValueError: {message}"]


@pytest.mark.slow
def test_worker_processes_never_load_jsonschema():
    """Workers import blockflow to unpickle its tasks: that import loads no validator."""
    import dask.array as da

    with LocalCluster(n_workers=1, threads_per_worker=1, processes=True,
                      dashboard_address=":0") as cluster, cluster.get_client() as client:
        x = blockflow.map_blocks(lambda b: b + 1, da.ones(8, chunks=4))
        assert client.compute(x.sum()).result() == 16
        assert set(client.run(lambda: "blockflow" in sys.modules).values()) == {True}
        assert set(client.run(lambda: "jsonschema" in sys.modules).values()) == {False}


# --- the command line: addresses ------------------------------------------------------------


@pytest.mark.parametrize("port", ["99999", "0", "65536"])
@pytest.mark.slow
def test_address_port_out_of_range_is_refused_at_once(port):
    address = f"tcp://127.0.0.1:{port}"
    start = time.monotonic()
    out = _python("-m", "blockflow", "info", "--address", address, "--timeout", "60")
    assert out.returncode == 2  # a bad option
    assert out.stderr == (f"Error: --address {address!r} has port {int(port)}, outside "
                          f"1-65535; give the port the scheduler listens on, e.g. "
                          f"tcp://10.0.0.5:8786.\n")
    assert time.monotonic() - start < 50  # never waits for the 60 s connect timeout


# --- output folders that cannot be written --------------------------------------------------


def test_write_parquet_on_a_full_device_names_the_file_and_the_error():
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with pytest.raises(OutputWriteError) as info:
        write_parquet(pd.DataFrame({"a": range(100_000)}), "/dev/full")
    assert str(info.value) == "Could not write '/dev/full': [Errno 28] No space left on device."
    assert info.value.errno == 28 and isinstance(info.value, OSError)


def test_no_space_inside_an_atomic_output_leaves_nothing(tmp_path):
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    out = tmp_path / "out"
    with pytest.raises(OutputWriteError) as info:
        with atomic_output_dir(out) as tmp:
            (tmp / "part.txt").write_text("partial")
            with open("/dev/full", "w") as full:  # the OS says: no space left on device
                full.write("x" * 100_000)
                full.flush()
    assert str(info.value) == (
        f"Could not write output {str(out)!r}: [Errno 28] No space left on device (while "
        f"writing); nothing was written. Free space on that file system or choose another "
        f"output folder (--output).")
    assert list(tmp_path.iterdir()) == []


def _proc_refuses_folders() -> bool:
    return sys.platform.startswith("linux") and os.access("/proc", os.W_OK | os.X_OK)


@pytest.mark.skipif(not _proc_refuses_folders(),
                    reason="/proc is not writable by permission here (refused up front anyway)")
@pytest.mark.slow
def test_output_folder_that_refuses_new_folders_is_refused_before_the_cluster_starts():
    message = ("Could not write output '/proc/blockflow-out': [Errno 2] No such file or "
               "directory (creating a folder in '/proc'); nothing was written. Choose another "
               "output folder (--output).")
    with pytest.raises(OutputWriteError) as info:
        check_output_dir("/proc/blockflow-out")
    assert str(info.value) == message
    out = _python("-m", "blockflow", "run", "flights", "--output", "/proc/blockflow-out")
    assert out.returncode == 1
    assert out.stderr == f"Error: {message}\n"
    assert out.stdout == ""  # no dashboard line: no cluster was started


@pytest.fixture(scope="module")
def tcp_cluster():
    """A scheduler the CLI processes can reach over TCP (workers in this process)."""
    with LocalCluster(n_workers=1, threads_per_worker=2, processes=False, protocol="tcp://",
                      host="127.0.0.1", dashboard_address=":0") as cluster:
        yield cluster


def _limit_file_size() -> None:
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))


@pytest.mark.slow
def test_output_too_large_for_the_file_system_is_one_line_and_leaves_nothing(tmp_path,
                                                                            tcp_cluster):
    """``ulimit -f 4`` makes the OS refuse the Parquet files (EFBIG), as a full disk would."""
    out = tmp_path / "out"
    proc = _python("-m", "blockflow", "run", "flights", "--address",
                   tcp_cluster.scheduler_address, "--output", str(out), "--no-progress",
                   preexec_fn=_limit_file_size)
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr == (
        f"Error: Could not write output {str(out)!r}: [Errno 27] File too large (writing "
        f"by_carrier.parquet); nothing was written. Raise the file size limit (ulimit -f) or "
        f"choose another output folder (--output).\n")
    assert "Traceback" not in proc.stdout
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder


# --- Ctrl-C -----------------------------------------------------------------------------------


def _as_from_a_terminal() -> None:
    """In the child before exec: SIGINT unblocked and at its default disposition, as a shell
    starts a command. A child inherits an ignored or blocked SIGINT from the process that
    starts it, and Python then keeps ignoring it; the test must not depend on what earlier
    tests in this pytest process did to its signals (the full suite's CI run saw the CLI
    finish its run, exit 0, after the signal)."""
    signal.pthread_sigmask(signal.SIG_SETMASK, set())
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.slow
def test_ctrl_c_mid_run_exits_130_with_one_line_and_leaves_nothing(tmp_path):
    """SIGINT to the whole process group, as a terminal sends Ctrl-C: the CLI shuts its
    cluster down, removes the temporary folder and says so; the workers print nothing."""
    out = tmp_path / "out"
    proc = subprocess.Popen(
        # scale 32: long enough (tens of seconds) that the run is still computing when the
        # signal comes, on an idle machine too
        [sys.executable, "-m", "blockflow", "run", "flights", "--scale", "32", "--n-workers",
         "2", "--threads-per-worker", "1", "--gpu", "false", "--output", str(out),
         "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(),
        start_new_session=True, preexec_fn=_as_from_a_terminal)
    try:

        def started():
            if any(p.name.startswith(".out.tmp-") for p in tmp_path.iterdir()):
                return True
            assert proc.poll() is None, proc.communicate()
            return False

        wait_until(started, timeout=120, interval=0.1,
                   message=lambda: f"the temporary output folder; {proc.communicate()}")
        children = psutil.Process(proc.pid).children(recursive=True)
        assert children  # the embedded cluster's nannies and workers
        time.sleep(1.5)  # mid-computation: workers hold results
        assert proc.poll() is None
        os.killpg(proc.pid, signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, stderr
    assert stderr.splitlines()[-1] == (
        f"Interrupted (Ctrl-C): the run was stopped and nothing was written to {str(out)!r}.")
    assert "Traceback" not in stderr and "Aborted!" not in stderr
    assert "Removing worker" not in stderr  # distributed's shutdown warnings are quiet
    assert list(tmp_path.iterdir()) == []  # no output, no temporary folder
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert alive == []
