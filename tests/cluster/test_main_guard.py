"""A script that calls blockflow.connect() without ``if __name__ == "__main__":`` ends within
seconds with one line naming the fix, instead of four bootstrap tracebacks and a hang.

Real scripts in real processes (spawn, distributed's default start method). The bounds are
the subprocess timeouts, stretched by the machine's load (``loadaware.scaled``): generous for
a loaded 2-core machine (each child imports blockflow again before it can notice), and far
below "forever".
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
from loadaware import scaled

from blockflow.cluster.main_guard import MESSAGE

FIX = 'put the code that calls blockflow.connect() under if __name__ == "__main__":'


#: pytest's own bound on each test here: above the load-scaled subprocess bounds (``scaled``
#: stretches up to 10x), so that the scaled bound, which says what was waited for, fails.
pytestmark = pytest.mark.timeout(3600)


def _run_script(tmp_path, source: str, timeout: float = 150) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(source))
    env = {**os.environ, "DASK_BLOCKFLOW__CLUSTER__DASHBOARD_ADDRESS": "127.0.0.1:0"}
    return subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=scaled(timeout), cwd=tmp_path, env=env)


def test_the_message_names_the_fix_in_one_line():
    assert FIX in MESSAGE and "\n" not in MESSAGE


@pytest.mark.slow
def test_script_without_main_guard_ends_with_the_fix(tmp_path):
    proc = _run_script(tmp_path, """
        import blockflow

        client = blockflow.connect(gpu=False, n_workers=2, threads_per_worker=1)
        print("connected")
        client.shutdown()
    """)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out
    assert "connected" not in proc.stdout
    assert proc.stderr.rstrip().splitlines()[-1] == f"RuntimeError: {MESSAGE}"
    # Only Python's short traceback of the parent's call: no multiprocessing bootstrap
    # tracebacks from the workers, no distributed log lines.
    assert "bootstrapping phase" not in out and "distributed.nanny" not in out
    assert len(out.splitlines()) <= 8, out


@pytest.mark.slow
def test_a_child_that_bootstraps_into_connect_says_it_in_one_line(tmp_path):
    """The child's own check, when its parent is not blockflow (a plain multiprocessing
    Process): one line on stderr and exit status 1, no cluster started in the child."""
    proc = _run_script(tmp_path, """
        import multiprocessing

        import blockflow

        if __name__ == "__mp_main__":  # only in the child, while it imports this script
            blockflow.connect(gpu=False, n_workers=1)


        def noop():
            pass


        if __name__ == "__main__":
            child = multiprocessing.get_context("spawn").Process(target=noop)
            child.start()
            child.join(120)
            print("child exit status", child.exitcode)
    """)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "child exit status 1\n"
    assert proc.stderr == MESSAGE + "\n"
