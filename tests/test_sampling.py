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
