"""Where a bucket key or a node's file name lands on this machine: always inside the folder it is given.

A key is data (a URI in a result.json or a run's config, a name a node's SFTP server lists), so it must
not choose a local path. `path_inside(root, key)` is `root / key` when that stays inside `root`, and a
`ValueError` naming the key and the folder when it would not: an absolute key (`s3://bucket//tmp/x` has
the key `/tmp/x`, which `root / key` turns into `/tmp/x`), a `..` segment, an empty or `.` segment
(`a//b` and `a/./b` would land where `a/b` does), a NUL byte, or a path that an existing symlink inside
`root` leads out of it. Standard library only: the node image imports it without boto3.
"""

from __future__ import annotations

from pathlib import Path


def path_inside(root: Path | str, key: str) -> Path:
    """`root / key`, refused (ValueError naming both) where the key, or a symlink on its way, would leave `root`."""
    root = Path(root)
    if problem := _key_problem(key):
        raise ValueError(f"key {key!r} cannot be a path inside {root}: {problem}")
    path = root / key
    resolved = path.resolve()
    if not resolved.is_relative_to(root.resolve()):
        raise ValueError(f"key {key!r} leads out of {root} through a symlink (to {resolved})")
    return path


def _key_problem(key: str) -> str | None:
    if "\x00" in key:
        return "it holds a NUL byte"
    if key.startswith("/"):
        return "it is absolute"
    segments = key.split("/")
    if ".." in segments:
        return "it has a '..' segment"
    if "" in segments or "." in segments:
        return "it has an empty or '.' segment, so it would land where another key does"
    return None
