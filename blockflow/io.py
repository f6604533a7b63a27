"""Atomic output: results are written to a hidden sibling folder and renamed into place.

A run writes its Parquet tables and ``manifest.json`` inside :func:`atomic_output_dir`, which
yields a temporary folder beside the requested output (same parent, so the final
:func:`os.replace` is a rename within one file system). Only when everything has been written
does the temporary folder take the output's name. A run that fails at any point deletes the
temporary folder and leaves an existing output untouched, so readers never see a
half-written result.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import logging
import math
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Iterator, Mapping

import numpy as np

__all__ = [
    "MANIFEST_NAME",
    "atomic_output_dir",
    "check_output_dir",
    "write_manifest",
    "write_outputs",
    "write_parquet",
    "write_tables",
]

logger = logging.getLogger(__name__)

#: File name of the run metadata written next to the tables.
MANIFEST_NAME = "manifest.json"


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
        If ``path`` exists (as a folder, file or link) and ``overwrite`` is False; or if
        ``overwrite`` is True but ``path`` is not a folder blockflow wrote (it holds no
        ``manifest.json``) and is not empty: overwriting never deletes other data. The
        message names the path and the fix.
    PermissionError
        If the folder that would hold ``path`` is not writable.
    """
    target = Path(os.path.abspath(os.fspath(path)))
    exists = target.exists() or target.is_symlink()
    if exists and not overwrite:
        raise FileExistsError(
            f"Output {os.fspath(target)!r} already exists; pass --overwrite "
            f"(overwrite=True in Python) to replace it, or choose another output folder."
        )
    if exists and not _is_replaceable_output(target):
        raise FileExistsError(
            f"Output {os.fspath(target)!r} exists and is not a blockflow output folder (no "
            f"{MANIFEST_NAME}); --overwrite only replaces folders blockflow wrote. Choose "
            f"another output folder, or remove it yourself."
        )
    parent = target.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the nearest folder that exists: parents get created there
    if not os.access(parent, os.W_OK | os.X_OK):
        raise PermissionError(
            f"Output {os.fspath(target)!r} cannot be written: {os.fspath(parent)!r} is not "
            f"writable; choose another output folder."
        )
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

    The temporary folder is ``<parent>/.<name>.tmp-<uuid4 hex>`` (hidden, same parent as
    ``path``). When the ``with`` block finishes without an exception it is renamed to
    ``path``. If ``path`` already exists and ``overwrite`` is True, the old output is first
    renamed aside to ``<parent>/.<name>.old-<uuid4 hex>``, the new folder is renamed in, and
    only then is the old one deleted; if renaming the new folder in fails, the old output is
    renamed back. On any exception inside the block the temporary folder is deleted and
    ``path`` is left untouched; the exception propagates.

    Parameters
    ----------
    path : str or path-like
        The output folder to create (or replace). Missing parent folders are created (and
        stay if the block fails).
    overwrite : bool, default False
        Replace an existing ``path``. When False an existing ``path`` is an error, checked
        both on entry (before any work is done) and again just before the final rename.

    Yields
    ------
    pathlib.Path
        The (empty) temporary folder to write into.

    Raises
    ------
    FileExistsError
        If ``path`` exists and ``overwrite`` is False; the message names the path and
        ``--overwrite``.
    OSError
        If the temporary folder cannot be created or renamed (e.g. no permission in the
        parent folder).

    Notes
    -----
    Readers see either the old output or the complete new one, never a partial folder: on
    POSIX file systems renaming a folder within one parent is atomic. With
    ``overwrite=True`` there is a short window between the two renames where ``path`` does
    not exist. A process killed mid-run (SIGKILL) leaves its hidden ``.tmp-`` folder behind;
    it never takes the output's name.

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
    target.parent.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    tmp = target.parent / f".{target.name}.tmp-{token}"
    tmp.mkdir()
    try:
        yield tmp
        _commit(tmp, target, overwrite, token)
    except BaseException:
        _remove(tmp)
        raise


def _commit(tmp: Path, target: Path, overwrite: bool, token: str) -> None:
    if not (target.exists() or target.is_symlink()):
        os.rename(tmp, target)
        logger.info("blockflow: wrote %s", target)
        return
    if not overwrite:  # appeared while the run was computing
        check_output_dir(target, overwrite=False)
    aside = target.parent / f".{target.name}.old-{token}"
    os.rename(target, aside)
    try:
        os.rename(tmp, target)
    except BaseException:
        os.rename(aside, target)  # put the old output back
        raise
    _remove(aside)
    logger.info("blockflow: replaced %s", target)


def _to_host_frame(frame):
    """A pandas DataFrame for ``frame`` (cuDF frames are copied to host memory)."""
    import pandas as pd

    if isinstance(frame, pd.DataFrame):
        return frame
    if hasattr(frame, "to_pandas"):
        return frame.to_pandas()
    raise TypeError(
        f"blockflow.io: expected a pandas or cuDF DataFrame, got "
        f"{type(frame).__module__}.{type(frame).__name__}."
    )


def write_parquet(frame, path: str | os.PathLike, *, index: bool | None = None) -> Path:
    """Write a DataFrame to one Parquet file with pyarrow.

    Parameters
    ----------
    frame : pandas.DataFrame or cudf.DataFrame
        The table; cuDF frames are copied to host memory first.
    path : str or path-like
        File to write (normally inside the folder yielded by :func:`atomic_output_dir`).
    index : bool, optional
        As in :meth:`pandas.DataFrame.to_parquet`: None stores a non-default index as
        columns and a RangeIndex as metadata only.

    Returns
    -------
    pathlib.Path
        ``path``.

    Raises
    ------
    TypeError
        If ``frame`` is not a pandas or cuDF DataFrame.
    pyarrow.ArrowException
        If a column cannot be converted to Arrow (e.g. mixed Python objects).
    """
    path = Path(path)
    _to_host_frame(frame).to_parquet(path, engine="pyarrow", index=index)
    return path


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


def write_manifest(directory: str | os.PathLike, manifest: Mapping[str, Any]) -> Path:
    """Write run metadata to ``<directory>/manifest.json``.

    Parameters
    ----------
    directory : str or path-like
        Folder to write into (normally the one yielded by :func:`atomic_output_dir`).
    manifest : mapping
        JSON-serialisable metadata. NumPy scalars and arrays, dates and paths are converted;
        NaN and infinities are written as ``null`` (strict JSON). A ``created`` key (UTC,
        ISO 8601) is added when missing.

    Returns
    -------
    pathlib.Path
        The manifest file.

    Raises
    ------
    TypeError
        If a value cannot be represented in JSON.
    """
    data = dict(manifest)
    data.setdefault("created", _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"))
    path = Path(directory) / MANIFEST_NAME
    text = json.dumps(_clean_floats(data), indent=2, sort_keys=True, default=_json_default,
                      allow_nan=False)
    path.write_text(text + "\n")
    return path


def write_tables(directory: str | os.PathLike, tables: Mapping[str, Any]) -> dict[str, dict]:
    """Write tables as ``<directory>/<name>.parquet`` (pyarrow, no index).

    Parameters
    ----------
    directory : str or path-like
        Folder to write into (normally the one yielded by :func:`atomic_output_dir`).
    tables : mapping of str to DataFrame
        File stem to pandas or cuDF table, e.g. ``{"by_carrier": df}`` ->
        ``by_carrier.parquet``. Written with ``index=False``: keep keys in columns.

    Returns
    -------
    dict of str to dict
        Per table: ``{"file": "<name>.parquet", "rows": int, "columns": [str, ...]}``, ready
        for the manifest's ``files`` entry.
    """
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
    """Write tables as ``<name>.parquet`` plus ``manifest.json`` atomically into ``path``.

    Parameters
    ----------
    path : str or path-like
        Output folder (see :func:`atomic_output_dir`).
    tables : mapping of str to DataFrame
        File stem to table (see :func:`write_tables`).
    manifest : mapping
        Run metadata; a ``files`` entry (from :func:`write_tables`) is added.
    overwrite : bool, default False
        Replace an existing ``path``.

    Returns
    -------
    pathlib.Path
        The absolute output folder.

    Raises
    ------
    FileExistsError
        If ``path`` exists and ``overwrite`` is False; nothing is written.
    """
    target = check_output_dir(path, overwrite)
    with atomic_output_dir(target, overwrite=overwrite) as tmp:
        files = write_tables(tmp, tables)
        write_manifest(tmp, {**manifest, "files": files})
    return target
