"""Writing output folders the way users expect: atomically, with ordinary file modes, and no litter.

Every folder this package writes (a converted target in the cache, a converted drafter) is built in a hidden
sibling ``.<name>.tmp-<pid>-<random>`` and renamed into place when complete, so a reader never sees half a folder.
A sibling left by a process that was killed is removed by the next writer of the same folder (its pid is gone).
safetensors writes weights with mode 0600 and ``mkdtemp`` makes folders 0700; `finish_modes` gives every file the
mode the user's umask asks for (0644 under umask 022), as ``open()`` would have.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable

# A temporary sibling without a pid (written by older versions) counts as abandoned after this long.
_UNOWNED_TMP_AGE_S = 3600.0


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def finish_modes(folder: Path) -> None:
    """Give ``folder`` (a folder or a file) and everything in it the modes the umask asks for: files 0666 & ~umask,
    folders 0777 & ~umask."""
    mask = _umask()
    if not folder.is_dir():
        os.chmod(folder, 0o666 & ~mask)
        return
    os.chmod(folder, 0o777 & ~mask)
    for path in folder.rglob("*"):
        if not path.is_symlink():
            os.chmod(path, (0o777 if path.is_dir() else 0o666) & ~mask)


def _tmp_prefix(final: Path) -> str:
    return f".{final.name}.tmp-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def remove_abandoned_tmp(final: Path) -> list[Path]:
    """Remove the temporary siblings of ``final`` whose writer is gone (dead pid, or no pid and over an hour old)."""
    removed = []
    prefix = _tmp_prefix(final)
    if not final.parent.is_dir():
        return removed
    for path in final.parent.iterdir():
        if not path.name.startswith(prefix):
            continue
        owner = path.name[len(prefix) :].split("-", 1)[0]
        if owner.isdigit():
            abandoned = int(owner) != os.getpid() and not _pid_alive(int(owner))
        else:
            abandoned = time.time() - path.stat().st_mtime > _UNOWNED_TMP_AGE_S
        if abandoned:
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def new_tmp_sibling(final: Path) -> Path:
    """A fresh hidden folder next to ``final`` owned by this process (abandoned ones are removed first)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    remove_abandoned_tmp(final)
    return Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{_tmp_prefix(final)}{os.getpid()}-"))


def replace_folder(tmp: Path, final: Path) -> None:
    """Move the finished ``tmp`` to ``final``, replacing whatever is there (a rename cannot replace a non-empty
    folder, so an existing one is first moved aside and then deleted)."""
    if final.exists():
        aside = Path(tempfile.mkdtemp(dir=final.parent, prefix=f"{_tmp_prefix(final)}{os.getpid()}-old-"))
        try:
            os.replace(final, aside / "old")
        except FileNotFoundError:
            pass
        shutil.rmtree(aside, ignore_errors=True)
    os.replace(tmp, final)


@contextmanager
def write_folder(final, overwrite: bool = False):
    """Build the folder ``final`` in a temporary sibling (yielded), then move it into place with ordinary modes.

    Raises ``FileExistsError`` when ``final`` exists and ``overwrite`` is false (checked before any work). On an
    error the temporary folder is removed and ``final`` is left as it was.
    """
    final = Path(final)
    if final.exists() and not overwrite:
        raise FileExistsError(f"{final} already exists: choose a new folder or pass --overwrite to replace it")
    tmp = new_tmp_sibling(final)
    try:
        yield tmp
        finish_modes(tmp)
        replace_folder(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_file(path, chunks: Iterable[str]) -> None:
    """Write the text ``chunks`` to ``path`` atomically (a hidden temporary file renamed over it), ordinary mode."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes it private
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(chunks)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def check_safetensors(folder, fix: str | None = None) -> None:
    """Raise a ``ValueError`` naming the file when a ``*.safetensors`` file in ``folder`` is empty or damaged, and
    ``fix`` (default: copy or save the weights again).

    Reads only the headers (cheap); safetensors' own ``SafetensorError`` otherwise surfaces as a traceback deep
    inside ``from_pretrained``.
    """
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        try:
            with safe_open(path, "pt") as handle:
                handle.keys()
        except Exception as err:  # safetensors raises SafetensorError (not an OSError) for a bad header
            size = path.stat().st_size
            what = "is empty" if size == 0 else f"is not a readable safetensors file ({err})"
            raise ValueError(f"{path} {what}: {fix or 'copy or save the weights again'}") from None
