"""Adaptive block size: the controller's choices on synthetic costs, and losslessness whatever it chooses."""

import copy

import pytest
import torch
from conftest import random_prompt, tiny_drafter
from oracle import pin

from dflash_hf import DraftLengthController
from dflash_hf.generation_dflash import DFlashCandidateGenerator, prompt_lookup


def simulate(costs, acceptance, rounds=300, seed=0, **controller_options):
    """Drive a controller with fixed per-k round costs and per-draft conditional acceptance; returns its choices."""
    controller = DraftLengthController(max_drafts=15, **controller_options)
    generator = torch.Generator().manual_seed(seed)
    choices = []
    for _ in range(rounds):
        k = controller.choose()
        shadow = controller.shadow
        assert not shadow or k == 0
        drafted = min(k + 1, 15) if k or shadow else 0  # the generator drafts one more than it proposes
        hits = 0
        while hits < drafted and torch.rand(1, generator=generator).item() < acceptance:
            hits += 1
        judged = min(min(hits, k) + 1, drafted)  # up to the first rejection; draft k+1 by the target's own token
        controller.record_acceptance(judged, min(hits, judged))
        if not shadow:  # the generator does not time shadow rounds
            controller.record_cost(k, costs[k])
        choices.append("s" if shadow else k)
    return choices


def round_cost(costs, choices):
    """Mean cost of the rounds in decode steps; a shadow round is plain decoding plus a drafter forward (SHADOW)."""
    return sum(costs[0] + SHADOW if k == "s" else costs[k] for k in choices) / len(choices)


SHADOW = 0.25  # fp32 SmolLM2: drafter forward + a one-row head, in decode steps


# Round costs in units of one decode step, shaped like the measured fp32 CPU curve (r(4) 1.5, r(8) 1.65, r(16) 2.05)
# plus a drafter forward of 0.1.
CPU_FP32 = {0: 1.0, 3: 1.6, 7: 1.75, 15: 2.15}


def test_useless_drafter_falls_back_to_plain_decoding_with_rare_shadow_probes():
    choices = simulate(CPU_FP32, acceptance=0.0)
    # a shadow first round (the drafter reads the prompt), one short draft and one plain round measure both costs,
    # then shadow drafts judge draft 1 until it has 3 judgements
    assert choices[:5] == ["s", 3, 0, "s", 0]
    assert all(k in (0, "s") for k in choices[2:])  # never again a drafted round
    probes = [i for i, k in enumerate(choices[5:]) if k == "s"]
    assert probes and len(probes) <= 5  # exponential back-off: 16, 32, 64, 128 rounds apart
    assert round_cost(CPU_FP32, choices) < 1.01  # under 1% slower than plain decoding over 300 rounds


def test_perfect_drafter_uses_the_whole_block():
    choices = simulate(CPU_FP32, acceptance=1.0)
    assert set(choices[12:]) == {15}  # climbs to the whole block within a few rounds


def test_costly_long_verify_picks_the_block_size_with_most_tokens_per_second():
    costs = {0: 1.0, 3: 1.5, 7: 1.7, 15: 3.5}  # a verify-cost cliff past 8 tokens
    choices = simulate(costs, acceptance=0.7)
    assert max(set(choices[10:]), key=choices[10:].count) == 7


# bf16 on the same CPU: verifying 4-16 tokens costs little more than one (r(16) ~ 1.3) plus a drafter of ~0.2.
CPU_BF16 = {0: 1.0, 3: 1.3, 7: 1.45, 15: 1.75}


@pytest.mark.parametrize("seed", range(5))
def test_good_drafter_with_rejection_streaks_keeps_drafting(seed):
    # p = 0.5: E[3] = 1.94 tokens for 1.3 -> 1.49x; plain decoding never wins, but 4+ rejections in a row happen.
    choices = simulate(CPU_BF16, acceptance=0.5, seed=seed)
    assert choices[10:].count(0) <= 3
    # the same controller judging only on the fast estimate quits on streaks (what the slow estimate prevents)
    assert simulate(CPU_BF16, acceptance=0.5, seed=seed, slow_rate=0.2)[10:].count(0) > choices[10:].count(0)
    assert round_cost(CPU_BF16, choices) > 1.2  # it drafts (and pays for it)


def test_one_stalled_round_does_not_price_a_size_out():
    controller = DraftLengthController(max_drafts=15)
    for k, cost in CPU_BF16.items():
        controller.record_cost(k, cost)
    controller.record_cost(3, 6.0)  # a garbage-collection pause inside one round
    assert controller.cost[3] == pytest.approx(1.3 * 1.2)  # counted as twice the estimate, at the moving rate
    for _ in range(20):
        controller.record_cost(3, 2.6)  # a lasting change is followed
    assert controller.cost[3] == pytest.approx(2.6, rel=0.02)


def test_controller_follows_acceptance_that_changes():
    controller = DraftLengthController(max_drafts=15)
    for k in (15, 0, 7, 3):
        controller.record_cost(k, CPU_FP32[k])
    for _ in range(20):
        controller.record_acceptance(1, 0)
    assert controller.choose() == 0
    for _ in range(20):
        controller.record_acceptance(15, 15)
    assert controller.choose() == 15


@pytest.mark.parametrize("block_size", [4, 16])
def test_adaptive_generation_is_lossless(target, block_size):
    drafter = tiny_drafter(target, block_size=block_size, adaptive=True)
    for seed in range(3):
        ids = random_prompt(seed)
        plain = target.generate(ids, max_new_tokens=40, do_sample=False)
        assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter), plain)
        pin(drafter, plain, cuts=lambda r, n: (r * 5 + 1) % (n + 1))
        assert torch.equal(target.generate(ids, max_new_tokens=40, do_sample=False, assistant_model=drafter), plain)
        assert max(drafter.last_stats.proposed_lengths) <= block_size - 1
        del drafter.make_candidate_generator


def test_shadow_rounds_decode_plainly_judge_one_draft_and_are_not_timed(target, monkeypatch):
    drafter = tiny_drafter(target, block_size=4, adaptive=True)
    controllers = []

    def always_shadow(self):
        controllers.append(self)
        self.shadow = True
        return 0

    monkeypatch.setattr(DraftLengthController, "choose", always_shadow)
    ids = random_prompt(0)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    assert torch.equal(target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter), plain)
    rounds = drafter.last_stats.num_rounds
    assert drafter.last_stats.proposed_lengths == [0] * rounds and rounds == 11
    controller = controllers[-1]
    assert controller.observations[:2] == [rounds, 0]  # every round judged draft 1, never draft 2
    assert controller.cost == {}  # shadow rounds cost neither what plain nor what drafted rounds cost


# ---- settings per call ---------------------------------------------------------------------------------------


def test_block_size_and_adaptivity_are_generate_arguments():
    from conftest import random_prompt, tiny_drafter, tiny_target
    from transformers import GenerationConfig

    from dflash_hf.generation_dflash import draft_settings

    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8, adaptive=True)

    def settings(**kwargs):
        return draft_settings(drafter, GenerationConfig(**(GenerationConfig._get_default_generation_params() | kwargs)))

    assert settings() == (8, True)  # transformers' defaults: the drafter's own settings
    assert settings(num_assistant_tokens=3) == (4, False)  # an explicit k with the constant schedule: fixed blocks
    assert settings(num_assistant_tokens=3, num_assistant_tokens_schedule="heuristic") == (4, True)
    assert settings(num_assistant_tokens=50) == (8, False)  # never past the drafter's block
    assert settings(num_assistant_tokens=0) == (1, False)  # plain decoding
    with pytest.raises(ValueError, match="num_assistant_tokens must be"):
        settings(num_assistant_tokens=-1)

    prompt = random_prompt(3)
    plain = target.generate(prompt, max_new_tokens=24, do_sample=False)
    out = target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter, num_assistant_tokens=3)
    assert torch.equal(out, plain)
    stats = drafter.last_stats
    assert stats.block_size == 4 and set(stats.proposed_lengths[:-3]) == {3}  # the last rounds stop at max_length
    assert drafter.config.block_size == 8 and drafter.adaptive_block_size  # the drafter is unchanged
    target.generate(prompt, max_new_tokens=24, do_sample=False, assistant_model=drafter)
    assert drafter.last_stats.block_size == 8  # the next call is back to the default


# ---- prompt lookup next to the drafter ------------------------------------------------------------------------


def test_prompt_lookup_continues_the_latest_longest_match():
    tokens = torch.tensor([5, 6, 7, 8, 9, 6, 7, 1, 2, 9, 6, 7])
    assert prompt_lookup(tokens, 3, 4).tolist() == [1, 2, 9, 6]  # "9 6 7" last seen at 4..6
    assert prompt_lookup(tokens, 2, 1).tolist() == [1]  # "6 7": the latest occurrence wins
    assert prompt_lookup(torch.tensor([1, 2, 3]), 3, 4) is None  # no earlier occurrence of any suffix
    assert prompt_lookup(tokens, 3, 0) is None
    assert prompt_lookup(tokens, 3, 7).tolist() == [1, 2, 9, 6, 7, 1, 2]  # past the end: the loop goes on
    assert prompt_lookup(torch.tensor([4, 4]), 3, 5).tolist() == [4] * 5


def test_lookup_rounds_are_lossless_and_commit_repeated_text(target):
    """A random tiny target falls into loops, where prompt lookup predicts the text and a random drafter does not;
    lookup rounds must be chosen, commit several tokens, and leave the output identical."""
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    for seed in range(3):
        ids = random_prompt(seed)
        plain = target.generate(ids, max_new_tokens=60, do_sample=False)
        sources = []
        original = DFlashCandidateGenerator.get_candidates

        def record(self, *args, **kwargs):
            out = original(self, *args, **kwargs)
            round = self.controller.current  # None for the prefill
            sources.append(round is not None and round.lookup is not None)
            return out

        DFlashCandidateGenerator.get_candidates = record
        try:
            out = target.generate(ids, max_new_tokens=60, do_sample=False, assistant_model=drafter)
        finally:
            DFlashCandidateGenerator.get_candidates = original
        assert torch.equal(out, plain)
        committed = [a for a, lookup in zip(drafter.last_stats.acceptance_lengths, sources[1:]) if lookup]
        assert committed and max(committed) > 2, (seed, committed)


def test_prompt_lookup_off_and_fixed_blocks_never_look_up(target):
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    drafter.prompt_lookup_ngram = 0
    generator = drafter.make_candidate_generator(target, target.generation_config, random_prompt(0), {})
    assert generator.controller.lookup_rates is None
    drafter.prompt_lookup_ngram = 3
    per_call = copy.deepcopy(target.generation_config)
    per_call.max_matching_ngram_size = 0  # generate(max_matching_ngram_size=0)
    assert drafter.make_candidate_generator(target, per_call, random_prompt(0), {}).controller.lookup_rates is None
    ids = random_prompt(1)
    plain = target.generate(ids, max_new_tokens=30, do_sample=False)
    out = target.generate(ids, max_new_tokens=30, do_sample=False, assistant_model=drafter, max_matching_ngram_size=0)
    assert torch.equal(out, plain)
    drafter = tiny_drafter(target, block_size=8, adaptive=False)
    generator = drafter.make_candidate_generator(target, target.generation_config, random_prompt(0), {})
    assert generator.controller.lookup_rates is None
