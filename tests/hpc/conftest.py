"""A real one-node Slurm (two partitions) for the HPC tests: one per test session.

Started by :func:`blockflow.testing.slurm.local_slurm` (munged, slurmctld, slurmd, no
systemd); the tests that use it skip, with the reason, where Slurm is not installed or cannot
start (``.ci/run`` installs Debian's ``slurm-wlm`` and ``munge``).
"""

from __future__ import annotations

import pytest

from blockflow.testing.slurm import SlurmUnavailable, local_slurm


@pytest.fixture(scope="session")
def slurm():
    """A running Slurm with partitions ``fast`` (default) and ``slow``; ``SLURM_CONF`` is
    set in this process while it runs."""
    pytest.importorskip("dask_jobqueue", reason="pip install dask-jobqueue")
    try:
        # its own temporary folder (not pytest's, which a concurrent session may prune)
        with local_slurm(("fast", "slow")) as s:
            yield s
    except SlurmUnavailable as e:
        pytest.skip(f"no local Slurm: {e}")
