"""Drafter forward parity (eager/sdpa, hand-written reference, built-in contract) and checkpoint round trips."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import random_prompt, tiny_drafter, tiny_target
from reference import ReferenceDrafter
from safetensors.torch import load_file, save_file
from transformers import AutoModel, DynamicCache
from transformers.cache_utils import DFlashCache

from dflash_hf import DFlashConfig, DFlashDraftModel

ZLAB_WEIGHTS = {"fc.weight", "hidden_norm.weight", "norm.weight"} | {
    f"layers.{i}.{name}.weight"
    for i in range(2)
    for name in (
        "self_attn.q_proj",
        "self_attn.k_proj",
        "self_attn.v_proj",
        "self_attn.o_proj",
        "self_attn.q_norm",
        "self_attn.k_norm",
        "mlp.gate_proj",
        "mlp.up_proj",
        "mlp.down_proj",
        "input_layernorm",
        "post_attention_layernorm",
    )
}


def block_inputs(drafter, context_len=7, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.config.hidden_size
    noise = torch.randn(1, block, hidden, generator=g)
    features = torch.randn(1, context_len, len(drafter.config.target_layer_ids) * hidden, generator=g)
    return noise, features, torch.arange(context_len + block)[None]


def test_weight_names_are_the_zlab_names():
    drafter = tiny_drafter(tiny_target(), num_layers=2)
    assert set(drafter.state_dict()) == ZLAB_WEIGHTS


def test_eager_and_sdpa_agree_and_match_the_hand_written_reference():
    target = tiny_target()
    outputs = {}
    for attn in ("eager", "sdpa"):
        drafter = tiny_drafter(target, attn=attn)
        noise, features, positions = block_inputs(drafter)
        outputs[attn] = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    reference = ReferenceDrafter(drafter)(noise, features, torch.arange(7), torch.arange(7, 11))
    torch.testing.assert_close(outputs["eager"], outputs["sdpa"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(outputs["sdpa"], reference, rtol=1e-4, atol=1e-4)


def test_cache_keeps_context_only_and_incremental_equals_one_shot():
    drafter = tiny_drafter(tiny_target())
    noise, features, positions = block_inputs(drafter, context_len=9)
    one_shot = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    cache = DynamicCache()
    drafter(
        noise_embedding=noise,
        target_hidden=features[:, :5],
        position_ids=torch.arange(0, 5 + 4)[None],
        past_key_values=cache,
        use_cache=True,
    )
    assert cache.get_seq_length() == 5  # the block's keys/values were not kept
    incremental = drafter(
        noise_embedding=noise,
        target_hidden=features[:, 5:],
        position_ids=torch.arange(5, 13)[None],
        past_key_values=cache,
        use_cache=True,
    ).last_hidden_state
    assert cache.get_seq_length() == 9
    torch.testing.assert_close(incremental, one_shot, rtol=1e-5, atol=1e-5)


def test_builtin_contract_caches_block_for_its_own_crop():
    drafter = tiny_drafter(tiny_target())
    noise, features, positions = block_inputs(drafter)
    ours = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    cache = DFlashCache(config=drafter.config)
    cache.set_previous_accepted_tokens(7)
    builtin = drafter(
        noise_embeds=noise, context_hidden_states=features, position_ids=positions, past_key_values=cache
    ).last_hidden_state
    assert cache.get_seq_length() == 7 + 4
    torch.testing.assert_close(builtin, ours)


def test_matches_transformers_muse_glimmer_after_two_renames():
    """transformers' in-tree DFlash drafter computes the same function: a cross-check of our layer math."""
    from transformers import MuseGlimmerAssistantConfig, MuseGlimmerAssistantModel

    drafter = tiny_drafter(tiny_target(), attn="eager")
    c = drafter.config
    glimmer_config = MuseGlimmerAssistantConfig(
        hidden_size=c.hidden_size,
        intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_hidden_layers,
        num_attention_heads=c.num_attention_heads,
        num_key_value_heads=c.num_key_value_heads,
        head_dim=c.head_dim,
        rms_norm_eps=c.rms_norm_eps,
        rope_parameters=dict(c.rope_parameters),
        layer_types=["full_attention"] * c.num_hidden_layers,
        block_size=c.block_size,
        mask_token_id=c.mask_token_id,
        target_layer_ids=c.target_layer_ids,
    )
    glimmer_config._attn_implementation = "eager"
    glimmer = MuseGlimmerAssistantModel(glimmer_config).eval()
    renamed = {
        k.replace("fc.", "encoder.fc.", 1).replace("hidden_norm.", "encoder.output_norm_enc.", 1)
        if k.startswith(("fc.", "hidden_norm.")) else k: v
        for k, v in drafter.state_dict().items()
    }
    missing, unexpected = glimmer.load_state_dict(renamed, strict=False)
    assert not unexpected and all("rotary" in m for m in missing)
    noise, features, positions = block_inputs(drafter)
    ours = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    theirs = glimmer(noise_embeds=noise, context_hidden_states=features, position_ids=positions).last_hidden_state
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_only_see_their_window():
    target = tiny_target()
    drafter = tiny_drafter(target, layer_types=["sliding_attention", "full_attention"], sliding_window=6)
    assert drafter.config.sliding_window == 6
    noise, features, positions = block_inputs(drafter, context_len=12)
    windowed = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    # Context older than the window cannot matter to a sliding layer, but does to the full one: perturb it and
    # compare with an all-full drafter of the same weights.
    full = tiny_drafter(target, layer_types=["full_attention", "full_attention"])
    full.load_state_dict(drafter.state_dict())
    unwindowed = full(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    assert not torch.allclose(windowed, unwindowed)
    one_layer = tiny_drafter(
        target, num_layers=1, layer_types=["sliding_attention"], sliding_window=6, target_layer_ids=[1, 3]
    )
    recent = one_layer(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    features_old_changed = features.clone()
    features_old_changed[:, :5] += 3.0  # positions 0..4 are >= 6 behind every block position (12..15)
    changed = one_layer(noise_embedding=noise, target_hidden=features_old_changed, position_ids=positions)
    torch.testing.assert_close(changed.last_hidden_state, recent)


def test_save_load_round_trip_writes_zlab_config(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"config.json", "model.safetensors", "configuration_dflash.py", "modeling_dflash.py", "controller_dflash.py",
            "generation_dflash.py"} <= files
    config = json.loads((tmp_path / "config.json").read_text())
    for key in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "intermediate_size", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings", "block_size",
        "num_target_layers", "rope_scaling",
    ):  # fmt: skip
        assert key in config, key
    assert config["model_type"] == "qwen3" and config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["target_layer_ids"] == drafter.config.target_layer_ids
    assert config["dflash_config"]["mask_token_id"] == drafter.config.mask_token_id
    assert config["auto_map"]["AutoModel"] == "modeling_dflash.DFlashDraftModel"
    assert "target_layer_ids" not in config and "mask_token_id" not in config  # only inside dflash_config
    assert set(load_file(tmp_path / "model.safetensors")) == ZLAB_WEIGHTS

    loaded = DFlashDraftModel.from_pretrained(tmp_path).eval()
    noise, features, positions = block_inputs(drafter)
    expected = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    actual = loaded(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    assert torch.equal(actual, expected)

    remote = AutoModel.from_pretrained(tmp_path, trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules")
    ids = random_prompt(0)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=remote), plain)
    assert remote.last_stats.num_rounds > 0


def test_remote_code_works_where_dflash_hf_is_not_importable(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.save_pretrained(tmp_path / "draft")
    target.save_pretrained(tmp_path / "target")
    script = textwrap.dedent(
        f"""
        import sys, importlib.abc
        class Block(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name == "dflash_hf" or name.startswith("dflash_hf."):
                    raise ImportError("dflash_hf is hidden in this test")
        sys.meta_path.insert(0, Block())
        import torch
        torch.set_num_threads(1)
        from transformers import AutoModel, AutoModelForCausalLM
        target = AutoModelForCausalLM.from_pretrained({str(tmp_path / "target")!r})
        draft = AutoModel.from_pretrained({str(tmp_path / "draft")!r}, trust_remote_code=True)
        ids = torch.tensor([{random_prompt(0)[0].tolist()}])
        plain = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0)
        out = target.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=0, assistant_model=draft)
        assert torch.equal(out, plain), (out, plain)
        assert draft.last_stats.num_rounds > 0
        batch = torch.cat([ids, torch.cat([torch.zeros(1, 3, dtype=torch.long), ids[:, 3:]], 1)])  # left-padded
        mask = (torch.arange(ids.shape[1]) >= torch.tensor([[0], [3]])).long()
        plain = target.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
        out = target.generate(batch, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0,
                              assistant_model=draft)
        assert torch.equal(out, plain), (out, plain)  # the batched loop travels with the checkpoint too
        assert len(draft.last_stats.rows) == 2
        print("REMOTE-OK", type(draft).__module__)
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=tmp_path)
    assert "REMOTE-OK transformers_modules" in done.stdout, done.stderr[-3000:]


def write_published_layout(folder, drafter):
    """A folder exactly as z-lab publishes: qwen3 model_type, only AutoModel in auto_map, bf16 un-prefixed weights,
    block_size at the top level, dflash_config with the ids."""
    c = drafter.config
    folder.mkdir()
    config = {
        "architectures": ["DFlashDraftModel"],
        "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
        "model_type": "qwen3",
        "block_size": c.block_size,
        "num_target_layers": c.num_target_layers,
        "dflash_config": {"mask_token_id": c.mask_token_id, "target_layer_ids": c.target_layer_ids},
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": c.head_dim,
        "vocab_size": c.vocab_size,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": c.rope_parameters["rope_theta"],
        "rope_scaling": None,
        "max_position_embeddings": c.max_position_embeddings,
        "layer_types": ["full_attention"] * c.num_hidden_layers,
        "sliding_window": None,
        "use_sliding_window": False,
        "max_window_layers": c.num_hidden_layers,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (folder / "config.json").write_text(json.dumps(config))
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in drafter.state_dict().items()}, folder / "model.safetensors")


def test_published_zlab_folder_loads_and_generates(tmp_path):
    target = tiny_target()
    drafter = tiny_drafter(target)
    write_published_layout(tmp_path / "zlab", drafter)
    loaded = DFlashDraftModel.from_pretrained(tmp_path / "zlab")
    assert loaded.dtype == torch.bfloat16
    assert loaded.config.target_layer_ids == drafter.config.target_layer_ids
    assert loaded.config.block_size == drafter.config.block_size
    for name, tensor in drafter.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor.to(torch.bfloat16)), name
    ids = random_prompt(2)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=loaded), plain)


def test_zlab_folder_without_trust_remote_code_is_refused_as_assistant(tmp_path):
    target = tiny_target()
    write_published_layout(tmp_path / "zlab", tiny_drafter(target))
    plain_qwen3 = AutoModel.from_pretrained(tmp_path / "zlab")  # transformers silently builds a Qwen3Model
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        target.generate(random_prompt(0), max_new_tokens=4, assistant_model=plain_qwen3)


def test_block_size_inside_dflash_config_is_read():
    config = DFlashConfig(
        hidden_size=64, num_hidden_layers=2, vocab_size=96, dflash_config={"block_size": 8, "mask_token_id": 3}
    )
    assert config.block_size == 8 and config.to_dict()["block_size"] == 8
