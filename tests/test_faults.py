"""Faults lose nothing: processes killed (``kill -9``) at random moments, and a full disk, leave only complete files.

A kill lands at a random moment after the process started writing (the first output file appeared); then every file
present must be complete (JSON parses, safetensors and ``torch.load(weights_only=True)`` read every tensor, Python
compiles), the rerun must complete, leave no temporary behind and produce what an uninterrupted run produces.
``DFLASH_FAULT_SEED`` picks other kill moments, ``DFLASH_FAULT_ROUNDS`` kills more often per test.

The full-disk tests mount a small tmpfs (root only; skipped elsewhere).
"""

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import chat_tokenizer, mask_token_id, save_chat_target, tiny_drafter, tiny_target, write_prompts
from safetensors import safe_open

from dflash_hf import DFlashDraftModel
from dflash_hf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
SEED = int(os.environ.get("DFLASH_FAULT_SEED", "0"))
ROUNDS = int(os.environ.get("DFLASH_FAULT_ROUNDS", "1"))
CHILD_ENV = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", "OMP_NUM_THREADS": "1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


# ------------------------------------------------------------------------------------------------------ checks
def incomplete_files(folder: Path) -> list[str]:
    """Every file under ``folder`` that is not complete, with why; temporaries (hidden names) are not looked at."""
    problems = []
    for path in sorted(folder.rglob("*")):
        if path.is_dir() or any(part.startswith(".") for part in path.relative_to(folder).parts):
            continue
        try:
            check_complete(path)
        except Exception as error:  # noqa: BLE001 - any failure to read is what we look for
            problems.append(f"{path.relative_to(folder)}: {type(error).__name__}: {error}")
    return problems


def check_complete(path: Path) -> None:
    if path.suffix == ".json":
        json.loads(path.read_text())
    elif path.suffix == ".jsonl":
        for line in path.read_text().splitlines():
            json.loads(line)
    elif path.suffix == ".safetensors":
        with safe_open(str(path), framework="pt") as handle:
            for name in handle.keys():
                handle.get_tensor(name)
    elif path.suffix == ".pt":
        torch.load(path, weights_only=True)
    elif path.suffix == ".py":
        compile(path.read_text(), str(path), "exec")
    elif path.name == "latest":
        assert (path.parent / path.read_text().strip() / "config.json").is_file(), "names a missing checkpoint"


def temporaries(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob(".*"))


def test_the_completeness_check_sees_a_truncated_file(tmp_path):
    tiny_drafter(tiny_target()).save_pretrained(tmp_path)
    assert incomplete_files(tmp_path) == []
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    (tmp_path / "config.json").write_text('{"cut": ')
    assert [p.split(":")[0] for p in incomplete_files(tmp_path)] == ["config.json", "model.safetensors"]


def kill_while_writing(argv: list[str], watched: Path, rng: random.Random, window: float) -> bool:
    """Start ``argv``, wait until ``watched`` exists, then ``kill -9`` it ``uniform(0, window)`` s later.
    Returns whether it was killed (False: it finished first)."""
    child = subprocess.Popen(argv, cwd=REPO, env=CHILD_ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not watched.exists() and child.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(rng.uniform(0, window))
    killed = child.poll() is None
    if killed:
        os.kill(child.pid, signal.SIGKILL)
    _, stderr = child.communicate()
    assert killed or child.returncode == 0, stderr.decode()[-2000:]
    return killed


# ---------------------------------------------------------------------------------------------- save_pretrained
SAVE_LOOP = """
import sys, torch
torch.set_num_threads(1)
from conftest import tiny_drafter, tiny_target
target = tiny_target(hidden_size=256, intermediate_size=512, head_dim=64)
drafters = [tiny_drafter(target, seed=seed, num_layers=3) for seed in (1, 2)]
for i in range(10**6):  # alternate weights, and one file with shards
    drafters[i % 2].save_pretrained(sys.argv[1], max_shard_size="1MB" if i % 3 == 0 else "50GB")
"""


@pytest.mark.parametrize("round_index", range(2 * ROUNDS))
def test_drafter_save_pretrained_killed_at_random_moments(tmp_path, round_index):
    rng = random.Random(SEED * 1000 + round_index)
    folder = tmp_path / "drafter"
    assert kill_while_writing([sys.executable, "-c", SAVE_LOOP, str(folder)], folder / "config.json", rng, 1.0)
    assert incomplete_files(folder) == []
    drafter = tiny_drafter(tiny_target(hidden_size=256, intermediate_size=512, head_dim=64), num_layers=3)
    drafter.save_pretrained(folder)  # the rerun
    assert temporaries(folder) == [] and incomplete_files(folder) == []
    loaded = DFlashDraftModel.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), drafter.state_dict().values()))
    assert not list(folder.glob("model-*")), "shards of an earlier save were left next to model.safetensors"


# ------------------------------------------------------------------------------------------------ distill, train
@pytest.fixture(scope="module")
def run_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    target = save_chat_target(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 8)
    return root, target, prompts


def distill_argv(run_inputs, out: Path) -> list[str]:
    _, target, prompts = run_inputs
    return ["distill", "--target", str(target), "--prompts", str(prompts), "--out", str(out), "--shard-size", "1",
            "--max-new-tokens", "24", "--target-layer-ids", "0,2", "--quiet", "--threads", "1"]


def train_argv(run_inputs, data: Path, out: Path, *extra) -> list[str]:
    _, target, _ = run_inputs
    return ["train", "--target", str(target), "--data", str(data), "--output-dir", str(out), "--mask-token-id",
            str(mask_token_id(chat_tokenizer())), "--num-draft-layers", "1", "--block-size", "4", "--num-anchors", "4",
            "--max-steps", "8", "--save-every", "1", "--keep-checkpoints", "2", "--log-every", "1",
            "--final-dtype", "float32", "--quiet", "--threads", "1", *extra]


@pytest.fixture(scope="module")
def straight(run_inputs):
    """Uninterrupted distill and train runs: what every interrupted one must end up with."""
    root = run_inputs[0]
    assert cli_main(distill_argv(run_inputs, root / "data")) == 0
    assert cli_main(train_argv(run_inputs, root / "data", root / "train")) == 0
    return root / "data", root / "train"


def tensors(path: Path) -> dict:
    with safe_open(str(path), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}


def same_tensors(a: Path, b: Path) -> bool:
    ta, tb = tensors(a), tensors(b)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("round_index", range(ROUNDS))
def test_distill_killed_at_a_random_moment_resumes_to_the_same_shards(run_inputs, straight, tmp_path, round_index):
    rng = random.Random(SEED * 1000 + 100 + round_index)
    out = tmp_path / "data"
    argv = [sys.executable, "-m", "dflash_hf", *distill_argv(run_inputs, out)]
    kill_while_writing(argv, out / "shard-00000.safetensors", rng, 3.0)
    assert incomplete_files(out) == []
    assert cli_main(distill_argv(run_inputs, out)) == 0  # the rerun
    assert temporaries(out) == [] and incomplete_files(out) == []
    shards = sorted(p.name for p in straight[0].glob("shard-*"))
    assert sorted(p.name for p in out.glob("shard-*")) == shards
    assert all(same_tensors(out / name, straight[0] / name) for name in shards)
    assert json.loads((out / "manifest.json").read_text())["finished_shards"] == shards


@pytest.mark.parametrize("round_index", range(ROUNDS))
def test_train_killed_at_a_random_moment_resumes_to_the_same_drafter(run_inputs, straight, tmp_path, round_index):
    rng = random.Random(SEED * 1000 + 200 + round_index)
    data, reference = straight
    out = tmp_path / "train"
    argv = [sys.executable, "-m", "dflash_hf", *train_argv(run_inputs, data, out)]
    kill_while_writing(argv, out / "checkpoints", rng, 4.0)
    assert incomplete_files(out) == []
    assert cli_main(train_argv(run_inputs, data, out, "--resume", "auto")) == 0  # the rerun
    assert temporaries(out) == [] and incomplete_files(out) == []
    assert same_tensors(out / "final" / "model.safetensors", reference / "final" / "model.safetensors")
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-0000007", "step-0000008"]
    steps = [json.loads(line)["step"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9)), "the log repeats or misses steps after the resume"


# -------------------------------------------------------------------------------------------------- full disk
@pytest.fixture
def small_disk(tmp_path):
    """``small_disk(size)``: a tmpfs of ``size`` (e.g. ``"1m"``) at a fresh folder (needs root: skipped elsewhere)."""
    if shutil.which("mount") is None or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    mounted = []

    def mount(size: str) -> Path:
        disk = tmp_path / f"disk{len(mounted)}"
        disk.mkdir()
        result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)], capture_output=True)
        if result.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {result.stderr.decode().strip()}")
        mounted.append(disk)
        return disk

    yield mount
    for disk in mounted:
        subprocess.run(["umount", str(disk)], check=True)


def test_drafter_save_on_a_full_disk_is_a_clear_error_and_leaves_nothing_half_written(small_disk):
    disk = small_disk("1m")
    drafter = tiny_drafter(tiny_target(hidden_size=256, intermediate_size=512, head_dim=64), num_layers=3)
    with pytest.raises(OSError, match="No space left on device") as error:
        drafter.save_pretrained(disk / "drafter")
    assert "free some space" in str(error.value)
    assert temporaries(disk) == [] and incomplete_files(disk) == []


def test_distill_on_a_full_disk_is_one_line_and_leaves_only_complete_shards(run_inputs, small_disk, capsys):
    disk = small_disk("40k")  # room for a few of the 8 shards
    assert cli_main(distill_argv(run_inputs, disk / "data")) == 1
    error = capsys.readouterr().err.splitlines()[-1]  # (after transformers' loading bar)
    assert error.startswith("dflash-hf distill: error: [Errno 28] No space left on device while writing")
    assert list((disk / "data").glob("shard-*")), "no shard fitted: the test did not fill the disk midway"
    assert temporaries(disk) == [] and incomplete_files(disk) == []


def test_train_on_a_full_disk_is_one_line_and_leaves_no_partial_checkpoint(run_inputs, straight, small_disk, capsys):
    disk = small_disk("1m")
    argv = train_argv(run_inputs, straight[0], disk / "train")
    argv[argv.index("--num-draft-layers") + 1] = "8"  # a checkpoint (drafter + optimizer state) beyond 1 MiB
    assert cli_main(argv) == 1
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("dflash-hf train: error: [Errno 28] No space left on device while writing")
    assert temporaries(disk) == [] and incomplete_files(disk) == []
    assert not (disk / "train" / "latest").exists()


def test_atomic_writes_give_files_the_mode_the_umask_asks_for(tmp_path):
    """safetensors writes 0600; a shard or checkpoint others should read gets 0666 & ~umask, as open() would give."""
    import torch

    from dflash_hf.training.data import write_shard

    previous = os.umask(0o022)
    try:
        path = tmp_path / "shard-00000.safetensors"
        sequence = {"input_ids": torch.arange(4), "loss_mask": torch.ones(4)}
        write_shard(path, [sequence], ["a"], None)
    finally:
        os.umask(previous)
    assert path.stat().st_mode & 0o777 == 0o644


def test_a_writing_librarys_own_temporary_goes_with_ours(tmp_path):
    """safetensors' ``save_file`` writes a ``.tmpXXXXXX`` beside the path it is given, then renames it; a kill inside
    that window left it in the shard folder, where no cleanup knew it. Written inside our pid's temporary folder, it
    goes with that folder: when the write succeeds, when it raises, and when the next write finds a killed writer's."""
    from dflash_hf.atomic import atomic_path

    final = tmp_path / "shard-00000.safetensors"
    with atomic_path(final) as tmp:
        (tmp.parent / ".tmpAbC123").write_bytes(b"half")  # what the library keeps beside its file while writing
        tmp.write_bytes(b"whole")
    assert final.read_bytes() == b"whole" and temporaries(tmp_path) == []
    with pytest.raises(RuntimeError), atomic_path(final) as tmp:
        (tmp.parent / ".tmpAbC123").write_bytes(b"half")
        raise RuntimeError("the writer failed")
    assert final.read_bytes() == b"whole" and temporaries(tmp_path) == []
    killed = tmp_path / f".{final.name}.tmp-4194399"  # beyond pid_max: its writer is gone
    killed.mkdir()
    (killed / ".tmpXyZ789").write_bytes(b"half")
    with atomic_path(final) as tmp:
        tmp.write_bytes(b"again")
    assert final.read_bytes() == b"again" and temporaries(tmp_path) == []
