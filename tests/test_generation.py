"""Greedy exactness of ``target.generate(..., assistant_model=draft)`` and the round bookkeeping behind it."""

import pytest
import torch
from conftest import MASK_ID, VOCAB, char_tokenizer, random_prompt, tiny_drafter, tiny_target
from oracle import corrupted, pin
from reference import ModelDrafter, reference_generate
from transformers.generation.streamers import BaseStreamer

from dflash_hf import generation_dflash
from dflash_hf.generation_dflash import _FASTER_TRANSPOSED, head_argmax


def greedy(target, ids, n, **kwargs):
    return target.generate(ids, max_new_tokens=n, do_sample=False, **kwargs)


def varied_cuts(round_index, num_drafts):
    """All drafts, then none, then a fixed pseudo-random number: rounds with full, zero and partial acceptance."""
    if round_index < 2:
        return (num_drafts, 0)[round_index]
    return (round_index * 7 + 3) % (num_drafts + 1)


def varied_proposals(plain):
    """The reference loop's ``propose``: ``plain``'s continuation cut as `varied_cuts` says (as `oracle.pin` does)."""

    def propose(round_index, anchor, real):
        num = plain[:, anchor + 1 : anchor + 1 + real.shape[1]].shape[1]
        return corrupted(plain, anchor + 1, num, varied_cuts(round_index, num), VOCAB)

    return propose


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("block_size", [1, 2, 4, 16])
def test_greedy_identical_with_random_drafter(target, attn, block_size):
    drafter = tiny_drafter(target, block_size=block_size, attn=attn)
    for seed in range(3):
        ids = random_prompt(seed, length=5 + 4 * seed)
        plain = greedy(target, ids, 24)
        assert torch.equal(greedy(target, ids, 24, assistant_model=drafter), plain)
        stats = drafter.last_stats
        assert sum(stats.acceptance_lengths) + 1 == 24  # the prefill commits the first token
        assert all(1 <= a <= block_size for a in stats.acceptance_lengths)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("block_size", [2, 4, 16])
def test_proposals_match_reference_round_under_pinned_acceptance(target, attn, block_size):
    """Per-round drafter proposals equal the hand-written reference loop's while acceptance varies 0..B-1."""
    drafter = tiny_drafter(target, block_size=block_size, attn=attn)
    ids = random_prompt(7)
    plain = greedy(target, ids, 40)
    generators = pin(drafter, plain, varied_cuts)
    out = greedy(target, ids, 40, assistant_model=drafter)

    reference, reference_rounds = reference_generate(target, drafter, ids, 40, varied_proposals(plain))
    ours = generators[0].real_proposals
    assert torch.equal(out, plain) and torch.equal(reference, plain)
    assert len(ours) == len(reference_rounds) > 3
    for round_index, (mine, theirs) in enumerate(zip(ours, reference_rounds)):
        assert torch.equal(mine, theirs), f"round {round_index}: {mine} vs reference {theirs}"
    accepted = [a - 1 for a in drafter.last_stats.acceptance_lengths]
    assert min(accepted) == 0 and max(accepted) == block_size - 1  # both extremes were exercised


def test_reference_loop_on_the_model_forward_matches_the_hand_written_one(target):
    """scripts/gpu_speed.py times the reference loop with `ModelDrafter` (the model's own z-lab-style forward and
    cache): its rounds must be the hand-written drafter's, token for token, with pinned varied acceptance."""
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(5)
    plain = greedy(target, ids, 30)

    by_hand, hand_rounds = reference_generate(target, drafter, ids, 30, varied_proposals(plain))
    by_model, model_rounds = reference_generate(target, drafter, ids, 30, varied_proposals(plain),
                                                implementation=ModelDrafter)
    assert torch.equal(by_model, plain) and torch.equal(by_hand, plain)
    assert len(model_rounds) == len(hand_rounds) > 3
    assert all(torch.equal(a, b) for a, b in zip(model_rounds, hand_rounds))


def test_unpinned_proposals_match_reference(target):
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(3)
    reference, reference_rounds = reference_generate(target, drafter, ids, 20)
    generators = pin(drafter, reference, cuts=lambda r, n: n)  # records real proposals; pinned = truth
    assert torch.equal(greedy(target, ids, 20, assistant_model=drafter), reference)
    assert len(generators[0].real_proposals) >= 1
    assert torch.equal(generators[0].real_proposals[0], reference_rounds[0])


def test_full_acceptance_commits_whole_blocks_and_stops_exactly_at_max_new_tokens(target):
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(11)
    plain = greedy(target, ids, 23)
    pin(drafter, plain)
    out = greedy(target, ids, 23, assistant_model=drafter)
    assert torch.equal(out, plain) and out.shape[1] == ids.shape[1] + 23
    # 1 token from prefill, then full blocks of 4, then a short final round that fits max_length exactly.
    assert drafter.last_stats.acceptance_lengths == [4, 4, 4, 4, 4, 2]
    assert drafter.last_stats.proposed_lengths == [3, 3, 3, 3, 3, 1]


def test_eos_inside_an_accepted_block_ends_generation_like_plain_greedy(target):
    drafter = tiny_drafter(target, block_size=16)
    ids = random_prompt(5)
    continuation = greedy(target, ids, 30)
    eos = int(continuation[0, ids.shape[1] + 6])  # a token the target emits mid-block
    plain = greedy(target, ids, 30, eos_token_id=eos)
    pin(drafter, continuation)
    out = greedy(target, ids, 30, eos_token_id=eos, assistant_model=drafter)
    assert torch.equal(out, plain)
    assert int(out[0, -1]) == eos and (out[0, ids.shape[1] :] == eos).sum() == 1


def test_stop_string_inside_a_block_stops_where_plain_greedy_stops():
    target = tiny_target("qwen3")
    tokenizer = char_tokenizer()
    drafter = tiny_drafter(target, block_size=16)
    ids = random_prompt(2)
    continuation = greedy(target, ids, 30)
    stop = tokenizer.decode(continuation[0, ids.shape[1] + 5 : ids.shape[1] + 7])
    plain = greedy(target, ids, 30, stop_strings=[stop], tokenizer=tokenizer)
    assert plain.shape[1] < continuation.shape[1]  # the stop string really stops plain greedy early
    pin(drafter, continuation)
    out = greedy(target, ids, 30, stop_strings=[stop], tokenizer=tokenizer, assistant_model=drafter)
    assert torch.equal(out, plain)


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_receives_prompt_then_exactly_the_committed_tokens(target):
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(9)
    plain = greedy(target, ids, 20)
    pin(drafter, plain, varied_cuts)
    streamer = Collect()
    out = greedy(target, ids, 20, assistant_model=drafter, streamer=streamer)
    assert streamer.ended and streamer.chunks[0] == ids[0].tolist()
    streamed = [t for chunk in streamer.chunks[1:] for t in chunk]
    assert streamed == out[0, ids.shape[1] :].tolist() == plain[0, ids.shape[1] :].tolist()
    assert len(streamer.chunks) - 2 == drafter.last_stats.num_rounds  # prompt, prefill token, one chunk per round


def test_builtin_dflash_generator_gives_identical_greedy_output(target):
    """transformers' own `speculation_type="dflash"` path drives our drafter through its contract."""
    drafter = tiny_drafter(target, block_size=4)
    for seed in range(3):
        ids = random_prompt(seed)
        plain = greedy(target, ids, 20)
        ours = greedy(target, ids, 20, assistant_model=drafter)
        ours_stats = list(drafter.last_stats.acceptance_lengths)
        drafter.last_stats = None
        builtin = greedy(target, ids, 20, assistant_model=drafter, speculation_type="dflash")
        assert torch.equal(builtin, plain) and torch.equal(ours, plain)
        assert drafter.last_stats is None  # the built-in generator ran, not ours
        assert ours_stats


def test_builtin_and_ours_propose_the_same_blocks(target):
    """Same weights, same context: the built-in generator's candidates equal ours round by round."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(4)
    plain = greedy(target, ids, 20)
    builtin_candidates = []
    original = DFlashTokenCandidateGenerator.get_candidates

    def spy(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        if candidates.shape[1] > input_ids.shape[1]:
            builtin_candidates.append(candidates[:, input_ids.shape[1] :])
        return candidates, logits

    DFlashTokenCandidateGenerator.get_candidates = spy
    try:
        greedy(target, ids, 20, assistant_model=drafter, speculation_type="dflash")
    finally:
        DFlashTokenCandidateGenerator.get_candidates = original
    generators = pin(drafter, plain, cuts=lambda r, n: 0)  # reject everything: same rounds as a random drafter
    greedy(target, ids, 20, assistant_model=drafter)
    ours = generators[0].real_proposals
    assert len(builtin_candidates) >= 3
    for mine, theirs in zip(ours, builtin_candidates):
        assert torch.equal(mine, theirs[:, : mine.shape[1]])


def test_output_hidden_states_and_scores_work(target):
    """transformers' built-in DFlash path crashes on output_hidden_states=True; ours returns them."""
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(1)
    plain = target.generate(ids, max_new_tokens=10, do_sample=False, return_dict_in_generate=True, output_scores=True)
    out = target.generate(
        ids,
        max_new_tokens=10,
        do_sample=False,
        assistant_model=drafter,
        return_dict_in_generate=True,
        output_hidden_states=True,
        output_scores=True,
    )
    assert torch.equal(out.sequences, plain.sequences)
    assert len(out.scores) == 10 and len(out.hidden_states) == 10
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(out.scores, plain.scores))


def test_spec_generate_matches_generate_and_cuts_after_stop_token(target):
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(6)
    plain = greedy(target, ids, 25)
    assert torch.equal(drafter.spec_generate(target=target, input_ids=ids, max_new_tokens=25, temperature=0.0), plain)
    stop = int(plain[0, ids.shape[1] + 4])
    out = drafter.spec_generate(target=target, input_ids=ids, max_new_tokens=25, stop_token_ids=[stop])
    first = (plain[0, ids.shape[1] :] == stop).nonzero()[0].item()
    assert torch.equal(out, plain[:, : ids.shape[1] + first + 1])
    sampled = drafter.spec_generate(target=target, input_ids=ids, max_new_tokens=8, temperature=0.7)
    assert sampled.shape[1] == ids.shape[1] + 8


def test_last_stats_summarise_rounds(target):
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(8)
    plain = greedy(target, ids, 17)
    pin(drafter, plain, cuts=lambda r, n: [3, 0, 1, 2][r % 4])
    greedy(target, ids, 17, assistant_model=drafter)
    stats = drafter.last_stats
    assert stats.acceptance_lengths == [4, 1, 2, 3, 4, 1, 1]
    assert stats.mean_acceptance_length == pytest.approx(16 / 7)
    assert stats.histogram == [0, 3, 1, 1, 2]
    assert stats.proposed_lengths == [3, 3, 3, 3, 3, 1, 0]  # the last rounds fit what max_length leaves
    assert stats.per_position_acceptance == pytest.approx([4 / 6, 3 / 5, 2 / 5])


def test_drafter_in_bf16_serves_fp32_target(target):
    drafter = tiny_drafter(target, block_size=4).to(torch.bfloat16)
    ids = random_prompt(0)
    assert torch.equal(greedy(target, ids, 16, assistant_model=drafter), greedy(target, ids, 16))


def test_drafter_inputs_are_anchor_and_masks_at_absolute_positions(target):
    """Each round the drafter sees [anchor, mask x (B-1)] embedded by the target's own table, the features of exactly
    the newly committed positions, and positions [first uncached context position, anchor + B)."""
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(3)
    plain = greedy(target, ids, 14)
    pin(drafter, plain, varied_cuts)
    calls = []
    hook = drafter.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    try:
        greedy(target, ids, 14, assistant_model=drafter)
    finally:
        hook.remove()
    embed = target.get_input_embeddings()
    fed = 0
    for call, committed in zip(calls, drafter.last_stats.acceptance_lengths):
        positions = call["position_ids"][0]
        anchor = int(positions[-4])
        block = torch.tensor([[int(plain[0, anchor]), MASK_ID, MASK_ID, MASK_ID]])
        assert torch.equal(call["noise_embedding"], embed(block))
        assert positions.tolist() == list(range(fed, anchor + 4))
        assert call["target_hidden"].shape[1] == anchor - fed  # one feature row per newly committed position
        fed = anchor
    assert len(calls) == sum(p > 0 for p in drafter.last_stats.proposed_lengths)  # no drafts, no drafter call


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("transposed", [False, True])
def test_head_argmax_equals_lm_head_argmax_in_either_matmul_form(dtype, transposed, monkeypatch):
    head = torch.nn.Linear(16, 50, bias=False).to(dtype)
    rows = torch.randn(3, 16, generator=torch.Generator().manual_seed(0)).to(dtype)
    monkeypatch.setitem(_FASTER_TRANSPOSED, (dtype, 3, (64, 16)), transposed)
    assert torch.equal(head_argmax(head, rows), head(rows).argmax(dim=-1))


def test_head_argmax_times_each_size_once_and_calls_other_heads_as_they_are(monkeypatch):
    monkeypatch.setattr(generation_dflash, "_FASTER_TRANSPOSED", {})
    head, rows = torch.nn.Linear(16, 50, bias=False), torch.randn(5, 16)
    head_argmax(head, rows)
    assert list(generation_dflash._FASTER_TRANSPOSED) == [(torch.float32, 5, (64, 16))]  # 50 rows: up to 64
    head_argmax(torch.nn.Linear(16, 60, bias=False), rows)  # a head of similar size shares the choice
    assert len(generation_dflash._FASTER_TRANSPOSED) == 1
    biased = torch.nn.Linear(16, 50)
    assert torch.equal(head_argmax(biased, rows), biased(rows).argmax(dim=-1))
    assert len(generation_dflash._FASTER_TRANSPOSED) == 1


# --- a draft vocabulary (`config.draft_vocab`): drafts from those rows of the target's head only ---
DRAFT_VOCAB = list(range(4, VOCAB, 3))  # a third of the tokens


def recording_drafts(drafter):
    """Record every draft ``drafter.propose`` returns (all rounds, all rows)."""
    seen, real = [], drafter.propose

    def propose(*args, **kwargs):
        drafts, logits = real(*args, **kwargs)
        seen.append(drafts.flatten())
        return drafts, logits

    drafter.propose = propose
    return seen


def test_draft_vocab_head_drafts_the_restricted_argmax_and_samples_inside_it(target):
    """With ``draft_vocab`` the drafts are the argmax of the full head's logits over those ids (which differs from
    the unrestricted argmax here), and a sampled draft's q is the tempered logits on those ids, zero elsewhere."""
    from dflash_hf.generation_dflash import DFlashDraftHead, DraftVocabHead, extract_context_feature
    from transformers.cache_utils import DynamicCache

    full = tiny_drafter(target, block_size=8)
    restricted = tiny_drafter(target, block_size=8, draft_vocab=DRAFT_VOCAB)  # same seed: the same weights
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    ids = random_prompt(2)
    with torch.no_grad():
        context = extract_context_feature(target(ids, output_hidden_states=True).hidden_states,
                                          full.config.target_layer_ids)
        block = torch.tensor([[int(ids[0, -1])] + [MASK_ID] * 7])
        positions = torch.arange(ids.shape[1] + 7)[None]
        hidden = full(noise_embedding=embed(block), target_hidden=context[:, :-1], position_ids=positions)
        logits = lm_head(hidden.last_hidden_state[0, 1:])  # [7, V]
    vocab = torch.tensor(DRAFT_VOCAB)
    head = DFlashDraftHead(restricted, embed, lm_head)
    assert isinstance(head.lm_head, DraftVocabHead) and head.lm_head.vocab_ids.tolist() == DRAFT_VOCAB
    drafts, q = head(block, context[:, :-1], positions, DynamicCache(), 7)
    assert q is None and torch.equal(drafts[0], vocab[logits[:, vocab].argmax(-1)])
    assert not torch.equal(drafts[0], logits.argmax(-1))  # the restriction changed some drafts
    full_drafts, _ = DFlashDraftHead(full, embed, lm_head)(block, context[:, :-1], positions, DynamicCache(), 7)
    assert torch.equal(full_drafts[0], logits.argmax(-1))

    torch.manual_seed(0)
    drafts, q = head(block, context[:, :-1], positions, DynamicCache(), 7, temperature=0.5)
    inside = torch.zeros(VOCAB, dtype=torch.bool)
    inside[vocab] = True
    assert bool(torch.isinf(q[0][:, ~inside]).all()) and not bool(torch.isinf(q[0][:, inside]).any())
    torch.testing.assert_close(q[0][:, inside], logits[:, inside] / 0.5)
    assert bool(inside[drafts[0]].all())


def test_the_prompts_tokens_join_the_draft_vocab_for_the_call(target):
    """Answers copy names from their prompt: the prompt's tokens are drafted from too (for that call only)."""
    from dflash_hf.generation_dflash import DFlashDraftHead

    drafter = tiny_drafter(target, draft_vocab=DRAFT_VOCAB)
    embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    prompt = torch.tensor([[5, 6, 7, 5, 90]])
    head = DFlashDraftHead(drafter, embed, lm_head, prompt_ids=prompt).lm_head
    assert head.vocab_ids.tolist() == sorted(set(DRAFT_VOCAB) | {5, 6, 7, 90})
    torch.testing.assert_close(head.weight, lm_head.weight[head.vocab_ids])
    assert DFlashDraftHead(tiny_drafter(target), embed, lm_head, prompt_ids=prompt).lm_head is lm_head  # no vocab


@pytest.mark.parametrize("adaptive", [False, True])
def test_greedy_with_a_draft_vocab_is_identical_and_drafts_stay_inside_it(target, adaptive):
    drafter = tiny_drafter(target, block_size=8, adaptive=adaptive, draft_vocab=DRAFT_VOCAB)
    for seed in range(3):
        seen = recording_drafts(drafter)
        ids = random_prompt(seed, length=5 + 4 * seed)
        assert torch.equal(greedy(target, ids, 24, assistant_model=drafter), greedy(target, ids, 24))
        drafted = torch.cat(seen)
        assert len(drafted) > 0 and set(drafted.tolist()) <= set(DRAFT_VOCAB) | set(ids[0].tolist())


def test_batched_greedy_with_a_draft_vocab_is_identical_and_drafts_stay_inside_it(target):
    """The batched loop drafts through the same `DFlashDraftHead`, so it gets the draft vocabulary too."""
    drafter = tiny_drafter(target, block_size=4, draft_vocab=DRAFT_VOCAB)
    seen = recording_drafts(drafter)
    prompts = [random_prompt(seed, length) for seed, length in enumerate((3, 9, 20))]
    width = max(p.shape[1] for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    drafted = torch.cat(seen)
    assert len(drafted) > 0 and set(drafted.tolist()) <= set(DRAFT_VOCAB) | set(ids.flatten().tolist())


def test_draft_vocab_survives_save_and_trust_remote_code_loading(target, tmp_path):
    """A drafter saved with its draft vocabulary and loaded through ``AutoModel(..., trust_remote_code=True)`` (its
    own copy of the code) drafts inside it and stays exact."""
    from transformers import AutoModel

    tiny_drafter(target, block_size=4, draft_vocab=DRAFT_VOCAB).save_pretrained(tmp_path / "d")
    drafter = AutoModel.from_pretrained(tmp_path / "d", trust_remote_code=True).eval()
    assert drafter.config.draft_vocab == DRAFT_VOCAB
    drafter.adaptive_block_size = False
    seen = recording_drafts(drafter)
    ids = random_prompt(4)
    assert torch.equal(greedy(target, ids, 16, assistant_model=drafter), greedy(target, ids, 16))
    assert len(seen) > 0 and set(torch.cat(seen).tolist()) <= set(DRAFT_VOCAB) | set(ids[0].tolist())
