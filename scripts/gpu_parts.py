#!/usr/bin/env python3
"""Moving files to the lent GPU machine in calls of at most 64 MiB each (standard library only: it runs there
before the carried wheels are installed).

Each `run` call sends the working tree plus the folders named in ``carry``, at most 64 MiB together. The default
target's GGUF (98 MB) and the wheels the machine lacks do not fit one call, so ``pack`` splits them into numbered
folders ``.gpu/1``, ``.gpu/2``, ... that each fit beside the tree; each call carries one (``carry: [".gpu/K"]``).
On the machine, ``stage`` checks every carried file against its sha256 and copies it to a stage folder outside the
repository, which stays while the machine is warm; ``assemble`` joins the payload's parts once all are there and
checks the whole file's sha256.

    python3 scripts/gpu_parts.py pack --payload F.gguf --extra wheels=.gpu-cache/wheels --out .gpu
    python3 scripts/gpu_parts.py stage .gpu /tmp/dflash-gpu          # on the machine, every call
    python3 scripts/gpu_parts.py assemble /tmp/dflash-gpu DEST.gguf  # exit 3 while parts are missing
    python3 scripts/gpu_parts.py check-requirements WHEEL_DIR         # the wheels' needs against what is installed
    python3 scripts/gpu_parts.py check-out OUT                        # what in $OUT would not come back
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

MIB = 1 << 20
MANIFEST = "manifest.json"
INCOMPLETE = 3  # exit status of `assemble` while parts are missing


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def travelling_tree_bytes(repo: Path) -> int:
    """Bytes of what every call sends: tracked files, untracked files git does not ignore, and ``shared/``."""
    listed = subprocess.run(["git", "-C", str(repo), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            check=True, capture_output=True).stdout.split(b"\0")
    paths = {repo / os.fsdecode(name) for name in listed if name}
    if (repo / "shared").is_dir():
        paths |= {p for p in (repo / "shared").rglob("*") if p.is_file()}
    return sum(p.stat().st_size for p in paths if p.is_file() and not p.is_symlink())


# ---------------------------------------------------------------------------------------------------------- pack
def pack(payload: Path, extras: dict[str, Path], out: Path, call_bytes: int, tree_bytes: int,
         margin_bytes: int = MIB, last_call_bytes: int = 0) -> dict:
    """Write ``out/1``, ``out/2``, ...: the ``extras`` (name -> folder, whole files) in folder 1, then the payload
    split into parts so that every folder plus the tree stays under ``call_bytes``; the last call also carries
    ``last_call_bytes`` of other paths (the repository's bulky folders, out of the tree: they arrive with the call
    that completes the payload, the one that runs the work). Returns the manifest (also written into every
    folder)."""
    room = call_bytes - tree_bytes - margin_bytes
    extra_files = {f"{name}/{p.name}": p for name, folder in extras.items() for p in sorted(Path(folder).iterdir())
                   if p.is_file()}
    first_room = room - sum(p.stat().st_size for p in extra_files.values())
    if first_room <= 0 or room - last_call_bytes <= 0:
        raise SystemExit(f"no room: {room / MIB:.1f} MiB per call beside the tree, extras "
                         f"{sum(p.stat().st_size for p in extra_files.values()) / MIB:.1f} MiB, last call's other "
                         f"paths {last_call_bytes / MIB:.1f} MiB")
    if out.exists():
        shutil.rmtree(out)
    size = payload.stat().st_size
    sizes, left = [], size  # the parts' sizes: each as full as it goes; the last leaves room for last_call_bytes
    while True:
        cap = first_room if not sizes else room
        if left + last_call_bytes <= cap:
            sizes.append(left)
            break
        sizes.append(min(left, cap))
        left -= sizes[-1]
        if left == 0:  # the payload is complete but the other paths do not fit beside its last part
            sizes.append(0)
            break
    parts = []
    with open(payload, "rb") as source:
        for index, part_size in enumerate(sizes, start=1):
            chunk = source.read(part_size)
            folder = out / str(index)
            folder.mkdir(parents=True)
            (folder / f"part-{index}").write_bytes(chunk)
            parts.append({"index": index, "size": len(chunk), "sha256": hashlib.sha256(chunk).hexdigest()})
    files = {}
    for relative, path in extra_files.items():
        (out / "1" / relative).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, out / "1" / relative)
        files[f"1/{relative}"] = sha256(path)
    for part in parts:
        files[f"{part['index']}/part-{part['index']}"] = part["sha256"]
    manifest = {"payload": {"name": payload.name, "size": size, "sha256": sha256(payload), "parts": parts},
                "files": files, "call_bytes": call_bytes, "tree_bytes": tree_bytes}
    for part in parts:
        folder = out / str(part["index"])
        (folder / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
        carried = sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())
        carried += tree_bytes + (last_call_bytes if part is parts[-1] else 0)
        if carried > call_bytes:
            raise SystemExit(f"{folder}: {carried / MIB:.1f} MiB with the tree, over the limit")
    return manifest


# --------------------------------------------------------------------------------------------------------- stage
def stage(carried: Path, stage_dir: Path) -> list[int]:
    """Check and copy every carried folder ``carried/K`` into ``stage_dir/K``; returns the part numbers staged so
    far (this call's and earlier calls'). A file whose sha256 differs from the manifest is an error."""
    stage_dir.mkdir(parents=True, exist_ok=True)
    for folder in sorted(p for p in carried.glob("*") if p.is_dir() and (p / MANIFEST).is_file()):
        manifest = json.loads((folder / MANIFEST).read_text())
        mine = {k: v for k, v in manifest["files"].items() if k.split("/", 1)[0] == folder.name}
        for relative, digest in mine.items():
            path = carried / relative
            if not path.is_file() or sha256(path) != digest:
                raise SystemExit(f"{path}: missing or its sha256 differs from the manifest: carry {folder} again")
        final, tmp = stage_dir / folder.name, stage_dir / f".tmp-{folder.name}"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(folder, tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        print(f"staged {folder} ({sum(p.stat().st_size for p in final.rglob('*') if p.is_file()) / MIB:.1f} MiB)")
    return staged_parts(stage_dir)


def staged_parts(stage_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in stage_dir.glob("*") if p.name.isdigit() and (p / MANIFEST).is_file())


def stage_manifest(stage_dir: Path) -> dict | None:
    parts = staged_parts(stage_dir)
    return json.loads((stage_dir / str(parts[0]) / MANIFEST).read_text()) if parts else None


def missing_parts(stage_dir: Path) -> list[int]:
    manifest = stage_manifest(stage_dir)
    if manifest is None:
        return [1]
    wanted = [part["index"] for part in manifest["payload"]["parts"]]
    return [i for i in wanted if i not in staged_parts(stage_dir)]


def assemble(stage_dir: Path, dest: Path) -> Path:
    """Join the staged parts into ``dest`` and check its sha256 (kept when it is already right)."""
    manifest = stage_manifest(stage_dir)
    missing = missing_parts(stage_dir)
    if missing:
        print(f"parts {missing} not staged yet: carry .gpu/{missing[0]} in the next call", file=sys.stderr)
        raise SystemExit(INCOMPLETE)
    payload = manifest["payload"]
    if dest.is_file() and dest.stat().st_size == payload["size"] and sha256(dest) == payload["sha256"]:
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    with open(tmp, "wb") as handle:
        for part in payload["parts"]:
            with open(stage_dir / str(part["index"]) / f"part-{part['index']}", "rb") as source:
                shutil.copyfileobj(source, handle, MIB)
    if sha256(tmp) != payload["sha256"]:
        tmp.unlink()
        raise SystemExit(f"{dest}: the joined parts' sha256 differs from the manifest")
    os.replace(tmp, dest)
    return dest


# ----------------------------------------------------------------------------------------------------- check-out
OUT_RULES = {"files": 8, "file_bytes": 16 * MIB, "total_bytes": 64 * MIB, "depth": 3}


def check_out(out: Path) -> list[str]:
    """What in ``out`` would not come back from the machine: more than 8 files, a file over 16 MiB or 64 MiB in
    all, a file more than two folders down, a name with characters other than letters, digits, '.', '_', '-'."""
    files = sorted(p for p in out.rglob("*") if p.is_file() or p.is_symlink())
    problems = []
    if len(files) > OUT_RULES["files"]:
        problems.append(f"{len(files)} files: at most {OUT_RULES['files']} come back")
    if sum(p.stat().st_size for p in files) > OUT_RULES["total_bytes"]:
        problems.append("over 64 MiB in all")
    for path in files:
        relative = path.relative_to(out)
        if path.is_symlink() or path.stat().st_size > OUT_RULES["file_bytes"]:
            problems.append(f"{relative}: a link or over 16 MiB")
        if len(relative.parts) > OUT_RULES["depth"]:
            problems.append(f"{relative}: more than two folders down")
        if any(not all(c.isascii() and (c.isalnum() or c in "._-") for c in part) for part in relative.parts):
            problems.append(f"{relative}: a name with other characters than letters, digits, '.', '_', '-'")
    return problems


# ------------------------------------------------------------------------------------------ check-requirements
def check_requirements(wheel_dir: Path) -> list[str]:
    """Every ``Requires-Dist`` (extras and other platforms left out) of the wheels in ``wheel_dir`` that neither
    the wheels nor the installed packages satisfy; needs ``packaging`` (the device has it)."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    wheels = sorted(wheel_dir.glob("*.whl"))
    carried = {canonicalize_name(w.name.split("-")[0]): w.name.split("-")[1] for w in wheels}
    problems = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            lines = archive.read(metadata).decode().splitlines()
        for line in lines:
            if not line.startswith("Requires-Dist:"):
                continue
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
                continue
            name = canonicalize_name(requirement.name)
            try:
                have = carried.get(name) or version(requirement.name)
            except PackageNotFoundError:
                problems.append(f"{wheel.name} needs {requirement}: not installed, not carried")
                continue
            if requirement.specifier and not requirement.specifier.contains(have, prereleases=True):
                problems.append(f"{wheel.name} needs {requirement}: {have} here")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("pack")
    p.add_argument("--payload", type=Path, required=True, help="the file to split (the target's GGUF)")
    p.add_argument("--extra", action="append", default=[], metavar="NAME=DIR",
                   help="a folder whose files travel whole in the first call, as NAME/ (wheels, prompts)")
    p.add_argument("--out", type=Path, default=Path(".gpu"))
    p.add_argument("--call-mib", type=float, default=64.0, help="what one call may carry, tree included")
    p.add_argument("--tree-bytes", type=int, default=None, help="default: measured with git in --repo")
    p.add_argument("--repo", type=Path, default=Path("."))
    p.add_argument("--last-carries", nargs="*", type=Path, default=[],
                   help="paths the last call carries too (folders taken out of the tree)")
    p = sub.add_parser("stage")
    p.add_argument("carried", type=Path)
    p.add_argument("stage_dir", type=Path)
    p = sub.add_parser("assemble")
    p.add_argument("stage_dir", type=Path)
    p.add_argument("dest", type=Path)
    p = sub.add_parser("check-requirements")
    p.add_argument("wheel_dir", type=Path)
    p = sub.add_parser("check-out", help="what in OUT would not come back from the machine")
    p.add_argument("out", type=Path)
    args = parser.parse_args(argv)
    if args.command == "pack":
        extras = dict(item.split("=", 1) for item in args.extra)
        tree = args.tree_bytes if args.tree_bytes is not None else travelling_tree_bytes(args.repo)
        last = sum(f.stat().st_size for path in args.last_carries for f in [path, *path.rglob("*")] if f.is_file())
        manifest = pack(args.payload, {k: Path(v) for k, v in extras.items()}, args.out, int(args.call_mib * MIB),
                        tree, last_call_bytes=last)
        carries = [[f".gpu/{p['index']}"] for p in manifest["payload"]["parts"]]
        carries[-1] += [str(path) for path in args.last_carries]
        print(f"tree {tree / MIB:.1f} MiB; {len(carries)} calls: "
              + ", ".join(f"carry {json.dumps(c)}" for c in carries))
    elif args.command == "stage":
        parts = stage(args.carried, args.stage_dir)
        missing = missing_parts(args.stage_dir)
        print(f"staged parts {parts}; " + (f"still missing {missing}" if missing else "all parts staged"))
    elif args.command == "assemble":
        print(assemble(args.stage_dir, args.dest))
    else:
        problems = check_requirements(args.wheel_dir) if args.command == "check-requirements" else check_out(args.out)
        for problem in problems:
            print(problem, file=sys.stderr)
        return 1 if problems else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
