"""`path_inside` keeps every key inside its folder and names the key and the folder when it refuses one.

Run: `.venv/bin/python -m pytest -n 0 -q tests/unit/test_local_paths.py`
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dflash_core.storage.local_paths import path_inside


def test_an_ordinary_key_lands_under_the_folder(tmp_path: Path) -> None:
    assert path_inside(tmp_path, "tokenized/d/r/shard-00000.arrow") == tmp_path / "tokenized/d/r/shard-00000.arrow"
    assert path_inside(tmp_path, "a..b/c.d") == tmp_path / "a..b/c.d"  # dots inside a segment are a name


@pytest.mark.parametrize(("key", "problem"), [
    ("/tmp/x/y.arrow", "absolute"),
    ("../y.arrow", "'..'"),
    ("a/../../y.arrow", "'..'"),
    ("a//b.arrow", "empty or '.'"),
    ("a/./b.arrow", "empty or '.'"),
    ("a/b/", "empty or '.'"),
    ("", "empty or '.'"),
    ("a/b\x00.arrow", "NUL"),
])
def test_a_key_that_would_leave_or_collapse_is_refused_by_name(tmp_path: Path, key: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"key {key!r} cannot be a path inside {tmp_path}")) as refused:
        path_inside(tmp_path, key)
    assert problem in str(refused.value)


def test_a_symlink_inside_the_folder_may_not_lead_out_of_it(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "within").mkdir(parents=True)
    outside.mkdir()
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "within")
    with pytest.raises(ValueError, match=re.escape(f"key 'out/y.arrow' leads out of {root} through a symlink")):
        path_inside(root, "out/y.arrow")
    (root / "within" / "file").symlink_to(outside / "file")
    with pytest.raises(ValueError, match="through a symlink"):
        path_inside(root, "within/file")
    assert path_inside(root, "in/y.arrow") == root / "in/y.arrow"


def test_a_folder_reached_through_a_symlink_is_still_its_own_inside(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "real")
    assert path_inside(tmp_path / "alias", "a/b") == tmp_path / "alias/a/b"
