"""Writes that a killed process or a full disk cannot leave half done.

Every output file or folder is written under a temporary sibling name ``.NAME.tmp-PID`` (a file as
``.NAME.tmp-PID/NAME``) and renamed into place only when complete (``os.replace`` is atomic on one filesystem), so a
file present under its final name is complete. A file is written inside a temporary folder because libraries keep
temporaries of their own beside the path they are given (safetensors writes ``.tmpXXXXXX`` and renames it): in our
folder, they are tied to our pid and go with it. A write that fails removes its temporary; one killed outright
(``kill -9``, power loss) leaves it behind, and the next write of the same name removes it (temporaries of processes
still alive are left alone). A full disk becomes an ``OSError`` that says so, whatever library did the writing
(safetensors and ``torch.save`` word it differently).
"""

import errno
import os
import re
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .files import _pid_alive, finish_modes, replace_folder

_LOW_SPACE = 1 << 20  # bytes: a write that failed with less free than this ran out of space


def temporary_name(final: Path, kind: str = "tmp") -> Path:
    """``DIR/.NAME.tmp-PID``: hidden (uploads and shard globs skip it), and tied to the process writing it."""
    return final.with_name(f".{final.name}.{kind}-{os.getpid()}")


def remove(path: Path) -> None:
    """Remove a file or a folder, if present."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


_TEMPORARY = re.compile(r"^\.(?P<name>.+?)\.(?:tmp|old)-(?P<pid>\d+)(?:-.*)?$")  # also `files`' siblings


def remove_stale_temporaries(directory: Path, name: str | None = None) -> None:
    """Remove what killed writers left in ``directory`` (``.NAME.tmp-PID`` / ``.NAME.old-PID`` of dead PIDs; only
    those of ``name`` when given)."""
    for path in Path(directory).glob(".*"):
        match = _TEMPORARY.match(path.name)
        pid = int(match["pid"]) if match else None
        if match and name in (None, match["name"]) and (pid == os.getpid() or not _pid_alive(pid)):
            remove(path)


def replace(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` (a file or a folder) to ``final``; an existing folder is moved aside first."""
    if final.is_dir() and not final.is_symlink():
        replace_folder(tmp, final)
    else:
        os.replace(tmp, final)


def is_disk_full(error: BaseException, directory: Path) -> bool:
    """Whether ``error`` from a write into ``directory`` means the disk is full (ENOSPC, or too little left)."""
    if getattr(error, "errno", None) in (errno.ENOSPC, errno.EDQUOT) or "No space left" in str(error):
        return True
    try:
        return shutil.disk_usage(directory).free < _LOW_SPACE
    except OSError:
        return False


def disk_full_error(final: Path, error: BaseException) -> OSError:
    """The one-line error for a write of ``final`` that ran out of space (``error``, chained, has the details)."""
    return OSError(errno.ENOSPC, f"No space left on device while writing {final}: nothing half-written was kept; "
                                 "free some space and rerun (finished files are reused)")


@contextmanager
def removed_on_error(tmp: Path, final: Path) -> Iterator[None]:
    """Remove ``tmp`` (the unfinished ``final``) if the block raises; a full disk raises `disk_full_error`."""
    try:
        yield
    except BaseException as error:
        full = isinstance(error, Exception) and is_disk_full(error, final.parent)
        remove(tmp)
        if full:
            raise disk_full_error(final, error) from error
        raise


@contextmanager
def atomic_path(final, directory: bool = False) -> Iterator[Path]:
    """Yield a temporary path to write ``final`` (a file, or a folder when ``directory``) to; it replaces ``final``
    when the block ends, and is removed when the block raises (a full disk raises `disk_full_error`).

    The path yielded for a file is ``.NAME.tmp-PID/NAME``: whatever the writing library creates beside it stays in
    that folder, which is removed with everything in it."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(final.parent, final.name)
    tmp = temporary_name(final)
    tmp.mkdir()
    written = tmp if directory else tmp / final.name
    with removed_on_error(tmp, final):
        yield written
        finish_modes(written)  # safetensors writes 0600: give the file the mode open() would have
        replace(written, final)
        if not directory:  # a folder was renamed into place; a file leaves its folder, with the library's leftovers
            remove(tmp)


__all__ = ["atomic_path", "disk_full_error", "is_disk_full", "remove", "remove_stale_temporaries", "removed_on_error",
           "replace", "temporary_name"]
