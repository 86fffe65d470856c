"""Adaptive block size: the controller's choices on synthetic costs, and losslessness whatever it chooses."""

import copy
import functools
import types

import pytest
import torch
from conftest import random_prompt, tiny_drafter, tiny_target
from oracle import pin

from dflash_hf import DraftLengthController
from dflash_hf.controller_dflash import DFlashStats, RoundController, prompt_lookup_match
from dflash_hf.generation_dflash import DFlashCandidateGenerator, extract_context_feature


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
        if shadow:  # a plain round plus a drafter forward
            controller.record_shadow_cost(costs[0] + SHADOW, SHADOW)
        else:
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


@pytest.mark.parametrize("share, allowance", [(None, None), (0.015, 1.0)])  # the shipped budget, and twice it
def test_useless_drafter_falls_back_to_plain_decoding_with_shadow_probes_within_the_budget(share, allowance):
    choices = simulate(CPU_FP32, acceptance=0.0, explore_share=share, allowance=allowance)
    share = share or DraftLengthController.explore_share
    allowance = allowance or DraftLengthController.allowance
    # a shadow first round: the drafter reads the prompt, and the rest of the round measures the unit of every cost
    assert choices[0] == "s"
    assert sum(k not in (0, "s") for k in choices) <= 1  # at most one short draft on the first judgement's evidence
    shadows = choices.count("s")
    # shadow drafts spend the allowance and a share of the rounds: a drafter forward (SHADOW) every SHADOW / share
    assert shadows * SHADOW <= allowance + share * len(choices) + SHADOW
    assert shadows >= share * len(choices) / SHADOW - 1  # and keep looking, for text the drafter starts to fit
    # over 300 rounds, the probe included: within 2.5 % of plain decoding at twice the budget, 1.5 % at the shipped one
    assert round_cost(CPU_FP32, choices) < 1 + share + 0.01


def test_exploration_budget_follows_the_measured_drafter_cost():
    # a drafter forward as costly as a plain round: shadows five times rarer than at 0.2
    cheap = simulate(CPU_FP32 | {0: 1.0}, acceptance=0.0, rounds=400)
    costly_controller = DraftLengthController(max_drafts=15)
    costly_controller.record_cost(0, 1.0)
    costly_controller.record_shadow_cost(2.0, 1.0)
    assert costly_controller.drafter_cost == pytest.approx(1.0)
    assert costly_controller.shadow_price() == pytest.approx(1.0)
    assert cheap.count("s") > 3


def test_a_slow_stretch_before_the_shadow_rounds_does_not_make_the_drafter_forward_look_free():
    """A plain round timed in a slow stretch (a neighbour busy, a stall) leaves the unit high. A shadow round priced by
    its excess over that unit would measure the drafter forward at 0, charge nothing, and every round would become a
    shadow that never updates the unit; timed on its own, the forward keeps its price and the shadows their budget."""
    controller = DraftLengthController(max_drafts=15)
    controller.record_cost(0, 1.3)
    shadows = 0
    choices = []
    for _ in range(300):
        k = controller.choose()
        choices.append(k)
        if controller.shadow:
            shadows += 1
            controller.record_acceptance(1, 0)
            controller.record_shadow_cost(1.0 + SHADOW, SHADOW)
        else:  # the drafter never fits
            controller.record_acceptance(1 if k else 0, 0)
            controller.record_cost(k, CPU_FP32[k])
    assert sum(k > 0 for k in choices) <= 1  # at most one short draft on the first judgement's evidence
    assert controller.step_seconds == pytest.approx(1.0, rel=1e-3)  # shadow rounds' plain part updates the unit too
    assert controller.drafter_cost == pytest.approx(SHADOW, rel=0.02)  # its first sample read against the high unit
    assert shadows * SHADOW <= controller.allowance + controller.explore_share * 300 + SHADOW


def test_perfect_drafter_uses_the_whole_block():
    choices = simulate(CPU_FP32, acceptance=1.0)
    assert set(choices[12:]) == {15, 0}  # climbs to the whole block within a few rounds
    # and re-times the unit with one plain round after every 16 drafted ones, never two in a row
    runs = "".join("p" if k == 0 else "d" for k in choices[12:]).split("p")
    assert all(len(run) <= 16 for run in runs) and all(runs[1:-1]) and choices.count(0) <= 300 / 17 + 3


def test_a_unit_timed_in_a_slow_stretch_does_not_make_drafting_look_cheap_for_long():
    """Against a plain-round time set too high (the first decode round after the prefill, a neighbour), drafted
    rounds look cheap: a drafter that commits 1.3 tokens a round at 1.6 plain rounds would be chosen every round, and
    no plain round would correct the unit. A plain round re-times it after 16 drafted ones, and the first samples
    count alike, so the unit comes down and drafting stops."""
    controller = DraftLengthController(max_drafts=15)
    controller.record_cost(0, 2.0)  # the unit, timed in a slow stretch: twice a plain round
    controller.cost.update({3: 1.6 / 2.0, 7: 1.75 / 2.0, 15: 2.15 / 2.0})  # drafted sizes timed against it
    controller.rounds = 1
    choices = []
    for _ in range(150):
        k = controller.choose()
        choices.append(k)
        if k:  # draft 1 accepted in every third round, never draft 2: tau ~ 1.3
            controller.record_acceptance(*((2, 1) if len(choices) % 3 == 0 else (1, 0)))
            controller.record_cost(k, CPU_FP32[k])
        else:
            controller.record_cost(0, 1.0)
    assert choices.index(0) <= 16
    assert controller.step_seconds < 1.05 and controller.cost[3] > 1.2  # priced closer to right (1.6),
    assert sum(k > 0 for k in choices[-30:]) == 0  # drafting stops


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

    def undrafted(rounds):  # rounds after the 10th that decode plainly, besides the unit's refresh after 16 drafted
        refresh = DraftLengthController.refresh_every
        return sum(k in (0, "s") and not all(j not in (0, "s") for j in rounds[i - refresh : i])
                   for i, k in enumerate(rounds) if i >= 10)

    assert undrafted(choices) <= 3
    # the same controller judging only on the fast estimate quits on streaks (what the slow estimate prevents)
    fast_only = simulate(CPU_BF16, acceptance=0.5, seed=seed, slow_rate=0.2)

    assert undrafted(fast_only) > undrafted(choices)
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


def test_costs_are_in_plain_rounds_so_a_slower_machine_keeps_the_choice():
    """A neighbour that doubles every round's time (plain rounds are timed often, drafted ones rarely) must not make
    a drafted size look cheaper: costs are ratios to the plain-round time measured in the same stretch."""
    quiet, loaded = DraftLengthController(max_drafts=15), DraftLengthController(max_drafts=15)
    for controller, slowdown in ((quiet, 1.0), (loaded, 2.0)):
        controller.record_cost(0, 0.08 * slowdown)
        for k, cost in CPU_FP32.items():
            controller.record_cost(k, 0.08 * slowdown * cost)
        for _ in range(30):
            controller.record_acceptance(3, 1)
    for k in CPU_FP32:
        assert loaded.cost[k] == pytest.approx(quiet.cost[k]) == pytest.approx(CPU_FP32[k])
    assert loaded.choose() == quiet.choose()
    # plain rounds slow down after the drafted sizes were timed: their ratios follow the plain-round time, which moves
    # within a few rounds, and are bounded per round so one stall cannot flip the choice
    for _ in range(30):
        loaded.record_cost(0, 0.16 * 2)
    assert loaded.step_seconds == pytest.approx(0.32, rel=0.01)
    assert loaded.cost[3] == pytest.approx(CPU_FP32[3])


def test_drafting_must_beat_plain_decoding_by_the_margin():
    controller = DraftLengthController(max_drafts=15, margin=0.05)
    controller.record_cost(0, 0.08)
    for _ in range(40):
        controller.record_acceptance(4, 2)  # p1 = p2 = 1, then 0: E[k] = 3 for every k >= 2
    controller.cost.update({3: 3.0 / 1.03, 7: 3.0 / 1.02, 15: 3.0})  # 1.03x plain decoding at best: break-even
    assert controller.rate(3) == pytest.approx(1.03, rel=1e-3)
    assert controller.best() == 0 and controller.choose() == 0
    controller.cost[3] = 2.5  # 1.2x
    assert controller.best() == 3 and controller.choose() == 3


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


def test_shadow_rounds_decode_plainly_judge_one_draft_and_time_their_drafter_forward_apart(target, monkeypatch):
    drafter = tiny_drafter(target, block_size=4, adaptive=True)
    controllers = []

    def always_shadow(self):
        controllers.append(self)
        self.shadow = True
        return 0

    monkeypatch.setattr(DraftLengthController, "choose", always_shadow)
    ids = random_prompt(0)
    plain = target.generate(ids, max_new_tokens=12, do_sample=False)
    ours = target.generate(ids, max_new_tokens=12, do_sample=False, assistant_model=drafter, max_matching_ngram_size=0)
    assert torch.equal(ours, plain)
    rounds = drafter.last_stats.num_rounds
    assert drafter.last_stats.proposed_lengths == [0] * rounds and rounds == 11
    controller = controllers[-1]
    assert controller.observations[:2] == [rounds, 0]  # every round judged draft 1, never draft 2
    # a shadow round is a plain round (the unit) plus a drafter forward, timed on its own: no drafted size is priced
    assert controller.cost == {0: 1.0} and controller.step_seconds > 0
    assert 0 < controller.drafter_cost < 50  # typical forwards timed (not the prompt's), in plain rounds


def test_a_drafted_round_after_a_plain_stretch_prices_its_size_with_a_typical_drafter_forward():
    """A drafter forward that read what plain rounds left pending costs more than a typical one: the round still
    measures its size, with the forward counted at its typical price (left untimed, the size kept its lower bound
    and every call probed it again)."""
    controller = DraftLengthController(max_drafts=15)
    controller.record_cost(0, 0.1)  # the unit: a plain round of 0.1 s
    controller.drafter_cost = 0.2  # a typical drafter forward: 0.2 plain rounds
    controller.record_drafted_cost(7, 0.30, drafter_seconds=0.12, typical=False)  # the forward read a long stretch
    assert controller.cost[7] == pytest.approx((0.30 - 0.12) / 0.1 + 0.2)
    controller.record_drafted_cost(3, 0.18, drafter_seconds=0.02, typical=True)  # typical: timed as it is
    assert controller.cost[3] == pytest.approx(1.8)


def test_context_deferred_over_plain_rounds_reaches_the_drafter_exactly(target, monkeypatch):
    """Plain and lookup rounds run no drafter forward; the features they commit wait until the next drafter call,
    which must read exactly the positions committed since its last call, in order, with the target's features there
    -- and the output stays plain greedy's."""
    drafter = tiny_drafter(target, block_size=4, adaptive=True)
    plan = iter(["s", 0, 0, 3, 0, 0, 0, "s", 0, 3, 0, 3] + [0] * 40)

    def planned(self):
        k = next(plan)
        self.shadow = k == "s"
        return 0 if self.shadow else k

    monkeypatch.setattr(DraftLengthController, "choose", planned)
    calls = []
    hook = drafter.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs), with_kwargs=True)
    ids = random_prompt(2)
    try:
        out = target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=drafter,
                              max_matching_ngram_size=0)
    finally:
        hook.remove()
    assert torch.equal(out, target.generate(ids, max_new_tokens=24, do_sample=False))
    hidden = target(out, output_hidden_states=True).hidden_states
    features = extract_context_feature(hidden, drafter.config.target_layer_ids)  # [1, n, F*H]
    fed = 0
    assert len(calls) == 5  # two shadow rounds and three drafted ones
    for call in calls:
        positions = call["position_ids"][0].tolist()
        anchor = positions[-4]
        assert positions == list(range(fed, anchor + 4))  # every position since the last call, none twice
        torch.testing.assert_close(call["target_hidden"], features[:, fed:anchor], atol=1e-4, rtol=1e-4)
        fed = anchor


def test_lookup_continuation_is_judged_every_round_against_the_committed_tokens():
    controller = RoundController(block_size=8, adaptive=True, lookup_ngram=3, stats=DFlashStats(8))
    controller.sizes.record_cost(0, 1.0)
    controller.sizes.rounds = 1  # past the first round (a shadow that reads the prompt)
    ids = torch.tensor([[10, 11, 12, 13, 14, 20, 10, 11, 12]])  # "10 11 12" was followed by 13 14 20 10 ...
    assert prompt_lookup_match(ids[0], 3, 4)[1] == 3
    estimator = controller.lookup_rates[3]
    controller.sizes.acceptance[0][0] = 1.0  # the drafter looks better than lookup: lookup is not proposed
    controller.sizes.cost.update({3: 1.1})
    controller.sizes.acceptance[0][1:] = [1.0] * 6
    round = controller.choose(ids, room=20)
    assert round.lookup is None and round.continuation[:3].tolist() == [13, 14, 20] and round.match == 3
    round.proposed = 3
    controller.record_verification(torch.tensor([13, 14, 99]))  # drafts 1, 2 accepted, then the target's 99
    assert estimator.observations[:4] == [1, 1, 1, 0]  # lookup's 13, 14 matched, its 20 lost to 99
    assert estimator.acceptance[0][:3] == [0.75, 0.75, 0.25]
    controller.choose(ids, room=20)
    controller.current.proposed = 0
    controller.record_verification(torch.tensor([13]))  # a plain round judges lookup's first token too
    assert estimator.observations[:2] == [2, 1]
    assert controller.lookup_rates[1].observations[0] == 0  # other match lengths keep their own estimates


def test_lookup_costs_are_remembered_across_calls_and_price_the_first_matches():
    """A lookup size never timed is priced at a plain round (no drafter forward), so a call proposes its first
    prompt-lookup matches on the prior acceptance; a lookup round timed in an earlier call prices them at what
    verifying that many tokens cost, and a match no better than the prior is not proposed."""
    from dflash_hf.controller_dflash import DraftRound, RoundCostMemory

    memory, lookup_memory = RoundCostMemory(), RoundCostMemory()
    ids = torch.tensor([[10, 11, 12, 13, 14, 20, 10, 11, 12]])  # "10 11 12" was followed by 13 14 20 10 ...

    def call(**memories):
        controller = RoundController(block_size=8, adaptive=True, lookup_ngram=3, stats=DFlashStats(8), **memories)
        sizes = controller.sizes
        sizes.record_cost(0, 1.0)  # the unit: one second a plain round
        sizes.rounds, sizes.explored = 5, 10.0  # past the first round, no budget for shadow drafts
        sizes.acceptance = [[0.0] * 7, [0.0] * 7]  # the drafter does not fit: plain unless lookup pays
        return controller

    first = call(memory=memory, lookup_memory=lookup_memory)
    assert first.choose(ids, room=20).lookup.tolist() == [[13, 14, 20]]  # 3 lookup tokens at the prior p = 0.5
    first.current.proposed = 3
    first.record_round_cost(first.current, 2.0)  # verifying them took two plain rounds
    assert lookup_memory.cost == {3: 2.0} and memory.cost == {}  # the lookup's costs are its own

    second = call(memory=memory, lookup_memory=lookup_memory)
    assert second.lookup_rates[1].cost == {0: 1.0, 3: 2.0}
    assert all(estimator.cost is second.lookup_rates[1].cost for estimator in second.lookup_rates.values())
    assert second.choose(ids, room=20).lookup is None  # 1.875 tokens for 2 plain rounds: decode plainly
    assert call().choose(ids, room=20).lookup is not None  # without the memory it proposes them again
    round = DraftRound(3, lookup=torch.tensor([[13, 14, 20]]), proposed=3)
    second.record_round_cost(round, 2.6)
    assert lookup_memory.cost[3] == pytest.approx(second.lookup_rates[1].cost[3]) and lookup_memory.cost[3] > 2.0


def test_a_call_that_copies_the_prompt_every_round_still_re_times_the_unit():
    """Lookup rounds time no plain round either: after 16 rounds without one, a round decodes plainly (not looked
    up, not drafted), and its time moves the unit."""
    controller = RoundController(block_size=8, adaptive=True, lookup_ngram=3, stats=DFlashStats(8))
    sizes = controller.sizes
    sizes.rounds, sizes.explored = 5, 10.0  # past the first round, no budget for shadow drafts
    sizes.record_cost(0, 2.0)  # the unit, timed in a slow stretch
    sizes.acceptance = [[0.0] * 7, [0.0] * 7]  # the drafter does not fit; the answer copies the prompt
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17, 10, 11, 12]])
    for estimator in controller.lookup_rates.values():
        estimator.acceptance = [[1.0] * 7, [1.0] * 7]
        estimator.judged = 7
    controller.lookup_rates[1].cost.update({7: 1.5})
    kinds = []
    for _ in range(40):
        round = controller.choose(ids, room=20)
        round.proposed = round.lookup.shape[1] if round.lookup is not None else 0
        kinds.append("lookup" if round.lookup is not None else "plain")
        controller.record_round_cost(round, 1.5 if round.proposed else 1.0)
    assert kinds == (["lookup"] * 16 + ["plain"]) * 2 + ["lookup"] * 6
    assert sizes.step_seconds == pytest.approx(4.0 / 3)  # (2.0 + 1.0 + 1.0) / 3: the running mean of its samples


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
    def found(tokens, max_ngram, num_tokens):  # (continuation as a list, matched n-gram length) or None
        match = prompt_lookup_match(tokens, max_ngram, num_tokens)
        return None if match is None else (match[0].tolist(), match[1])

    tokens = torch.tensor([5, 6, 7, 8, 9, 6, 7, 1, 2, 9, 6, 7])
    assert found(tokens, 3, 4) == ([1, 2, 9, 6], 3)  # "9 6 7" last seen at 4..6
    assert found(tokens, 2, 1) == ([1], 2)  # "6 7": the latest occurrence wins
    assert found(torch.tensor([1, 2, 3]), 3, 4) is None  # no earlier occurrence of any suffix
    assert found(tokens, 3, 0) is None
    assert found(tokens, 3, 7) == ([1, 2, 9, 6, 7, 1, 2], 3)  # past the end: the loop goes on
    assert found(torch.tensor([4, 4]), 3, 5) == ([4] * 5, 1)


def test_lookup_rounds_are_lossless_and_commit_repeated_text(target):
    """A random tiny target falls into loops, where prompt lookup predicts the text and a random drafter does not;
    lookup rounds must be chosen, commit several tokens, and leave the output identical."""
    for seed in range(3):
        drafter = tiny_drafter(target, block_size=8, adaptive=True)  # a fresh one: no costs remembered from a call
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
        # the lookup rounds' costs stay with the drafter, apart from its own (the next calls start from them)
        lookup_memory = [memory for key, memory in drafter.round_costs.items() if key[-1] == "prompt lookup"]
        assert len(lookup_memory) == 1 and lookup_memory[0].cost and lookup_memory[0].calls == 1


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


# ---------------------------------------------------------------- round costs remembered across calls


def test_a_second_single_sequence_call_starts_from_the_first_calls_round_costs(target, monkeypatch):
    """The single-sequence path shares the batched path's memory (`RoundCostMemory`, key ``"single"``, batch 1): the
    second call starts with the costs the first measured (every draft accepted: it climbed 3 -> 7) and probes no size,
    and both calls (and a third, with the drafter's own drafts) equal plain greedy."""
    from dflash_hf import controller_dflash
    from dflash_hf.controller_dflash import RoundCostMemory

    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    ids = random_prompt(7)
    plain = target.generate(ids, max_new_tokens=40, do_sample=False)
    starts, probes = [], []
    recall, choose = RoundCostMemory.recall, DraftLengthController.choose

    def recording_recall(self):
        costs, drafter_cost = recall(self)
        starts.append((dict(costs), drafter_cost))  # a copy: the call's controller adds to its own
        probes.append([])
        return costs, drafter_cost

    def recording_choose(self):
        k = choose(self)
        if k and k not in self.cost:
            probes[-1].append(k)
        return k

    monkeypatch.setattr(RoundCostMemory, "recall", recording_recall)
    monkeypatch.setattr(DraftLengthController, "choose", recording_choose)
    # A fake clock: a target forward over n tokens takes 1 + 0.05 n, a drafter forward 0.3 (the choices no longer
    # depend on how fast this machine runs the tiny models).
    clock, forward = [0.0], target.forward

    @functools.wraps(forward)
    def timed_forward(*args, **kwargs):
        clock[0] += 1 + 0.05 * kwargs["input_ids"].shape[1]
        return forward(*args, **kwargs)

    monkeypatch.setattr(controller_dflash, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(target, "forward", timed_forward)
    real_draft, draft_forward = DFlashCandidateGenerator.draft_block, drafter.forward

    @functools.wraps(draft_forward)
    def timed_draft_forward(*args, **kwargs):
        clock[0] += 0.3
        return draft_forward(*args, **kwargs)

    monkeypatch.setattr(drafter, "forward", timed_draft_forward)

    def perfect(self, input_ids, round):  # the drafter runs; its drafts are the greedy continuation, all accepted
        real_draft(self, input_ids, round)
        start = input_ids.shape[1]
        round.drafts = plain[:, start : start + min(round.num_drafts + 1, self.block_size - 1)]
        return round.drafts[:, : round.num_drafts], None

    monkeypatch.setattr(DFlashCandidateGenerator, "draft_block", perfect)
    options = dict(max_new_tokens=40, do_sample=False, assistant_model=drafter, max_matching_ngram_size=0)
    assert torch.equal(target.generate(ids, **options), plain)
    ((key, memory),) = drafter.round_costs.items()
    assert key[:2] == ("single", 1) and starts[0] == ({}, None) and probes[0] == [3, 7]
    first_costs = dict(memory.cost)
    assert first_costs == pytest.approx({3: 1.5 / 1.05, 7: 1.7 / 1.05})  # (verify k + 1 tokens + drafter) / plain
    assert torch.equal(target.generate(ids, **options), plain)
    assert starts[1][0] == {k: max(cost, 1.0) for k, cost in first_costs.items()} and set(first_costs) == {3, 7}
    assert probes[1] == [] and max(drafter.last_stats.proposed_lengths) == 7
    monkeypatch.setattr(DFlashCandidateGenerator, "draft_block", real_draft)
    assert torch.equal(target.generate(ids, **options), plain)
    assert set(starts[2][0]) == {3, 7}


def test_round_cost_key_separates_what_costs_depend_on():
    from dflash_hf.controller_dflash import round_cost_key

    target = tiny_target()
    drafter = tiny_drafter(target)
    key = round_cost_key("batched", target, drafter, 4, 8, False)
    assert round_cost_key("batched", target, drafter, 4, 8, False) == key
    assert round_cost_key("batched", tiny_target(seed=3), tiny_drafter(target, seed=5), 4, 8, False) == key
    others = [
        round_cost_key("single", target, drafter, 4, 8, False),
        round_cost_key("batched", target, drafter, 8, 8, False),
        round_cost_key("batched", target, drafter, 4, 16, False),
        round_cost_key("batched", target, drafter, 4, 8, True),
        round_cost_key("batched", target, copy.deepcopy(drafter).double(), 4, 8, False),
        round_cost_key("batched", tiny_target("llama"), drafter, 4, 8, False),
        round_cost_key("batched", tiny_target(num_hidden_layers=3), drafter, 4, 8, False),
        round_cost_key("batched", tiny_target(attn="eager"), drafter, 4, 8, False),
    ]
    threads = torch.get_num_threads()
    torch.set_num_threads(threads + 1)
    try:
        others.append(round_cost_key("batched", target, drafter, 4, 8, False))
    finally:
        torch.set_num_threads(threads)
    assert len({key, *others}) == len(others) + 1


def test_round_cost_memory_recalls_merges_and_forgets():
    from dflash_hf.controller_dflash import RoundCostMemory, remembered_round_costs

    memory = RoundCostMemory()
    memory.forget_after = 2
    assert memory.recall() == ({}, None)
    memory.remember_size(1, 0.8)  # timed below a plain round (a slowed unit): recalled as one plain round
    memory.remember_size(3, 2.0)
    memory.remember_drafter(0.4)
    assert memory.recall() == ({1: 1.0, 3: 2.0}, 0.4)
    memory.remember_size(3, 2.2)  # a call writes back the sizes it timed; the others stay
    assert memory.recall() == ({1: 1.0, 3: 2.2}, 0.4)  # size 1 not timed in the last call (2)
    assert memory.recall() == ({3: 2.2}, 0.4)  # ... nor in the 2 before this one: forgotten
    assert memory.recall() == ({}, 0.4)
    target = tiny_target()
    drafter = tiny_drafter(target)
    first = remembered_round_costs(drafter, ("batched", 4))
    assert remembered_round_costs(drafter, ("batched", 4)) is first
    assert remembered_round_costs(drafter, ("batched", 8)) is not first
    assert set(drafter.round_costs) == {("batched", 4), ("batched", 8)}
    assert tiny_drafter(target).round_costs is None  # per drafter, not per class or process
    assert not any("round_costs" in name for name in drafter.state_dict())


def test_remembered_costs_count_as_measured_and_are_written_back_as_they_move():
    """A controller starting from a memory: a remembered size is measured (no waiting for the size below it), the
    plain round is still timed first, and each timed round's new cost is in the memory at once."""
    from dflash_hf.controller_dflash import RoundCostMemory

    memory = RoundCostMemory()
    memory.remember_size(7, 1.5)
    memory.remember_size(15, 3.0)
    controller = DraftLengthController(15, memory=memory)
    controller.acceptance = [[0.9] * 15, [0.9] * 15]
    controller.judged = 15
    assert controller.choose() == 0 and controller.shadow  # the first round: shadow
    assert controller.choose() == 0  # the unit is not timed yet
    controller.record_cost(0, 0.1)
    assert controller.best() == 7  # 3 was never timed, but 7 is remembered (and 15 measured dearer)
    controller.record_cost(7, 0.2)
    assert memory.cost[7] == pytest.approx(controller.cost[7]) and controller.cost[7] > 1.5
