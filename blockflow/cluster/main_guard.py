"""A script that calls ``blockflow.connect()`` outside ``if __name__ == "__main__":``.

A spawned child exits (:func:`exit_if_bootstrapping`) and the parent raises :data:`MESSAGE`.
Method: Python's multiprocessing documentation, "Safe importing of main module"."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shutil
import tempfile
from typing import Iterator

__all__ = ["MESSAGE", "children_ran_main", "exit_if_bootstrapping", "watch_children"]

#: The fix, in one line.
MESSAGE = (
    "blockflow.connect: the worker processes import this script again when they start, and "
    "its top-level code calls blockflow.connect() again there, so no worker can start; put "
    "the code that calls blockflow.connect() under if __name__ == \"__main__\": (see \"Safe "
    "importing of main module\" in Python's multiprocessing documentation)."
)

#: Environment variable naming the file a bootstrapping child writes for its parent.
NOTE_VARIABLE = "BLOCKFLOW_BOOTSTRAP_NOTE"


def bootstrapping() -> bool:
    """Whether this process is a multiprocessing child still importing the main module."""
    return bool(getattr(multiprocessing.current_process(), "_inheriting", False))


def exit_if_bootstrapping() -> None:
    """Exit this process if it is a spawned child importing the main script.

    Raises
    ------
    SystemExit
        In such a child (status 1; :data:`MESSAGE` on stderr unless the parent reports it).
    """
    if not bootstrapping():
        return
    note = os.environ.get(NOTE_VARIABLE)
    if note:
        with contextlib.suppress(OSError), open(note, "w") as f:
            f.write(str(os.getpid()))
        raise SystemExit(1)
    raise SystemExit(MESSAGE)


@contextlib.contextmanager
def watch_children() -> Iterator[str]:
    """While the block starts worker processes, let them leave a note if they bootstrap
    into ``connect()``; yields the note's path (see :func:`children_ran_main`)."""
    folder = tempfile.mkdtemp(prefix="blockflow-bootstrap-")
    note = os.path.join(folder, "note")
    old = os.environ.get(NOTE_VARIABLE)
    os.environ[NOTE_VARIABLE] = note  # inherited by the children spawned meanwhile
    try:
        yield note
    finally:
        if old is None:
            os.environ.pop(NOTE_VARIABLE, None)
        else:
            os.environ[NOTE_VARIABLE] = old
        shutil.rmtree(folder, ignore_errors=True)


def children_ran_main(note: str) -> bool:
    """Whether a child left its note: it re-ran the script's call to ``connect()``."""
    return os.path.exists(note)

