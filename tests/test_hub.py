"""Hub assets: model card, z-lab <-> built-in conversion, pre-upload checks, dry-run upload, custom_generate.

Everything runs offline on tiny random models; the upload tests replace `HfApi` so nothing can reach the network.
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import random_prompt, tiny_target
from safetensors.torch import load_file, save_file
from transformers import MuseGlimmerAssistantModel
from transformers.generation import BaseStreamer

from dflash_hf import DFlashConfig, DFlashDraftModel, hub
from dflash_hf.hub import (
    convert_checkpoint,
    publishable_files,
    push_to_hub,
    validate_for_publishing,
    write_model_card,
)

REPO_ROOT = Path(__file__).resolve().parent.parent
HUB_ASSETS = REPO_ROOT / "hub_assets"
NEW_TOKENS = 16


@pytest.fixture(scope="module")
def target():
    return tiny_target("qwen3")


def make_drafter(target, dtype=torch.float32, **overrides) -> DFlashDraftModel:
    """Random drafter whose norms are random too, so that a wrong rename of ``hidden_norm`` would show."""
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=3, num_hidden_layers=2, block_size=4, target_layer_ids=[1, 2], **overrides
    )
    torch.manual_seed(1)
    drafter = DFlashDraftModel(config)
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return drafter.to(dtype).eval()


@pytest.fixture
def saved_drafter(target, tmp_path) -> Path:
    path = tmp_path / "draft"
    make_drafter(target).save_pretrained(path)
    return path


@pytest.fixture
def prompt():
    return random_prompt(7, length=10)


def greedy(target, prompt, **kwargs):
    return target.generate(prompt, max_new_tokens=NEW_TOKENS, do_sample=False, **kwargs)


def test_round_trip_is_bit_exact(target, tmp_path):
    source = tmp_path / "zlab"
    make_drafter(target, torch.bfloat16).save_pretrained(source)
    convert_checkpoint(source, tmp_path / "builtin", to="builtin")
    convert_checkpoint(tmp_path / "builtin", tmp_path / "back", to="zlab")

    original, back = load_file(source / "model.safetensors"), load_file(tmp_path / "back" / "model.safetensors")
    assert original.keys() == back.keys()
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype == torch.bfloat16
        assert torch.equal(back[name], tensor), name
    assert json.loads((tmp_path / "back" / "config.json").read_text()) == json.loads(
        (source / "config.json").read_text()
    )
    problems = validate_for_publishing(tmp_path / "back")  # a publishable dflash-hf checkpoint, card aside
    assert len(problems) == 1 and problems[0].startswith("README.md (model card) is missing")

    # The built-in class loads every converted tensor under its own names: nothing missing, nothing left over.
    builtin_weights = load_file(tmp_path / "builtin" / "model.safetensors")
    builtin = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "builtin")
    assert builtin.state_dict().keys() == builtin_weights.keys()
    assert {"encoder.fc.weight", "encoder.output_norm_enc.weight"} <= builtin_weights.keys()
    assert builtin.dtype == torch.bfloat16
    assert builtin.config.rope_parameters == DFlashConfig.from_pretrained(source).rope_parameters


def assert_same_forward(ours, builtin):
    noise, context = torch.randn(1, 4, 64), torch.randn(1, 9, 128)
    position_ids = torch.arange(13)[None]
    with torch.no_grad():
        a = ours(noise_embeds=noise, context_hidden_states=context, position_ids=position_ids).last_hidden_state
        b = builtin(noise_embeds=noise, context_hidden_states=context, position_ids=position_ids).last_hidden_state
    assert torch.equal(a, b)


def test_sliding_window_survives_conversion(target, tmp_path, prompt):
    """MuseGlimmer defaults to all-sliding layers with window 2048: the drafter's own layer types and window win.

    No forward comparison here: without a cache, MuseGlimmer builds its sliding mask for the block only and so
    attends to the whole context, and its bidirectional window is inclusive (``|q - k| <= w``, ours ``q - k < w``).
    """
    layer_types = ["sliding_attention", "full_attention"]
    make_drafter(target, layer_types=layer_types, sliding_window=5, is_causal=False).save_pretrained(tmp_path / "z")
    builtin = MuseGlimmerAssistantModel.from_pretrained(convert_checkpoint(tmp_path / "z", tmp_path / "b")).eval()
    assert builtin.config.layer_types == layer_types and builtin.config.sliding_window == 5
    out = greedy(target, prompt, assistant_model=builtin, speculation_type="dflash")
    assert torch.equal(out, greedy(target, prompt))
    back = DFlashConfig.from_pretrained(convert_checkpoint(tmp_path / "b", tmp_path / "z2", to="zlab"))
    assert back.layer_types == layer_types and back.sliding_window == 5
    assert back.is_causal is False  # the built-in drafter's sliding layers are bidirectional: say so explicitly


def test_drafts_the_builtin_class_cannot_reproduce_are_not_converted(target, tmp_path):
    """Causal sliding layers (z-lab's default without `is_causal`), the newer keys and DFlash2 have no built-in twin."""
    make_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=5).save_pretrained(tmp_path / "c")
    with pytest.raises(ValueError, match="causal layer 0"):
        convert_checkpoint(tmp_path / "c", tmp_path / "c2")
    make_drafter(target, output_multiplier=0.5).save_pretrained(tmp_path / "m")
    with pytest.raises(ValueError, match="output_multiplier"):
        convert_checkpoint(tmp_path / "m", tmp_path / "m2")


def test_validation_knows_dflash2_checkpoints(tmp_path):
    from published import dflash2_config, write_checkpoint

    folder = write_checkpoint(tmp_path / "d2", dflash2_config(target := tiny_target()))
    DFlashDraftModel.from_pretrained(folder).save_pretrained(tmp_path / "saved")
    write_model_card(tmp_path / "saved", "org/target")
    assert validate_for_publishing(tmp_path / "saved") == []
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    del config["dflash_config"]["selector_rank"]
    (tmp_path / "saved" / "config.json").write_text(json.dumps(config))
    assert validate_for_publishing(tmp_path / "saved") == ["config.json lacks `dflash_config.selector_rank` (DFlash2)"]
    assert target.config.vocab_size == 96


def test_builtin_conversion_decodes_like_ours(target, saved_drafter, tmp_path, prompt):
    ours = DFlashDraftModel.from_pretrained(saved_drafter).eval()
    builtin = MuseGlimmerAssistantModel.from_pretrained(convert_checkpoint(saved_drafter, tmp_path / "b")).eval()

    assert_same_forward(ours, builtin)
    plain = greedy(target, prompt)
    assert torch.equal(greedy(target, prompt, assistant_model=ours), plain)
    assert torch.equal(greedy(target, prompt, assistant_model=builtin, speculation_type="dflash"), plain)


def test_model_card(saved_drafter):
    yaml = pytest.importorskip("yaml")
    card = write_model_card(saved_drafter, "Qwen/Qwen3-8B", {"gsm8k": 5.123, "mt-bench": 3.5}, "me/qwen3-dflash")
    text = card.read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == {"library_name": "transformers", "base_model": "Qwen/Qwen3-8B",
                     "tags": ["dflash", "speculative-decoding"]}
    assert "| gsm8k | 5.12 |" in text and "| mt-bench | 3.50 |" in text
    assert "| Target layer ids (`hidden_states[i + 1]`) | `[1, 2]` |" in text and "| Mask token id | 3 |" in text
    assert 'AutoModel.from_pretrained("me/qwen3-dflash", trust_remote_code=True' in text
    assert '"method": "dflash", "model": "me/qwen3-dflash", "num_speculative_tokens": 3}' in text
    assert "--attention-backend flash_attn" in text
    assert "--speculative-algorithm DFLASH" in text and "--speculative-num-draft-tokens 4" in text

    # Without a target: no base_model, a placeholder in the commands, no acceptance section.
    text = write_model_card(saved_drafter).read_text()
    assert "base_model" not in yaml.safe_load(text.split("---\n")[1])
    assert "vllm serve <target-model>" in text and "Measured acceptance" not in text


def edit_config(path: Path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def test_validation_names_each_problem(saved_drafter):
    write_model_card(saved_drafter, "Qwen/Qwen3-8B")
    assert validate_for_publishing(saved_drafter) == []

    edit_config(saved_drafter, num_target_layers=None, auto_map={"AutoModel": "dflash.DFlashDraftModel"})
    assert validate_for_publishing(saved_drafter) == [
        "config.json lacks `num_target_layers` (read by vLLM/SGLang)",
        "auto_map names dflash.DFlashDraftModel but dflash.py is missing",
    ]


def test_validation_rejects_extra_weights_and_missing_card(saved_drafter):
    weights = load_file(saved_drafter / "model.safetensors")
    weights["lm_head.weight"] = torch.zeros(128, 64)
    del weights["norm.weight"]
    save_file(weights, saved_drafter / "model.safetensors", metadata={"format": "pt"})
    (saved_drafter / "own_dflash.py").write_text("from .own_helpers import x\n")
    edit_config(saved_drafter, auto_map={"AutoModel": "own_dflash.DFlashDraftModel"})

    problems = validate_for_publishing(saved_drafter)
    assert "weight norm.weight is missing" in problems
    assert "unexpected weight lm_head.weight (the drafter borrows the target's; engines expect none)" in problems
    assert "own_dflash.py imports own_helpers.py, which is missing" in problems
    assert problems[-1].startswith("README.md (model card) is missing")


class RecordingApi:
    """Stands in for `HfApi`: records calls, reaches nothing."""

    calls = []

    def __init__(self, token=None):
        self.calls.append(("init", token))

    def create_repo(self, repo_id, **kwargs):
        self.calls.append(("create_repo", repo_id, kwargs))

    def create_commit(self, **kwargs):
        self.calls.append(("create_commit", kwargs))


def test_push_dry_run_and_upload_calls(saved_drafter, monkeypatch):
    monkeypatch.setattr(hub, "HfApi", RecordingApi)
    RecordingApi.calls = []
    with pytest.raises(ValueError, match="README.md \\(model card\\) is missing"):
        push_to_hub(saved_drafter, "me/draft", dry_run=True)

    write_model_card(saved_drafter)
    (saved_drafter / "__pycache__").mkdir()
    (saved_drafter / "__pycache__" / "x.pyc").write_bytes(b"0")
    files = push_to_hub(saved_drafter, "me/draft", dry_run=True)
    names = [name for name, _ in files]
    assert names == ["README.md", "config.json", "configuration_dflash.py", "generation_dflash.py",
                     "model.safetensors", "modeling_dflash.py", "modeling_dflash2.py"]
    assert dict(files)["model.safetensors"] == (saved_drafter / "model.safetensors").stat().st_size
    assert RecordingApi.calls == []

    assert push_to_hub(saved_drafter, "me/draft", token="t", private=True) == files
    assert RecordingApi.calls[:2] == [
        ("init", "t"),
        ("create_repo", "me/draft", {"private": True, "exist_ok": True, "repo_type": "model"}),
    ]
    commit = RecordingApi.calls[2][1]
    assert commit["repo_id"] == "me/draft"
    assert [op.path_in_repo for op in commit["operations"]] == names
    assert publishable_files(saved_drafter) == files


def test_push_adds_the_remote_code_a_drafter_folder_lacks(saved_drafter, tmp_path):
    """A drafter folder holds config, weights and card; the upload adds the package's remote code (real files)."""
    write_model_card(saved_drafter)
    for name in hub.REMOTE_CODE_FILES:
        (saved_drafter / name).unlink()
    assert validate_for_publishing(saved_drafter) == []
    sources = hub.upload_sources(saved_drafter)
    assert sorted(sources) == sorted(["README.md", "config.json", "model.safetensors", *hub.REMOTE_CODE_FILES])
    for name in hub.REMOTE_CODE_FILES:
        assert not sources[name].is_symlink()
        assert sources[name].read_bytes() == (REPO_ROOT / name).read_bytes()


class Collector(BaseStreamer):
    def __init__(self):
        self.puts, self.ended = [], False

    def put(self, value):
        self.puts.append(value.reshape(-1).clone())

    def end(self):
        self.ended = True


def test_custom_generate_from_local_repo(target, saved_drafter, tmp_path, prompt):
    repo = tmp_path / "dflash_generate"
    shutil.copytree(HUB_ASSETS / "custom_generate", repo / "custom_generate")
    draft = DFlashDraftModel.from_pretrained(saved_drafter).eval()
    plain = greedy(target, prompt)

    streamer = Collector()
    out = target.generate(
        input_ids=prompt, custom_generate=str(repo), trust_remote_code=True, assistant_model=draft,
        streamer=streamer, max_new_tokens=NEW_TOKENS, do_sample=False,
    )
    assert torch.equal(out, plain)
    assert torch.equal(streamer.puts[0], prompt[0]) and streamer.ended
    assert torch.equal(torch.cat(streamer.puts[1:]), plain[0, prompt.shape[1]:])
    assert draft.last_stats.num_rounds > 0  # our candidate generator ran, not plain decoding

    builtin = MuseGlimmerAssistantModel.from_pretrained(convert_checkpoint(saved_drafter, tmp_path / "b")).eval()
    out = greedy(target, prompt, custom_generate=str(repo), trust_remote_code=True, assistant_model=builtin)
    assert torch.equal(out, plain)

    with pytest.raises(ValueError, match="needs the drafter"):
        greedy(target, prompt, custom_generate=str(repo), trust_remote_code=True)
