"""The committed corpora (dflash_hf/corpora): each folder's manifest lists exactly the shards it holds, counts their
response tokens, and every shard is a token-only shard of the layout `dflash-hf distill --no-features` writes."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

CORPORA = Path(__file__).resolve().parents[1] / "dflash_hf" / "corpora"
FOLDERS = sorted(p.parent for p in CORPORA.glob("*/*/manifest.json"))


def test_there_are_committed_corpora():
    assert len(FOLDERS) >= 9


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_corpus_manifest_says_what_its_folder_holds(folder):
    manifest = json.loads((folder / "manifest.json").read_text())
    shards = sorted(p.name for p in folder.glob("shard-*.safetensors"))
    assert manifest["finished_shards"] == shards
    assert shards == [f"shard-{i:05d}.safetensors" for i in range(len(shards))]  # a prefix: resuming goes on from it
    assert len(shards) <= manifest["num_shards"]
    tokens = 0
    for name in shards:
        shard = load_file(folder / name)
        assert set(shard) == {"input_ids", "loss_mask", "offsets"}
        assert shard["input_ids"].dtype == torch.uint16 and shard["loss_mask"].dtype == torch.uint8
        offsets = shard["offsets"]
        assert int(offsets[0]) == 0 and int(offsets[-1]) == shard["input_ids"].numel() == shard["loss_mask"].numel()
        assert bool((offsets[1:] > offsets[:-1]).all())
        tokens += int(shard["loss_mask"].sum())
    assert manifest["response_tokens"] == tokens
    for key in ("how", "prompts", "target", "dtype", "max_new_tokens"):
        assert manifest.get(key), f"{folder.name}/manifest.json says nothing under {key!r}"
    for resume in manifest.get("resumes", []):
        assert set(resume["shards"]) <= set(shards)
        assert "/" not in resume["target"] or "prepare" in resume["target"]  # a description, not a machine's path
