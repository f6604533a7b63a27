"""Atomic output: results are written to a hidden sibling folder and renamed into place.

A failed run leaves an existing output untouched; a write the file system refuses raises
:class:`OutputWriteError` naming the output and the fix. Guide: docs/guide/reliability.md.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno as _errno
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np
import pandas as pd

__all__ = [
    "MANIFEST_NAME",
    "OutputWriteError",
    "atomic_output_dir",
    "check_output_dir",
    "write_bytes",
    "write_manifest",
    "write_outputs",
    "write_parquet",
    "write_tables",
]

logger = logging.getLogger(__name__)

#: File name of the run metadata written next to the tables.
MANIFEST_NAME = "manifest.json"

# OS errors that can only mean "this file system refuses the write", whoever raised them.
_WRITE_ERRNOS = {getattr(_errno, name) for name in ("ENOSPC", "EDQUOT", "EFBIG", "EROFS")
                 if hasattr(_errno, name)}
_NO_SPACE = {getattr(_errno, name) for name in ("ENOSPC", "EDQUOT") if hasattr(_errno, name)}


class OutputWriteError(OSError):
    """Results could not be written: the file system refused (no space, read-only, ...).

    ``errno`` and ``filename`` are the OS error's; ``output`` is the output folder, or None
    for a single file's write.
    """

    output: str | None = None

    def __str__(self) -> str:  # the message, not OSError's "[Errno n] strerror: filename"
        return str(self.args[0]) if self.args else super().__str__()


def _os_error_text(e: OSError) -> str:
    """``[Errno 28] No space left on device``, without the file name and library details."""
    if e.errno:
        return f"[Errno {e.errno}] {os.strerror(e.errno)}"
    return str(e)


def _file_error(path: Path, e: OSError) -> OutputWriteError:
    error = OutputWriteError(f"Could not write {os.fspath(path)!r}: {_os_error_text(e)}.")
    error.errno, error.filename = e.errno, os.fspath(path)
    return error


def _output_error(target: Path, e: OSError, doing: str) -> OutputWriteError:
    """The one-line error of a failed output: folder, OS error, nothing written, the fix."""
    if e.errno in _NO_SPACE:
        fix = "free space on that file system or choose another output folder (--output)"
    elif e.errno == _errno.EFBIG:
        fix = ("raise the file size limit (ulimit -f) or choose another output folder "
               "(--output)")
    else:
        fix = "choose another output folder (--output)"
    kept = (", and the existing output there is untouched"
            if target.exists() or target.is_symlink() else "")
    error = OutputWriteError(
        f"Could not write output {os.fspath(target)!r}: {_os_error_text(e)} ({doing}); "
        f"nothing was written{kept}. {fix[0].upper()}{fix[1:]}."
    )
    error.errno, error.filename = e.errno, getattr(e, "filename", None)
    error.output = os.fspath(target)
    return error


def check_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Path:
    """Check that ``path`` may be written as an output folder; return it as an absolute path.

    Parameters
    ----------
    path : str or path-like
        The output folder.
    overwrite : bool, default False
        Whether an existing ``path`` may be replaced.

    Returns
    -------
    pathlib.Path
        ``path`` made absolute (not resolved through symlinks).

    Raises
    ------
    FileExistsError
        If ``path`` exists and is not a folder blockflow wrote, or exists and ``overwrite``
        is False.
    PermissionError
        If the folder that would hold ``path`` is not writable.
    OutputWriteError
        If that folder refuses a new folder all the same (e.g. ``/proc``).
    """
    target = Path(os.path.abspath(os.fspath(path)))
    exists = target.exists() or target.is_symlink()
    if exists and not _is_replaceable_output(target):
        # Checked first: --overwrite would be refused too, so don't suggest it.
        if target.is_symlink() or not target.is_dir():
            what = "a link" if target.is_symlink() else "a file"
        else:
            what = f"a folder blockflow did not write (no {MANIFEST_NAME})"
        raise FileExistsError(
            f"Output {os.fspath(target)!r} exists and is {what}, which blockflow never "
            f"replaces, even with --overwrite (overwrite=True): choose another output folder, "
            f"or move or remove it yourself."
        )
    if exists and not overwrite:
        raise FileExistsError(
            f"Output {os.fspath(target)!r} already exists; pass --overwrite "
            f"(overwrite=True in Python) to replace it, or choose another output folder."
        )
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest folder that exists: parents get created there
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"Output {os.fspath(target)!r} cannot be written: {os.fspath(parent)!r} is not "
            f"writable; choose another output folder."
        )
    probe = parent / f".{target.name}.probe-{uuid.uuid4().hex}"
    try:
        probe.mkdir()
    except OSError as e:
        raise _output_error(target, e, f"creating a folder in {os.fspath(parent)!r}") from e
    probe.rmdir()
    return target


def _is_replaceable_output(path: Path) -> bool:
    """An existing output may be replaced if blockflow wrote it, or if it is an empty folder."""
    if path.is_symlink() or not path.is_dir():
        return False
    return (path / MANIFEST_NAME).is_file() or not any(path.iterdir())


def _remove(path: Path) -> None:
    """Delete a folder tree, a file or a link; missing paths are fine."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Write an output folder atomically: yield a temporary sibling, rename it on success.

    The temporary folder is ``<parent>/.<name>.tmp-<uuid4 hex>``, renamed atomically on
    POSIX file systems; on an exception it is deleted and ``path`` left untouched.

    Parameters
    ----------
    path : str or path-like
        The output folder to create or replace; missing parents are created.
    overwrite : bool, default False
        Replace an existing ``path``.

    Yields
    ------
    pathlib.Path
        The empty temporary folder; writers given a path inside it return the final path.

    Raises
    ------
    FileExistsError
        If ``path`` exists and ``overwrite`` is False.
    OutputWriteError
        If the temporary folder cannot be created or renamed, or a write inside fails for
        a file-system reason (no space, quota, read-only).

    Examples
    --------
    >>> import os, tempfile
    >>> out = os.path.join(tempfile.mkdtemp(), "result")
    >>> with atomic_output_dir(out) as tmp:
    ...     _ = (tmp / "hello.txt").write_text("hi")
    >>> os.listdir(out)
    ['hello.txt']
    """
    target = check_output_dir(path, overwrite)
    token = uuid.uuid4().hex
    tmp = target.parent / f".{target.name}.tmp-{token}"
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    except OSError as e:
        raise _output_error(target, e, f"creating {os.fspath(tmp)!r}") from e
    _PENDING[tmp] = target
    try:
        yield tmp
        _commit(tmp, target, overwrite, token)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OutputWriteError) and e.output is None and e.filename is not None:
            raise _output_error(target, e, f"writing {Path(e.filename).name}") from e
        if isinstance(e, OSError) and e.errno in _WRITE_ERRNOS:
            raise _output_error(target, e, "while writing") from e
        raise
    finally:
        _PENDING.pop(tmp, None)


# Temporary folders of the atomic_output_dir blocks now open, and the outputs they become.
_PENDING: dict[Path, Path] = {}


def _final_path(path: Path) -> Path:
    """Where ``path`` will be once its atomic output is committed."""
    absolute = Path(os.path.abspath(os.fspath(path)))
    for tmp, target in list(_PENDING.items()):
        if absolute == tmp or tmp in absolute.parents:
            return target / absolute.relative_to(tmp)
    return path


def _commit(tmp: Path, target: Path, overwrite: bool, token: str) -> None:
    if not (target.exists() or target.is_symlink()):
        try:
            os.rename(tmp, target)
        except OSError as e:
            raise _output_error(target, e, f"renaming {os.fspath(tmp)!r} to it") from None
        logger.info("blockflow: wrote %s", target)
        return
    if not overwrite:  # appeared while the run was computing
        check_output_dir(target, overwrite=False)
    aside = target.parent / f".{target.name}.old-{token}"
    try:
        os.rename(target, aside)
    except OSError as e:
        raise _output_error(target, e, "moving the existing output aside") from None
    try:
        os.rename(tmp, target)
    except BaseException as e:
        os.rename(aside, target)  # put the old output back
        if isinstance(e, OSError):
            raise _output_error(target, e, f"renaming {os.fspath(tmp)!r} to it") from None
        raise
    _remove(aside)
    logger.info("blockflow: replaced %s", target)


def _to_host_frame(frame):
    """A pandas DataFrame for ``frame`` (cuDF frames are copied to host memory)."""
    if isinstance(frame, pd.DataFrame):
        return frame
    if hasattr(frame, "to_pandas"):
        return frame.to_pandas()
    raise TypeError(
        f"blockflow.io: expected a pandas or cuDF DataFrame, got "
        f"{type(frame).__module__}.{type(frame).__name__}."
    )


def write_parquet(frame, path: str | os.PathLike, *, index: bool | None = None) -> Path:
    """Write a pandas or cuDF DataFrame (copied to the host) to one Parquet file with pyarrow.

    ``index`` as in :meth:`pandas.DataFrame.to_parquet`; returns the final path. Raises
    ``TypeError`` for another type and :class:`OutputWriteError` when the file system
    refuses.
    """
    path = Path(path)
    frame = _to_host_frame(frame)
    try:
        frame.to_parquet(path, engine="pyarrow", index=index)
    except OSError as e:
        if isinstance(e, OutputWriteError):
            raise
        raise _file_error(path, e) from e
    return _final_path(path)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, np.integer):
        return int(obj)
    if isinstance(obj, np.floating):
        return _json_float(float(obj))
    if isinstance(obj, np.bool_):
        return bool(obj)
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, (_dt.datetime, _dt.date)):
        return obj.isoformat()
    if isinstance(obj, os.PathLike):
        return os.fspath(obj)
    raise TypeError(f"manifest value of type {type(obj).__name__} is not JSON-serialisable")


def _json_float(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _clean_floats(obj: Any) -> Any:
    """Non-finite floats become null: strict JSON has no NaN or Infinity."""
    if isinstance(obj, float):
        return _json_float(obj)
    if isinstance(obj, Mapping):
        return {k: _clean_floats(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean_floats(v) for v in obj]
    return obj


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    """Write ``data`` (bytes) to the file ``path``; return its final path, as
    :func:`write_parquet` does, or raise :class:`OutputWriteError` naming the file."""
    path = Path(path)
    try:
        with open(path, "wb") as fh:
            fh.write(data)
    except OSError as e:
        raise _file_error(path, e) from e
    return _final_path(path)


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> Path:
    """Write run metadata to ``<directory>/manifest.json``.

    NaN and infinities become ``null`` and a UTC ``created`` key is added when missing;
    returns the final path. Raises ``TypeError`` or :class:`OutputWriteError`.
    """
    data = dict(manifest)
    data.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    path = Path(directory) / MANIFEST_NAME
    text = json.dumps(_clean_floats(data), indent=2, sort_keys=True, default=_json_default,
                      allow_nan=False)
    try:
        path.write_text(text + "\n")
    except OSError as e:
        raise _file_error(path, e) from e
    return _final_path(path)


def write_tables(directory: str | os.PathLike, tables: Mapping[str, Any]) -> dict[str, dict]:
    """Write ``{name: table}`` as ``<directory>/<name>.parquet`` (pyarrow, no index) and
    return ``{name: {"file", "rows", "columns"}}`` for the manifest's ``files`` entry."""
    files = {}
    for name, table in tables.items():
        write_parquet(table, Path(directory) / f"{name}.parquet", index=False)
        files[name] = {"file": f"{name}.parquet", "rows": int(len(table)),
                       "columns": [str(c) for c in table.columns]}
    return files


def write_outputs(
    path: str | os.PathLike,
    tables: Mapping[str, Any],
    manifest: Mapping[str, Any],
    *,
    overwrite: bool = False,
) -> Path:
    """Write tables as ``<name>.parquet`` plus ``manifest.json`` (with a ``files`` entry)
    atomically into ``path`` (:func:`atomic_output_dir`); return the absolute folder.
    Raises ``FileExistsError`` or :class:`OutputWriteError` with nothing written."""
    target = check_output_dir(path, overwrite)
    with atomic_output_dir(target, overwrite=overwrite) as tmp:
        files = write_tables(tmp, tables)
        write_manifest(tmp, {**manifest, "files": files})
    return target
