"""Hub assets: model card, z-lab <-> built-in conversion, pre-upload checks, dry-run upload, custom_generate.

Everything runs offline on tiny random models; the upload tests replace `HfApi` so nothing can reach the network.
"""

import json
import os
import shutil
import stat
import time
from pathlib import Path

import pytest
import torch
from conftest import random_prompt, randomize_norms, tiny_drafter, tiny_target
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
    """A tiny drafter with random norms too, so that a wrong rename of ``hidden_norm`` would show."""
    return randomize_norms(tiny_drafter(target, target_layer_ids=[1, 2], **overrides)).to(dtype)


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


def test_model_card_fills_base_model_commands_and_acceptance(saved_drafter):
    yaml = pytest.importorskip("yaml")
    card = write_model_card(saved_drafter, "Qwen/Qwen3-8B", {"gsm8k": 5.123, "mt-bench": 3.5}, "me/qwen3-dflash")
    text = card.read_text()
    front = yaml.safe_load(text.split("---\n")[1])
    assert front == {"library_name": "transformers", "base_model": "Qwen/Qwen3-8B",
                     "tags": ["dflash", "speculative-decoding"]}
    assert "| gsm8k | 5.12 |" in text and "| mt-bench | 3.50 |" in text
    assert "| Target layer ids (`hidden_states[i + 1]`) | `[1, 2]` |" in text and "| Mask token id | 3 |" in text
    assert "| Draft vocabulary (`dflash_config.draft_vocab`) | all tokens |" in text
    assert 'AutoModel.from_pretrained("me/qwen3-dflash", trust_remote_code=True' in text
    assert '"method": "dflash", "model": "me/qwen3-dflash", "num_speculative_tokens": 3}' in text
    assert "--attention-backend flash_attn" in text
    assert "--speculative-algorithm DFLASH" in text and "--speculative-num-draft-tokens 4" in text

    # Without a target the card would publish a placeholder: refused, and the card written above is kept.
    with pytest.raises(ValueError, match="needs the target's Hub id"):
        write_model_card(saved_drafter)
    assert card.read_text() == text
    # Without measurements: no acceptance section.
    assert "Measured acceptance" not in write_model_card(saved_drafter, "Qwen/Qwen3-8B").read_text()


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

    write_model_card(saved_drafter, "Qwen/Qwen3-8B")
    (saved_drafter / "__pycache__").mkdir()
    (saved_drafter / "__pycache__" / "x.pyc").write_bytes(b"0")
    files = push_to_hub(saved_drafter, "me/draft", dry_run=True)
    names = [name for name, _ in files]
    assert names == ["README.md", "batch_generation_dflash.py", "config.json", "configuration_dflash.py",
                     "controller_dflash.py", "generation_dflash.py", "model.safetensors", "modeling_dflash.py", "modeling_dflash2.py"]
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
    write_model_card(saved_drafter, "Qwen/Qwen3-8B")
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


# ---- what a new user runs into -------------------------------------------------------------------------------


def run_cli(argv, capsys) -> tuple[int, str]:
    from dflash_hf.cli import main

    status = main(argv)
    return status, capsys.readouterr().err


def test_convert_from_a_missing_source_says_so(tmp_path, capsys):
    status, err = run_cli(["convert", str(tmp_path / "nope"), str(tmp_path / "out"), "--to", "builtin"], capsys)
    assert status == 1 and err == f"dflash-hf convert: error: {tmp_path / 'nope'} is not a folder: pass a local " \
        "drafter folder (config.json + *.safetensors)\n"
    assert not (tmp_path / "out").exists()


def test_convert_refuses_to_overwrite_and_replaces_whole_with_overwrite(saved_drafter, tmp_path, capsys):
    write_model_card(saved_drafter, "Qwen/Qwen3-8B")
    out = tmp_path / "out"
    convert_checkpoint(saved_drafter, out, to="builtin")
    convert_checkpoint(out, tmp_path / "zlab", to="zlab")  # has remote code
    status, err = run_cli(["convert", str(out), str(tmp_path / "zlab"), "--to", "builtin"], capsys)
    assert status == 1 and "already exists" in err and "--overwrite" in err
    assert (tmp_path / "zlab" / "modeling_dflash.py").is_file()  # untouched

    assert run_cli(["convert", str(out), str(tmp_path / "zlab"), "--to", "builtin", "--overwrite"], capsys)[0] == 0
    assert sorted(p.name for p in (tmp_path / "zlab").iterdir()) == ["README.md", "config.json", "model.safetensors"]
    assert (tmp_path / "zlab" / "README.md").read_text() == (saved_drafter / "README.md").read_text()  # card kept
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_convert_writes_ordinary_file_modes(saved_drafter, tmp_path):
    old = os.umask(0o022)
    try:
        out = convert_checkpoint(saved_drafter, tmp_path / "out", to="builtin")
    finally:
        os.umask(old)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()} == {
        "config.json": 0o644, "model.safetensors": 0o644}


def test_convert_removes_what_a_killed_conversion_left(saved_drafter, tmp_path):
    dead = tmp_path / ".out.tmp-4194399-x1"  # pids stop at 4194304 (pid_max): its writer is gone
    alive = tmp_path / f".out.tmp-{os.getppid()}-x2"  # a live process may still be writing
    old_unowned = tmp_path / ".out.tmp-x3"  # no pid (older versions), two hours old
    for folder in (dead, alive, old_unowned):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"0" * 64)
    os.utime(old_unowned, (time.time() - 7200,) * 2)
    convert_checkpoint(saved_drafter, tmp_path / "out", to="builtin")
    assert not dead.exists() and not old_unowned.exists() and alive.exists()


@pytest.mark.parametrize("damage", ["empty", "truncated"])
def test_damaged_weights_are_one_line_in_convert_and_push(saved_drafter, tmp_path, capsys, damage):
    write_model_card(saved_drafter, "Qwen/Qwen3-8B")
    weights = saved_drafter / "model.safetensors"
    weights.write_bytes(b"" if damage == "empty" else weights.read_bytes()[:200])
    status, err = run_cli(["convert", str(saved_drafter), str(tmp_path / "out"), "--to", "builtin"], capsys)
    assert status == 1 and err.count("\n") == 1 and f"{weights} is " in err and "Traceback" not in err
    status, err = run_cli(["push", str(saved_drafter), "me/draft", "--dry-run"], capsys)
    assert status == 1 and "Traceback" not in err
    what = "is empty" if damage == "empty" else "is not a readable safetensors file"
    assert f"\n- {weights} {what}" in err and "copy or save the weights again" in err


def test_push_refuses_a_bad_repo_id_and_names_the_card_command(saved_drafter, capsys):
    status, err = run_cli(["push", str(saved_drafter), "not a repo id!!", "--dry-run"], capsys)
    assert status == 1 and err.startswith("dflash-hf push: error: 'not a repo id!!' is not a Hub repository id")
    status, err = run_cli(["push", str(saved_drafter), "me/draft", "--dry-run"], capsys)
    assert status == 1 and f"write it with `dflash-hf card {saved_drafter} --target TARGET_ID`" in err


def test_card_without_target_is_refused(saved_drafter, capsys):
    from dflash_hf.cli import main

    with pytest.raises(SystemExit) as info:
        main(["card", str(saved_drafter)])
    assert info.value.code == 2 and "--target" in capsys.readouterr().err
    assert not (saved_drafter / "README.md").exists()


def test_model_card_names_the_draft_vocabulary(saved_drafter):
    from dflash_hf.hub import set_draft_vocab

    set_draft_vocab(saved_drafter, [5, 3, 9])
    text = write_model_card(saved_drafter, "Qwen/Qwen3-8B").read_text()
    assert "| Draft vocabulary (`dflash_config.draft_vocab`) | 3 tokens (dflash-hf drafts from those rows" in text
