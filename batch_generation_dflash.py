"""Batched DFlash: ``target.generate(**left_padded_batch, assistant_model=draft)`` for a batch of prompts.

This file travels as remote code inside every saved drafter (``generation_dflash`` imports it), so it imports only
``torch``, ``transformers`` and its flat siblings.

transformers' assisted-decoding loop serves one sequence, so a batch runs this loop instead; `install_dflash_dispatch`
(``generation_dflash``) sends a DFlash drafter's batch here from ``_assisted_decoding``. The round has the phases of
the single-sequence path, for every row at once:

1. **feed context** (`BatchedDFlashLoop._take_context`): the target features of the slots written since the drafter
   last ran, with their per-row validity and positions;
2. **draft** (`BatchedDFlashLoop._draft`): one `DFlashDraftHead` call (the single-sequence path's draft head, one
   hook-visible module call): the drafter over ``[anchor, mask x (B-1)]`` for every row, then the target's head;
3. **verify** (`BatchedDFlashLoop._verify`): one target forward over ``[anchor, k drafts]`` for every row;
4. **accept** (`BatchedDFlashLoop._accept`): per row the longest prefix of drafts equal to the target's tokens (greedy:
   its argmax; sampling: an independent sample at every position, i.e. rejection sampling with a one-hot draft
   distribution, or `_speculative_sampling` for drafters that return one), plus the target's own next token;
5. **commit** (`BatchedDFlashLoop._commit`): per row, EOS / stop strings / other stopping criteria / the token budget
   cut the committed tokens; a finished row is padded with ``pad_token_id`` from then on.

Design: **a cache with per-row holes** (the choice, over realigning the cache every round or cropping every row to
the shortest acceptance: neither copies nor waits). All rows keep the same cache length; every verify writes the whole
block for every row, and the slots a row rejected stay in the cache as *holes*: a per-row slot mask ``[b, T]`` (the
tokenizer's left padding, then the holes) is the target's 2-D ``attention_mask``, and every forward gets each row's
logical ``position_ids`` (the number of valid slots before it), so a row's keys carry the positions its tokens have in
its own sequence and the holes are invisible. Rows accept different counts in the same round and none waits. Columns
dead in every row (beyond the longest acceptance) are cropped after each round. The drafter's context cache is kept
slot for slot aligned with the target's: it is fed the features of every written slot (zeroed where invalid) with the
same slot mask as its key mask, so the same holes are masked there. A row that finishes leaves the batch after its
round (`BatchedDFlashLoop._drop_finished`: both caches and every per-row tensor keep the other rows), so no later
forward computes it -- plain batched decoding computes finished rows to the end. Once dead slots (holes, left padding
no remaining row needs) are an eighth of the cache, each row's valid slots are packed together
(`BatchedDFlashLoop._close_holes`): every forward attends over, masks and copies all slots.

Block size: the adaptive `DraftLengthController` of the single-sequence path (`BatchDraftLengthController`: one
draft per round as a candidate, larger sizes tried one at a time), one block size per round for the whole batch: a
round's cost is measured for this batch size (wall time, as a ratio to the plain round measured in the same stretch,
remembered across the process's calls at this batch size: `RoundCostMemory`; the draft head's one-off matmul timing,
`_calibrate_head`, runs before the clock starts), its acceptance is judged on every active row, and it falls back to
plain batched decoding when drafting does not pay; what the drafter costs beyond what it commits is bounded by an
exploration budget (`BatchDraftLengthController`). A plain round is a plain batched greedy step (one target forward
over the anchors, the feature layers captured for the drafter's pending context) and costs the same, so there is no
separate hand-over to plain decoding. No prompt lookup in the batch path.

The drafter's causal and sliding-window layers get the logical positions of its cached slots
(``cached_positions``), so its windows count positions, not slots.

Limits (each refused with a clear error): no streamer, no per-token scores/logits/attentions/hidden states in the
output, no target with sliding-window (or other non-full) attention layers (transformers builds their windows in
slots, which the holes break), no right padding.
"""

import time

import torch
from transformers.cache_utils import DynamicCache
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

from .controller_dflash import (
    DFlashStats,
    DraftLengthController,
    ForwardTimer,
    RoundCostMemory,
    remembered_round_costs,
    round_cost_key,
)
from .generation_dflash import (
    DFlashDraftHead,
    calibrate_head,
    draft_sampling_mode,
    draft_settings,
    extract_context_feature,
)


# Logits processors that read the scores only, never the tokens: applied to every block position at once.
_SCORES_ONLY = (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)


class BatchDraftLengthController(DraftLengthController):
    """The adaptive block size for a batch: `DraftLengthController` with these changes for a batch whose verify
    cost grows with batch x block (on this project's AVX2 EPYC in float32, verifying 16 tokens per row costs 2.3x a
    plain step at batch 1, 2.9x at batch 4, 4.3x at batch 8; BENCHMARKS.md, "Batched DFlash"):

    * each active row is one judgement of the round's drafts, so a round teaches ``b`` of them: the moving averages
      of the acceptance rates move ``1/b`` as far per judgement, to remember as many rounds as at batch 1 (the fast
      one would otherwise follow the last round's rows only);
    * one draft per round is a candidate too (the cheapest drafted round, and the first one probed);
    * **the unit is measured, not guessed.** Every cost is a ratio to the plain round's time, so a unit measured on
      one round (the first decode step after the prefill, or one a neighbour slowed down) misprices every size for
      the rest of the call -- and a call that drafts from its third round on never times a plain round again. So the
      batch drafts only after ``unit_rounds`` plain rounds were timed (the unit starts at their median), and
      decodes one round plainly after every ``refresh_every`` rounds without one (as at batch 1,
      `DraftLengthController`: at most 1/16 of a drafting gain);
    * **exploration pays for itself.** Drafted rounds are booked at what they realized, in plain rounds: their cost
      minus the tokens they committed per row (``drafting``; negative when drafting paid: a plain round commits one
      per row for a cost of one). A drafted round runs only while the drafter's whole bill in this call -- shadow
      drafts (``explored``, as at batch 1) plus ``drafting`` plus, for a size not measured yet, what the probe
      loses if no draft is accepted -- stays within the exploration budget (``allowance`` plus ``explore_share`` of
      the rounds so far; twice the single-sequence budget, see ``explore_share``). Drafting that pays earns room for
      more, and for shadow drafts up to one ``allowance`` of it (`shadow_affordable`); drafting that does not -- the
      first probes at 1, 3 and 7 drafts, rounds drafted on estimates that have not caught up with the text -- costs
      the call at most the budget plus one round, and the batch decodes plainly until plain rounds have restored it.

    Sizes are tried one at a time upwards, as at batch 1: a round of 15 drafts at batch 8 costs about four plain steps,
    and is tried only once 7 drafts measured cheap enough that it might pay.

    **A process pays its probes once.** Round costs in plain rounds depend on the machine, the models, their dtypes
    and devices and the batch size, not on the prompt; so with a ``memory`` (`RoundCostMemory`, kept on the drafter
    per `round_cost_key`: the batch size the call starts with among its keys) a call starts from the sizes' costs
    earlier calls measured: those sizes are measured (no probe risk in `affordable`, no climbing to them one at a
    time), the unit is still timed on the call's first plain rounds, and every cost the call measures is written back
    as it moves (`BatchedDFlashLoop` stops writing once a row has left the batch: those rounds run fewer rows).
    Acceptance starts afresh. A remembered cost that has gone stale is corrected by the moving average, and the
    memory keeps the correction. A stale *low* one cannot make the batch draft on a losing size for long: the first
    round a call drafts at a remembered size is booked at what it realized, not at most twice the remembered
    estimate (which another call made), so a size that loses spends the exploration budget in that round, and the
    estimate climbs with every later timed round; the bound above -- the budget plus one round per call -- holds
    whatever the memory says. A stale *high* one can only keep the batch from drafting, until the memory forgets a
    size it has not timed in `RoundCostMemory.forget_after` calls.
    """

    unit_rounds = 3

    # The budget also pays the probes here, and a probe of 1 draft at batch 8 loses ~0.5 plain rounds or more when
    # nothing is accepted, so the batch keeps twice the single-sequence budget (a round plus 1.5 % of the rounds).
    explore_share, allowance = 0.015, 1.0

    def __init__(self, max_drafts: int, batch_size: int, memory: RoundCostMemory | None = None):
        super().__init__(max_drafts, memory=memory)
        self.batch_size = batch_size
        self.candidates = sorted(set(self.candidates) | ({1} if max_drafts > 1 else set()))
        self.plain_timed = 0  # plain rounds timed
        self.drafting = 0.0  # what drafted rounds cost beyond what they committed, in plain rounds
        self.first_plain: list[float] = []  # the first `unit_rounds` plain rounds' seconds
        self.recalled = set(self.cost)  # sizes priced by the memory and not timed in this call yet

    def affordable(self, num_drafts: int) -> bool:
        """Whether the exploration budget has room for a round of ``num_drafts`` drafts: for a size not measured yet
        (a probe), its estimated cost beyond a plain round, what it loses if no draft is accepted; for a measured
        size chosen because it pays, nothing (its booking stops it after the fact if it does not)."""
        risk = 0.0 if num_drafts in self.cost else self.estimated_cost(num_drafts) - 1.0
        return self.explored + self.drafting + risk <= self.allowance + self.explore_share * self.rounds

    def shadow_affordable(self) -> bool:
        """Shadow rounds pay from the drafter's whole bill, drafting included, with at most ``allowance`` of what
        drafting gained counted for them. A batch whose drafted rounds stop paying decodes plainly with the
        acceptance estimates they left, and only a shadow can move those again; judged by their own spending alone,
        shadows stayed unaffordable after the first two (1 plain round at 0.5 each), so at batch 4 a call whose
        blocks of 7 had gained 0.6 plain rounds decoded its last 40 rounds plainly without judging a draft. A
        drafting loss leaves less room for shadows, as for drafted rounds."""
        bill = self.explored + max(self.drafting, -self.allowance)
        return bill + self.shadow_price() <= self.allowance + self.explore_share * self.rounds

    def estimated_cost(self, num_drafts: int) -> float:
        """Measured cost in plain rounds; a size not measured yet is priced on the line through the two largest
        measured drafted sizes below it (verifying grows with batch x block: at batch 8 in bf16 a round of 15 drafts
        cost 5.7 plain rounds, one of 7 drafts 3.2), never below the single-sequence lower bound. Priced at the lower
        bound alone, the cost of 7 drafts, a call that remembered 1, 3 and 7 probed 15 drafts on one shadow's
        acceptance of draft 1 and lost 4.7 plain rounds in that round."""
        bound = super().estimated_cost(num_drafts)
        below = sorted(k for k in self.cost if 0 < k < num_drafts)
        if num_drafts in self.cost or len(below) < 2:
            return bound
        (small, large), costs = below[-2:], self.cost
        slope = max(costs[large] - costs[small], 0.0) / (large - small)
        return max(bound, costs[large] + slope * (num_drafts - large))

    def choose(self) -> int:
        """`DraftLengthController.choose`, plain until the unit is timed; a size the exploration budget cannot afford
        gives way to the best smaller one that it can (a drafter that pays keeps drafting while a longer block waits
        for room), else to a plain round (not a shadow: `DraftLengthController.choose` sets ``shadow`` only for
        plain rounds)."""
        wanted = super().choose()  # plain after `refresh_every` rounds that did not time the unit
        if self.plain_timed < self.unit_rounds:
            return 0
        while wanted and not self.affordable(wanted):
            wanted = self.best(limit=wanted - 1)
        return wanted

    def record_acceptance(self, judged: int, accepted: int) -> None:
        rates = self.rates  # the round costs keep their own pace (one per round)
        self.rates = tuple(rate / self.batch_size for rate in rates)
        try:
            super().record_acceptance(judged, accepted)
        finally:
            self.rates = rates

    def record_round(self, proposed: int, shadow: bool, seconds: float, committed: float, typical: bool,
                     drafter_seconds: float = 0.0) -> None:
        """A round that proposed ``proposed`` drafts (a ``shadow`` round: none, but the drafter ran) took ``seconds``,
        ``drafter_seconds`` of them in its drafter forward, and committed ``committed`` tokens per active row: book a
        drafted one in ``drafting`` (at no more than twice its size's estimated cost, as in `moving_cost`: a stall is
        not the drafter's doing -- unless the estimate is a remembered one this call has not timed yet); time its size
        (`record_drafted_cost`: when not ``typical``, its drafter forward read more than a block of new context and
        counts at a typical forward's price)."""
        if shadow:
            self._book_shadow(drafter_seconds)
            return
        if proposed and self.step_seconds:
            realized = seconds / self.step_seconds
            if proposed not in self.recalled:  # a remembered estimate may be stale: no cap until this call timed it
                realized = min(realized, 2 * self.estimated_cost(proposed))
            self.drafting += realized - committed
        if proposed:
            self.record_drafted_cost(proposed, seconds, drafter_seconds, typical)
            self.recalled.discard(proposed)
        else:  # a plain round (always typical: it runs no drafter)
            self.record_cost(0, seconds)
            self.plain_timed += 1
            if self.plain_timed <= self.unit_rounds:  # the unit starts at their median: one slow round is left out
                self.first_plain.append(seconds)
                self.step_seconds = sorted(self.first_plain)[(len(self.first_plain) - 1) // 2]

    def rows_left(self, batch_size: int) -> None:
        """Rows finished and left the batch, ``batch_size`` remain (`BatchedDFlashLoop._drop_finished`): each
        remaining row's judgement of a draft now counts ``1 / batch_size`` (`record_acceptance`). The unit is not
        re-timed at once: a plain round of fewer rows costs less, so drafted rounds look cheaper than they are until
        the next plain round corrects it, but fewer rows also make drafting pay more, and a forced plain round per
        departure measured slower, not faster (BENCHMARKS.md, "Rows leaving the batch")."""
        self.batch_size = batch_size

    def _book_shadow(self, drafter_seconds: float) -> None:
        """A shadow round's drafter forward, in plain rounds, replaces the price `choose` charged for it in the
        exploration budget (`shadow_price`), once the unit is timed (`unit_rounds` plain rounds): against a unit
        still settling it could look free. Its forward also reads the context that plain rounds left pending, so it
        does not price a typical drafter forward (``drafter_cost``); the budget pays what it really cost (at batch 8
        in fp32, 0.5-1.0 plain rounds against 0.5 charged)."""
        if self.plain_timed >= self.unit_rounds:
            self.explored += drafter_seconds / self.step_seconds - self.shadow_price()


class DFlashBatchStats(DFlashStats):
    """Statistics of one batched ``generate`` call (lands on ``draft.last_stats``).

    ``rows[i]`` is a `DFlashStats` of row ``i`` alone (its rounds: tokens committed, drafts proposed); the inherited
    lists and properties pool every row's rounds (``mean_acceptance_length`` is tau over all rows).
    ``num_batch_rounds`` counts the verify forwards of the batch, ``num_drafted_batch_rounds`` those that verified
    drafts (shadow rounds, which run the drafter but propose nothing, are not among them).
    """

    def __init__(self, block_size: int, batch_size: int):
        super().__init__(block_size)
        self.rows = [DFlashStats(block_size) for _ in range(batch_size)]
        self.num_batch_rounds = self.num_drafted_batch_rounds = 0

    def record_row(self, row: int, proposed: int, committed: int) -> None:
        self.rows[row].record(proposed, committed)
        self.record(proposed, committed)


def check_batch_supported(target, drafter, generation_config, streamer) -> None:
    """Raise a `ValueError` naming the fix for what the batched loop cannot do."""
    if streamer is not None:
        raise ValueError(
            "A streamer shows one sequence, but DFlash got a batch of prompts: stream one prompt at a time "
            "(generate per prompt), or drop `streamer` to generate the batch."
        )
    wanted = [
        name
        for name in ("output_scores", "output_logits", "output_attentions", "output_hidden_states")
        if generation_config.return_dict_in_generate and getattr(generation_config, name)
    ]
    if wanted:
        raise ValueError(
            f"Batched DFlash returns sequences only, not {', '.join(wanted)}: drop {'/'.join(wanted)}, or generate one "
            "prompt at a time."
        )
    layer_types = getattr(target.config.get_text_config(), "layer_types", None) or []
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(
            f"Batched DFlash needs a target with full attention in every layer (this one has "
            f"{sorted(set(layer_types))}): generate one prompt at a time."
        )


def right_align(tokens: torch.LongTensor, lengths: torch.LongTensor, pad: int) -> torch.LongTensor:
    """Rows of ``tokens [b, N]`` cut to ``lengths [b]`` and right-aligned (left-padded with ``pad``) ->
    ``[b, max(lengths)]``: the layout logits processors and stopping criteria see in plain batched generation."""
    width = int(lengths.max())
    index = torch.arange(width, device=tokens.device)[None] - (width - lengths)[:, None]  # [b, width]
    aligned = tokens.gather(1, index.clamp(min=0))
    return aligned.masked_fill(index < 0, pad)


class BatchedDFlashLoop:
    """One batched DFlash ``generate`` call (see the module docstring). State, for the ``b`` rows still generating
    (``row_ids [b]``: their indices in the caller's batch; finished rows wait in ``finished_rows``):

    * ``slot_mask [b, T]``: which of the target cache's ``T`` slots hold a committed token of the row;
    * ``num_valid [b]``: valid slots, i.e. the logical position of the row's anchor (its last committed token, not yet
      in the cache);
    * ``sequences [b, P + max_new]``: the left-padded prompt then the generated tokens, ``lengths [b]`` of them;
    * ``pending``: features, validity and positions of slots the drafter has not read yet.
    """

    def __init__(self, target, drafter, input_ids, logits_processor, stopping_criteria, generation_config, cache,
                 attention_mask=None):
        self.target, self.drafter = target, drafter
        self.config = generation_config
        self.logits_processor = logits_processor
        # EOS and max_length are applied exactly below; any other criterion (stop strings, max_time, custom) is
        # checked on each committed prefix.
        self.extra_criteria = [
            c for c in stopping_criteria if not isinstance(c, (EosTokenCriteria, MaxLengthCriteria))
        ]
        eos = getattr(generation_config, "_eos_token_tensor", None)
        self.eos = eos.to(input_ids.device).flatten() if eos is not None else None
        pad = generation_config.pad_token_id
        if pad is None and (self.eos is not None or self.extra_criteria):
            raise ValueError(
                "Rows of a batch end at different times and are then padded: set `pad_token_id` (for example "
                "`pad_token_id=tokenizer.pad_token_id`)."
            )
        self.pad = int(pad if pad is not None else 0)
        self.block_size, adaptive = draft_settings(drafter, generation_config)
        self.controller = None
        if adaptive:  # round costs in plain rounds are the process's, not the prompts': start from earlier calls'
            key = round_cost_key("batched", target, drafter, input_ids.shape[0], self.block_size,
                                 generation_config.do_sample)
            self.controller = BatchDraftLengthController(
                self.block_size - 1, input_ids.shape[0], memory=remembered_round_costs(drafter, key)
            )
        self.do_sample = bool(generation_config.do_sample)
        # Sampled drafts hand q to the verifier (as the single-sequence path); greedy drafts are judged by equality.
        sampled = self.do_sample and draft_sampling_mode(drafter, generation_config) == "sample"
        self.temperature = generation_config.temperature if sampled else None
        self.layer_ids = list(drafter.config.target_layer_ids)
        self.draft_head = DFlashDraftHead(
            drafter, target.get_input_embeddings(), target.get_output_embeddings(), prompt_ids=input_ids
        )
        self.cache = cache

        batch, prompt_len = input_ids.shape
        device = input_ids.device
        mask = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        if not bool(mask.any(dim=1).all()):
            raise ValueError("A prompt of the batch is empty (all padding): every row needs at least one token.")
        if bool((mask[:, 1:] < mask[:, :-1]).any()):
            raise ValueError(
                "DFlash takes a left-padded batch: tokenize with `padding_side='left'` (padding=True, "
                "padding_side='left')."
            )
        self.batch, self.prompt_len, self.device = batch, prompt_len, device
        # Rows still generating, as indices into the caller's batch: every per-row tensor below (and both caches)
        # holds these rows only; a finished row's sequence moves to `finished_rows` (`_drop_finished`).
        self.full_batch = batch
        self.row_ids = torch.arange(batch, device=device)
        self.finished_rows: dict[int, torch.LongTensor] = {}
        self.finished_lengths: dict[int, int] = {}
        self.slot_mask = mask
        self.num_valid = mask.sum(dim=1)
        self.max_new = max(generation_config.max_length - prompt_len, 0)
        # Room for one more block past the budget, so that a round's writes never need clamping.
        width = prompt_len + self.max_new + self.block_size + 1
        self.sequences = torch.full((batch, width), self.pad, dtype=torch.long, device=device)
        self.sequences[:, :prompt_len] = input_ids
        self.lengths = torch.full((batch,), prompt_len, dtype=torch.long, device=device)
        self.done = torch.full((batch,), self.max_new == 0, dtype=torch.bool, device=device)
        self.anchor = input_ids[:, -1]
        self.pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.drafter_cache = DynamicCache()
        # Positions of the drafter's cached slots, for its causal / sliding-window layers (slots are not positions).
        self.drafter_positions = self.num_valid.new_zeros((batch, 0))
        self.mask_ids = torch.full((batch, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long,
                                   device=device)
        self.stats = DFlashBatchStats(self.block_size, batch)
        self.cache_argument = "cache" if "cache" in _forward_parameters(target) else "past_key_values"

    def _calibrate_head(self, num_drafts: int) -> None:
        """Time the draft head's matmul forms for the head rows of a round of ``num_drafts`` drafts (shadow: 0) at this
        batch size now (`calibrate_head`, once per process and row count), before the round's clock starts. Only the
        sizes a call drafts are timed: every form costs a few head matmuls (0.3-0.8 s of CPU for 8 rows x 4-16 block
        rows in fp32), and timing every candidate size again each time a row leaves cost more than all the plain rounds
        of some calls."""
        if self.draft_head.rows_independent:
            calibrate_head(self.draft_head.lm_head, self.batch * min(num_drafts + 1, self.block_size - 1))

    # ---------------------------------------------------------------- the loop

    @torch.no_grad()
    def run(self) -> torch.LongTensor:
        """Generate; returns ``[b, P + max generated]``, finished rows padded with ``pad_token_id``."""
        if self.max_new > 0:
            self._prefill()
            self._drop_finished()
        while not bool(self.done.all()):
            self._round()
            self._drop_finished()
            self._close_holes()
        return self._output()

    def _output(self) -> torch.LongTensor:
        """Every row of the caller's batch, in its order, cut to the longest -> ``[B, P + max generated]``."""
        rows = dict(self.finished_rows)
        rows.update(zip(self.row_ids.tolist(), self.sequences))
        lengths = [self.prompt_len] + [int(n) for n in self.lengths] + list(self.finished_lengths.values())
        return torch.stack([rows[i] for i in range(self.full_batch)])[:, : max(lengths)]

    def _drop_finished(self) -> None:
        """Rows that finished leave the batch: their sequences are kept aside, and every per-row tensor, the target's
        cache and the drafter's cache keep the other rows only (one copy of each cache per finished round), so no
        later forward computes a finished row. Plain batched decoding keeps them to the end, padded."""
        done = self.done
        if not bool(done.any()) or bool(done.all()):
            return
        for index in done.nonzero().flatten().tolist():
            row = int(self.row_ids[index])
            self.finished_rows[row] = self.sequences[index]
            self.finished_lengths[row] = int(self.lengths[index])
        keep = (~done).nonzero().flatten()
        if self.controller is not None:  # rounds of fewer rows cost less: not what this batch size remembers
            self.controller.memory = None
            self.controller.rows_left(int(keep.shape[0]))
        self.cache.batch_select_indices(keep)
        self.drafter_cache.batch_select_indices(keep.to(self.drafter.device))
        for name in ("row_ids", "slot_mask", "num_valid", "sequences", "lengths", "done", "anchor",
                     "drafter_positions", "mask_ids"):
            setattr(self, name, getattr(self, name)[keep])
        self.pending = [tuple(part[keep] for part in entry) for entry in self.pending]
        self.batch = int(keep.shape[0])

    def _round(self) -> None:
        wanted = self.controller.choose() if self.controller is not None else self.block_size - 1
        shadow = self.controller is not None and self.controller.shadow
        active = ~self.done
        budget = self.max_new - (self.lengths - self.prompt_len)  # tokens each row may still generate
        limits = torch.clamp(torch.clamp(budget - 1, min=0), max=wanted) * active  # drafts per row: [b]
        num_drafts = int(limits.max())
        fed = sum(features.shape[1] for features, _, _ in self.pending)
        typical = not shadow and (num_drafts == 0 or fed <= self.block_size)
        drafts = draft_logits = None
        runs_drafter = num_drafts > 0 or shadow
        if runs_drafter:
            self._calibrate_head(num_drafts)
        drafter_time = ForwardTimer(self.draft_head.draft_device) if runs_drafter else None
        started = time.perf_counter()
        if runs_drafter:
            with drafter_time:
                drafts, draft_logits = self._draft(num_drafts)
        proposals = drafts[:, :num_drafts] if drafts is not None else self.anchor.new_zeros((self.batch, 0))
        logits, features = self._verify(proposals, limits)
        accepted, committed = self._accept(proposals, limits, logits, draft_logits)
        kept = self._commit(committed, accepted, active)
        self._after_round(features, accepted, limits, active)
        self.stats.num_batch_rounds += 1
        self.stats.num_drafted_batch_rounds += num_drafts > 0
        for row in active.nonzero().flatten().tolist():
            self.stats.record_row(int(self.row_ids[row]), int(limits[row]), int(kept[row]))
        if self.controller is not None:
            self._teach_controller(drafts, committed, accepted, limits, active)
            per_row = float(kept[active].float().mean()) if bool(active.any()) else 1.0
            self.controller.record_round(num_drafts, shadow, time.perf_counter() - started, per_row, typical,
                                         drafter_time.seconds() if drafter_time is not None else 0.0)

    def _close_holes(self, min_dead: int = 16) -> None:
        """Pack every row's valid slots together once dead slots (holes, and left padding no remaining row needs)
        make up an eighth of the cache, and at least ``min_dead`` columns: every later forward attends over, masks
        and copies all ``T`` columns, so rejected drafts would otherwise slow down every round after them.

        The drafter has read the first ``D`` slots (its cache) and not the rest (``pending``); each part is packed
        on its own, every row's valid slots right-aligned in their part in their order, so both caches stay slot for
        slot aligned. Positions are logical (``num_valid``), so no position changes: only which column holds what.
        """
        total, read = self.slot_mask.shape[1], self.drafter_positions.shape[1]
        if not self.pending or total - int(self.num_valid.max()) < max(min_dead, total // 8):
            return
        read_part, pending_part = self.slot_mask[:, :read], self.slot_mask[:, read:]
        keep_read, keep_pending = int(read_part.sum(dim=1).max()), int(pending_part.sum(dim=1).max())
        # A stable sort puts each row's invalid slots first and its valid ones after them, in order.
        read_index = read_part.int().argsort(dim=1, stable=True)[:, read - keep_read :]
        pending_index = pending_part.int().argsort(dim=1, stable=True)[:, total - read - keep_pending :]
        index = torch.cat([read_index, read + pending_index], dim=1)  # [b, T']
        _gather_slots(self.cache, index)
        _gather_slots(self.drafter_cache, read_index.to(self.drafter.device))
        self.slot_mask = self.slot_mask.gather(1, index)
        self.drafter_positions = self.drafter_positions.gather(1, read_index)
        features, valid, positions = (torch.cat(parts, dim=1) for parts in zip(*self.pending))
        self.pending = [(
            features.gather(1, pending_index[..., None].expand(-1, -1, features.shape[-1])),
            valid.gather(1, pending_index),
            positions.gather(1, pending_index),
        )]

    # ---------------------------------------------------------------- phases

    def _prefill(self) -> None:
        """The target reads the prompts; the first token of every row becomes its anchor."""
        positions = (self.slot_mask.long().cumsum(dim=1) - 1).clamp(min=0)
        ids = self.sequences[:, : self.prompt_len]
        # The last position as an index, not `logits_to_keep=1`: the slice `hidden[:, -1:]` of a batch is not
        # contiguous, and `lm_head` on it runs a bmm that copies the head's weight once per row (pytorch#151934; at
        # batch 8 in bf16 on a CPU, 0.7-1.7 s per call, more than ten decode steps). Indexing copies the rows instead.
        last = torch.tensor([ids.shape[1] - 1], device=self.device)
        outputs = self._target_forward(ids, self.slot_mask, positions, logits_to_keep=last)
        scores = self.logits_processor(ids, outputs.logits[:, -1].float())
        first = self._pick(scores[:, None])[:, 0]
        self._push_context(outputs.hidden_states, self.slot_mask, positions)
        self._commit(first[:, None], torch.zeros_like(first), ~self.done)

    def _take_context(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed context: features ``[b, C, F*H]`` (zero at invalid slots) and positions ``[b, C]`` of the slots the
        drafter has not read; its key mask is the target's slot mask (`_draft`)."""
        features = torch.cat([f for f, _, _ in self.pending], dim=1)
        valid = torch.cat([v for _, v, _ in self.pending], dim=1)
        positions = torch.cat([p for _, _, p in self.pending], dim=1)
        self.pending = []
        # torch.where, not a product: a fully masked (left-pad) query row may hold NaN, and NaN * 0 is NaN.
        return torch.where(valid[..., None], features, torch.zeros((), dtype=features.dtype)), positions

    def _draft(self, num_drafts: int) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """Draft: one drafter forward over ``[anchor, mask x (B-1)]`` for every row -> drafts ``[b, k']`` with
        ``k' = min(num_drafts + 1, B - 1)`` (one more than proposed, for the controller), and the draft
        distribution's logits ``[b, k', V]`` when the drafter has one."""
        device = self.draft_head.draft_device
        context, context_positions = self._take_context()
        block_ids = torch.cat([self.anchor[:, None], self.mask_ids], dim=1)
        block_positions = self.num_valid[:, None] + torch.arange(self.block_size, device=self.device)
        key_mask = torch.cat([self.slot_mask, torch.ones_like(block_ids, dtype=torch.bool)], dim=1)
        judged = min(num_drafts + 1, self.block_size - 1)
        drafts, logits = self.draft_head(
            block_ids,
            context.to(device),
            torch.cat([context_positions, block_positions], dim=1).to(device),
            self.drafter_cache,
            judged,
            self.temperature,
            attention_mask=key_mask.to(device),
            cached_positions=self.drafter_positions.to(device),
        )
        self.drafter_positions = torch.cat([self.drafter_positions, context_positions], dim=1)
        drafts = drafts.to(self.device)
        if logits is not None:
            logits = logits.to(self.device)
            # The controller's extra draft is judged by equality with the target's token: q's argmax, as in the
            # single-sequence path (a sampled one would match only with probability sum p*q).
            drafts[:, num_drafts:] = logits[:, num_drafts:].argmax(dim=-1)
        return drafts, logits

    def _verify(self, proposals: torch.LongTensor, limits: torch.LongTensor):
        """Verify: one target forward over ``[anchor, drafts]`` ``[b, k + 1]``; slots past a row's own limit (and every
        slot of a finished row) are written but invalid. -> logits ``[b, k + 1, V]``, the forward's hidden states."""
        width = proposals.shape[1] + 1
        columns = torch.arange(width, device=self.device)
        valid = (columns[None] <= limits[:, None]) & ~self.done[:, None]  # [b, k + 1]
        block = torch.cat([self.anchor[:, None], proposals], dim=1).masked_fill(~valid, self.pad)
        self._block_valid = valid
        positions = self.num_valid[:, None] + columns
        outputs = self._target_forward(block, torch.cat([self.slot_mask, valid], dim=1), positions)
        return outputs.logits.float(), outputs.hidden_states

    def _accept(self, proposals, limits, logits, draft_logits):
        """Accept: per row the number ``a`` of leading drafts the target agrees with (at most its limit) -> ``(a [b],
        committed [b, k + 1])``, where row ``i`` commits ``committed[i, : a_i + 1]`` (accepted drafts, then the
        target's own token)."""
        scores = self._processed_scores(proposals, logits)
        num_drafts = proposals.shape[1]
        if draft_logits is not None and self.do_sample and num_drafts > 0:
            return self._accept_with_draft_distribution(proposals, limits, scores, draft_logits)
        targets = self._pick(scores)  # [b, k + 1]: argmax, or an independent sample at every position
        columns = torch.arange(num_drafts, device=self.device)
        agree = (proposals == targets[:, :num_drafts]) & (columns[None] < limits[:, None])
        accepted = agree.long().cumprod(dim=1).sum(dim=1)
        return accepted, targets  # where drafts were accepted they equal the targets' tokens

    def _accept_with_draft_distribution(self, proposals, limits, scores, draft_logits):
        """Rejection sampling against the drafter's distribution q (transformers' `_speculative_sampling`), row by
        row over each row's own limit."""
        from transformers.generation.utils import _speculative_sampling

        accepted = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        committed = torch.full((self.batch, proposals.shape[1] + 1), self.pad, dtype=torch.long, device=self.device)
        for row in (~self.done).nonzero().flatten().tolist():
            k = int(limits[row])
            if k == 0:
                committed[row, 0] = self._pick(scores[row : row + 1, :1])[0, 0]
                continue
            tokens, matches = _speculative_sampling(
                proposals[row : row + 1, :k], draft_logits[row : row + 1, :k].float(), k, scores[row : row + 1, : k + 1]
            )
            accepted[row] = int(matches)
            committed[row, : tokens.shape[1]] = tokens[0]
        return accepted, committed

    def _commit(self, committed: torch.LongTensor, accepted: torch.LongTensor, active: torch.Tensor):
        """Commit ``committed[i, : a_i + 1]`` to every active row, cut after the first stop (EOS, a stopping
        criterion) or at the budget; a row that stops is done. -> tokens kept per row ``[b]``."""
        offered = torch.where(active, accepted + 1, torch.zeros_like(accepted))
        budget = self.max_new - (self.lengths - self.prompt_len)
        kept = torch.minimum(offered, budget)
        columns = torch.arange(committed.shape[1], device=self.device)
        if self.eos is not None:
            is_eos = torch.isin(committed, self.eos) & (columns[None] < kept[:, None])
            first_eos = torch.where(is_eos.any(dim=1), is_eos.long().argmax(dim=1) + 1, kept)
            kept = torch.minimum(kept, first_eos)
        stopped = active & (kept < offered)
        if self.extra_criteria:
            kept, fired = self._cut_at_criteria(committed, kept)
            stopped |= active & fired
        if self.eos is not None:  # the last kept token is an EOS: plain decoding stops there too
            last = committed.gather(1, (kept - 1).clamp(min=0)[:, None])[:, 0]
            stopped |= active & (kept > 0) & torch.isin(last, self.eos)
        index = self.lengths[:, None] + columns[None]  # where each committed token lands
        writes = columns[None] < kept[:, None]
        self.sequences.scatter_(1, index, torch.where(writes, committed, self.sequences.gather(1, index)))
        self.lengths = self.lengths + kept
        self.done = self.done | stopped | (self.lengths - self.prompt_len >= self.max_new)
        self.anchor = self.sequences.gather(1, (self.lengths - 1)[:, None])[:, 0]
        return kept

    def _after_round(self, hidden_states, accepted, limits, active) -> None:
        """The anchor and accepted drafts become valid slots; columns past the longest acceptance are dead in every
        row and are cropped; the written slots' features wait for the drafter (the next feed)."""
        width = self._block_valid.shape[1]
        columns = torch.arange(width, device=self.device)
        valid = self._block_valid & (columns[None] <= accepted[:, None]) & active[:, None]
        keep = int(accepted[active].max()) + 1 if bool(active.any()) else 1
        if keep < width:
            self.cache.crop(-(width - keep))
        positions = self.num_valid[:, None] + columns[:keep]
        self.slot_mask = torch.cat([self.slot_mask, valid[:, :keep]], dim=1)
        self.num_valid = self.num_valid + valid.sum(dim=1)
        features = tuple(h[:, :keep] if h is not None else None for h in hidden_states)
        self._push_context(features, valid[:, :keep], positions)

    # ---------------------------------------------------------------- helpers

    def _target_forward(self, ids, attention_mask, position_ids, **kwargs):
        return self.target(
            input_ids=ids,
            attention_mask=attention_mask.long(),
            position_ids=position_ids,
            use_cache=True,
            output_hidden_states=[i + 1 for i in self.layer_ids],
            **{self.cache_argument: self.cache},
            **kwargs,
        )

    def _push_context(self, hidden_states, valid, positions) -> None:
        self.pending.append((extract_context_feature(hidden_states, self.layer_ids), valid, positions))

    def _processed_scores(self, proposals, logits):
        """The logits processors at every block position of every active row -> ``[b, k + 1, V]``.

        Processors that read only the scores (temperature, top-k/p, ...) run once on all positions. Any other one is
        shown, for each row and position, the row's own prefix (left-padded prompt, its generated tokens, the drafts
        before the position: what plain batched generation shows that row at that step), in a batch of the real size
        (processors may hold per-row state, e.g. the prompt padding the repetition penalty skips); the line of the
        row's index in the caller's batch is kept (finished rows have left the loop's batch, not the processors').
        """
        scores = logits
        rows = (~self.done).nonzero().flatten().tolist()
        for processor in self.logits_processor:
            if isinstance(processor, _SCORES_ONLY):
                flat = scores.reshape(-1, scores.shape[-1])
                scores = processor(flat.new_zeros((flat.shape[0], 1), dtype=torch.long), flat).view(scores.shape)
                continue
            processed = scores.clone()
            for i in rows:
                length, caller_row = int(self.lengths[i]), int(self.row_ids[i])
                row = torch.cat([self.sequences[i, :length], proposals[i]])
                for j in range(scores.shape[1]):
                    prefix = row[None, : length + j].expand(self.full_batch, -1)
                    shown = scores[i : i + 1, j].expand(self.full_batch, -1)
                    processed[i, j] = processor(prefix, shown)[caller_row]
            scores = processed
        return scores

    def _pick(self, scores):
        """The target's token at every position of ``scores [b, n, V]``: argmax, or a sample (``[b, n]``)."""
        if not self.do_sample:
            return scores.argmax(dim=-1)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1).view(probs.shape[:-1])

    def _cut_at_criteria(self, committed, kept):
        """Cut each row after the first committed token at which a stopping criterion other than EOS/max_length fires
        (on the row's own sequence, right-aligned) -> ``(kept [b], fired [b])``."""
        full = torch.cat([self.sequences, committed.new_full(committed.shape, self.pad)], dim=1)
        full.scatter_(1, self.lengths[:, None] + torch.arange(committed.shape[1], device=self.device), committed)
        cut = kept.clone()
        open_rows = kept > 0
        for t in range(1, int(kept.max()) + 1 if bool(open_rows.any()) else 1):
            lengths = self.lengths + torch.minimum(kept, torch.full_like(kept, t))
            fired = torch.zeros_like(open_rows)
            for criterion in self.extra_criteria:
                fired |= criterion(right_align(full, lengths, self.pad), None).to(self.device)
            hit = open_rows & fired & (t <= kept)
            cut = torch.where(hit, torch.full_like(cut, t), cut)
            open_rows &= ~hit
        return cut, (kept > 0) & ~open_rows

    def _teach_controller(self, drafts, committed, accepted, limits, active) -> None:
        """Each active row is one judgement of the drafts it was offered (plus the extra draft against the target's
        own token after a full acceptance, as in the single-sequence path)."""
        if drafts is None:
            return
        for row in active.nonzero().flatten().tolist():
            a, offered = int(accepted[row]), int(limits[row])
            judged = min(a + 1, drafts.shape[1])
            if a == offered and judged > a:
                a += int(drafts[row, a] == committed[row, a])
            self.controller.record_acceptance(judged, a)


def _gather_slots(cache: DynamicCache, index: torch.LongTensor) -> None:
    """Keep, in every layer of ``cache``, the slots ``index [b, T']`` of each row (keys/values ``[b, h, T, d]``)."""
    for layer in cache.layers:
        if getattr(layer, "keys", None) is None or layer.keys.numel() == 0:
            continue
        expanded = index[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[-1])
        layer.keys = layer.keys.gather(2, expanded.to(layer.keys.device))
        layer.values = layer.values.gather(2, expanded.to(layer.values.device))


def _forward_parameters(model) -> set:
    import inspect

    return set(inspect.signature(model.forward).parameters)


def batched_dflash_decoding(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                            streamer=None, assistant_model=None, **model_kwargs):
    """``generate``'s decoding method for a batch with a DFlash drafter (dispatched from ``_assisted_decoding``)."""
    check_batch_supported(target, drafter, generation_config, streamer)
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))  # renamed in transformers 5.24
    if cache is None:
        cache = DynamicCache()
    if not isinstance(cache, DynamicCache) or cache.get_seq_length() > 0:
        raise ValueError(
            "Batched DFlash needs a fresh dynamic cache (it writes per-row holes and crops): pass no "
            "`past_key_values`."
        )
    loop = BatchedDFlashLoop(target, drafter, input_ids, logits_processor, stopping_criteria, generation_config,
                             cache, attention_mask=model_kwargs.get("attention_mask"))
    drafter.last_stats = loop.stats
    if assistant_model is not None and assistant_model is not drafter:  # an adopted z-lab drafter
        assistant_model.last_stats = loop.stats
    sequences = loop.run()
    if generation_config.return_dict_in_generate:
        from transformers.generation.utils import GenerateDecoderOnlyOutput

        return GenerateDecoderOnlyOutput(sequences=sequences)
    return sequences


__all__ = ["BatchedDFlashLoop", "DFlashBatchStats", "batched_dflash_decoding", "right_align"]
