"""Every published drafter layout loads and runs in ``target.generate(**inputs, assistant_model=draft)``: z-lab's own
remote-code classes, v1 with the newer (Gemma-style) keys, DFlash2 -- each checkpoint written by the test from the
documented config and header shapes (tests/published.py), each checked against tests/reference.py."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import random_prompt, tiny_target
from oracle import corrupted, pin
from published import base_config, dflash2_config, gemma_style_config, random_weights, write_checkpoint
from reference import ReferenceDrafter, reference_generate
from safetensors.torch import load_file
from test_generation import greedy, varied_cuts
from transformers import AutoModel
from zlab_dflash_standin import CODEBOOK_KEY_MAPPING

from dflash_hf import DFlash2DraftModel, DFlashConfig, DFlashDraftModel, as_dflash_drafter
from dflash_hf.generation_dflash import is_dflash_drafter


def load(folder, attn="sdpa"):
    return DFlashDraftModel.from_pretrained(folder, dtype=torch.float32, attn_implementation=attn).eval()


def drafter_inputs(drafter, context_len=9, block=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = drafter.config.hidden_size
    noise = torch.randn(1, block, hidden, generator=g)
    features = torch.randn(1, context_len, len(drafter.config.target_layer_ids) * hidden, generator=g)
    return noise, features


def check_forward_matches_reference(drafter, raw, context_len=9, block=4):
    noise, features = drafter_inputs(drafter, context_len, block)
    positions = torch.arange(context_len + block)[None]
    ours = drafter(noise_embedding=noise, target_hidden=features, position_ids=positions).last_hidden_state
    expected = ReferenceDrafter(drafter, raw)(
        noise, features, torch.arange(context_len), torch.arange(context_len, context_len + block)
    )
    torch.testing.assert_close(ours, expected, rtol=1e-4, atol=1e-4)
    return ours


def check_rounds_match_reference(target, drafter, raw, tokens=30):
    """Greedy equals plain greedy, and every round's proposals equal the reference loop's while acceptance varies."""
    ids = random_prompt(7)
    plain = greedy(target, ids, tokens)
    generators = pin(drafter, plain, varied_cuts)
    assert torch.equal(greedy(target, ids, tokens, assistant_model=drafter), plain)

    def propose(round_index, anchor, real):
        num = plain[:, anchor + 1 : anchor + 1 + real.shape[1]].shape[1]
        return corrupted(plain, anchor + 1, num, varied_cuts(round_index, num), target.config.vocab_size)

    reference, reference_rounds = reference_generate(target, drafter, ids, tokens, propose, raw=raw)
    ours = generators[0].real_proposals
    assert torch.equal(reference, plain) and len(ours) == len(reference_rounds) > 3
    for index, (mine, theirs) in enumerate(zip(ours, reference_rounds)):
        assert torch.equal(mine, theirs), f"round {index}: {mine} vs reference {theirs}"
    del drafter.make_candidate_generator  # unpin: plain generation with the drafter's own proposals
    assert torch.equal(greedy(target, ids, tokens, assistant_model=drafter), plain)


# --- z-lab's own remote code --------------------------------------------------------------------------------------


def test_importing_the_package_installs_the_dispatch():
    script = (
        "import dflash_hf\nfrom transformers import GenerationMixin\n"
        "assert getattr(GenerationMixin._get_candidate_generator, '_dflash_dispatch', False)\nprint('INSTALLED')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert "INSTALLED" in done.stdout, done.stderr[-2000:]


@pytest.mark.parametrize("layout", ["v1", "dflash2"])
def test_zlab_remote_code_drafter_runs_as_assistant_on_its_own_weights(target, layout, tmp_path):
    config = base_config(target, block_size=4) if layout == "v1" else dflash2_config(target)
    folder = write_checkpoint(tmp_path / layout, config, remote_code=True)
    zlab = AutoModel.from_pretrained(folder, trust_remote_code=True, dtype=torch.float32, key_mapping=CODEBOOK_KEY_MAPPING)
    assert type(zlab).__module__.startswith("transformers_modules") and type(zlab).__name__ == config["architectures"][0]
    assert not is_dflash_drafter(zlab)

    ids = random_prompt(1)
    plain = greedy(target, ids, 16)
    assert torch.equal(greedy(target, ids, 16, assistant_model=zlab), plain)
    assert zlab.last_stats is not None and zlab.last_stats.num_rounds > 0

    adopted = as_dflash_drafter(zlab)
    assert as_dflash_drafter(zlab) is adopted  # adopted once
    theirs = {id(parameter) for parameter in zlab.parameters()}
    assert {id(parameter) for parameter in adopted.parameters()} == theirs  # the same Parameter objects, no copy
    ours = load(folder)
    assert type(adopted) is type(ours)
    noise, features = drafter_inputs(ours)
    expected = ours(noise_embedding=noise, target_hidden=features).last_hidden_state
    torch.testing.assert_close(adopted(noise_embedding=noise, target_hidden=features).last_hidden_state, expected)


def test_zlab_remote_drafter_with_unknown_weights_gets_a_working_fix(tmp_path):
    target = tiny_target()
    folder = write_checkpoint(tmp_path / "zlab", base_config(target, block_size=4), remote_code=True)
    zlab = AutoModel.from_pretrained(folder, trust_remote_code=True)
    zlab.register_parameter("extra_gate", torch.nn.Parameter(torch.zeros(3)))  # a layout we do not know
    with pytest.raises(ValueError, match=r"DFlashDraftModel\.from_pretrained\(path\)") as error:
        target.generate(random_prompt(0), max_new_tokens=4, assistant_model=zlab)
    assert "without the DFlash code" not in str(error.value)
    assert torch.equal(greedy(target, random_prompt(0), 8, assistant_model=load(folder)), greedy(target, random_prompt(0), 8))


# --- v1 with the newer keys (Gemma-style) ------------------------------------------------------------------------


def test_newer_keys_are_read_dflash_config_first_and_saved_inside_it(tmp_path):
    target = tiny_target()
    raw = gemma_style_config(target)
    raw["output_multiplier"] = 99.0  # the top-level copy loses to dflash_config's 0.5
    config = DFlashConfig(**raw)
    assert (config.input_embedding_scale, config.output_multiplier) == (8.0, 0.5)
    assert config.final_logit_softcapping == 3.0 and config.is_causal is True  # top level only
    assert config.selector_top_k is None and DFlashConfig(**base_config(target, block_size=4)).is_causal is None
    assert [config.layer_is_causal(i) for i in range(2)] == [True, True]
    assert [DFlashConfig(**dict(raw, is_causal=None)).layer_is_causal(i) for i in range(2)] == [True, False]
    saved = config.to_dict()
    assert saved["dflash_config"]["output_multiplier"] == 0.5 and "output_multiplier" not in saved
    assert saved["dflash_config"]["final_logit_softcapping"] == 3.0 and saved["is_causal"] is True
    assert "is_causal" not in DFlashConfig(**base_config(target, block_size=4)).to_dict()


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_gemma_style_forward_equals_the_reference(attn, tmp_path):
    target = tiny_target()
    raw = gemma_style_config(target, window=6)
    drafter = load(write_checkpoint(tmp_path / "gemma", raw), attn)
    ours = check_forward_matches_reference(drafter, raw, context_len=9, block=4)
    unmasked = load(write_checkpoint(tmp_path / "plain", dict(raw, is_causal=False, layer_types=["full_attention"] * 2)))
    noise, features = drafter_inputs(unmasked)
    assert not torch.allclose(unmasked(noise_embedding=noise, target_hidden=features).last_hidden_state, ours)

    rows = torch.randn(5, drafter.config.hidden_size)
    head = target.get_output_embeddings()
    with torch.no_grad():
        expected = ReferenceDrafter(drafter, raw).logits(head.weight, rows)
        torch.testing.assert_close(drafter.transform_logits(head(rows)), expected)
    assert float(expected.abs().max()) <= 3.0  # the softcap bounds them


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("block_size", [2, 8, 16])
@pytest.mark.parametrize("layout", ["gemma_style", "dflash2"])
def test_greedy_is_plain_greedy_and_rounds_match_the_reference(target, layout, attn, block_size, tmp_path):
    """Gemma-style v1 (a causal window of 6) and DFlash2 (all sliding, bidirectional), Qwen3 and Llama targets."""
    if layout == "gemma_style":
        raw = gemma_style_config(target, block_size=block_size, window=6)
    else:
        raw = dflash2_config(target, block_size=block_size)
    drafter = load(write_checkpoint(tmp_path / layout, raw), attn)
    drafter.adaptive_block_size = False
    check_rounds_match_reference(target, drafter, raw)


def test_embedding_scale_uses_the_raw_table(tmp_path):
    target = tiny_target()
    drafter = load(write_checkpoint(tmp_path / "gemma", gemma_style_config(target)))
    embed = target.get_input_embeddings()
    ids = torch.tensor([[5, 3, 3]])
    assert torch.equal(drafter.embed_block(embed, ids), embed.weight[ids] * 8.0)


# --- DFlash2 ---------------------------------------------------------------------------------------------------


def test_dflash2_published_layout_loads_with_the_one_loader(tmp_path):
    target = tiny_target()
    raw = dflash2_config(target)
    folder = write_checkpoint(tmp_path / "d2", raw)
    assert "auto_map" not in json.loads((folder / "config.json").read_text())
    drafter = DFlashDraftModel.from_pretrained(folder)
    assert type(drafter) is DFlash2DraftModel and drafter.dtype == torch.bfloat16
    weights = load_file(folder / "model.safetensors")
    assert set(drafter.state_dict()) == set(weights)  # bare codebook keys, nothing missing or extra
    for name, tensor in weights.items():
        assert torch.equal(drafter.state_dict()[name], tensor), name
    config = drafter.config
    assert (config.conv_kernel_size, config.conv_group_size, config.selector_rank, config.selector_top_k) == (2, 16, 8, 5)
    assert config.block_size == 4 and config.output_multiplier == pytest.approx(0.196116135)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize(("window", "is_causal"), [(2048, False), (3, False), (3, None), (2048, True)])
def test_dflash2_forward_equals_the_reference(attn, window, is_causal, tmp_path):
    target = tiny_target()
    raw = dflash2_config(target, block_size=6, window=window, is_causal=is_causal)
    if is_causal is None:
        del raw["is_causal"]  # absent: causal on the (all sliding) layers
    drafter = load(write_checkpoint(tmp_path / "d2", raw), attn)
    check_forward_matches_reference(drafter, raw, context_len=9, block=6)


def test_dflash2_selector_walk_equals_the_reference_and_changes_drafts(tmp_path):
    target = tiny_target()
    raw = dflash2_config(target)
    drafter = load(write_checkpoint(tmp_path / "d2", raw))
    head, reference = target.get_output_embeddings(), ReferenceDrafter(drafter, raw)
    changed = 0
    for seed in range(20):
        rows = torch.randn(7, drafter.config.hidden_size, generator=torch.Generator().manual_seed(seed))
        anchor = torch.tensor(seed + 4)
        path, draft_logits = drafter.propose(head, rows, anchor)
        assert draft_logits is None
        assert torch.equal(path, reference.propose(head.weight, rows, int(anchor)))
        changed += int(not torch.equal(path, drafter.transform_logits(head(rows)).argmax(-1)))
    assert changed > 0  # the selector really overrides the argmax sometimes


def test_dflash2_sampled_walk_returns_the_distribution_it_sampled_from(tmp_path):
    target = tiny_target()
    drafter = load(write_checkpoint(tmp_path / "d2", dflash2_config(target)))
    rows = torch.randn(5, drafter.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    path, draft_logits = drafter.propose(target.get_output_embeddings(), rows, torch.tensor(7), temperature=0.7)
    q = draft_logits.softmax(-1)
    assert draft_logits.shape == (5, target.config.vocab_size)
    assert torch.allclose(q.sum(-1), torch.ones(5)) and int((q > 0).sum()) == 5 * drafter.config.selector_top_k
    assert bool((q[torch.arange(5), path] > 0).all())  # every drafted token is one of its position's candidates


def test_dflash2_saved_checkpoint_carries_auto_map_and_remote_code(tmp_path):
    target = tiny_target()
    drafter = load(write_checkpoint(tmp_path / "d2", dflash2_config(target)))
    drafter.save_pretrained(tmp_path / "saved")
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["auto_map"]["AutoModel"] == "modeling_dflash2.DFlash2DraftModel"
    assert config["architectures"] == ["DFlash2DraftModel"] and config["dflash_config"]["selector_top_k"] == 5
    assert (tmp_path / "saved" / "modeling_dflash2.py").is_file()
    remote = AutoModel.from_pretrained(tmp_path / "saved", trust_remote_code=True).eval()
    assert type(remote).__module__.startswith("transformers_modules") and type(remote).__name__ == "DFlash2DraftModel"
    ids = random_prompt(0)
    assert torch.equal(greedy(target, ids, 12, assistant_model=remote), greedy(target, ids, 12))
    assert torch.equal(load(tmp_path / "saved").state_dict()["candidate_selector.successor_codebook"],
                       drafter.state_dict()["candidate_selector.successor_codebook"])


# --- what the loader cannot load --------------------------------------------------------------------------------


def test_loader_names_what_it_cannot_load(tmp_path):
    target = tiny_target()
    write_checkpoint(tmp_path / "domino", base_config(target, block_size=4, architectures=["DominoDraftModel"]))
    with pytest.raises(ValueError, match=r"DominoDraftModel.*DFlash2DraftModel"):
        DFlashDraftModel.from_pretrained(tmp_path / "domino")
    write_checkpoint(tmp_path / "broken", dflash2_config(target))
    broken = dflash2_config(target)
    del broken["dflash_config"]["selector_rank"]
    (tmp_path / "broken" / "config.json").write_text(json.dumps(broken))
    with pytest.raises(ValueError, match="needs selector_rank"):
        DFlashDraftModel.from_pretrained(tmp_path / "broken")


def test_builtin_muse_glimmer_layout_is_pointed_to_what_works(tmp_path):
    from dflash_hf.hub import convert_checkpoint

    target = tiny_target()
    source = write_checkpoint(tmp_path / "zlab", base_config(target, block_size=4))
    convert_checkpoint(source, tmp_path / "builtin", to="builtin")
    with pytest.raises(ValueError, match="dflash-hf convert"):
        DFlashDraftModel.from_pretrained(tmp_path / "builtin")
    from transformers import MuseGlimmerAssistantModel

    builtin = MuseGlimmerAssistantModel.from_pretrained(tmp_path / "builtin", dtype=torch.float32)
    with pytest.raises(ValueError, match="speculation_type='dflash'"):  # not transformers' AttributeError
        greedy(target, random_prompt(0), 8, assistant_model=builtin)
    ids = random_prompt(0)
    assert torch.equal(greedy(target, ids, 8, assistant_model=builtin, speculation_type="dflash"), greedy(target, ids, 8))


def test_published_fixture_weights_have_the_documented_header_shapes():
    raw = dflash2_config(tiny_target())
    shapes = {name: tuple(t.shape) for name, t in random_weights(raw).items()}
    assert shapes["layers.0.attention_conv.base_kernel"] == (2, 2, 64)
    assert shapes["layers.1.mlp_conv.kernel_projection.weight"] == (2 * 2 * 4, 64)  # 2 sides x K taps x G groups
    assert shapes["candidate_selector.predecessor_codebook"] == (96, 8)
    assert os.environ.get("HF_HUB_OFFLINE") == "1"  # conftest keeps every load here offline
