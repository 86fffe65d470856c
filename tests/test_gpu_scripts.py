"""The GPU plan (docs/gpu.md) rehearsed on CPU: the transfer in parts (split, staged call by call, joined, checked),
what may come back from $OUT, the wheels' requirements, and scripts/gpu_train.sh and scripts/gpu_speed.sh end to
end on a tiny target, with the same wheel install and staging as on the machine."""

import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import mask_token_id, chat_tokenizer, save_chat_drafter, save_chat_target, write_prompts

from dflash_hf import DFlashDraftModel
from dflash_hf.cli import main
from dflash_hf.training.data import ShardDataset

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gpu_parts", REPO / "scripts" / "gpu_parts.py")
gpu_parts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gpu_parts)
KIB = 1024


def make_wheel(folder: Path, name: str, requires: list[str]) -> Path:
    """A minimal pure-Python wheel ``name-1.0`` whose module sets ``PROBE = 1``."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-1.0-py3-none-any.whl"
    info = f"{name}-1.0.dist-info"
    metadata = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n"]
                       + [f"Requires-Dist: {r}\n" for r in requires])
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(f"{name}/__init__.py", "PROBE = 1\n")
        archive.writestr(f"{info}/METADATA", metadata)
        archive.writestr(f"{info}/WHEEL",
                         "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        listed = [f"{name}/__init__.py"] + [f"{info}/{part}" for part in ("METADATA", "WHEEL", "RECORD")]
        archive.writestr(f"{info}/RECORD", "".join(f"{path},,\n" for path in listed))
    return path


def pack_fixture(tmp_path, payload_bytes=300 * KIB, call_bytes=200 * KIB, tree_bytes=50 * KIB):
    payload = tmp_path / "target.gguf"
    payload.write_bytes(os.urandom(payload_bytes))
    extras = tmp_path / "extras"
    extras.mkdir()
    (extras / "a.txt").write_bytes(os.urandom(20 * KIB))
    manifest = gpu_parts.pack(payload, {"prompts": extras}, tmp_path / "carried", call_bytes, tree_bytes,
                              margin_bytes=4 * KIB)
    return payload, manifest


# ------------------------------------------------------------------------------------------------- the transfer
def test_payload_split_over_calls_is_staged_call_by_call_and_joined_exactly(tmp_path):
    payload, manifest = pack_fixture(tmp_path)
    parts = manifest["payload"]["parts"]
    assert len(parts) == 3  # 300 KiB + 20 KiB of extras at < 150 KiB per call
    for part in parts:  # every call fits beside the tree
        carried = sum(p.stat().st_size for p in (tmp_path / "carried" / str(part["index"])).rglob("*") if p.is_file())
        assert carried + 50 * KIB <= 200 * KIB
    stage = tmp_path / "stage"
    for index in (1, 2, 3):  # one call each: only that folder travels; the stage stays on the warm machine
        call = tmp_path / f"call-{index}"
        call.mkdir()
        (tmp_path / "carried" / str(index)).rename(call / str(index))
        assert gpu_parts.stage(call, stage) == list(range(1, index + 1))
        if index < 3:
            with pytest.raises(SystemExit) as missing:
                gpu_parts.assemble(stage, tmp_path / "joined")
            assert missing.value.code == gpu_parts.INCOMPLETE
    joined = gpu_parts.assemble(stage, tmp_path / "joined")
    assert joined.read_bytes() == payload.read_bytes()
    assert (stage / "1" / "prompts" / "a.txt").is_file()
    assert gpu_parts.assemble(stage, joined) == joined  # a second call keeps the checked file


def test_a_corrupted_part_is_refused_at_staging(tmp_path):
    pack_fixture(tmp_path)
    part = tmp_path / "carried" / "2" / "part-2"
    data = bytearray(part.read_bytes())
    data[100] ^= 1
    part.write_bytes(bytes(data))
    with pytest.raises(SystemExit, match="sha256 differs.*carry"):
        gpu_parts.stage(tmp_path / "carried", tmp_path / "stage")


@pytest.mark.parametrize("last_bytes", [30 * KIB, 140 * KIB])
def test_the_last_call_leaves_room_for_the_folders_it_carries_too(tmp_path, last_bytes):
    payload = tmp_path / "target.gguf"
    payload.write_bytes(os.urandom(300 * KIB))
    manifest = gpu_parts.pack(payload, {}, tmp_path / "carried", 200 * KIB, 50 * KIB, margin_bytes=4 * KIB,
                              last_call_bytes=last_bytes)
    sizes = [part["size"] for part in manifest["payload"]["parts"]]
    assert sum(sizes) == 300 * KIB and all(size <= 146 * KIB for size in sizes)
    assert sizes[-1] + last_bytes <= 146 * KIB  # the call that completes the payload also carries the folders
    assert len(sizes) == (3 if last_bytes == 30 * KIB else 4)  # 146 + 146 + 8 | 146 + 146 + 8 + 0


def test_pack_refuses_when_nothing_fits_beside_the_tree(tmp_path):
    with pytest.raises(SystemExit, match="no room"):
        pack_fixture(tmp_path, call_bytes=60 * KIB)


def test_check_out_names_what_would_not_come_back(tmp_path):
    out = tmp_path / "out"
    (out / "a" / "b" / "c").mkdir(parents=True)
    (out / "ok.json").write_text("{}")
    assert gpu_parts.check_out(out) == []
    (out / "a" / "b" / "c" / "deep.txt").write_text("x")
    (out / "bad name.txt").write_text("x")
    for i in range(7):
        (out / f"f{i}").write_text("x")
    problems = "\n".join(gpu_parts.check_out(out))
    assert "10 files" in problems and "deep.txt: more than two folders down" in problems
    assert "bad name.txt: a name with other characters" in problems


def test_check_requirements_reports_what_neither_the_wheels_nor_the_machine_have(tmp_path):
    wheels = tmp_path / "wheels"
    make_wheel(wheels, "probe_a", ["packaging>=1", "probe_b==1.0", "surely-not-installed-pkg", "x; extra == 'dev'"])
    make_wheel(wheels, "probe_b", ["packaging<1"])
    problems = gpu_parts.check_requirements(wheels)
    assert len(problems) == 2, problems
    assert "surely-not-installed-pkg: not installed" in problems[0] and "packaging<1" in problems[1]


# ------------------------------------------------------------------------------------------ the scripts, tiny
@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    """A tiny target and drafter, a token-only corpus made as the committed one is (96 prompts per shard), and
    the carried folder 1 with a wheel and the prompt files."""
    root = tmp_path_factory.mktemp("gpu")
    target = save_chat_target(root / "target")
    drafter = save_chat_drafter(root / "drafter", target, block_size=4)
    prompts = root / "prompts"
    prompts.mkdir()
    write_prompts(prompts / "gsm8k.jsonl", 97)
    for name in ("eval-gsm8k", "eval-mtbench"):
        write_prompts(prompts / f"{name}.jsonl", 2)
    main(["distill", "--target", str(target), "--prompts", str(prompts / "gsm8k.jsonl"), "--out",
          str(root / "corpus" / "gsm8k"), "--limit", "2", "--shard-size", "96", "--max-new-tokens", "12",
          "--no-features", "--target-layer-ids", "0,2", "--quiet"])
    make_wheel(root / "wheels", "dflash_probe", ["packaging"])
    payload = root / "payload.bin"
    payload.write_bytes(b"not needed: the target is given")
    gpu_parts.pack(payload, {"wheels": root / "wheels", "prompts": prompts}, root / "carried", 10 << 20, 0)
    return root, target, drafter


def run_script(script: str, root: Path, out: Path, **env) -> subprocess.CompletedProcess:
    environment = dict(os.environ, PYTHON=sys.executable, OUT=str(out), DFLASH_GPU_STAGE=str(root / "stage"),
                       DFLASH_GPU_CARRIED=str(root / "carried"), DFLASH_GPU_TARGET=str(root / "target"),
                       DEVICE="cpu", OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(REPO / "scripts" / script)], env=environment, capture_output=True, text=True,
                          timeout=600)


def test_gpu_train_script_end_to_end_on_a_tiny_target(tiny_plan, tmp_path):
    root, _, drafter = tiny_plan
    out = tmp_path / "out"
    result = run_script("gpu_train.sh", root, out, INIT_FROM=str(drafter), CORPUS=str(root / "corpus"),
                        MASK=str(mask_token_id(chat_tokenizer())), TOTAL_SECONDS="300", DISTILL_SECONDS="60",
                        DISTILL_EXTRA="1", DISTILL_TOKENS="6", DISTILL_BATCH="2", EVAL_SECONDS="60", BATCH="1",
                        ANCHORS="4", EPOCHS="50", EXPORT_EVERY="0", ATTN="sdpa", EVAL_LIMIT="1", EVAL_TOKENS="6",
                        EVAL_BLOCK="4")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert (root / "stage" / "site" / "dflash_probe" / "__init__.py").is_file()  # the carried wheel was installed
    assert ShardDataset(root / "stage" / "data" / "gsm8k").paths[-1].name == "shard-00001.safetensors"  # continued
    assert gpu_parts.check_out(out) == []
    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert "drafter/config.json" in files and "result.json" in files and "run.log" in files, files
    assert not any(f.endswith(".py") for f in files)
    result_json = json.loads((out / "result.json").read_text())
    assert result_json["summary"]["step"] >= 1 and result_json["eval"]["gsm8k"]["results"][0]["block_size"] == 4
    trained = DFlashDraftModel.from_pretrained(out / "drafter")
    start = DFlashDraftModel.from_pretrained(drafter)
    assert any((a.float() - b.float()).abs().max() > 0 for a, b in zip(trained.parameters(), start.parameters()))


def test_gpu_speed_script_end_to_end_on_a_tiny_target(tiny_plan, tmp_path):
    root, _, drafter = tiny_plan
    out = tmp_path / "out"
    result = run_script("gpu_speed.sh", root, out, SPEED_DRAFT=str(drafter), SPEED_QWEN3="tiny", SPEED_TOKENS="16",
                        SPEED_PROMPTS="1", SPEED_REPEATS="1", SPEED_SECONDS="300")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert gpu_parts.check_out(out) == []
    rows = json.loads((out / "speed.json").read_text())["summary"]
    assert [(r["setup"], r["method"]) for r in rows] == (
        [("smollm2", m) for m in ("greedy", "dflash", "dflash_full", "builtin", "reference")]
        + [("qwen3-tiny", m) for m in ("greedy", "dflash_full", "builtin", "reference")])
    assert all(r["identical"] for r in rows)  # float32: every method is lossless
    for setup in ("smollm2", "qwen3-tiny"):  # same proposals at full blocks: the same rounds (pinned on Qwen3)
        tau = {r["method"]: r["tau"] for r in rows if r["setup"] == setup}
        assert tau["greedy"] == 1 and tau["dflash_full"] == tau["builtin"] == tau["reference"], (setup, tau)
    assert [r["tau"] for r in rows if r["setup"] == "qwen3-tiny"][1] > 2
    assert "| qwen3-tiny | reference |" in (out / "speed.md").read_text()
