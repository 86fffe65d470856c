"""Training: block pictures and the two PR #473 pitfalls, labels, over-fit gate, distill/train resume, DDP, eval."""

import dataclasses
import math
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_hf import DFlashConfig, DFlashDraftModel
from dflash_hf.training.blocks import (
    block_labels_and_weights,
    block_mask_mod,
    build_block_inputs,
    build_block_mask,
    build_flex_block_mask,
    sample_anchors,
)
from transformers import AutoModelForCausalLM

from dflash_hf.cli import build_parser
from dflash_hf.training import distill as distill_module
from dflash_hf.training.data import ShardDataset, collate
from dflash_hf.training.trainer import (
    RunClock,
    block_loss,
    budget_cosine_lambda,
    cosine_lambda,
    grow_draft,
    resolve_attention,
    resolve_autocast,
    warm_start_from_target,
)
from conftest import mask_token_id, save_chat_drafter, save_chat_target, write_prompts
REPO = Path(__file__).resolve().parents[1]
MASK = 259  # "<mask>" in the tiny tokenizer
LAYERS = "0,2"


def render_mask(mask: torch.Tensor) -> list[str]:
    """A 2D boolean mask as rows of ``#`` (attend) and ``.``, for the block pictures below."""
    return ["".join("#" if bool(v) else "." for v in row) for row in mask]


# ------------------------------------------------------------------------------------------------ invariants
def check_block_mask(mask, anchors, keep, seq_len, block_size):
    """What the drafter may see, stated independently of build_block_mask; raises AssertionError on a violation."""
    batch, num = anchors.shape
    for i in range(batch):
        for row in range(num * block_size):
            n = row // block_size
            visible = mask[i, 0, row]
            context = visible[:seq_len].nonzero().flatten().tolist()
            blocks = (visible[seq_len:].nonzero().flatten() // block_size).tolist()
            if keep[i, n]:
                assert context == list(range(int(anchors[i, n]))), f"row {row}: context {context}"
            else:
                assert context == [], "a padded block sees context"
            assert blocks and set(blocks) == {n}, f"row {row} sees blocks {set(blocks)}"
            assert int(visible[seq_len:].sum()) == block_size, "not bidirectional inside the block"


def check_labels(labels, position_ids, input_ids, weights, seq_len):
    """Row r predicts the token at its own position (no shift), wherever it carries weight."""
    block_pos = position_ids[:, seq_len:]
    for i in range(labels.shape[0]):
        for r in range(labels.shape[1]):
            if weights[i, r] > 0:
                assert labels[i, r] == input_ids[i, block_pos[i, r]], f"row {r} is not same-position"


# --------------------------------------------------------------------------------------------- block pictures
def test_mask_picture_and_padding():
    anchors, keep = torch.tensor([[2, 4], [3, 0]]), torch.tensor([[True, True], [True, False]])
    mask = build_block_mask(anchors, keep, seq_len=6, block_size=2)
    assert mask.shape == (2, 1, 4, 10) and mask.dtype == torch.bool
    #        context | b0 b1
    assert render_mask(mask[0, 0]) == [
        "##....##..",  # block 0 (anchor 2): context 0..1 only (never its own anchor), itself
        "##....##..",
        "####....##",  # block 1 (anchor 4): context 0..3, itself, never block 0
        "####....##",
    ]
    assert render_mask(mask[1, 0]) == [
        "###...##..",
        "###...##..",
        "........##",  # padded block: only itself (no empty row -> no NaN), no context
        "........##",
    ]
    check_block_mask(mask, anchors, keep, 6, 2)


def test_mask_off_by_one_is_caught():
    anchors, keep = torch.tensor([[2, 4]]), torch.ones(1, 2, dtype=torch.bool)
    good = build_block_mask(anchors, keep, 6, 2)
    leaky = good.clone()  # the pre-PR-#473 rule: kv <= anchor
    for n, a in enumerate(anchors[0].tolist()):
        leaky[0, 0, n * 2 : n * 2 + 2, a] = True
    assert render_mask(leaky[0, 0])[0] == "###...##.." != render_mask(good[0, 0])[0]
    with pytest.raises(AssertionError):
        check_block_mask(leaky, anchors, keep, 6, 2)
    cross = good.clone()
    cross[0, 0, 2, 6] = True  # block 1 peeks at block 0
    with pytest.raises(AssertionError):
        check_block_mask(cross, anchors, keep, 6, 2)


def test_block_inputs_labels_and_weights():
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 0]])
    anchors, keep = torch.tensor([[2, 5, 0]]), torch.tensor([[True, True, False]])
    noise, positions = build_block_inputs(input_ids, anchors, 3, MASK, keep)
    assert noise.tolist() == [[12, MASK, MASK, 15, MASK, MASK, MASK, MASK, MASK]]
    assert positions.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 2, 3, 4, 5, 6, 7, 0, 1, 2]]
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, 3, gamma=2.0)
    assert labels.tolist() == [[12, 13, 14, 15, 16, 17, 10, 11, 12]]  # same position: row k -> input_ids[a + k]
    decay = torch.exp(-torch.tensor(1.0) / 2)
    expected = torch.tensor([[0, 1, decay, 0, 1, 0, 0, 0, 0]])  # anchor rows 0; 17 is prompt/pad; padding 0
    torch.testing.assert_close(weights, expected)
    check_labels(labels, positions, input_ids, weights, 8)
    shifted = torch.roll(input_ids, -1, dims=1).gather(1, positions[:, 8:])  # the pre-PR-#473 labels
    with pytest.raises(AssertionError):
        check_labels(shifted, positions, input_ids, weights, 8)
    # out of bounds: a block hanging off the end gets zero weight there
    labels, weights = block_labels_and_weights(input_ids, torch.ones(1, 8), torch.tensor([[6]]),
                                               torch.tensor([[True]]), 3, gamma=None)
    assert labels.tolist() == [[16, 17, 0]] and weights.tolist() == [[0.0, 1.0, 0.0]]


def test_sampled_answers_learn_the_greedy_path_up_to_their_first_departure():
    """With the target's predictions ``next_ids``, row k learns the prediction after token p - 1 (not the sampled
    token at p), and only while the tokens between anchor and row follow the predictions."""
    input_ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1]])
    greedy_answer = torch.cat([input_ids[:, 1:], torch.zeros(1, 1, dtype=torch.long)], dim=1)
    anchors, keep = torch.tensor([[2]]), torch.tensor([[True]])
    # on the target's own greedy answer, the predictions are the next tokens: the same labels as without them
    plain = block_labels_and_weights(input_ids, loss_mask, anchors, keep, 4, gamma=None)
    same = block_labels_and_weights(input_ids, loss_mask, anchors, keep, 4, gamma=None, next_ids=greedy_answer)
    assert plain[0].tolist() == same[0].tolist() == [[12, 13, 14, 15]]
    assert plain[1].tolist() == same[1].tolist() == [[0, 1, 1, 1]]
    # token 14 at position 4 was sampled: greedy decoding would have written 99 after 13
    sampled = greedy_answer.clone()
    sampled[0, 3] = 99
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, 4, gamma=None, next_ids=sampled)
    assert labels.tolist() == [[12, 13, 99, 15]]  # position 4 learns the greedy 99; position 5 is off the path
    assert weights.tolist() == [[0, 1, 1, 0]]
    # a departure right after the anchor still teaches the first draft; one at the anchor itself changes nothing
    sampled = greedy_answer.clone()
    sampled[0, 2] = 98
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, 4, gamma=None, next_ids=sampled)
    assert labels.tolist() == [[12, 98, 14, 15]] and weights.tolist() == [[0, 1, 0, 0]]
    sampled = greedy_answer.clone()
    sampled[0, 1] = 97  # the anchor 12 itself was sampled: its block is the greedy continuation of 12 all the same
    assert block_labels_and_weights(input_ids, loss_mask, anchors, keep, 4, None, sampled)[1].tolist() == [[0, 1, 1, 1]]


def test_sample_anchors_stay_in_the_response_sorted_and_seeded():
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 0, 1, 1, 1, 1]])
    for seed in range(20):
        anchors, keep = sample_anchors(loss_mask, 4, 3, torch.Generator().manual_seed(seed))
        assert anchors.shape == (2, 3)
        for i in range(2):
            kept = anchors[i][keep[i]].tolist()
            assert kept == sorted(set(kept))
            assert all(loss_mask[i, a] == 1 and a <= 10 - 4 for a in kept)
        assert keep[0].all() and keep[1].tolist() == [True, False, False] and anchors[1].tolist() == [6, 0, 0]
    a, _ = sample_anchors(loss_mask, 4, 3, torch.Generator().manual_seed(1))
    b, _ = sample_anchors(loss_mask, 4, 3, torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    seen = {tuple(sample_anchors(loss_mask[:1], 4, 2, torch.Generator().manual_seed(s))[0][0].tolist())
            for s in range(60)}
    assert len(seen) > 5  # really random: C(5, 2) = 10 pairs


# -------------------------------------------------------------------------------------------- tiny models
@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    target = save_chat_target(root / "target")
    prompts = write_prompts(root / "prompts.jsonl", 6, bad_lines=1)
    main(["distill", "--target", str(target), "--prompts", str(prompts), "--out", str(root / "data"),
          "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40", "--target-layer-ids", LAYERS])
    return root


def main(argv):
    args = build_parser().parse_args(argv + ["--quiet", "--threads", "1"])
    return args.func(args)


def train_argv(work, out, *extra):
    return ["train", "--target", str(work / "target"), "--data", str(work / "data"), "--output-dir", str(out),
            "--mask-token-id", str(MASK), "--num-draft-layers", "1", "--block-size", "8", "--num-anchors", "16",
            "--log-every", "5", *extra]


def test_draft_forward_with_block_mask_equals_one_block_at_a_time():
    """All blocks in one masked forward == each block drafted alone from the context before its anchor."""
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[0, 1],
                          mask_token_id=49)
    draft = DFlashDraftModel(config).eval()
    seq_len, block = 12, 4
    embed = torch.nn.Embedding(50, 32)
    input_ids = torch.randint(0, 49, (1, seq_len))
    features = torch.randn(1, seq_len, 64)
    anchors, keep = torch.tensor([[1, 5, 8]]), torch.ones(1, 3, dtype=torch.bool)
    noise, positions = build_block_inputs(input_ids, anchors, block, 49, keep)
    mask = build_block_mask(anchors, keep, seq_len, block)
    with torch.no_grad():
        together = draft(noise_embedding=embed(noise), target_hidden=features, position_ids=positions,
                         attention_mask=mask).last_hidden_state
        for n, a in enumerate(anchors[0].tolist()):
            ids = noise[:, n * block : (n + 1) * block]
            alone = draft(noise_embedding=embed(ids), target_hidden=features[:, :a],
                          position_ids=torch.arange(a + block)[None]).last_hidden_state
            torch.testing.assert_close(together[:, n * block : (n + 1) * block], alone, atol=1e-5, rtol=1e-5)


def test_flex_mask_mod_draws_the_same_picture():
    from torch.nn.attention.flex_attention import create_mask

    anchors, keep = torch.tensor([[2, 4], [3, 0]]), torch.tensor([[True, True], [True, False]])
    flex = create_mask(block_mask_mod(anchors, keep, 6, 2), 2, 1, 4, 10, device="cpu")
    assert torch.equal(flex, build_block_mask(anchors, keep, 6, 2))  # the pictures of test_mask_picture_and_padding
    loss_mask = (torch.rand(3, 40, generator=torch.Generator().manual_seed(0)) > 0.3).long()
    for seed in range(5):
        anchors, keep = sample_anchors(loss_mask, 4, 6, torch.Generator().manual_seed(seed))
        flex = create_mask(block_mask_mod(anchors, keep, 40, 4), 3, 1, 24, 64, device="cpu")
        assert torch.equal(flex, build_block_mask(anchors, keep, 40, 4))
        check_block_mask(flex, anchors, keep, 40, 4)


def tiny_config(**overrides):
    options = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[0, 1],
                   mask_token_id=49)
    return DFlashConfig(**(options | overrides))


@pytest.mark.parametrize("sliding", [False, True])
def test_flex_attention_block_mask_equals_dense_mask(sliding):
    """FlexAttention (what training uses on GPU) computes what SDPA computes with the dense mask. Forward only:
    PyTorch has no FlexAttention backward on CPU."""
    torch.manual_seed(0)
    config = tiny_config()
    if sliding:
        config.sliding_window, config.layer_types = 5, ["sliding_attention", "full_attention"]
    draft = DFlashDraftModel(config).eval()
    seq_len, block = 16, 4
    input_ids = torch.randint(0, 49, (2, seq_len))
    loss_mask = torch.ones(2, seq_len)
    anchors, keep = torch.tensor([[1, 6, 11], [9, 12, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    noise, positions = build_block_inputs(input_ids, anchors, block, 49, keep)
    embeds, features = torch.nn.Embedding(50, 32)(noise).detach(), torch.randn(2, seq_len, 64)
    outputs = {}
    with torch.no_grad():
        for implementation, mask in (("sdpa", build_block_mask(anchors, keep, seq_len, block)),
                                     ("flex_attention", build_flex_block_mask(anchors, keep, seq_len, block))):
            draft.config._attn_implementation = implementation
            outputs[implementation] = draft(noise_embedding=embeds, target_hidden=features, position_ids=positions,
                                            attention_mask=mask).last_hidden_state
    weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, block, None)[1]
    rows = weights > 0  # padded blocks' rows carry no loss
    torch.testing.assert_close(outputs["flex_attention"][rows], outputs["sdpa"][rows], atol=1e-5, rtol=1e-5)


def block_attention_case(config):
    """A drafter and a batch of blocks for the block-sparse attention tests: two rows of 16 tokens, blocks of 4 at
    anchors ``[1, 6, 11]`` and ``[9, 12]`` plus a padded block."""
    from dflash_hf.training.attention import BlockLayout

    torch.manual_seed(0)
    draft = DFlashDraftModel(config)
    seq_len, block = 16, 4
    input_ids = torch.randint(0, 49, (2, seq_len))
    anchors, keep = torch.tensor([[1, 6, 11], [9, 12, 0]]), torch.tensor([[True, True, True], [True, True, False]])
    noise, positions = build_block_inputs(input_ids, anchors, block, 49, keep)
    inputs = dict(noise_embedding=torch.randn(2, 12, 32), target_hidden=torch.randn(2, seq_len, 64),
                  position_ids=positions)
    masks = {"sdpa": {"attention_mask": build_block_mask(anchors, keep, seq_len, block)},
             "block_sparse": {"block_layout": BlockLayout(anchors, keep)}}
    return draft, inputs, masks


def block_attention_run(draft, inputs, masks, implementation, dtype=torch.float32):
    """The drafter's output and parameter gradients with one attention implementation, under autocast to ``dtype``
    (the trainer's bf16 mode) unless float32."""
    draft.zero_grad()
    draft.config._attn_implementation = implementation
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        hidden = draft(**inputs, **masks[implementation]).last_hidden_state.float()
    (hidden * torch.linspace(-1, 1, 32)).sum().backward()
    return hidden.detach(), [p.grad.clone() for p in draft.parameters()]


@pytest.mark.parametrize("rule", ["none", "causal", "sliding"])
def test_block_sparse_attention_equals_dense_mask(rule):
    """The CPU training attention (only the seen scores) gives SDPA's outputs and gradients with the dense block
    mask, padded block included; a layer's own position rule (causal, sliding window) is applied too."""
    from dflash_hf.training.attention import BLOCK_SPARSE

    config = tiny_config(is_causal=True) if rule == "causal" else tiny_config()
    if rule == "sliding":
        config.sliding_window, config.layer_types = 5, ["sliding_attention", "full_attention"]
    draft, inputs, masks = block_attention_case(config)
    sparse, sparse_grads = block_attention_run(draft, inputs, masks, BLOCK_SPARSE)
    dense, dense_grads = block_attention_run(draft, inputs, masks, "sdpa")
    torch.testing.assert_close(sparse, dense, atol=1e-5, rtol=1e-5)
    for sparse_grad, dense_grad in zip(sparse_grads, dense_grads):
        torch.testing.assert_close(sparse_grad, dense_grad, atol=1e-5, rtol=1e-4)
    if rule != "none":  # the rule is not a no-op here: without it the outputs differ
        draft.config = tiny_config()
        draft.config._attn_implementation = BLOCK_SPARSE
        with torch.no_grad():
            plain = draft(**inputs, **masks[BLOCK_SPARSE]).last_hidden_state
        assert not torch.allclose(plain, sparse, atol=1e-3)


def test_block_sparse_attention_in_bf16_is_as_close_to_float32_as_dense_sdpa():
    """Under bf16 autocast (the trainer's default where the CPU computes bf16) the block-sparse attention, whose
    softmax runs in the scores' dtype, is as close to the float32 outputs and gradients as SDPA with the dense mask
    in bf16 is."""
    draft, inputs, masks = block_attention_case(tiny_config())
    reference, reference_grads = block_attention_run(draft, inputs, masks, "sdpa")
    errors = {}
    for implementation in ("sdpa", "block_sparse"):
        out, grads = block_attention_run(draft, inputs, masks, implementation, torch.bfloat16)
        errors[implementation] = [float((out - reference).norm() / reference.norm())] + [
            float((g - r).norm() / r.norm()) for g, r in zip(grads, reference_grads) if r.norm() > 0]
    assert max(errors["sdpa"]) > 1e-4  # bf16 does round here
    for sparse, dense in zip(errors["block_sparse"], errors["sdpa"]):
        assert sparse <= 2 * dense + 1e-3


@pytest.mark.parametrize("kd_weight", [0.0, 0.4])
@pytest.mark.parametrize("answers", ["greedy", "sampled"])
@pytest.mark.parametrize("implementation", ["block_sparse", "sdpa"])
def test_block_loss_equals_the_plain_dense_loss(implementation, answers, kd_weight):
    """`block_loss` (context cut at the last anchor, the last MLP on label rows only, the chosen attention) gives
    the loss and gradients of the plain formula: the whole context, the dense mask, every row through every layer;
    on sampled answers, with the labels and rows of the batch's ``next_ids``; with ``kd_weight``, a share of each
    row's loss is the KL to the target's distribution at the position before the row's label."""
    torch.manual_seed(0)
    draft = DFlashDraftModel(tiny_config(num_hidden_layers=2))
    embed, head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)
    seq_len, block = 40, 4
    input_ids = torch.randint(0, 49, (2, seq_len))
    loss_mask = torch.zeros(2, seq_len)
    loss_mask[0, 10:30], loss_mask[1, 5:] = 1, 1  # sequence 0 ends in padding: context after its anchors unseen
    batch = {"input_ids": input_ids, "loss_mask": loss_mask}
    next_ids = None
    if answers == "sampled":  # the target would have written another token after a third of the positions
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros(2, 1, dtype=torch.long)], dim=1)
        departs = torch.rand(2, seq_len) < 0.3
        next_ids[departs] = (next_ids[departs] + 1) % 49
        batch["next_ids"] = next_ids
    features = torch.randn(2, seq_len, 64)
    teacher_hidden = torch.randn(2, seq_len, 32)
    if kd_weight:
        batch["teacher_hidden"] = teacher_hidden

    # the plain formula, drawing anchors and positions in block_loss's order
    generator = torch.Generator().manual_seed(3)
    anchors, keep = sample_anchors(loss_mask, block, 6, generator)
    noise, positions = build_block_inputs(input_ids, anchors, block, 49, keep)
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, block, 2.0, next_ids)
    if next_ids is not None:  # the sampled answers change both
        greedy_labels, greedy_weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, block, 2.0)
        assert not torch.equal(labels, greedy_labels) and weights.sum() < greedy_weights.sum()
    chosen = (weights > 0) & (torch.rand(weights.shape, generator=generator) < weights)
    draft.config._attn_implementation = "sdpa"
    hidden = draft(noise_embedding=embed(noise), target_hidden=features, position_ids=positions,
                   attention_mask=build_block_mask(anchors, keep, seq_len, block)).last_hidden_state
    logits = head(hidden[chosen])
    per_row = torch.nn.functional.cross_entropy(logits, labels[chosen], reduction="none")
    if kd_weight:  # row j of sequence i: block j // B, offset j % B, label at anchor + offset, read one before
        before = [int(anchors[i, j // block]) + j % block - 1 for i, j in chosen.nonzero().tolist()]
        sequence = chosen.nonzero()[:, 0]
        teacher = head(teacher_hidden[sequence, torch.tensor(before)]).log_softmax(-1)
        kl = (teacher.exp() * (teacher - logits.log_softmax(-1))).sum(-1)
        per_row = (1 - kd_weight) * per_row + kd_weight * kl
    expected = per_row.sum() / weights.sum()
    expected.backward()
    expected_grads = [p.grad.clone() for p in draft.parameters()]
    assert int(anchors.max()) + 1 < seq_len and chosen.float().mean() < 0.6  # both shortcuts skip something

    draft.zero_grad()
    draft.config._attn_implementation = implementation
    loss, _ = block_loss(draft, embed, head, batch, features, block_size=block, num_anchors=6, mask_token_id=49,
                         gamma=2.0, generator=torch.Generator().manual_seed(3), sample_positions=True,
                         kd_weight=kd_weight)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for param, grad in zip(draft.parameters(), expected_grads):
        torch.testing.assert_close(param.grad, grad, atol=1e-6, rtol=1e-4)
    mlp = draft.layers[-1].mlp
    assert not mlp._forward_hooks and not mlp._forward_pre_hooks  # the shortcut does not outlive the loss


def test_training_attention_choice():
    assert resolve_attention("auto", torch.device("cpu")) == "block_sparse"
    assert resolve_attention("auto", torch.device("cuda", 0)) == "flex_attention"
    assert resolve_attention("eager", torch.device("cuda", 0)) == "eager"
    with pytest.raises(ValueError, match="no backward on CPU"):
        resolve_attention("flex_attention", torch.device("cpu"))


def test_training_autocast_choice(monkeypatch):
    """Unset, bf16 autocast follows the device: on where it computes bf16 natively, off where a CPU would emulate it;
    ``--bf16`` / ``--no-bf16`` win either way."""
    import dflash_hf.loading as loading

    monkeypatch.setattr(loading, "cpu_flags", lambda: ["avx2", "fma"])
    assert resolve_autocast(None, torch.device("cpu"))[0] is False
    assert resolve_autocast(True, torch.device("cpu")) == (True, "asked for")
    assert resolve_autocast(None, torch.device("cuda", 0))[0] is True
    monkeypatch.setattr(loading, "cpu_flags", lambda: ["avx2", "amx_bf16"])
    on, why = resolve_autocast(None, torch.device("cpu"))
    assert on is True and "AMX" in why
    assert resolve_autocast(False, torch.device("cpu")) == (False, "asked for")
    required = ["train", "--target", "t", "--data", "d", "--output-dir", "o", "--mask-token-id", "1"]
    parse = lambda *flags: build_parser().parse_args(required + list(flags)).bf16
    assert (parse(), parse("--bf16"), parse("--no-bf16")) == (None, True, False)


def test_drafter_overfits_one_sequence(work):
    """The pipeline can learn: one sequence, ~100% accuracy at every block position."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    target = AutoModelForCausalLM.from_pretrained(work / "target").eval().requires_grad_(False)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=MASK, num_hidden_layers=1, block_size=8,
                                             target_layer_ids=[0, 2])
    draft = DFlashDraftModel(config).train()
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, 250, (1, 40), generator=gen)  # a random sequence: nothing to guess, all memory
    loss_mask = torch.zeros(1, 40)
    loss_mask[:, 8:] = 1
    batch = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": torch.ones_like(input_ids)}
    with torch.no_grad():
        out = target(input_ids=input_ids, output_hidden_states=True)
    features = torch.cat([out.hidden_states[1], out.hidden_states[3]], dim=-1)
    optimizer = torch.optim.AdamW(draft.parameters(), lr=3e-3)
    losses = []
    for _ in range(120):
        loss, stats = block_loss(draft, target.get_input_embeddings(), target.get_output_embeddings(), batch,
                                 features, block_size=8, num_anchors=32, mask_token_id=MASK, gamma=4.0,
                                 generator=gen)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    accuracy = stats["correct"][1:] / stats["count"][1:]
    # The tiny target's random lm_head (std 0.02) caps logit margins, so the loss floor is high; accuracy is the gate.
    assert (accuracy > 0.95).all() and losses[-1] < 0.7 * losses[0], (losses[0], losses[-1], accuracy)


def test_distill_shards_resume_and_bad_lines(work, capsys):
    data = work / "data"
    shards = sorted(data.glob("shard-*.safetensors"))
    assert [p.name for p in shards] == ["shard-00000.safetensors", "shard-00001.safetensors", "shard-00002.safetensors"]
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["target_layer_ids"] == [0, 2] and len(manifest["finished_shards"]) == 3
    assert manifest["skipped"] == [f"{work / 'prompts.jsonl'}:2: not JSON (Expecting property name enclosed in "
                                   "double quotes)"]
    # features == a teacher-forced forward of the target on the stored sequence
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(work / "target").eval()
    sample = ShardDataset(data)[0]
    assert sample["loss_mask"].sum() > 0 and sample["loss_mask"][0] == 0
    with torch.no_grad():
        hs = target(input_ids=sample["input_ids"][None], output_hidden_states=True).hidden_states
    expected = torch.cat([hs[1], hs[3]], dim=-1)[0].to(torch.bfloat16)
    torch.testing.assert_close(sample["features"].float(), expected.float(), atol=0.05, rtol=0.02)
    # rerun: finished shards are skipped (untouched); a lost shard is redone; the bad line is reported again
    stamps = {p.name: p.stat().st_mtime_ns for p in shards}
    shards[1].unlink()
    (data / "manifest.json").write_text(json.dumps({**manifest, "how": "a note a person wrote",
                                                    "target": "the tiny target, as a person named it"}))
    summary = main(["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out",
                    str(data), "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40",
                    "--target-layer-ids", LAYERS, "--dtype", "bfloat16"])
    assert summary["written"] == [1] and summary["skipped_shards"] == 2
    assert any(":2: not JSON" in p for p in summary["problems"])
    assert shards[0].stat().st_mtime_ns == stamps[shards[0].name]
    assert shards[1].exists()
    rewritten = json.loads((data / "manifest.json").read_text())
    assert rewritten["how"] == "a note a person wrote" and len(rewritten["finished_shards"]) == 3
    # the resume keeps the corpus's own record of its first run and lists its own settings with the shard it wrote
    assert rewritten["target"] == "the tiny target, as a person named it"
    assert rewritten["dtype"] == manifest["dtype"] != "bfloat16"
    assert rewritten["resumes"] == [{"shards": ["shard-00001.safetensors"], "target": str(work / "target"),
                                     "dtype": "bfloat16", "draft": None, "max_new_tokens": 40, "temperature": 0.0,
                                     "seed": None}]
    responses = sum(int(ShardDataset(data)[i]["loss_mask"].sum()) for i in range(len(ShardDataset(data))))
    assert rewritten["response_tokens"] == responses > 0


def test_distill_on_two_processes_lists_every_shard_whichever_finishes_last(work, tmp_path, monkeypatch):
    """With RANK/WORLD_SIZE each process writes every W-th shard and records it: the manifest of the process that
    finished last lists all shards (process 0 alone used to write it, so shards finished after it were missing),
    and a resume on both keeps both processes' `resumes` entries."""
    out = tmp_path / "corpus"
    argv = ["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out", str(out),
            "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40", "--target-layer-ids", LAYERS,
            "--no-features"]
    monkeypatch.setenv("WORLD_SIZE", "2")

    def run(rank):
        monkeypatch.setenv("RANK", str(rank))
        return main(argv)

    assert run(0)["written"] == [0, 2]
    assert json.loads((out / "manifest.json").read_text())["finished_shards"] == [
        "shard-00000.safetensors", "shard-00002.safetensors"]
    assert run(1)["written"] == [1]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["finished_shards"] == [f"shard-{i:05d}.safetensors" for i in range(3)]
    dataset = ShardDataset(out)
    assert manifest["response_tokens"] == sum(int(dataset[i]["loss_mask"].sum()) for i in range(len(dataset))) > 0
    for shard in ("shard-00000.safetensors", "shard-00001.safetensors"):
        (out / shard).unlink()
    assert run(1)["written"] == [1] and run(0)["written"] == [0]
    resumes = json.loads((out / "manifest.json").read_text())["resumes"]
    assert sorted(r["shards"][0] for r in resumes) == ["shard-00000.safetensors", "shard-00001.safetensors"]


def test_resume_gives_identical_state(work, tmp_path):
    straight = main(train_argv(work, tmp_path / "a", "--max-steps", "6", "--save-every", "0"))
    first = main(train_argv(work, tmp_path / "b", "--max-steps", "6", "--stop-after", "3"))
    assert first["step"] == 3 and (tmp_path / "b" / "latest").read_text().strip() == "checkpoints/step-0000003"
    second = main(train_argv(work, tmp_path / "b", "--max-steps", "6", "--resume", "auto"))
    assert straight["step"] == second["step"] == 6
    a = load_file(tmp_path / "a" / "checkpoints" / "step-0000006" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step-0000006" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a = torch.load(tmp_path / "a" / "checkpoints" / "step-0000006" / "trainer_state.pt", weights_only=True)
    state_b = torch.load(tmp_path / "b" / "checkpoints" / "step-0000006" / "trainer_state.pt", weights_only=True)
    for pa, pb in zip(state_a["optimizer"]["state"].values(), state_b["optimizer"]["state"].values()):
        assert torch.equal(pa["exp_avg"], pb["exp_avg"])
    ckpt = tmp_path / "b" / "checkpoints" / "step-0000006"
    assert {"config.json", "model.safetensors", "modeling_dflash.py", "trainer_state.pt", "rng-rank0.pt",
            "training_args.json"} <= {p.name for p in ckpt.iterdir()}
    log = [json.loads(line) for line in (tmp_path / "b" / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in log] == [5, 6] and (tmp_path / "b" / "curves.png").exists()


def test_online_features_warm_start_and_grad_accum(work, tmp_path):
    summary = main(train_argv(work, tmp_path / "online", "--max-steps", "2", "--online-features", "--warm-start",
                              "--grad-accum", "2", "--batch-size", "2", "--kd-weight", "0.5"))
    assert summary["step"] == 2 and summary["blocks"] > 0


def test_kd_weight_needs_online_features_and_a_share(work, tmp_path, capsys):
    """The target's distribution is only there when the target runs online; a weight outside [0, 1] is refused."""
    from dflash_hf.cli import main as cli

    assert cli(train_argv(work, tmp_path / "stored", "--max-steps", "1", "--kd-weight", "0.5", "--quiet")) == 1
    assert "pass --online-features" in capsys.readouterr().err.splitlines()[-1]
    with pytest.raises(SystemExit):
        build_parser().parse_args(train_argv(work, tmp_path / "x", "--kd-weight", "1.5"))
    assert "must be a number in [0, 1], got 1.5" in capsys.readouterr().err


def test_trained_drafter_beats_untrained(work, tmp_path):
    from dflash_hf.training.evaluate import acceptance
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dflash_hf.training.distill import encode_prompt

    run = tmp_path / "run"
    summary = main(train_argv(work, run, "--max-steps", "80", "--lr", "3e-3", "--sample-positions", "--bf16",
                              "--final-dtype", "float32"))
    assert summary["step"] == 80
    target = AutoModelForCausalLM.from_pretrained(work / "target").eval()
    tokenizer = AutoTokenizer.from_pretrained(work / "target")
    prompts = [encode_prompt(tokenizer, f"Tell me about topic {i}.") for i in (0, 3)]
    trained = DFlashDraftModel.from_pretrained(run / "final").eval()
    torch.manual_seed(0)
    untrained = DFlashDraftModel(trained.config).eval()
    good = acceptance(target, trained, prompts, block_size=8, max_new_tokens=32)
    bad = acceptance(target, untrained, prompts, block_size=8, max_new_tokens=32)
    assert len(good["histogram"]) == 9  # the generator used block_size 8
    print(f"tau trained {good['tau']:.2f} vs untrained {bad['tau']:.2f}")
    assert good["tau"] > bad["tau"] + 0.5, (good["tau"], bad["tau"])
    four = acceptance(target, trained, prompts, block_size=4, max_new_tokens=32)
    assert len(four["histogram"]) == 5 and max(i for i, c in enumerate(four["histogram"]) if c) <= 4

    # teacher-forced tau on the distilled answer == the first real round's committed tokens: a sample cut to
    # prompt + B tokens has one possible anchor, the first response token, which is what round 1 drafts from.
    from dflash_hf.training.evaluate import teacher_forced_tau

    data = ShardDataset(work / "data")
    for item, ids in zip((0, 3), prompts):
        sample = {k: v[: len(ids) + 8] for k, v in data[item].items()}
        assert torch.equal(sample["input_ids"][: len(ids)], torch.tensor(ids))
        measured = teacher_forced_tau(trained, target.get_input_embeddings(), target.get_output_embeddings(),
                                      [sample], block_size=8)
        acceptance(target, trained, [ids], block_size=8, max_new_tokens=32)
        assert measured["blocks"] == 1
        assert measured["tau"] == trained.last_stats.acceptance_lengths[0]
        assert measured["tau_by_offset"] == {"0-127": {"tau": measured["tau"], "blocks": 1}}


def test_teacher_forced_tau_splits_its_blocks_by_where_they_sit_in_the_answer():
    """``tau_by_offset`` keys a block by its anchor's distance from the first response token: with one-token windows
    and every valid anchor drawn, the keys are exactly the offsets 0 .. S - B - prompt length, and the windows pool
    back to the overall tau."""
    from dflash_hf.training.evaluate import teacher_forced_tau

    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[0, 1],
                          mask_token_id=49)
    draft = DFlashDraftModel(config).eval()
    embed, head = torch.nn.Embedding(50, 32), torch.nn.Linear(32, 50, bias=False)
    prompt, length, block = 10, 40, 4
    input_ids = torch.randint(0, 8, (length,))  # a small alphabet, so that some drafts match
    sample = {"input_ids": input_ids, "loss_mask": (torch.arange(length) >= prompt).long(),
              "features": torch.randn(length, 64)}
    result = teacher_forced_tau(draft, embed, head, [sample], block, num_anchors=length, offset_window=1)
    assert list(result["tau_by_offset"]) == [f"{k}-{k}" for k in range(length - block - prompt + 1)]
    parts = result["tau_by_offset"].values()
    assert sum(p["blocks"] for p in parts) == result["blocks"] == length - block - prompt + 1
    assert sum(p["tau"] * p["blocks"] for p in parts) / result["blocks"] == pytest.approx(result["tau"])
    wide = teacher_forced_tau(draft, embed, head, [sample], block, num_anchors=length, offset_window=8)
    assert [p["blocks"] for p in wide["tau_by_offset"].values()] == [8, 8, 8, 3]


def test_a_grown_drafter_starts_as_the_drafter_it_grew_from():
    """Appended layers add nothing to the residual stream at first, so the grown drafter's hidden states equal the
    original's."""
    torch.manual_seed(0)
    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[0, 1],
                          mask_token_id=49)
    draft = DFlashDraftModel(config).eval()
    grown = grow_draft(draft, 2).eval()
    assert grown.config.num_hidden_layers == 4 and len(grown.layers) == 4 and len(grown.config.layer_types) == 4
    assert draft.config.num_hidden_layers == 2  # the source is left as it was
    inputs = dict(noise_embedding=torch.randn(1, 4, 32), target_hidden=torch.randn(1, 7, 64),
                  position_ids=torch.arange(11)[None])
    with torch.no_grad():
        torch.testing.assert_close(grown(**inputs).last_hidden_state, draft(**inputs).last_hidden_state)
        for layer in grown.layers[2:]:  # the zeroed output projections are what keeps the function unchanged
            layer.self_attn.o_proj.weight.normal_()
        assert not torch.allclose(grown(**inputs).last_hidden_state, draft(**inputs).last_hidden_state)


def test_training_grows_a_trained_drafter_and_refuses_to_grow_nothing(work, tmp_path):
    main(train_argv(work, tmp_path / "small", "--max-steps", "2", "--final-dtype", "float32"))
    main(train_argv(work, tmp_path / "deep", "--max-steps", "3", "--final-dtype", "float32",
                    "--init-from", str(tmp_path / "small" / "final"), "--add-draft-layers", "1"))
    small = DFlashDraftModel.from_pretrained(tmp_path / "small" / "final")
    deep = DFlashDraftModel.from_pretrained(tmp_path / "deep" / "final")
    assert (small.config.num_hidden_layers, deep.config.num_hidden_layers) == (1, 2)
    assert deep.layers[1].mlp.down_proj.weight.abs().sum() > 0  # the new layer trained
    with torch.no_grad():  # it started as a copy of the last trained layer, output projections aside
        assert torch.equal(grow_draft(small, 1).layers[1].mlp.up_proj.weight, small.layers[0].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="--add-draft-layers grows a trained drafter: pass .* --init-from"):
        main(train_argv(work, tmp_path / "none", "--max-steps", "1", "--add-draft-layers", "1"))


def test_appended_layers_get_their_own_learning_rate():
    from dflash_hf.training.config import TrainOptions
    from dflash_hf.training.trainer import build_optimizer

    config = DFlashConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2, head_dim=8, vocab_size=50, block_size=4, target_layer_ids=[0, 1],
                          mask_token_id=49)
    grown = grow_draft(DFlashDraftModel(config), 1)
    options = TrainOptions(mask_token_id=49, lr=1e-3, add_draft_layers=1, new_layers_lr_scale=10.0)
    optimizer = build_optimizer(grown, options)
    rate = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    decay = {id(p): group["weight_decay"] for group in optimizer.param_groups for p in group["params"]}
    for name, param in grown.named_parameters():
        assert rate[id(param)] == (1e-2 if name.startswith("layers.2.") else 1e-3), name
        assert decay[id(param)] == (options.weight_decay if param.ndim >= 2 else 0.0), name
    assert len(rate) == sum(1 for _ in grown.parameters())


def test_warm_start_llama_target(tmp_path):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(save_chat_target(tmp_path / "llama", arch="llama"))
    config = DFlashConfig.from_target_config(target.config, mask_token_id=MASK, num_hidden_layers=2, block_size=4,
                                             target_layer_ids=[0, 1])
    draft = DFlashDraftModel(config)
    copied = warm_start_from_target(draft, target)
    assert torch.equal(draft.layers[1].self_attn.q_proj.weight, target.model.layers[3].self_attn.q_proj.weight)
    assert torch.equal(draft.layers[0].mlp.down_proj.weight, target.model.layers[2].mlp.down_proj.weight)
    assert torch.equal(draft.norm.weight, target.model.norm.weight)
    assert not any("q_norm" in name for name in copied)  # Llama has none: they stay ones
    assert torch.equal(draft.layers[0].self_attn.q_norm.weight, torch.ones(16))


def test_train_all_on_cpu_with_tiny_budget(work, tmp_path):
    out = tmp_path / "all"
    summary = main(["train-all", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"),
                    "--out", str(out), "--budget", "6", "--mask-token-id", str(MASK), "--num-draft-layers", "1",
                    "--block-size", "8", "--num-anchors", "8", "--max-new-tokens", "24", "--shard-size", "3",
                    "--target-layer-ids", LAYERS, "--final-max-shard-size", "20KB", "--max-steps", "100000"])
    assert summary["stopped_by_budget"]
    files = sorted(p.name for p in (out / "train" / "final").iterdir())
    weights = [p for p in (out / "train" / "final").glob("*.safetensors")]
    assert len(weights) > 1 and all(p.stat().st_size <= 20_000 for p in weights), files
    assert "model.safetensors.index.json" in files
    reloaded = DFlashDraftModel.from_pretrained(out / "train" / "final")
    assert reloaded.dtype == torch.bfloat16 and reloaded.config.mask_token_id == MASK


def free_port() -> str:
    """A free local port for torchrun's rendezvous: other test runs may share the machine."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def test_torchrun_two_processes_gloo(work, tmp_path):
    out = tmp_path / "ddp"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", free_port(),
           "-m", "dflash_hf", *train_argv(work, out, "--max-steps", "3", "--quiet", "--threads", "1")]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    ckpt = out / "checkpoints" / "step-0000003"
    assert (ckpt / "rng-rank0.pt").exists() and (ckpt / "rng-rank1.pt").exists()
    assert torch.load(ckpt / "trainer_state.pt", weights_only=True)["world_size"] == 2
    assert (out / "final" / "model.safetensors").exists()
    # the log's throughput counts every rank's blocks, as the summary does (not rank 0's times the world)
    logged = [json.loads(line)["blocks"] for line in (out / "log.jsonl").read_text().splitlines()]
    assert sum(logged) == json.loads((out / "summary.json").read_text())["blocks"] > 0


def test_step_sync_sums_block_counts_over_ranks(tmp_path):
    """The per-step all-reduce tells every rank whether any ran out of time and sums the ranks' blocks (their draws
    differ in size), so the summary does not report rank 0's count times the world size."""
    script = tmp_path / "sync.py"
    script.write_text("import os, sys, torch\nfrom dflash_hf.training.trainer import _any_and_sum\n"
                      "torch.distributed.init_process_group('gloo')\nrank = int(os.environ['RANK'])\n"
                      "flag, blocks = _any_and_sum(rank == 1, 10 + rank, 2, torch.device('cpu'))\n"
                      "open(f'{sys.argv[1]}/rank{rank}.txt', 'w').write(f'{flag} {blocks}')\n"
                      "torch.distributed.destroy_process_group()\n")  # as the trainer does: else gloo may abort at exit
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                             free_port(), str(script), str(tmp_path)],
                            env=dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1"),
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    # each rank writes its own file: two ranks' prints interleave on one stdout
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in (0, 1)] == ["True 21", "True 21"]


def test_features_stage_adds_what_distill_stores(work, tmp_path, monkeypatch):
    """Token-only shards + `dflash-hf features` == the shards `distill` writes with features (same tokens, same
    hidden states of the +1-offset layers), and a rerun skips finished shards."""
    tokens_only = tmp_path / "tokens"
    main(["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out",
          str(tokens_only), "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40",
          "--target-layer-ids", LAYERS, "--no-features"])
    assert not ShardDataset(tokens_only).has_features
    argv = ["features", "--target", str(work / "target"), "--data", str(tokens_only), "--out",
            str(tmp_path / "feats"), "--batch-size", "2"]
    assert len(main(argv)["written"]) == 3
    with_features, reference = ShardDataset(tmp_path / "feats"), ShardDataset(work / "data")
    assert with_features.has_features and with_features.target_layer_ids == [0, 2]
    for i in range(len(reference)):
        assert torch.equal(with_features[i]["input_ids"], reference[i]["input_ids"])
        torch.testing.assert_close(with_features[i]["features"].float(), reference[i]["features"].float(),
                                   atol=0.05, rtol=0.02)
    assert main(argv)["written"] == []
    # next_ids: the target's argmax after each token (+1 offset), taken a position at a time here (chunked head)
    # and equal to the full logits' argmax; on its own greedy answers it is the next token
    shard = "shard-00000.safetensors"
    assert "next_ids" not in load_file(tokens_only / shard) and "next_ids" in load_file(tmp_path / "feats" / shard)
    target = AutoModelForCausalLM.from_pretrained(work / "target", dtype=torch.float32)
    monkeypatch.setattr(distill_module, "ARGMAX_CHUNK", 1)
    chunked = tmp_path / "chunked"
    main(["features", "--target", str(work / "target"), "--data", str(tokens_only), "--out", str(chunked)])
    for i in range(len(reference)):
        sample, token_only = ShardDataset(chunked)[i], ShardDataset(tokens_only)[i]
        ids = sample["input_ids"]
        with torch.no_grad():
            out = target(ids[None], output_hidden_states=True)
        argmax = out.logits[0].argmax(-1)
        assert torch.equal(sample["next_ids"], argmax) and torch.equal(with_features[i]["next_ids"], argmax)
        expected = torch.cat([out.hidden_states[layer + 1][0] for layer in (0, 2)], dim=-1)  # the +1 offset
        torch.testing.assert_close(sample["features"].float(), expected, atol=0.05, rtol=0.02)
        response = sample["loss_mask"][1:].bool()
        assert torch.equal(sample["next_ids"][:-1][response], ids[1:][response])
        assert torch.equal(token_only["next_ids"][:-1], ids[1:])  # no stored predictions: the answer's own tokens


def test_sampled_answers_are_seeded_recorded_and_labelled_with_the_greedy_path(work, tmp_path):
    """`distill --temperature T --seed S` writes the same answers for the same seed, records both in the manifest,
    and the stored ``next_ids`` mark where a sampled answer left the target's greedy path."""
    def sample(out, seed):
        main(["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out",
              str(out), "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40", "--target-layer-ids",
              LAYERS, "--temperature", "1.0", "--seed", str(seed)])
        return ShardDataset(out)

    first, again, other = sample(tmp_path / "a", 5), sample(tmp_path / "b", 5), sample(tmp_path / "c", 6)
    tokens = [torch.cat([d[i]["input_ids"] for i in range(len(d))]) for d in (first, again, other)]
    assert torch.equal(tokens[0], tokens[1]) and not torch.equal(tokens[0], tokens[2])
    manifest = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert (manifest["temperature"], manifest["seed"]) == (1.0, 5)
    departures = 0
    for i in range(len(first)):
        ids, nxt, response = first[i]["input_ids"], first[i]["next_ids"], first[i]["loss_mask"][1:].bool()
        departures += int((ids[1:] != nxt[:-1])[response].sum())
    assert departures > 0  # a random tiny target at T = 1 leaves its greedy path: those rows train on the argmax
    labels = torch.cat([first[i]["next_ids"][:-1][first[i]["loss_mask"][1:].bool()] for i in range(len(first))])
    counts = first.response_token_counts()  # the draft vocabulary is drawn from what training learns
    assert torch.equal(counts, torch.bincount(labels, minlength=len(counts)))


def test_train_reads_several_folders_as_one_mix(work, tmp_path):
    """``train --data A B``: the sequences of every folder, each folder's shards in turn (a folder named twice counts
    twice); shards whose features come from other target layers are refused, since one drafter reads one set."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    shards = sorted((work / "data").glob("shard-*.safetensors"))
    first, rest, other = tmp_path / "first", tmp_path / "rest", tmp_path / "other-layers"
    for folder, chosen in ((first, shards[:1]), (rest, shards[1:])):
        folder.mkdir()
        for i, shard in enumerate(chosen):
            shutil.copy(shard, folder / f"shard-{i:05d}.safetensors")
    mixed, whole = ShardDataset([first, rest]), ShardDataset(work / "data")
    assert len(mixed) == len(whole) and mixed.has_features and mixed.target_layer_ids == [0, 2]
    for i in range(len(whole)):
        assert torch.equal(mixed[i]["input_ids"], whole[i]["input_ids"])
        assert torch.equal(mixed[i]["features"], whole[i]["features"])
    twice = ShardDataset([first, first]).response_token_counts()
    assert torch.equal(twice, 2 * ShardDataset(first).response_token_counts())

    argv = train_argv(work, tmp_path / "run", "--max-steps", "2", "--train-vocab", "40")
    at = argv.index("--data")
    summary = main(argv[: at + 1] + [str(first), str(rest)] + argv[at + 2 :])
    assert summary["step"] == 2 and summary["blocks"] > 0

    other.mkdir()
    with safe_open(str(shards[0]), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        meta = {**handle.metadata(), "target_layer_ids": "[0, 1]"}
    save_file(tensors, other / "shard-00000.safetensors", metadata=meta)
    with pytest.raises(ValueError, match=r"features of target layers \[0, 1\], the shards before it of \[0, 2\]"):
        ShardDataset([first, other])
    assert len(ShardDataset([first, other], load_features=False)) == 2 * len(ShardDataset(first))
    with pytest.raises(FileNotFoundError, match="No shard-"):
        ShardDataset([first, tmp_path / "empty"])


def test_vocab_subset_head_keeps_the_loss_of_in_subset_labels():
    """Over a subset holding every label, the loss equals the full head's loss restricted to those logits; labels
    outside the subset carry no weight."""
    from dflash_hf.training.trainer import VocabSubsetHead

    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    ids = torch.tensor([3, 7, 11, 40])
    subset = VocabSubsetHead(head, ids)
    hidden = torch.randn(5, 16)
    torch.testing.assert_close(subset(hidden), head(hidden)[:, ids])
    assert subset.rows(torch.tensor([7, 40, 8])).tolist() == [1, 3, -1]


def test_training_with_a_vocab_subset(work, tmp_path):
    """The drafter keeps the tokens its loss covered as its draft vocabulary, in checkpoints and the final drafter."""
    summary = main(train_argv(work, tmp_path / "subset", "--max-steps", "3", "--train-vocab", "40"))
    assert summary["step"] == 3 and summary["blocks"] > 0
    ids, coverage = ShardDataset(work / "data").frequent_response_tokens(40)
    assert len(ids) == 40 and 0 < coverage <= 1
    assert DFlashConfig.from_pretrained(tmp_path / "subset" / "final").draft_vocab == ids.tolist()
    checkpoint = sorted((tmp_path / "subset" / "checkpoints").iterdir())[-1]
    assert DFlashDraftModel.from_pretrained(checkpoint).config.draft_vocab == ids.tolist()


def test_draft_vocab_command_attaches_and_clears_a_vocabulary(work, tmp_path, capsys):
    """``dflash-hf draft-vocab`` writes the most frequent response tokens of the shards into config.json (a folder
    named twice counts twice) and nothing else; ``--clear`` removes them; a wrong folder is one line."""
    from dflash_hf.cli import main as cli

    draft = tmp_path / "draft"
    target_config = DFlashConfig.from_pretrained(work / "target")
    DFlashDraftModel(DFlashConfig.from_target_config(target_config, mask_token_id=MASK, num_hidden_layers=1,
                                                     target_layer_ids=[0, 2])).save_pretrained(draft)
    before = json.loads((draft / "config.json").read_text())
    assert cli(["draft-vocab", str(draft), "--data", str(work / "data"), str(work / "data"), "--size", "30"]) == 0
    ids, coverage = ShardDataset(work / "data").frequent_response_tokens(30)
    after = json.loads((draft / "config.json").read_text())
    assert after["dflash_config"].pop("draft_vocab") == ids.tolist() and after == before
    assert f"{100 * coverage:.2f}%" in capsys.readouterr().out
    assert cli(["draft-vocab", str(draft), "--clear"]) == 0
    assert DFlashConfig.from_pretrained(draft).draft_vocab is None
    assert cli(["draft-vocab", str(tmp_path / "missing"), "--clear"]) == 1
    assert "is not a folder: pass a local drafter folder" in capsys.readouterr().err.splitlines()[-1]


def test_average_command_writes_the_mean_under_the_first_config(work, tmp_path, capsys):
    """``dflash-hf average`` writes the element-wise mean of the drafters' weights with the first one's config (its
    draft vocabulary kept); drafters of another shape, or a single drafter, are one line."""
    from dflash_hf.cli import main as cli

    target_config = DFlashConfig.from_pretrained(work / "target")
    folders, drafters = [], []
    for seed, layers, vocab in ((0, 1, [3, 5, 7]), (1, 1, None), (2, 2, None)):
        torch.manual_seed(seed)
        config = DFlashConfig.from_target_config(target_config, mask_token_id=MASK, num_hidden_layers=layers,
                                                 target_layer_ids=[0, 2])
        config.draft_vocab = vocab
        drafters.append(DFlashDraftModel(config))
        folders.append(tmp_path / f"draft{seed}")
        drafters[-1].save_pretrained(folders[-1])
    out = tmp_path / "mean"
    assert cli(["average", str(folders[0]), str(folders[1]), "--out", str(out), "--dtype", "float32"]) == 0
    mean = DFlashDraftModel.from_pretrained(out, dtype=torch.float32)
    assert mean.config.draft_vocab == [3, 5, 7]
    for (name, got), a, b in zip(mean.state_dict().items(), drafters[0].state_dict().values(),
                                 drafters[1].state_dict().values()):
        torch.testing.assert_close(got, (a + b) / 2, msg=name)
    assert not torch.equal(drafters[0].fc.weight, drafters[1].fc.weight)  # the mean is not one of them
    capsys.readouterr()
    assert cli(["average", str(folders[0]), str(folders[2]), "--out", str(tmp_path / "bad")]) == 1
    assert "is not shaped like" in capsys.readouterr().err.splitlines()[-1] and not (tmp_path / "bad").exists()
    assert cli(["average", str(folders[0]), "--out", str(tmp_path / "one")]) == 1
    assert "at least two drafter folders" in capsys.readouterr().err.splitlines()[-1]


# ------------------------------------------------------------------------------------ typed configs, library
def test_train_all_is_a_library_function_the_command_line_wraps(monkeypatch, tmp_path):
    """`train_all` turns one `TrainAllConfig` into the distill and train configs (budget split, data and run folders,
    resume); ``dflash-hf train-all`` only parses its flags into that config."""
    from dflash_hf.training import GenerationOptions, TrainAllConfig, TrainOptions, pipeline, train_all

    calls = {}
    monkeypatch.setattr(pipeline, "distill", lambda config: calls.setdefault("distill", config))
    monkeypatch.setattr(pipeline, "train", lambda config: calls.setdefault("train", config) and {"final": "x"})
    config = TrainAllConfig(target="t", prompts=["p.jsonl"], out=str(tmp_path), budget=100, seed=3, device="cpu",
                            generation=GenerationOptions(batch_size=5, temperature=0.5),
                            training=TrainOptions(mask_token_id=MASK, batch_size=2, target_layer_ids=[0, 2]))
    train_all(config)
    distill, train = calls["distill"], calls["train"]
    assert (distill.out, distill.batch_size, distill.temperature, distill.seed) == (str(tmp_path / "data"), 5, 0.5, 3)
    assert distill.time_budget == 30 and distill.target_layer_ids == [0, 2] and distill.dtype == "float32"
    assert (train.data, train.output_dir, train.resume) == (str(tmp_path / "data"), str(tmp_path / "train"), "auto")
    assert train.batch_size == 2 and train.mask_token_id == MASK and 90 < train.time_budget <= 95  # 95% of what is left

    wrapped = {}
    monkeypatch.setattr(pipeline, "train_all", lambda config: wrapped.setdefault("config", config) and {})
    main(["train-all", "--target", "t", "--prompts", "p.jsonl", "--out", str(tmp_path), "--budget", "100",
          "--seed", "3", "--device", "cpu", "--distill-batch-size", "5", "--temperature", "0.5",
          "--mask-token-id", str(MASK), "--batch-size", "2", "--target-layer-ids", LAYERS])
    parsed = wrapped["config"]
    assert parsed.generation == config.generation and parsed.prompts == config.prompts and parsed.budget == 100
    assert parsed.training == dataclasses.replace(config.training, final_max_shard_size="15MB")


def test_eval_honours_seed(work, tmp_path, monkeypatch):
    from dflash_hf.training import evaluate as evaluation
    from conftest import save_chat_drafter

    draft = save_chat_drafter(tmp_path / "draft", work / "target")
    seeds = []
    real_acceptance = evaluation.acceptance

    def acceptance(*args, **kwargs):
        seeds.append(torch.initial_seed())
        return real_acceptance(*args, **kwargs)

    monkeypatch.setattr(evaluation, "acceptance", acceptance)
    for seed in ("5", "6"):
        main(["eval", "--target", str(work / "target"), "--draft", str(draft), "--prompts", str(work / "prompts.jsonl"),
              "--limit", "1", "--block-sizes", "2", "--max-new-tokens", "4", "--seed", seed])
    assert seeds == [5, 6]


def test_eval_reads_every_prompt_unless_limited(work, tmp_path):
    """Without --limit, eval runs every prompt of the file (a 21-prompt file is not cut to a default of 20)."""
    draft = save_chat_drafter(tmp_path / "draft", work / "target")
    prompts = write_prompts(tmp_path / "many.jsonl", 21)
    argv = ["eval", "--target", str(work / "target"), "--draft", str(draft), "--prompts", str(prompts),
            "--block-sizes", "2", "--max-new-tokens", "1"]
    assert main(argv)["num_prompts"] == 21
    assert main(argv + ["--limit", "3"])["num_prompts"] == 3


def test_teacher_forced_eval_reads_every_sequence_unless_limited(work, tmp_path):
    """``eval --data`` without --limit takes every distilled sequence (no None reaches a min()); with it, the first
    ``limit``."""
    draft = save_chat_drafter(tmp_path / "draft", work / "target")
    argv = ["eval", "--target", str(work / "target"), "--draft", str(draft), "--data", str(work / "data"),
            "--block-sizes", "2"]
    assert main(argv)["num_sequences"] == len(ShardDataset(work / "data")) > 2
    assert main(argv + ["--limit", "2"])["num_sequences"] == 2


def test_eval_names_a_missing_or_unfitting_drafter_folder(work, tmp_path, capsys):
    """A missing drafter folder is named as one (not taken for a Hub repo id); a drafter for another target is refused."""
    from dflash_hf.cli import main as cli

    base = ["eval", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--quiet"]
    assert cli(base + ["--draft", str(tmp_path / "missing")]) == 1
    assert "has no config.json: pass a DFlash drafter folder" in capsys.readouterr().err.splitlines()[-1]
    other = save_chat_drafter(tmp_path / "other-vocab", work / "target", vocab_size=1000)
    assert cli(base + ["--draft", str(other)]) == 1
    assert "does not fit the target" in capsys.readouterr().err.splitlines()[-1]


def test_bad_chat_template_kwargs_name_the_flag(work, tmp_path):
    with pytest.raises(ValueError, match="--chat-template-kwargs is not valid JSON"):
        main(["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out",
              str(tmp_path), "--chat-template-kwargs", "{enable_thinking: false}"])


def test_distill_with_a_drafter_writes_the_plain_paths_tokens(work, tmp_path):
    """``distill --draft``: the batches decode with batched DFlash and the shards hold exactly the plain path's
    tokens (greedy, float32)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(work / "target")
    config = DFlashConfig.from_target_config(target.config, mask_token_id=MASK, num_hidden_layers=1, block_size=4,
                                             target_layer_ids=[0, 2])
    torch.manual_seed(0)
    DFlashDraftModel(config).save_pretrained(tmp_path / "drafter")
    calls = []
    from dflash_hf import batch_generation_dflash

    original = batch_generation_dflash.BatchedDFlashLoop.run
    batch_generation_dflash.BatchedDFlashLoop.run = lambda self: calls.append(self.batch) or original(self)
    try:
        main(["distill", "--target", str(work / "target"), "--prompts", str(work / "prompts.jsonl"), "--out",
              str(tmp_path / "data"), "--shard-size", "2", "--batch-size", "3", "--max-new-tokens", "40",
              "--target-layer-ids", LAYERS, "--no-features", "--draft", str(tmp_path / "drafter")])
    finally:
        batch_generation_dflash.BatchedDFlashLoop.run = original
    assert calls and all(rows == 2 for rows in calls)  # every shard's batch went through the batched loop
    plain, drafted = ShardDataset(work / "data"), ShardDataset(tmp_path / "data")
    assert len(plain) == len(drafted) == 6
    for i in range(len(plain)):
        assert torch.equal(plain[i]["input_ids"], drafted[i]["input_ids"])
        assert torch.equal(plain[i]["loss_mask"], drafted[i]["loss_mask"])
    manifest = json.loads((tmp_path / "data" / "manifest.json").read_text())
    assert manifest["draft"] == str(tmp_path / "drafter")


def test_time_schedule_follows_whichever_of_steps_and_time_runs_out_first():
    """``--schedule time``: the step schedule's warm-up and cosine over max(step / steps, elapsed / budget)."""
    elapsed = [0.0]  # a stopped clock: the real one ticks on a loaded machine (0.5013 against 0.5 once)
    by_time = budget_cosine_lambda(1000, 100.0, lambda: elapsed[0], warmup_ratio=0.04, min_ratio=0.1)
    by_steps = cosine_lambda(1000, 40, 0.1)
    assert [by_time(s) for s in (100, 500, 999)] == pytest.approx([by_steps(s) for s in (100, 500, 999)])
    elapsed[0] = 50.0  # half the time gone at step 10: the time decides, the cosine is half way
    assert by_time(10) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (0.5 - 0.04) / 0.96)))
    elapsed[0] = 150.0  # past the budget: the floor
    assert by_time(10) == pytest.approx(0.1)
    elapsed[0] = 2.0  # in the warm-up by time
    assert by_time(1) == pytest.approx(0.02 / 0.04)


def test_run_clock_adds_the_time_a_resumed_run_had_used():
    clock = RunClock(offset=30.0)
    assert 30.0 <= clock() < 40.0
    clock.restart()
    assert 30.0 <= clock() < 40.0


def test_time_schedule_needs_a_time_budget(work, tmp_path):
    with pytest.raises(ValueError, match="--schedule time.*--time-budget"):
        main(train_argv(work, tmp_path / "run", "--max-steps", "2", "--schedule", "time"))
