"""A full disk while writing a checkpoint, a converted model, a download (dflash_core.storage) or a small file
of a run (`write_atomically`, `append_whole`: its run record, its metrics): one error, `DiskFull`, raised
after the partial output is removed, naming the dir, what the write needs and what is free, so a run stops
with a reason instead of a writer's traceback (torch's zip writer says only `inline_container.cc ...
unexpected pos`, safetensors `I/O error ... (os error 28)`, s3transfer a bare `OSError` from its IO thread)
and a disk left full.
"""

from __future__ import annotations

import errno
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dflash_core.units import binary_bytes

# What to do when a training run's output_dir fills: its checkpoints, run record or metrics.
RUN_DISK_FULL_ADVICE = ("Free space on that disk or set output_dir to one with room, then rerun with --resume "
                        "(the last complete checkpoint is intact)")
DISK_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
_DISK_FULL_TEXT = ("No space left on device", "os error 28", "Disk quota exceeded", "os error 122")
# torch.save's C++ writer loses the errno: these say only that a write came up short.
_TORCH_WRITER_TEXT = ("inline_container", "PytorchStreamWriter", "iostream error")


class DiskFull(OSError):
    """Not enough disk space for a write; the message says where, how much, and what to do. Retrying
    on the same disk cannot help."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)
        self.message = message

    def __str__(self) -> str:
        return self.message


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem of `directory` (or of its nearest existing parent)."""
    path = Path(directory).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def tensor_bytes(state: Any) -> int:
    """Bytes of every tensor in a nested dict/list/tuple (a state dict, an optimizer's state); duck-typed,
    so this module needs no torch."""
    if hasattr(state, "element_size") and hasattr(state, "numel"):
        return state.numel() * state.element_size()
    if isinstance(state, dict):
        return sum(tensor_bytes(value) for value in state.values())
    if isinstance(state, (list, tuple)):
        return sum(tensor_bytes(value) for value in state)
    return 0


def require_free(directory: Path, needed_bytes: int, *, what: str, advice: str) -> None:
    """Raise `DiskFull` before writing when `directory`'s filesystem has less than `needed_bytes` free."""
    free = free_bytes(directory)
    if free < needed_bytes:
        raise DiskFull(_message(what, directory=Path(directory), needed_bytes=needed_bytes, free=free,
                                removed=None, advice=advice))


def discard_partial_write(error: BaseException, *, partial: Path, needed_bytes: int, what: str, advice: str) -> None:
    """After a failed write into the temp dir or file `partial`: remove it at once, then raise `DiskFull`
    (from `error`) when the disk was full. Returns otherwise, for the caller to re-raise `error`."""
    if Path(partial).is_dir():
        shutil.rmtree(partial, ignore_errors=True)
    else:
        Path(partial).unlink(missing_ok=True)
    directory = Path(partial).parent
    free = free_bytes(directory)
    if is_disk_full(error, free_after_bytes=free, needed_bytes=needed_bytes):
        raise DiskFull(_message(what, directory=directory, needed_bytes=needed_bytes, free=free,
                                removed=Path(partial), advice=advice)) from error


def write_atomically(path: Path, data: bytes | str, *, what: str, advice: str) -> None:
    """Write `data` to `path` through a temp file beside it, renamed into place: a failed write leaves the old
    file (or none) and no partial one, and a full disk raises `DiskFull`."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(partial, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(partial, path)
    except OSError as error:
        discard_partial_write(error, partial=partial, needed_bytes=len(data), what=what, advice=advice)
        raise


def append_whole(path: Path, data: bytes | str, *, what: str, advice: str) -> None:
    """Append `data` to `path` whole or not at all: a failed write cuts the file back to where it ended (a file
    it created goes), and a full disk raises `DiskFull`."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    existed = path.exists()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        end = os.fstat(fd).st_size
        try:
            rest = memoryview(data)
            while rest:  # a write that runs out of space mid-way returns short before it fails
                rest = rest[os.write(fd, rest):]
        except OSError as error:
            os.ftruncate(fd, end)
            if not existed:
                path.unlink()
            _raise_if_disk_full(error, directory=path.parent, needed_bytes=len(data), what=what, advice=advice)
            raise
    finally:
        os.close(fd)


def _raise_if_disk_full(error: OSError, *, directory: Path, needed_bytes: int, what: str, advice: str) -> None:
    free = free_bytes(directory)
    if is_disk_full(error, free_after_bytes=free, needed_bytes=needed_bytes):
        raise DiskFull(_message(what, directory=directory, needed_bytes=needed_bytes, free=free, removed=None,
                                advice=advice)) from error


def is_disk_full(error: BaseException, *, free_after_bytes: int, needed_bytes: int) -> bool:
    """ENOSPC/EDQUOT anywhere in the error's chain (safetensors only says it in its text); torch's
    writer, which drops the errno, counts when the write cannot fit in what is free once its partial
    output is gone."""
    chain = list(_chain(error))
    if any(isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS for e in chain):
        return True
    if any(text in str(e) for e in chain for text in _DISK_FULL_TEXT):
        return True
    torch_writer = any(isinstance(e, RuntimeError) and any(t in str(e) for t in _TORCH_WRITER_TEXT) for e in chain)
    return torch_writer and free_after_bytes < needed_bytes


def _chain(error: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def _message(what: str, *, directory: Path, needed_bytes: int, free: int, removed: Path | None, advice: str) -> str:
    done = f"; the partial {removed.name} was removed" if removed is not None else "; nothing was written"
    return (f"disk full: {what} needs about {binary_bytes(needed_bytes)} in {directory}, and {binary_bytes(free)} "
            f"are free there{done}. {advice}")
