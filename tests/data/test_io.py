"""blockflow.io: atomic output folders, Parquet tables and the manifest (real files, no mocks)."""

from __future__ import annotations

import json
import os

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from blockflow.io import (
    MANIFEST_NAME,
    atomic_output_dir,
    check_output_dir,
    write_manifest,
    write_outputs,
    write_parquet,
    write_tables,
)


def _exists_message(path) -> str:
    return (
        f"Output {os.fspath(path)!r} already exists; pass --overwrite (overwrite=True in "
        f"Python) to replace it, or choose another output folder."
    )


def _old_output(path):
    """A previous blockflow output: its files and a manifest.json."""
    path.mkdir()
    (path / "old.txt").write_text("old result")
    (path / "manifest.json").write_text("{}")
    return path


def _entries(parent) -> list[str]:
    return sorted(os.listdir(parent))


def test_success_renames_temporary_folder_into_place(tmp_path):
    out = tmp_path / "result"
    with atomic_output_dir(out) as tmp:
        assert tmp.parent == tmp_path
        assert tmp.name.startswith(".result.tmp-") and len(tmp.name) == len(".result.tmp-") + 32
        assert tmp.is_dir() and not out.exists()  # nothing visible under the final name yet
        (tmp / "a.txt").write_text("new")
    assert (out / "a.txt").read_text() == "new"
    assert _entries(tmp_path) == ["result"]  # no hidden folder left behind


def test_exception_removes_temporary_folder_and_creates_nothing(tmp_path):
    out = tmp_path / "result"
    with pytest.raises(RuntimeError, match="boom"):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.txt").write_text("half-written")
            raise RuntimeError("boom")
    assert _entries(tmp_path) == []


def test_keyboard_interrupt_also_cleans_up(tmp_path):
    out = tmp_path / "result"
    with pytest.raises(KeyboardInterrupt):
        with atomic_output_dir(out) as tmp:
            (tmp / "half.txt").write_text("x")
            raise KeyboardInterrupt
    assert _entries(tmp_path) == []


def test_existing_output_without_overwrite_fails_on_entry(tmp_path):
    out = _old_output(tmp_path / "result")
    with pytest.raises(FileExistsError) as info:
        with atomic_output_dir(out):
            pytest.fail("the block must not run when the output exists")
    assert str(info.value) == _exists_message(out)
    assert _entries(tmp_path) == ["result"]
    assert _entries(out) == ["manifest.json", "old.txt"]


def _never_replaced_message(path, what: str) -> str:
    return (f"Output {os.fspath(path)!r} exists and is {what}, which blockflow never replaces, "
            f"even with --overwrite (overwrite=True): choose another output folder, or move "
            f"or remove it yourself.")


FOREIGN_FOLDER = "a folder blockflow did not write (no manifest.json)"


def test_existing_file_counts_as_existing_output(tmp_path):
    out = tmp_path / "result"
    out.write_text("a file")
    with pytest.raises(FileExistsError) as info:
        check_output_dir(out)
    assert str(info.value) == _never_replaced_message(out, "a file")
    assert out.read_text() == "a file"


def test_a_folder_blockflow_did_not_write_gets_the_real_way_out_at_once(tmp_path):
    """Without --overwrite the first error must not suggest --overwrite, which would be
    refused: it says what will work."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "thesis.tex").write_text("years of work")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError) as info:
            check_output_dir(project, overwrite=overwrite)
        assert str(info.value) == _never_replaced_message(project, FOREIGN_FOLDER)
    link = tmp_path / "link"
    link.symlink_to(project)
    with pytest.raises(FileExistsError) as info:
        check_output_dir(link)
    assert str(info.value) == _never_replaced_message(link, "a link")
    # A folder blockflow wrote, and an empty one, are replaced with --overwrite: say so.
    for path in (_old_output(tmp_path / "old"), tmp_path / "empty"):
        path.mkdir(exist_ok=True)
        with pytest.raises(FileExistsError) as info:
            check_output_dir(path)
        assert str(info.value) == _exists_message(path)
        assert check_output_dir(path, overwrite=True) == path
    assert (project / "thesis.tex").read_text() == "years of work"


def test_relative_path_is_reported_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _old_output(tmp_path / "rel")
    with pytest.raises(FileExistsError) as info:
        check_output_dir("rel")
    assert str(info.value) == _exists_message(tmp_path / "rel")
    assert check_output_dir("other") == tmp_path / "other"


def test_overwrite_replaces_old_output(tmp_path):
    out = _old_output(tmp_path / "result")
    with atomic_output_dir(out, overwrite=True) as tmp:
        assert _entries(out) == ["manifest.json", "old.txt"]  # old output readable meanwhile
        (tmp / "new.txt").write_text("new")
    assert _entries(out) == ["new.txt"]
    assert _entries(tmp_path) == ["result"]  # the old one renamed aside was deleted


def test_overwrite_never_deletes_data_blockflow_did_not_write(tmp_path):
    """--overwrite replaces blockflow outputs (with a manifest) and empty folders only."""
    afile = tmp_path / "afile"
    afile.write_text("a file")
    project = tmp_path / "project"
    project.mkdir()
    (project / "thesis.tex").write_text("years of work")
    for out in (afile, project):
        with pytest.raises(FileExistsError) as e:
            with atomic_output_dir(out, overwrite=True):
                pass
        what = "a file" if out == afile else FOREIGN_FOLDER
        assert str(e.value) == _never_replaced_message(out, what)
    assert afile.read_text() == "a file"
    assert (project / "thesis.tex").read_text() == "years of work"
    empty = tmp_path / "empty"
    empty.mkdir()
    with atomic_output_dir(empty, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert _entries(empty) == ["new.txt"]


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_parent_is_refused_up_front(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(PermissionError, match="is not writable; choose another output"):
            with atomic_output_dir(ro / "sub" / "out"):
                pass
    finally:
        ro.chmod(0o700)
    assert _entries(tmp_path) == ["result"]


def test_failure_with_overwrite_keeps_old_output(tmp_path):
    out = _old_output(tmp_path / "result")
    with pytest.raises(ValueError, match="mid-way"):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise ValueError("failed mid-way")
    assert _entries(tmp_path) == ["result"]
    assert (out / "old.txt").read_text() == "old result"


def test_output_created_meanwhile_is_not_clobbered(tmp_path):
    out = tmp_path / "result"
    with pytest.raises(FileExistsError) as info:
        with atomic_output_dir(out) as tmp:
            (tmp / "new.txt").write_text("new")
            _old_output(out)  # another process wrote the output while we computed
    assert str(info.value) == _exists_message(out)
    assert _entries(tmp_path) == ["result"]
    assert _entries(out) == ["manifest.json", "old.txt"]


def test_missing_parents_are_created(tmp_path):
    out = tmp_path / "a" / "b" / "result"
    with atomic_output_dir(out) as tmp:
        (tmp / "x").write_text("x")
    assert (out / "x").exists()


def test_write_parquet_round_trip(tmp_path):
    df = pd.DataFrame({"k": ["a", "b", None], "n": [1, 2, 3], "x": [0.5, np.nan, 2.0]})
    path = write_parquet(df, tmp_path / "t.parquet", index=False)
    pd.testing.assert_frame_equal(pd.read_parquet(path), df)


def test_files_written_inside_an_atomic_output_return_their_final_paths(tmp_path):
    """Not the temporary folder's, which is gone once the output is committed."""
    out = tmp_path / "result"
    df = pd.DataFrame({"a": [1, 2]})
    with atomic_output_dir(out) as tmp:
        table = write_parquet(df, tmp / "t.parquet")
        nested = tmp / "sub"
        nested.mkdir()
        deeper = write_parquet(df, nested / "u.parquet")
        manifest = write_manifest(tmp, {"workload": "test"})
        assert table == out / "t.parquet" and not table.exists()  # there once committed
    assert (table, deeper, manifest) == (out / "t.parquet", out / "sub" / "u.parquet",
                                         out / MANIFEST_NAME)
    pd.testing.assert_frame_equal(pd.read_parquet(table), df)
    pd.testing.assert_frame_equal(pd.read_parquet(deeper), df)
    assert json.loads(manifest.read_text())["workload"] == "test"
    # Outside any atomic output (and after it), a path is returned as given.
    assert write_parquet(df, tmp_path / "plain.parquet") == tmp_path / "plain.parquet"


def test_write_parquet_refuses_non_frames(tmp_path):
    with pytest.raises(TypeError, match="expected a pandas or cuDF DataFrame, got builtins.dict"):
        write_parquet({"a": [1]}, tmp_path / "t.parquet")


def test_manifest_is_strict_json(tmp_path):
    path = write_manifest(tmp_path, {
        "n": np.int64(3), "x": np.float64(1.5), "nan": float("nan"), "inf": np.float32("inf"),
        "flag": np.bool_(True), "arr": np.arange(3), "nested": {"y": [1.0, float("nan")]},
    })
    assert path == tmp_path / MANIFEST_NAME
    data = json.loads(path.read_text())  # json.loads accepts NaN; check the text too
    assert "NaN" not in path.read_text() and "Infinity" not in path.read_text()
    assert data["n"] == 3 and data["x"] == 1.5 and data["flag"] is True
    assert data["nan"] is None and data["inf"] is None and data["arr"] == [0, 1, 2]
    assert data["nested"] == {"y": [1.0, None]}
    assert data["created"].endswith("+00:00")


def test_manifest_rejects_unserialisable_values(tmp_path):
    with pytest.raises(TypeError, match="manifest value of type object is not JSON-serialisable"):
        write_manifest(tmp_path, {"bad": object()})


def test_write_outputs_writes_tables_and_manifest(tmp_path):
    out = tmp_path / "run"
    tables = {"first": pd.DataFrame({"a": [1, 2]}), "second": pd.DataFrame({"b": ["x"]})}
    assert write_outputs(out, tables, {"workload": "test"}) == out
    assert _entries(out) == ["first.parquet", "manifest.json", "second.parquet"]
    for name, table in tables.items():
        pd.testing.assert_frame_equal(pd.read_parquet(out / f"{name}.parquet"), table)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["workload"] == "test"
    assert manifest["files"]["first"] == {"file": "first.parquet", "rows": 2, "columns": ["a"]}


def test_write_outputs_failing_mid_way_leaves_old_output(tmp_path):
    out = _old_output(tmp_path / "run")
    tables = {
        "good": pd.DataFrame({"a": [1, 2]}),  # written first ...
        "bad": pd.DataFrame({"mixed": [1, "two", 3.0]}, dtype=object),  # ... then Arrow fails
    }
    with pytest.raises((pa.ArrowException, TypeError, ValueError)):
        write_outputs(out, tables, {"workload": "test"}, overwrite=True)
    assert _entries(tmp_path) == ["run"]
    assert _entries(out) == ["manifest.json", "old.txt"]


def test_write_tables_lists_files(tmp_path):
    files = write_tables(tmp_path, {"t": pd.DataFrame({"a": [1], "b": [2.0]})})
    assert files == {"t": {"file": "t.parquet", "rows": 1, "columns": ["a", "b"]}}
