"""Batched DFlash (``batch_generation_dflash``): every row of a left-padded batch equals that prompt's plain greedy
output generated alone, whatever the other rows accept, stop on or how long their prompts are."""

import pytest
import torch
from conftest import VOCAB, char_tokenizer, random_prompt, tiny_drafter, tiny_target
from oracle import corrupted
from transformers.generation.streamers import BaseStreamer

from dflash_hf import batch_generation_dflash, controller_dflash
from dflash_hf.batch_generation_dflash import BatchedDFlashLoop
from dflash_hf.controller_dflash import RoundCostMemory

PAD = 0


def left_padded(prompts):
    """``[1, n_i]`` prompts -> ``(input_ids [b, max n], attention_mask)``, left-padded with PAD."""
    width = max(p.shape[1] for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, width - p.shape[1] :], mask[i, width - p.shape[1] :] = p[0], 1
    return ids, mask


def alone(target, prompt, n, **kwargs):
    """Plain greedy for one prompt, generated alone: its new tokens ``[m]``."""
    return target.generate(prompt, max_new_tokens=n, do_sample=False, **kwargs)[0, prompt.shape[1] :]


def rows_of(out, width, prompts):
    """The new tokens of each row of a batched output (prompt part checked to be unchanged)."""
    return [out[i, width:] for i in range(len(prompts))]


def assert_rows_equal_alone(target, out, ids, prompts, n, pad=PAD, **kwargs):
    kwargs = {k: v for k, v in kwargs.items() if k not in ("max_new_tokens", "do_sample")}
    width = ids.shape[1]
    assert torch.equal(out[:, :width], ids)
    for i, prompt in enumerate(prompts):
        expected = alone(target, prompt, n, **kwargs)
        row = out[i, width:]
        assert torch.equal(row[: expected.shape[0]], expected), f"row {i}: {row.tolist()} vs {expected.tolist()}"
        assert bool((row[expected.shape[0] :] == pad).all()), f"row {i} is not padded after it ended"


PROMPT_LENGTHS = (1, 5, 37, 100)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_every_row_equals_its_prompt_generated_alone(target, attn):
    target.config._attn_implementation = attn
    drafter = tiny_drafter(target, block_size=4, attn=attn)
    prompts = [random_prompt(seed, length) for seed, length in enumerate(PROMPT_LENGTHS)]
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=drafter)
    assert out.shape == (len(prompts), ids.shape[1] + 30)
    assert_rows_equal_alone(target, out, ids, prompts, 30)
    plain_batch = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False)
    assert torch.equal(out, plain_batch)
    stats = drafter.last_stats
    assert len(stats.rows) == len(prompts)
    for row in stats.rows:  # the prefill commits the first token
        assert sum(row.acceptance_lengths) + 1 == 30 and all(1 <= a <= 4 for a in row.acceptance_lengths)


def test_the_prefill_hands_lm_head_contiguous_hidden_states(target):
    """The prefill asks for the last position's logits by index: the slice ``hidden[:, -1:]`` of a batch is not
    contiguous, and ``lm_head`` on it copies the head's weight once per row (pytorch#151934)."""
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(seed, length) for seed, length in enumerate((6, 9, 4))]
    ids, mask = left_padded(prompts)
    seen = []
    hook = target.get_output_embeddings().register_forward_pre_hook(
        lambda module, args: seen.append((tuple(args[0].shape), args[0].is_contiguous())))
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant_model=drafter)
    finally:
        hook.remove()
    assert seen[0] == ((3, 1, target.config.hidden_size), True)  # the prefill: one position per row
    assert all(contiguous for _, contiguous in seen)
    assert_rows_equal_alone(target, out, ids, prompts, 6)


@pytest.mark.parametrize("block_size", [1, 2, 16])
def test_block_sizes_and_the_adaptive_block_size(block_size):
    target = tiny_target("llama")
    prompts = [random_prompt(10 + i, length) for i, length in enumerate((3, 12, 7))]
    ids, mask = left_padded(prompts)
    for adaptive in (False, True):
        drafter = tiny_drafter(target, block_size=block_size, adaptive=adaptive)
        out = target.generate(ids, attention_mask=mask, max_new_tokens=25, do_sample=False, assistant_model=drafter)
        assert_rows_equal_alone(target, out, ids, prompts, 25)


def test_a_single_prompt_through_the_batched_loop_equals_plain_greedy(target, monkeypatch):
    drafter = tiny_drafter(target, block_size=4)
    drafter.batched_from = 1
    runs = []
    original = BatchedDFlashLoop.run
    monkeypatch.setattr(BatchedDFlashLoop, "run", lambda self: runs.append(self) or original(self))
    prompt = random_prompt(5, 9)
    out = target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert len(runs) == 1
    assert torch.equal(out, target.generate(prompt, max_new_tokens=20, do_sample=False))


def test_rows_stopping_on_eos_inside_a_block_are_padded_while_others_continue(target):
    drafter = tiny_drafter(target, block_size=8)
    prompts = [random_prompt(20 + i, length) for i, length in enumerate((4, 30, 11))]
    ids, mask = left_padded(prompts)
    free = [alone(target, p, 30) for p in prompts]
    eos = int(free[0][6])  # row 0 stops at its 7th token (inside the first blocks); other rows may or may not
    options = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=PAD)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **options)
    assert_rows_equal_alone(target, out, ids, prompts, 30, eos_token_id=eos, pad_token_id=PAD)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **options))
    assert int((out[0, ids.shape[1] :] == eos).nonzero()[0]) <= 6


def test_all_rows_ending_at_once(target):
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(30 + i, length) for i, length in enumerate((6, 2, 15))]
    ids, mask = left_padded(prompts)
    for n in (1, 2, 9):  # the budget ends every row in the same round
        out = target.generate(ids, attention_mask=mask, max_new_tokens=n, do_sample=False, assistant_model=drafter)
        assert out.shape[1] == ids.shape[1] + n
        assert_rows_equal_alone(target, out, ids, prompts, n)
    same = [random_prompt(40, 8)] * 3  # identical rows: the same EOS ends all of them in the same round
    ids, mask = left_padded(same)
    eos = int(alone(target, same[0], 20)[9])
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, eos_token_id=eos,
                          pad_token_id=PAD, assistant_model=drafter)  # fmt: skip
    expected = alone(target, same[0], 20, eos_token_id=eos, pad_token_id=PAD)
    assert out.shape[1] == ids.shape[1] + expected.shape[0]
    assert all(torch.equal(row, expected) for row in rows_of(out, ids.shape[1], same))


def test_stop_strings_per_row():
    target = tiny_target("qwen3", seed=2)
    tokenizer = char_tokenizer()
    drafter = tiny_drafter(target, block_size=8)
    prompts = [random_prompt(50 + i, length) for i, length in enumerate((5, 20, 9))]
    ids, mask = left_padded(prompts)
    free = alone(target, prompts[1], 30)
    stop = next(t for t in range(6, 20) if bool((free[t - 1 : t + 1] >= 4).all()))  # two plain characters
    text = tokenizer.decode(free[stop - 1 : stop + 1])  # row 1 stops after token `stop` (unless earlier)
    # With an EOS id, plain batched generation pads a row after its stop string too (without one it lets it run on).
    options = dict(max_new_tokens=30, do_sample=False, stop_strings=[text], tokenizer=tokenizer, pad_token_id=PAD,
                   eos_token_id=tokenizer.eos_token_id)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **options)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **options))
    assert_rows_equal_alone(target, out, ids, prompts, 30, **options)
    options.pop("eos_token_id")  # our loop pads a finished row either way
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **options)
    assert_rows_equal_alone(target, out, ids, prompts, 30, **options)
    assert bool((out[1, ids.shape[1] + stop + 1 :] == PAD).all())


def pin_batch(monkeypatch, continuations, cuts):
    """Make the batched loop propose each row's greedy continuation (``continuations[i]``: its new tokens), corrupted
    at slot ``cuts(row, round, n)`` (n = none): rows then accept exactly that many drafts in the same round. The
    drafter still runs (context feeding is exercised)."""
    rounds = []
    original = BatchedDFlashLoop._draft

    def pinned(self, num_drafts):
        drafts, _ = original(self, num_drafts)
        rounds.append(drafts)
        generated = (self.lengths - self.prompt_len).tolist()
        rows = []
        for i, start in enumerate(generated):
            row = continuations[i][start : start + drafts.shape[1]]
            row = torch.cat([row, row.new_full((drafts.shape[1] - row.shape[0],), PAD)])
            rows.append(corrupted(row, 0, row.shape[0], cuts(i, len(rounds) - 1, num_drafts), VOCAB))
        return torch.stack(rows), None  # pinned drafts are no samples of the drafter's q: verify them by equality

    monkeypatch.setattr(BatchedDFlashLoop, "_draft", pinned)
    return rounds


def test_rows_accept_none_partial_and_all_drafts_in_the_same_round(target, monkeypatch):
    drafter = tiny_drafter(target, block_size=6)
    prompts = [random_prompt(60 + i, length) for i, length in enumerate((7, 3, 25, 12))]
    ids, mask = left_padded(prompts)
    continuations = [alone(target, p, 60) for p in prompts]

    def cuts(row, round_index, n):  # row 0 rejects every first draft, row 1 accepts 2, row 2 all, row 3 varies
        return (0, 2, n, (round_index * 7 + 3) % (n + 1))[row]

    rounds = pin_batch(monkeypatch, continuations, cuts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert len(rounds) > 3
    assert_rows_equal_alone(target, out, ids, prompts, 40)
    accepted = [[a - 1 for a in row.acceptance_lengths] for row in drafter.last_stats.rows]
    assert set(accepted[0]) == {0}
    assert accepted[1][:-1] == [2] * (len(accepted[1]) - 1)
    assert accepted[2][:-1] == [5] * (len(accepted[2]) - 1)
    assert len(set(accepted[3])) > 2


def test_refusals_name_the_fix(target):
    drafter = tiny_drafter(target)
    ids, mask = left_padded([random_prompt(0, 4), random_prompt(1, 6)])

    class Streamer(BaseStreamer):
        def put(self, value):
            pass

        def end(self):
            pass

    with pytest.raises(ValueError, match="stream one prompt at a time"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter, streamer=Streamer())
    with pytest.raises(ValueError, match="padding_side='left'"):
        target.generate(ids, attention_mask=mask.flip(1), max_new_tokens=4, assistant_model=drafter)
    with pytest.raises(ValueError, match="output_scores"):
        target.generate(ids, attention_mask=mask, max_new_tokens=4, assistant_model=drafter, output_scores=True,
                        return_dict_in_generate=True)  # fmt: skip


def test_return_dict_and_spec_generate_take_a_batch(target):
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(70, 3), random_prompt(71, 10)]
    ids, mask = left_padded(prompts)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False)
    result = target.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, assistant_model=drafter,
                             return_dict_in_generate=True)  # fmt: skip
    assert torch.equal(result.sequences, plain)
    out = drafter.spec_generate(target=target, input_ids=ids, attention_mask=mask, max_new_tokens=12)
    assert torch.equal(out, plain)


def test_right_align():
    tokens = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    aligned = batch_generation_dflash.right_align(tokens, torch.tensor([2, 3]), pad=0)
    assert aligned.tolist() == [[0, 1, 2], [5, 6, 7]]


def assert_rows_sample_exactly(target, drafter, ids, mask, joints, options, min_accepted_rate=0.2):
    """Every row's sampled continuations pass the chi-square test against its exact joint distribution, and drafts
    were really accepted (so the acceptance rule and the residual both ran)."""
    from collections import Counter

    from test_sampling import NUM_SAMPLES, chi_square_rejects

    torch.manual_seed(1234)
    samples, accepted = [Counter() for _ in joints], 0
    for _ in range(NUM_SAMPLES):
        out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **options)
        for row, counter in enumerate(samples):
            counter[tuple(out[row, ids.shape[1] :].tolist())] += 1
        accepted += sum(a - 1 for a in drafter.last_stats.acceptance_lengths)
    for row, (counter, joint) in enumerate(zip(samples, joints)):
        rejects, statistic, critical = chi_square_rejects(counter, joint, NUM_SAMPLES)
        assert not rejects, f"row {row}: chi2 {statistic:.1f} > {critical:.1f}"
    assert accepted > NUM_SAMPLES * min_accepted_rate


@pytest.mark.parametrize(("temperature", "top_k"), [(0.7, 8)])
def test_sampling_follows_each_rows_target_distribution(temperature, top_k, monkeypatch):
    """Chi-square per row (as `test_sampling`): rows of different lengths sampled together each follow the exact
    joint distribution of their own first three tokens, while drafts are accepted and rejected."""
    from test_sampling import exact_joint, processors

    target = tiny_target(seed=3)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    drafter = tiny_drafter(target, block_size=4)
    prompts = [random_prompt(4, length=6), random_prompt(8, length=2)]
    ids, mask = left_padded(prompts)
    warp = processors(temperature, top_k, 1.0)
    joints = [exact_joint(target, p, warp) for p in prompts]
    pin_batch(monkeypatch, [alone(target, p, 8) for p in prompts], cuts=lambda row, r, n: 99)  # greedy paths
    options = dict(do_sample=True, temperature=temperature, top_k=top_k or None, top_p=1.0, max_new_tokens=3)
    assert_rows_sample_exactly(target, drafter, ids, mask, joints, options)


def test_sampled_drafts_with_their_q_follow_each_rows_target_distribution():
    """Unpinned: a plain DFlash drafter samples each row's drafts from its own q and hands q to the verifier
    (``draft_sampling="sample"``, the default); chi-square per row."""
    from test_sampling import exact_joint, processors

    target = tiny_target(seed=3)
    with torch.no_grad():
        target.get_output_embeddings().weight.mul_(3.0)
    drafter = tiny_drafter(target, block_size=4)
    drafter.adaptive_block_size = False
    prompts = [random_prompt(4, length=6), random_prompt(8, length=2)]
    ids, mask = left_padded(prompts)
    joints = [exact_joint(target, p, processors(1.0, 0, 1.0)) for p in prompts]
    options = dict(do_sample=True, temperature=1.0, top_k=None, top_p=1.0, max_new_tokens=3)
    # an untrained drafter: drafts are accepted now and then (both the acceptance and the residual run)
    assert_rows_sample_exactly(target, drafter, ids, mask, joints, options, min_accepted_rate=0.01)


@pytest.mark.parametrize("window", [2048, 6])
def test_a_dflash2_drafter_with_causal_sliding_layers_drafts_row_by_row(tmp_path, window):
    """DFlash2 walks a path per row (`propose` row by row); its causal, sliding-window layers must count positions,
    not cache slots (holes and left padding would otherwise hide or expose the wrong context)."""
    from published import dflash2_config, write_checkpoint

    from dflash_hf import DFlash2DraftModel

    target = tiny_target(seed=3)
    folder = write_checkpoint(tmp_path / "d2", dflash2_config(target, block_size=4, window=window, is_causal=True), seed=2)
    drafter = DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafter.adaptive_block_size = False
    assert drafter.config.layer_is_causal(0)
    prompts = [random_prompt(80 + i, length) for i, length in enumerate((2, 19, 8))]
    ids, mask = left_padded(prompts)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    assert_rows_equal_alone(target, out, ids, prompts, 20)
    seen = []  # the drafter's output rows handed to `propose`, call by call
    propose = drafter.propose
    drafter.propose = lambda lm_head, rows, *args: seen.append(rows.clone()) or propose(lm_head, rows, *args)
    alone_rows = []
    for prompt in prompts:  # the batched drafter computes what it computes for the prompt alone
        seen.clear()
        target.generate(prompt, max_new_tokens=20, do_sample=False, assistant_model=drafter)
        alone_rows.append(list(seen))
    seen.clear()
    target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    for i, expected in enumerate(alone_rows):  # batched calls go row 0, 1, 2 in every round
        batched = seen[i :: len(prompts)]
        assert len(expected) > 3
        for round_index, (mine, theirs) in enumerate(zip(batched, expected)):
            n = min(mine.shape[0], theirs.shape[0])
            torch.testing.assert_close(mine[:n], theirs[:n], atol=1e-4, rtol=1e-4, msg=f"row {i}, round {round_index}")


def test_logits_processors_see_each_rows_own_prefix(target, monkeypatch):
    """Rows that have committed different numbers of tokens get processors (repetition penalty, min_new_tokens) on
    their own prefix, as plain generation shows them."""
    drafter = tiny_drafter(target, block_size=6)
    prompts = [random_prompt(90 + i, length) for i, length in enumerate((4, 13, 8))]
    ids, mask = left_padded(prompts)
    options = dict(repetition_penalty=1.3, pad_token_id=PAD)
    free = [alone(target, p, 40, **options) for p in prompts]
    eos = int(free[1][2])  # row 1 would stop at its 3rd token: min_new_tokens keeps it going
    options.update(eos_token_id=eos, min_new_tokens=12)
    continuations = [alone(target, p, 40, **options) for p in prompts]
    pin_batch(monkeypatch, continuations, cuts=lambda row, r, n: (n, 0, 2)[row])  # rows drift apart in length
    out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=drafter,
                          **options)  # fmt: skip
    assert_rows_equal_alone(target, out, ids, prompts, 40, **options)
    assert len({sum(row.acceptance_lengths) for row in drafter.last_stats.rows}) > 1 or bool((out == PAD).any())


def test_dflash2_sampling_with_its_draft_distribution_follows_each_rows_target_distribution(tmp_path):
    """DFlash2 hands q to the verifier: each row runs rejection sampling against it (accept u * q(d) < p(d), else
    resample from norm(max(p - q, 0))) over its own drafts; chi-square per row on an 8-token vocabulary."""
    from published import dflash2_config, write_checkpoint
    from test_sampling import exact_joint, processors

    from dflash_hf import DFlash2DraftModel

    target = tiny_target(seed=3, vocab_size=8)
    folder = write_checkpoint(tmp_path / "d2", dflash2_config(target, block_size=4), seed=2)
    drafter = DFlash2DraftModel.from_pretrained(folder, dtype=torch.float32).eval()
    drafter.adaptive_block_size = False
    prompts = [random_prompt(4, length=6) % 7 + 1, random_prompt(5, length=3) % 7 + 1]  # no pad id (0) inside
    ids, mask = left_padded(prompts)
    joints = [exact_joint(target, p, processors(0.7, 0, 1.0)) for p in prompts]
    options = dict(do_sample=True, temperature=0.7, top_k=None, top_p=1.0, max_new_tokens=3)
    assert_rows_sample_exactly(target, drafter, ids, mask, joints, options)


def test_finished_rows_leave_the_batch_and_every_row_still_equals_its_prompt_alone(target):
    """A row that ends (EOS) leaves every later forward (target and drafter), while the other rows -- with a logits
    processor that reads each row's own prefix -- still equal their prompts generated alone."""
    drafter = tiny_drafter(target, block_size=6)
    prompts = [random_prompt(100 + i, length) for i, length in enumerate((9, 4, 22, 13))]
    ids, mask = left_padded(prompts)
    options = dict(pad_token_id=PAD, repetition_penalty=1.2)
    eos = int(alone(target, prompts[1], 30, **options)[4])  # row 1 ends at its 5th token at the latest
    options["eos_token_id"] = eos
    ended = [bool((alone(target, p, 30, **options) == eos).any()) for p in prompts]
    assert ended[1] and not all(ended)
    rows_seen = {"target": [], "drafter": []}
    hooks = [target.register_forward_pre_hook(lambda m, a, kw: rows_seen["target"].append(kw["input_ids"].shape[0]),
                                              with_kwargs=True),
             drafter.register_forward_pre_hook(
                 lambda m, a, kw: rows_seen["drafter"].append(kw["noise_embedding"].shape[0]), with_kwargs=True)]
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                              **options)
    finally:
        for hook in hooks:
            hook.remove()
    assert_rows_equal_alone(target, out, ids, prompts, 30, **options)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, **options))
    assert rows_seen["target"][0] == len(prompts)  # the prefill (a row may end on its first token)
    for seen in rows_seen.values():  # the batch only shrinks, and the rows that ended left it
        assert seen == sorted(seen, reverse=True) and seen[-1] <= len(prompts) - 1
    for prompt, row in zip(prompts, drafter.last_stats.rows):  # statistics by the caller's row (prefill: 1 token)
        assert sum(row.acceptance_lengths) + 1 == alone(target, prompt, 30, **options).shape[0]


def test_batch_controller_climbs_one_size_at_a_time_and_averages_per_row_left():
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController
    from dflash_hf.controller_dflash import DraftLengthController

    controller = BatchDraftLengthController(15, batch_size=4)
    assert controller.candidates == [0, 1, 3, 7, 15]
    controller.cost = {0: 1.0, 1: 1.2, 3: 1.4}
    controller.acceptance = [[0.9] * 15, [0.9] * 15]
    controller.judged = 15
    assert controller.best() == 7  # 15 would look better at the lower-bound cost of 3, but 7 is untried
    controller.cost[7] = 4.0  # 7 measured expensive: 15 (at least as expensive) is still not tried
    assert controller.best() == 3

    def after_rejections(model, judgements):
        model.acceptance, model.observations = [[0.5] * 15, [0.5] * 15], [100] * 15
        for _ in range(judgements):
            model.record_acceptance(1, 0)
        return model.acceptance[0][0]

    single = after_rejections(DraftLengthController(15), 1)
    assert single < 0.5
    # four rows rejecting draft 1 move the batch's estimate like one judgement; once two rows are left, two do
    assert after_rejections(controller, 4) == pytest.approx(single, abs=0.02)
    controller.rows_left(2)
    assert after_rejections(controller, 2) == pytest.approx(single, abs=0.02)


# Batch-8 round costs in plain rounds, shaped like the measured fp32 curve (scripts/batch_policy_trace.py): one draft
# already costs 1.8 plain rounds, so a drafter accepting 0.6 per position loses (E[3] = 2.18 tokens for 2.4).
BATCH8_COSTS = {0: 1.0, 1: 1.8, 3: 2.4, 7: 3.4, 15: 5.0}


def drive_batch_controller(acceptance, first_plain_seconds=1.0, rounds=64, batch=8, seed=0, memory=None, probes=None):
    """Drive `BatchDraftLengthController` as `BatchedDFlashLoop._round` does, with `BATCH8_COSTS` (seconds = plain
    rounds; a shadow round costs a plain round plus 0.3, the first one reads the prompts: 0.7) and every row accepting
    each draft with probability ``acceptance``; the first plain round takes ``first_plain_seconds`` (the first decode
    step after the prefill, or one a neighbour slowed down). Returns the choices and what the drafter cost the call
    beyond plain decoding, in plain rounds (negative: it paid). With ``memory`` (`RoundCostMemory`) the controller
    starts from its costs; ``probes`` collects the drafted sizes it chose without a cost for them."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    controller = BatchDraftLengthController(15, batch_size=batch, memory=memory)
    generator = torch.Generator().manual_seed(seed)
    choices, bill, first_plain = [], 0.0, True
    for index in range(rounds):
        k = controller.choose()
        if probes is not None and k and k not in controller.cost:
            probes.append(k)
        shadow = controller.shadow
        drafted = min(k + 1, 15) if k or shadow else 0
        committed = []
        for _ in range(batch):
            hits = 0
            while hits < drafted and torch.rand(1, generator=generator).item() < acceptance:
                hits += 1
            if drafted:
                judged = min(min(hits, k) + 1, drafted)
                controller.record_acceptance(judged, min(hits, judged))
            committed.append(min(hits, k) + 1)
        cost = 1.0 + (0.7 if index == 0 else 0.3) if shadow else BATCH8_COSTS[k]
        seconds = first_plain_seconds if k == 0 and not shadow and first_plain else cost
        first_plain = first_plain and (k or shadow)
        per_row = sum(committed) / batch
        controller.record_round(k, shadow, seconds, per_row, typical=index > 0,
                                drafter_seconds=cost - 1.0 if shadow else 0.0)
        bill += cost - per_row
        choices.append("s" if shadow else k)
    return choices, bill


@pytest.mark.parametrize("seed", range(5))
def test_batch_exploration_is_bounded_when_drafting_cannot_pay(seed):
    """A drafter that cannot pay at this batch size, and a unit (plain round) first timed 40 % slow, which makes every
    size look cheaper: the probes and the drafted rounds cost the call at most the exploration budget (1 plain round
    plus 1.5 % of the rounds) plus one round. (The policy before the exploration ledger drafted such calls to the end:
    12-19 plain rounds lost out of 64 in four of these five seeds.)"""
    choices, bill = drive_batch_controller(acceptance=0.6, first_plain_seconds=1.4, seed=seed)
    assert bill <= 1.0 + 0.015 * len(choices) + (BATCH8_COSTS[7] - 1.0)
    assert sum(k not in (0, "s") for k in choices) <= 4


@pytest.mark.parametrize("seed", range(3))
def test_batch_drafting_that_pays_earns_its_own_room(seed):
    """A drafter that pays (0.85 per position: E[7] = 4.5 tokens for 3.4 plain rounds) drafts most rounds of the call
    once its probes have paid, with long blocks, and gains most of what it can."""
    choices, bill = drive_batch_controller(acceptance=0.85, seed=seed)
    assert sum(k not in (0, "s") for k in choices) >= len(choices) // 2
    assert choices[-20:].count(7) + choices[-20:].count(15) >= 15
    assert bill < -40  # plain rounds saved


def test_a_size_never_measured_is_priced_on_the_line_through_the_measured_ones():
    """After 1, 3 and 7 drafts were measured (here as a call at batch 8 left them), 15 drafts are priced on the line
    through 3 and 7, not at 7's cost: one shadow round that saw draft 1 accepted by most rows (every later position
    assumed as good) does not make a round of 15 drafts look affordable -- at 7's cost it did, and lost 4.7 plain
    rounds at batch 8 in bf16. The batch drafts the best size the budget can pay instead."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController
    from dflash_hf.controller_dflash import DraftLengthController

    controller = BatchDraftLengthController(15, batch_size=8)
    controller.cost = {0: 1.0, 1: 1.7, 3: 1.9, 7: 2.2}
    assert controller.estimated_cost(15) == pytest.approx(2.2 + (2.2 - 1.9) / 4 * 8)
    assert controller.estimated_cost(3) == 1.9  # measured sizes keep their cost
    single = DraftLengthController(15)
    single.cost = dict(controller.cost)
    assert single.estimated_cost(15) == 2.2  # the single-sequence lower bound, unchanged
    controller.acceptance, controller.judged = [[0.9] * 15, [0.9] * 15], 1
    controller.plain_timed, controller.step_seconds, controller.rounds, controller.explored = 3, 1.0, 46, 0.5
    assert controller.best() == 15  # what the acceptance asks for is a probe the budget cannot pay ...
    assert controller.choose() == 7  # ... (0.5 + 1.8 > 1 + 0.015 * 47), so the best measured size drafts
    assert controller.explored + 2.2 - 1.0 <= controller.allowance + controller.explore_share * controller.rounds


def test_drafting_that_paid_leaves_room_for_a_shadow_and_a_drafting_loss_takes_it():
    """When plain decoding wins again, a shadow round pays from the drafter's whole bill: what drafting gained (at
    most one allowance of it) leaves room for one after the shadows have spent theirs; what it lost leaves none."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    def after_drafting(bill, explored=1.0):
        controller = BatchDraftLengthController(15, batch_size=4)
        controller.cost, controller.step_seconds, controller.plain_timed = {0: 1.0, 1: 1.5, 3: 1.8}, 1.0, 3
        controller.acceptance, controller.judged = [[0.2] * 15, [0.2] * 15], 4  # drafting no longer pays
        controller.rounds, controller.since_plain, controller.explored, controller.drafting = 20, 0, explored, bill
        return controller.choose(), controller.shadow

    assert after_drafting(0.0) == (0, False)  # two shadows spent the budget (1 + 0.015 * 21 < 1.5)
    assert after_drafting(-0.6) == (0, True)  # drafting gained 0.6: one more shadow
    assert after_drafting(-30.0, explored=2.0) == (0, False)  # a gain counts up to one allowance: 2 - 1 + 0.5 > 1.3
    assert after_drafting(1.2, explored=0.0) == (0, False)  # a loss leaves no room: 0 + 1.2 + 0.5 > 1.3


def test_a_shadow_round_is_booked_at_its_measured_drafter_forward_once_the_unit_is_timed():
    """A shadow round's drafter forward is charged at the assumed price when chosen and booked at what it measured
    (its seconds over the unit) once the unit is timed; the first one, before any plain round, stays at the charge."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    controller = BatchDraftLengthController(15, batch_size=8)
    assert controller.choose() == 0 and controller.shadow  # the first round reads the prompts
    charged = controller.explored
    controller.record_round(0, True, 3.0, 1.0, typical=False, drafter_seconds=2.0)
    assert controller.explored == charged  # no unit yet: nothing to measure it against
    for _ in range(3):
        controller.choose()
        controller.record_round(0, False, 1.0, 1.0, typical=True)
    explored = controller.explored
    controller.record_round(0, True, 1.9, 1.0, typical=False, drafter_seconds=0.9)
    assert controller.explored == pytest.approx(explored + 0.9 - controller.shadow_price())
    assert controller.step_seconds == 1.0 and controller.drafter_cost is None  # neither the unit nor a typical forward


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_closing_the_holes_keeps_every_row_equal_to_its_prompt_alone(target, monkeypatch, attn):
    """Packing each row's valid slots (`_close_holes`, here after every round with a hole) while rows accept 0, some
    or all drafts: the cache narrows to the longest row, both caches stay aligned, every row is still its prompt
    alone."""
    target.config._attn_implementation = attn
    drafter = tiny_drafter(target, block_size=6, attn=attn)
    prompts = [random_prompt(120 + i, length) for i, length in enumerate((3, 17, 8))]
    ids, mask = left_padded(prompts)
    continuations = [alone(target, p, 40) for p in prompts]
    pin_batch(monkeypatch, continuations, cuts=lambda row, r, n: (0, n, (r * 5 + 1) % (n + 1))[row])
    widths = []
    close = BatchedDFlashLoop._close_holes

    def close_often(self, min_dead=16):
        close(self, min_dead=1)
        widths.append((self.slot_mask.shape[1], int(self.num_valid.max()), self.drafter_positions.shape[1]))
        for layer in self.drafter_cache.layers:  # the drafter's cache holds exactly the slots it has read
            assert layer.keys.shape[2] == self.drafter_positions.shape[1]

    monkeypatch.setattr(BatchedDFlashLoop, "_close_holes", close_often)
    out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert_rows_equal_alone(target, out, ids, prompts, 40)
    assert len(widths) > 3
    # every time: no more columns than the longest row's slots plus at most one (pending) block of holes
    assert all(width <= valid + 6 for width, valid, _ in widths)


def test_plain_rounds_commit_the_plain_greedy_token_and_keep_the_drafters_context_pending(target, monkeypatch):
    """Rounds that propose 0 drafts (the controller deciding so, no shadow) commit exactly plain batched greedy's
    token per row, one per round, without running the drafter; when drafting resumes, its first forward reads every
    slot written since the prompt (the context kept pending), and every row still equals its prompt alone."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    drafter = tiny_drafter(target, block_size=4, adaptive=True)
    prompts = [random_prompt(140 + i, length) for i, length in enumerate((5, 19, 2))]
    ids, mask = left_padded(prompts)
    plain_rounds = 6
    choices = []

    def choose(self):  # plain for the first rounds, then 3 drafts a round
        self.shadow = False
        choices.append(0 if len(choices) < plain_rounds else 3)
        return choices[-1]

    monkeypatch.setattr(BatchDraftLengthController, "choose", choose)
    context_read = []
    hook = drafter.register_forward_pre_hook(
        lambda m, a, kw: context_read.append(kw["target_hidden"].shape[1]), with_kwargs=True)
    try:
        out = target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, assistant_model=drafter)
    finally:
        hook.remove()
    assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False))
    assert_rows_equal_alone(target, out, ids, prompts, 20)
    for row in drafter.last_stats.rows:  # each plain round: 0 proposed, exactly 1 token committed
        assert row.proposed_lengths[:plain_rounds] == [0] * plain_rounds
        assert row.acceptance_lengths[:plain_rounds] == [1] * plain_rounds
    # the drafter first ran in round 7 and read the prompt slots plus the 6 plain rounds' anchors at once
    assert context_read[0] == ids.shape[1] + plain_rounds
    # rounds that verified drafts: all but the plain ones and the last, whose rows had one token left (no room)
    stats = drafter.last_stats
    drafted = [any(row.proposed_lengths[i] > 0 for row in stats.rows) for i in range(stats.num_batch_rounds)]
    assert stats.num_drafted_batch_rounds == sum(drafted) == stats.num_batch_rounds - plain_rounds - 1


def test_the_draft_head_is_timed_only_for_drafted_sizes_and_not_again_when_rows_leave(target, monkeypatch):
    """The draft head's matmul forms are timed (`calibrate_head`) for the head rows a round actually drafts, before
    the round's clock starts -- never for sizes the call does not draft, and not again for every size whenever a
    row leaves the batch (that re-timing cost seconds of CPU per finished row on SmolLM2)."""
    drafter = tiny_drafter(target, block_size=4)  # fixed blocks: 3 drafts, 4 head rows per row
    prompts = [random_prompt(150 + i, length) for i, length in enumerate((6, 11, 3))]
    ids, mask = left_padded(prompts)
    options = dict(pad_token_id=PAD)
    eos = int(alone(target, prompts[0], 30, **options)[3])
    options["eos_token_id"] = eos
    timed, drafted = [], []
    monkeypatch.setattr(batch_generation_dflash, "calibrate_head", lambda head, rows: timed.append(rows) or False)
    original = BatchedDFlashLoop._draft
    monkeypatch.setattr(BatchedDFlashLoop, "_draft",
                        lambda self, k: drafted.append(self.batch * min(k + 1, 3)) or original(self, k))
    out = target.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, assistant_model=drafter,
                          **options)
    assert_rows_equal_alone(target, out, ids, prompts, 30, **options)
    assert min(drafted) < max(drafted)  # a row left the batch
    assert timed == drafted  # once per drafted round, for its own row count, nothing else


# ---------------------------------------------------------------- round costs remembered across calls


def record_batch_choices(monkeypatch):
    """Record, per call, the costs its controller started with (``starts``) and every round's ``(k, probe)`` (a probe:
    a drafted size the call had no cost for when it chose it) in ``calls``."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    starts, calls = [], []
    init, choose = BatchDraftLengthController.__init__, BatchDraftLengthController.choose

    def recording_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        starts.append(dict(self.cost))
        calls.append([])

    def recording_choose(self):
        k = choose(self)
        calls[-1].append((k, k > 0 and k not in self.cost))
        return k

    monkeypatch.setattr(BatchDraftLengthController, "__init__", recording_init)
    monkeypatch.setattr(BatchDraftLengthController, "choose", recording_choose)
    return starts, calls


def fake_round_clock(monkeypatch):
    """Rounds take ``b * (1 + 0.05 k)`` seconds for ``k`` drafts verified on ``b`` rows, plus 0.3 per drafter forward,
    on a fake clock: the controller's choices no longer depend on how fast this machine runs the tiny models."""
    import types

    clock = [0.0]
    fake_time = types.SimpleNamespace(perf_counter=lambda: clock[0])
    monkeypatch.setattr(batch_generation_dflash, "time", fake_time)
    monkeypatch.setattr(controller_dflash, "time", fake_time)  # `ForwardTimer`, which times the drafter forward
    verify, draft = BatchedDFlashLoop._verify, BatchedDFlashLoop._draft

    def timed_verify(self, proposals, limits):
        clock[0] += self.batch * (1 + 0.05 * proposals.shape[1])
        return verify(self, proposals, limits)

    def timed_draft(self, num_drafts):
        clock[0] += 0.3
        return draft(self, num_drafts)

    monkeypatch.setattr(BatchedDFlashLoop, "_verify", timed_verify)
    monkeypatch.setattr(BatchedDFlashLoop, "_draft", timed_draft)


def only_memory(drafter):
    (memory,) = drafter.round_costs.values()
    return memory


def test_a_second_call_at_the_same_batch_size_starts_from_the_first_calls_costs_and_probes_nothing(target, monkeypatch):
    """Every row accepts every draft (pinned, never corrupted; rounds timed on a fake clock), so the first call probes
    1, 3 and 7 drafts; the second call at the same batch size starts with the costs the first measured, goes straight
    to 7 drafts and probes nothing. Both equal plain batched greedy, and so does a third, unpinned call starting from
    the same costs."""
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    prompts = [random_prompt(170 + i, length) for i, length in enumerate((9, 4, 21))]
    ids, mask = left_padded(prompts)
    plain = target.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False)
    continuations = [alone(target, p, 60) for p in prompts]
    starts, calls = record_batch_choices(monkeypatch)
    fake_round_clock(monkeypatch)
    real_draft = BatchedDFlashLoop._draft
    pin_batch(monkeypatch, continuations, cuts=lambda row, r, n: 99)
    options = dict(attention_mask=mask, max_new_tokens=60, do_sample=False, assistant_model=drafter)
    assert torch.equal(target.generate(ids, **options), plain)
    first_costs = dict(only_memory(drafter).cost)
    assert starts[0] == {} and [k for k, probe in calls[0] if probe] == [1, 3, 7]
    assert set(first_costs) == {1, 3, 7}  # the memory holds what the first call measured
    assert torch.equal(target.generate(ids, **options), plain)
    assert starts[1] == {k: max(cost, 1.0) for k, cost in first_costs.items()}
    drafted = [k for k, _ in calls[1] if k]
    assert drafted[0] == 7 and not any(probe for _, probe in calls[1])  # straight to the best size, no probe
    monkeypatch.setattr(BatchedDFlashLoop, "_draft", real_draft)
    assert torch.equal(target.generate(ids, **options), plain)
    assert set(starts[2]) == {1, 3, 7}


def test_a_size_first_drafted_after_a_plain_stretch_is_measured_and_not_probed_again_by_the_next_call():
    """The round that first drafts a size after plain rounds has a drafter forward that reads their pending
    context: the size is measured with that forward at a typical price, and remembered, so the next call starts
    with it (batch 4, held-out GSM8K: every call probed 7 drafts again, 2.5-3.7 plain rounds believed 2.1)."""
    from dflash_hf.batch_generation_dflash import BatchDraftLengthController

    memory = RoundCostMemory()
    controller = BatchDraftLengthController(15, batch_size=4, memory=memory)
    for _ in range(3):
        controller.choose()
        controller.record_round(0, False, 1.0, 1.0, typical=True)
    estimate = controller.estimated_cost(7)  # never measured: a lower bound
    controller.record_round(7, False, 3.9, 1.0, typical=False, drafter_seconds=1.5)  # 1.5 s reading a stretch
    assert controller.cost[7] == pytest.approx(3.9 - 1.5 + controller.shadow_price())
    assert controller.drafting == pytest.approx(min(3.9, 2 * estimate) - 1.0)  # booked as before: what it cost, capped
    assert memory.recall()[0][7] == controller.cost[7]
    assert 7 in BatchDraftLengthController(15, batch_size=4, memory=memory).cost


def test_another_batch_size_does_not_reuse_the_costs(monkeypatch):
    """Costs in plain rounds depend on the batch size: a call at batch 2 after one at batch 3 starts without costs
    and probes again; each batch size has its own memory on the drafter."""
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    prompts = [random_prompt(180 + i, length) for i, length in enumerate((6, 13, 2))]
    continuations = [alone(target, p, 40) for p in prompts]
    starts, calls = record_batch_choices(monkeypatch)
    fake_round_clock(monkeypatch)
    pin_batch(monkeypatch, continuations, cuts=lambda row, r, n: 99)
    for rows in (3, 2):
        ids, mask = left_padded(prompts[:rows])
        out = target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=drafter)
        assert torch.equal(out, target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False))
    assert starts == [{}, {}]
    assert [k for k, probe in calls[1] if probe] == [1, 3, 7]
    assert sorted(key[1] for key in drafter.round_costs) == [2, 3]


def test_a_call_that_raises_has_already_written_its_costs_back(monkeypatch):
    """Costs are written back as they are measured: a call interrupted after its first drafted rounds leaves them."""
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    prompts = [random_prompt(190 + i, length) for i, length in enumerate((6, 13))]
    ids, mask = left_padded(prompts)
    fake_round_clock(monkeypatch)
    pin_batch(monkeypatch, [alone(target, p, 40) for p in prompts], cuts=lambda row, r, n: 99)
    real_round, measured = BatchedDFlashLoop._round, {}

    def interrupted(self):
        real_round(self)
        if len(self.controller.cost) > 2:  # a plain round and two drafted sizes measured
            measured.update((k, cost) for k, cost in self.controller.cost.items() if k)
            raise KeyboardInterrupt

    monkeypatch.setattr(BatchedDFlashLoop, "_round", interrupted)
    with pytest.raises(KeyboardInterrupt):
        target.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, assistant_model=drafter)
    assert len(measured) == 2 and only_memory(drafter).cost == measured


def test_costs_measured_after_a_row_left_are_not_remembered_for_the_batch_size(monkeypatch):
    """A row that finished leaves the batch: later rounds compute fewer rows and are cheaper, so the memory of this
    batch size keeps the costs as they were when the first row left, while the call's controller goes on timing."""
    target = tiny_target()
    drafter = tiny_drafter(target, block_size=8, adaptive=True)
    prompts = [random_prompt(200 + i, length) for i, length in enumerate((6, 13, 8))]
    ids, mask = left_padded(prompts)
    continuations = [alone(target, p, 60) for p in prompts]
    fake_round_clock(monkeypatch)
    pin_batch(monkeypatch, continuations, cuts=lambda row, r, n: 99)
    eos = int(continuations[0][30])
    assert eos not in continuations[1].tolist() and eos not in continuations[2].tolist()
    real_drop, when_left, controllers = BatchedDFlashLoop._drop_finished, [], []

    def drop(self):
        if bool(self.done.any()) and not when_left:
            when_left.append({k: cost for k, cost in self.controller.cost.items() if k})
            controllers.append(self.controller)
        real_drop(self)

    monkeypatch.setattr(BatchedDFlashLoop, "_drop_finished", drop)
    options = dict(max_new_tokens=60, do_sample=False, pad_token_id=PAD, eos_token_id=eos)
    out = target.generate(ids, attention_mask=mask, assistant_model=drafter, **options)
    assert torch.equal(out, target.generate(ids, attention_mask=mask, **options))
    assert when_left[0] and only_memory(drafter).cost == when_left[0]
    assert {k: c for k, c in controllers[0].cost.items() if k} != when_left[0]  # it went on measuring


def test_a_stale_low_remembered_cost_costs_at_most_the_budget_plus_a_round():
    """Remembered costs far too low (every size at a plain round: 1.8-5x too cheap) for a drafter that cannot pay:
    the batch drafts on them, but the first round at a remembered size is booked at what it realized, so the call
    loses at most the exploration budget plus one round, and leaves higher costs in the memory."""

    memory = RoundCostMemory()
    for k in (1, 3, 7, 15):
        memory.remember_size(k, 1.0)
    choices, bill = drive_batch_controller(acceptance=0.6, memory=memory)
    assert any(k not in (0, "s") for k in choices)
    assert bill <= 1.0 + 0.015 * len(choices) + (BATCH8_COSTS[15] - 1.0)
    assert sum(k not in (0, "s") for k in choices) <= 2
    assert max(memory.cost.values()) > 1.0


@pytest.mark.parametrize("seed", range(3))
def test_batch_controller_remembering_its_costs_probes_once_per_process(seed):
    """A drafter that pays: the first call probes 1, 3 and 7 drafts (15, priced on the line through 3 and 7 at 5.4
    plain rounds, would commit fewer tokens per plain round than 7: E[15] = 6.2 tokens for 5.0); a second call with
    the same memory probes nothing, goes straight to the long blocks and gains as much."""

    memory, probes = RoundCostMemory(), []
    first, first_bill = drive_batch_controller(acceptance=0.85, seed=seed, memory=memory, probes=probes)
    assert probes == [1, 3, 7]
    probes.clear()
    second, second_bill = drive_batch_controller(acceptance=0.85, seed=seed + 10, memory=memory, probes=probes)
    assert probes == []
    assert [k for k in second if k not in (0, "s")][0] in (7, 15)
    assert second.index(7) < first.index(7)  # the long blocks start sooner ...
    assert second_bill <= first_bill + 0.5  # ... and the call gains as much, up to its own rows' luck
