"""Sampling with the drafter follows the target's distribution exactly.

For a tiny target we compute the exact joint distribution of the first three sampled tokens (with the same logits
processors generate uses), draw N samples through ``generate(assistant_model=draft, do_sample=True)`` and run a
chi-square goodness-of-fit test at a 0.1 % false-alarm rate (fixed seeds, so the outcome is reproducible). The drafter
proposes the target's greedy continuation, so rounds accept drafts often and reject them often: an acceptance rule
that is off in any direction shifts the joint distribution far beyond the test's threshold.
"""

import math
from collections import Counter

import pytest
import torch
from conftest import random_prompt, tiny_drafter, tiny_target
from oracle import pin
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

NUM_SAMPLES = 800
ALPHA_Z = 3.090  # standard normal quantile for a 1e-3 false-alarm rate


def processors(temperature, top_k, top_p):
    chain = LogitsProcessorList([TemperatureLogitsWarper(temperature)])
    if top_k:
        chain.append(TopKLogitsWarper(top_k))
    if top_p < 1.0:
        chain.append(TopPLogitsWarper(top_p))
    return chain


@torch.no_grad()
def exact_joint(target, ids, warp, depth=3, floor=1e-5):
    """P(t1..t_depth | ids) for every continuation whose probability exceeds ``floor``."""
    joint = {(): 1.0}
    for _ in range(depth):
        prefixes = list(joint)
        batch = torch.cat([torch.cat([ids, torch.tensor([p], dtype=torch.long).reshape(1, -1)], 1) for p in prefixes])
        logits = target(batch).logits[:, -1].float()
        probs = torch.softmax(warp(batch, logits), dim=-1)
        joint = {
            prefix + (token,): joint[prefix] * float(p)
            for prefix, row in zip(prefixes, probs)
            for token, p in enumerate(row.tolist())
            if joint[prefix] * p > floor
        }
    return joint


def chi_square_rejects(samples: Counter, joint: dict, n: int) -> tuple[bool, float, float]:
    cells, pooled_expected, pooled_observed = [], 0.0, 0
    for sequence, p in joint.items():
        if p * n >= 5:
            cells.append((samples.get(sequence, 0), p * n))
        else:
            pooled_expected += p * n
            pooled_observed += samples.get(sequence, 0)
    pooled_observed += sum(count for seq, count in samples.items() if seq not in joint)
    pooled_expected += n * (1.0 - sum(joint.values()))
    cells.append((pooled_observed, pooled_expected))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    critical = df * (1 - 2 / (9 * df) + ALPHA_Z * math.sqrt(2 / (9 * df))) ** 3  # Wilson-Hilferty
    return statistic > critical, statistic, critical


def check_follows_the_joint(target, drafter, ids, joint, options) -> int:
    """Draw NUM_SAMPLES continuations through generate() with the drafter, run the chi-square test against the exact
    joint, and return how many drafts were accepted in all."""
    torch.manual_seed(1234)
    samples, accepted = Counter(), 0
    for _ in range(NUM_SAMPLES):
        out = target.generate(ids, assistant_model=drafter, **options)
        samples[tuple(out[0, ids.shape[1] :].tolist())] += 1
        accepted += sum(a - 1 for a in drafter.last_stats.acceptance_lengths)
    rejects, statistic, critical = chi_square_rejects(samples, joint, NUM_SAMPLES)
    assert not rejects, f"chi2 {statistic:.1f} > {critical:.1f}: the drafter changed the sampling distribution"
    return accepted


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 8, 1.0), (1.3, 0, 0.8)],
)
def test_sampling_with_drafter_follows_target_distribution(temperature, top_k, top_p):
    target = tiny_target(seed=3)
    with torch.no_grad():  # a moderately peaked target: drafts of its greedy path are accepted about half the time
        target.get_output_embeddings().weight.mul_(3.0)
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(4, length=6)
    greedy_path = target.generate(ids, max_new_tokens=8, do_sample=False)
    joint = exact_joint(target, ids, processors(temperature, top_k, top_p))
    pin(drafter, greedy_path)
    options = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p, max_new_tokens=3)
    accepted = check_follows_the_joint(target, drafter, ids, joint, options)
    assert accepted > NUM_SAMPLES * 0.2  # drafts were really accepted, so the acceptance rule was exercised


def test_the_chi_square_check_catches_a_biased_sampler():
    """Power check: samples from a distorted distribution are rejected."""
    target = tiny_target(seed=3)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    ids = random_prompt(4, length=6)
    joint = exact_joint(target, ids, processors(1.0, 0, 1.0))
    sharpened = exact_joint(target, ids, processors(0.8, 0, 1.0))  # a subtle bias: temperature 0.8 instead of 1
    sequences, weights = zip(*sharpened.items())
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(torch.tensor(weights), NUM_SAMPLES, replacement=True, generator=generator)
    samples = Counter(sequences[i] for i in draws.tolist())
    assert chi_square_rejects(samples, joint, NUM_SAMPLES)[0]


@pytest.mark.parametrize("temperature", [0.7])
def test_dflash2_sampling_with_its_draft_distribution_follows_target_distribution(temperature, tmp_path):
    """DFlash2 samples its path from q_t = softmax(S_t / T) and hands q to the verifier (accept u * q(d) < p(d), else
    resample from norm(max(p - q, 0))). An 8-token vocabulary keeps the exact joint small and q far from one-hot, and
    its top-5 candidates leave q = 0 on three tokens, so both the acceptance and the residual are exercised."""
    from published import dflash2_config, write_checkpoint

    from dflash_hf import DFlash2DraftModel

    target = tiny_target(seed=3, vocab_size=8)
    folder = write_checkpoint(tmp_path / "d2", dflash2_config(target, block_size=4), seed=2)
    drafter = DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafter.adaptive_block_size = False
    ids = random_prompt(4, length=6) % 7 + 1  # no pad id (0) in the prompt
    joint = exact_joint(target, ids, processors(temperature, 0, 1.0))
    options = dict(do_sample=True, temperature=temperature, top_k=None, top_p=1.0, max_new_tokens=3)
    accepted = check_follows_the_joint(target, drafter, ids, joint, options)
    assert accepted > NUM_SAMPLES * 0.2  # drafts were really accepted (0.31 per sample here), so both paths ran


# --- DFlash v1 with sampled drafts: q = softmax of the drafter's logits, warped by the target's logits processors ---


@pytest.mark.parametrize(
    ("kind", "head_scale", "temperature", "top_k", "top_p"),
    [("qwen3", 6.0, 0.7, 0, 1.0), ("llama", 2.0, 1.0, 5, 1.0), ("qwen3", 6.0, 1.3, 0, 0.8)],
)
def test_sampled_drafts_with_their_distribution_follow_target_distribution(kind, head_scale, temperature, top_k, top_p):
    """``draft_sampling="sample"``: every draft is drawn from the drafter's own warped softmax q and transformers'
    loop accepts it with ``u * q(d) < p(d)``, resampling from ``norm(max(p - q, 0))``. An 8-token vocabulary keeps
    the exact joint small and q overlapping p, so drafts are both accepted and rejected (the residual is exercised);
    the head scales keep p peaked enough for 20-50 unpooled chi-square cells. A q off by a row or at another
    temperature shifts the joint too little for 800 samples to show (tried: x1.4 on q passes here); the next test
    pins q itself."""
    target = tiny_target(kind, seed=3, vocab_size=8, head_scale=head_scale)
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(4, length=6) % 7 + 1  # no pad id (0) in the prompt
    joint = exact_joint(target, ids, processors(temperature, top_k, top_p))
    options = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=top_p, max_new_tokens=3,
                   draft_sampling="sample")
    accepted = check_follows_the_joint(target, drafter, ids, joint, options)
    assert accepted > NUM_SAMPLES * 0.2  # drafts were really accepted, so the acceptance rule was exercised


def first_verified_round(target, drafter, ids, **options):
    """``(candidate ids [1, n + k], candidate logits [1, k, V])`` that the first drafted round hands the verifier."""
    from transformers.generation import utils

    seen, real = [], utils._speculative_sampling

    def recording(candidate_input_ids, candidate_logits, *args, **kwargs):
        seen.append((candidate_input_ids.clone(), candidate_logits.clone()))
        return real(candidate_input_ids, candidate_logits, *args, **kwargs)

    utils._speculative_sampling = recording
    try:
        target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=12, **options)
    finally:
        utils._speculative_sampling = real
    return seen[0]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_sampled_draft_distribution_is_the_warped_drafter_softmax_at_each_position(kind):
    """q of draft ``t`` is the hand-written reference drafter's logits of block row ``t + 1``, warped by the target's
    processors on the ids before that position (temperature, top-k and a repetition penalty, which reads them), and
    draft ``t`` lies in its support. Fails if q is taken one row off, at another temperature, or unwarped."""
    from reference import ReferenceDrafter
    from transformers import RepetitionPenaltyLogitsProcessor

    target = tiny_target(kind, seed=5)
    drafter = tiny_drafter(target, block_size=8)
    ids = random_prompt(7)
    torch.manual_seed(0)
    candidates, draft_logits = first_verified_round(
        target, drafter, ids, temperature=0.6, top_k=4, repetition_penalty=1.5, draft_sampling="sample"
    )
    anchor, num_drafts = ids.shape[1], draft_logits.shape[1]
    assert num_drafts == 7 and candidates.shape[1] == anchor + 1 + num_drafts

    with torch.no_grad():
        features = target(ids, output_hidden_states=True).hidden_states
        context = torch.cat([features[i + 1] for i in drafter.config.target_layer_ids], dim=-1)
        block = torch.tensor([[int(candidates[0, anchor])] + [drafter.config.mask_token_id] * 7])
        reference = ReferenceDrafter(drafter)
        hidden = reference(target.get_input_embeddings()(block), context, torch.arange(anchor), torch.arange(anchor, anchor + 8))
        logits = reference.logits(target.get_output_embeddings().weight, hidden[0, 1:]).float()
    warp = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.5), *processors(0.6, 4, 1.0)])
    for t in range(num_drafts):
        expected = warp(candidates[:, : anchor + 1 + t], logits[t : t + 1])[0]
        got = draft_logits[0, t]
        assert torch.equal(torch.isinf(got), torch.isinf(expected)), f"draft {t}: another top-k support"
        finite = ~torch.isinf(expected)
        torch.testing.assert_close(got[finite], expected[finite], rtol=1e-4, atol=1e-4)
        assert finite[candidates[0, anchor + 1 + t]], f"draft {t} was not sampled from its own q"


def test_draft_sampling_is_chosen_per_call_with_the_drafter_default(tmp_path):
    """Per call (`generate(draft_sampling=...)`, the target's generation config), else the drafter's default; greedy
    drafts hand the verifier no distribution (it compares samples), sampled ones their q; a wrong value is refused."""
    from transformers.generation import utils

    target = tiny_target(seed=5)
    drafter = tiny_drafter(target, block_size=4)
    ids = random_prompt(7)
    handed_q = []
    real = utils._speculative_sampling
    utils._speculative_sampling = lambda *args, **kwargs: handed_q.append(True) or real(*args, **kwargs)
    try:
        for call, default, expected in [({}, "sample", True), ({}, "greedy", False),
                                        ({"draft_sampling": "greedy"}, "sample", False),
                                        ({"draft_sampling": "sample"}, "greedy", True)]:
            drafter.draft_sampling, handed_q[:] = default, []
            target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=8, **call)
            assert bool(handed_q) == expected, (call, default)
        drafter.draft_sampling, handed_q[:] = "sample", []
        target.generation_config.draft_sampling = "greedy"
        target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=8)
        assert not handed_q
    finally:
        utils._speculative_sampling = real
    with pytest.raises(ValueError, match="draft_sampling must be 'greedy' or 'sample'"):
        target.generate(ids, assistant_model=drafter, do_sample=True, max_new_tokens=4, draft_sampling="argmax")


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 0)])
def test_sampled_drafts_from_a_draft_vocabulary_follow_target_distribution(temperature, top_k):
    """With ``draft_vocab`` q is the drafter's warped softmax over those ids and zero elsewhere; rejection sampling
    stays exact: tokens outside the draft vocabulary can only come from the residual ``norm(max(p - q, 0))``, and
    they do (the vocabulary leaves out tokens the target samples)."""
    target = tiny_target("qwen3", seed=3, vocab_size=8, head_scale=6.0)
    draft_vocab = [1, 2, 4, 6, 7]
    drafter = tiny_drafter(target, block_size=4, draft_vocab=draft_vocab)
    # The prompt's tokens join the draft vocabulary for the call, so the prompt is drawn from it: q stays zero on
    # 0, 3 and 5, which the target samples.
    ids = torch.tensor(draft_vocab)[random_prompt(4, length=6) % len(draft_vocab)]
    joint = exact_joint(target, ids, processors(temperature, top_k, 1.0))
    outside = sum(p for sequence, p in joint.items() if set(sequence) - set(draft_vocab))
    assert 0.1 < outside < 0.9  # the residual path is needed often, and drafts can be accepted often
    options = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=1.0, max_new_tokens=3,
                   draft_sampling="sample")
    accepted = check_follows_the_joint(target, drafter, ids, joint, options)
    assert accepted > NUM_SAMPLES * 0.2  # drafts were really accepted, so the acceptance rule was exercised
