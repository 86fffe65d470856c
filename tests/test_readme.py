"""The README's "Use" snippet runs as written: on tiny folders everywhere, and on the real SmolLM2 when present."""

import re
from pathlib import Path

import pytest
import torch
from conftest import save_chat_drafter, save_chat_target

import dflash_hf.assets

README = Path(__file__).resolve().parent.parent / "README.md"


def use_snippet(max_new_tokens: int) -> str:
    """The first Python block of the README's "Use" section, with its ``max_new_tokens`` lowered to keep tests fast
    (each line must pass one: a line without it would run into the target's default length)."""
    section = README.read_text().split("\n## Use\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    generate_lines = [line for line in code.splitlines() if ".generate(" in line]
    assert generate_lines and all("max_new_tokens=" in line for line in generate_lines)
    return re.sub(r"max_new_tokens=\d+", f"max_new_tokens={max_new_tokens}", code)


def run_snippet(max_new_tokens: int) -> dict:
    namespace = {}
    exec(compile(use_snippet(max_new_tokens), str(README), "exec"), namespace)
    return namespace


def test_use_snippet_runs_on_tiny_folders(tmp_path, monkeypatch):
    target = save_chat_target(tmp_path / "target")
    draft = save_chat_drafter(tmp_path / "draft", target, block_size=16)
    monkeypatch.setattr(dflash_hf.assets, "prepare_default_target", lambda: target)
    monkeypatch.setattr(dflash_hf.assets, "default_draft_path", lambda: draft)
    names = run_snippet(8)
    stats = names["draft"].last_stats  # of the last call: num_assistant_tokens=7, blocks of 8 instead of 16
    assert stats.num_rounds > 0 and stats.block_size == 8


def test_use_snippet_runs_on_smollm2(smollm2_path):
    names = run_snippet(16)
    stats, out = names["draft"].last_stats, names["out"]
    assert out.shape[1] == names["inputs"]["input_ids"].shape[1] + 16
    assert stats.mean_acceptance_length >= 1.0
    plain = names["target"].generate(**names["inputs"], max_new_tokens=16, do_sample=False)
    first = names["target"].generate(**names["inputs"], assistant_model=names["draft"], max_new_tokens=16)
    assert torch.equal(first, plain)
