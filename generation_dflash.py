"""DFlash inside ``target.generate(..., assistant_model=draft)``: the candidate generator and its dispatch.

This file travels as remote code inside every saved drafter, so it imports only ``torch`` and ``transformers``.

One speculative round, in the order transformers' assisted-decoding loop runs it:

1. **feed context** (`DFlashCandidateGenerator._collect_context`): the target features of exactly the positions
   committed since the last round (the whole prompt after prefill; anchor + accepted drafts afterwards);
2. **draft** (`DFlashCandidateGenerator._draft`): embed ``[last token, mask x (B-1)]`` with the target's embedding, run
   the drafter once, take the argmax of the target's ``lm_head`` on rows ``1..B-1``;
3. **verify** and 4. **accept**: transformers' loop runs the target on the block and keeps the longest matching prefix
   plus the target's own next token. Greedy: first mismatch. Sampling: the generator returns no draft distribution,
   so the loop samples the target at every position and accepts drafts while they equal the sample -- rejection
   sampling with a one-hot draft distribution, exact target sampling with the highest acceptance a greedy draft gets.

Dispatch: `install_dflash_dispatch` wraps ``GenerationMixin._get_candidate_generator`` (and the mode validation
before it) so that a DFlash drafter passed as ``assistant_model`` gets `DFlashCandidateGenerator`. Every other
assistant, and ``speculation_type="dflash"`` (transformers' own DFlash generator), go to transformers unchanged.
"""

import inspect
import logging
import time
import weakref
from dataclasses import dataclass, field

import torch
import transformers
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS = ">=5.23,<5.25"


@dataclass
class DFlashStats:
    """Per-call acceptance statistics; a fresh one lands on ``draft.last_stats`` at every ``generate`` call.

    ``acceptance_lengths[r]`` is the number of tokens committed by verify round ``r`` (accepted drafts + the target's
    own token), i.e. tau for that round; ``proposed_lengths[r]`` is how many drafts the round proposed.
    """

    block_size: int
    acceptance_lengths: list[int] = field(default_factory=list)
    proposed_lengths: list[int] = field(default_factory=list)

    def record(self, proposed: int, committed: int) -> None:
        self.proposed_lengths.append(proposed)
        self.acceptance_lengths.append(committed)

    @property
    def num_rounds(self) -> int:
        return len(self.acceptance_lengths)

    @property
    def mean_acceptance_length(self) -> float:
        """tau: mean tokens committed per verify round (0.0 before any round)."""
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0

    @property
    def histogram(self) -> list[int]:
        """``histogram[n]`` = rounds that committed ``n`` tokens, for ``n`` in ``0..block_size``."""
        counts = [0] * (self.block_size + 1)
        for length in self.acceptance_lengths:
            counts[length] += 1
        return counts

    @property
    def per_position_acceptance(self) -> list[float]:
        """Fraction of rounds that accepted draft ``k`` (``k = 1..B-1``) among rounds that proposed it."""
        rates = []
        for k in range(1, self.block_size):
            offered = [a for a, p in zip(self.acceptance_lengths, self.proposed_lengths) if p >= k]
            rates.append(sum(a - 1 >= k for a in offered) / len(offered) if offered else 0.0)
        return rates


def check_drafter_fits_target(drafter, target) -> None:
    """Raise a `ValueError` naming the fix when ``drafter`` cannot serve ``target``."""
    config, target_config = drafter.config, target.config.get_text_config()
    name = type(target).__name__
    if config.hidden_size != target_config.hidden_size:
        raise ValueError(
            f"The drafter's hidden_size {config.hidden_size} differs from the target's ({name}: "
            f"{target_config.hidden_size}). A DFlash drafter reads the target's hidden states and borrows its "
            "embedding and lm_head, so it must be trained for this target: load the matching drafter."
        )
    if config.vocab_size != target_config.vocab_size:
        raise ValueError(
            f"The drafter's vocab_size {config.vocab_size} differs from the target's ({target_config.vocab_size}); "
            "the drafter uses the target's vocabulary: load the drafter trained for this target."
        )
    num_layers = target_config.num_hidden_layers
    if not config.target_layer_ids or max(config.target_layer_ids) >= num_layers:
        raise ValueError(
            f"The drafter reads target layers {config.target_layer_ids}, but the target has {num_layers} layers "
            f"(valid ids 0..{num_layers - 1}); load the drafter trained for this target."
        )
    if config.mask_token_id is None or not 0 <= config.mask_token_id < target_config.vocab_size:
        raise ValueError(
            f"mask_token_id {config.mask_token_id} is not a row of the target's vocabulary (size "
            f"{target_config.vocab_size}); set `dflash_config.mask_token_id` to a reserved or unused token id."
        )
    if config.num_target_layers not in (None, num_layers):
        logger.warning(
            "The drafter was trained for a %d-layer target, this target has %d layers: expect low acceptance.",
            config.num_target_layers,
            num_layers,
        )


class DraftLengthController:
    """Adaptive block size: how many drafts to propose next round, from measured costs and recent acceptance.

    A round that proposes ``k`` drafts commits ``E[k] = 1 + sum_{j<=k} prod_{i<=j} p_i`` tokens on average, where
    ``p_i`` is the rate at which draft ``i`` is accepted given that drafts ``1..i-1`` were; it costs ``cost[k]``
    seconds, measured on this target in this call (drafter forward + verifying ``k + 1`` tokens + glue). When all
    ``k`` drafts are accepted, draft ``k + 1`` (drafted, not proposed) is judged against the target's own token, so
    the estimates can climb towards longer blocks.

    The controller proposes the ``k`` with the most tokens per second, ``k = 0`` being plain decoding. Two estimates
    of ``p`` serve two decisions: a fast moving average (``fast_rate``) picks the block size, and plain decoding is
    chosen only when a slow one (``slow_rate``, a memory of ~16 judgements) agrees. A good drafter has streaks of
    rejections (at ``p_1 = 0.55``, four in a row every ~25 rounds); quitting on one would lose many rounds of drafting.
    The first round (whose drafter forward reads the whole prompt) is a shadow draft; then it measures a short draft
    and plain decoding and bounds the cost of larger sizes from below until it tries them. Evidence while plain
    decoding wins comes from **shadow drafts** (``shadow`` set with ``k = 0``): the round
    decodes plainly but the drafter runs, and its draft 1 is judged against the target's token -- a drafter forward
    instead of a longer verify. It gathers ``min_evidence`` judgements of draft 1 before plain decoding may settle,
    then re-checks with exponential back-off, so that a drafter that starts to fit the text is noticed.
    """

    def __init__(self, max_drafts: int, fast_rate: float = 0.2, slow_rate: float = 1 / 16, first_probe: int = 16,
                 min_evidence: int = 3):
        self.candidates = sorted({0, max_drafts} | {2**i - 1 for i in range(2, 10) if 2**i - 1 < max_drafts})
        self.rates, self.first_probe = (fast_rate, slow_rate), first_probe
        self.acceptance = [[0.5] * max_drafts for _ in self.rates]  # fast and slow p_i, conditional
        self.observations = [0] * max_drafts  # judgements per draft position
        self.judged = 0  # drafts 1..judged have been observed at least once
        self.min_evidence = min_evidence  # judgements of draft 1 before plain decoding may win
        self.cost: dict[int, float] = {}
        self.probe_interval, self.rounds_without_drafts = first_probe, 0
        self.shadow = False  # set by `choose`: draft without proposing, to judge draft 1

    def expected_tokens(self, num_drafts: int, slow: bool = False) -> float:
        """``E[k]``; a draft position never judged yet is assumed as good as the last judged one."""
        acceptance = self.acceptance[int(slow)]
        expected, reach, p = 1.0, 1.0, 0.5
        for i in range(num_drafts):
            p = acceptance[i] if i < self.judged or not self.judged else p
            reach *= p
            expected += reach
        return expected

    def best(self, slow: bool = False) -> int:
        """The candidate with the most expected tokens per second."""
        return max(self.candidates, key=lambda k: self.expected_tokens(k, slow) / self.estimated_cost(k))

    def choose(self) -> int:
        """Drafts to propose next round; sets ``shadow`` for a plain round that should judge a draft anyway."""
        self.shadow = not self.cost and not self.observations[0]  # the first round
        if self.shadow:
            return 0
        for k in (self.candidates[1], 0):  # a short draft (cheap if the drafter is useless), then plain decoding
            if k not in self.cost:
                return k
        best = self.best() or self.best(slow=True)
        if best > 0:
            self.probe_interval, self.rounds_without_drafts = self.first_probe, 0
            return best
        if self.observations[0] < self.min_evidence:  # one unlucky first round must not decide
            self.shadow = True
            return 0
        self.rounds_without_drafts += 1
        if self.rounds_without_drafts >= self.probe_interval:
            self.rounds_without_drafts, self.probe_interval = 0, 2 * self.probe_interval
            self.shadow = True
        return 0

    def estimated_cost(self, num_drafts: int) -> float:
        """Measured cost; for a size not tried yet, the cost of the largest measured smaller size -- a lower bound
        (verifying more tokens costs no less), so a size that might pay gets tried once and then measured."""
        if num_drafts in self.cost:
            return self.cost[num_drafts]
        return self.cost[max(k for k in self.cost if k < num_drafts)]

    def record_acceptance(self, judged: int, accepted: int) -> None:
        """Drafts ``1..judged`` were compared with the committed tokens; the first ``accepted`` matched."""
        for i in range(judged):  # a running mean over the first 1/rate judgements, then a moving average
            self.observations[i] += 1
            for rate, acceptance in zip(self.rates, self.acceptance):
                weight = max(rate, 1.0 / (self.observations[i] + 1))
                acceptance[i] += weight * (float(i < accepted) - acceptance[i])
        self.judged = max(self.judged, judged)

    def record_cost(self, proposed: int, seconds: float) -> None:
        """A moving average of round costs; one round counts as at most twice the estimate, so that a one-off
        stall (a garbage collection: 230 ms against 40) cannot price a size out of the choice for good."""
        if proposed in self.candidates:
            previous = self.cost.get(proposed, seconds)
            self.cost[proposed] = previous + self.rates[0] * (min(seconds, 2 * previous) - previous)


class DFlashCandidateGenerator(CandidateGenerator):
    """Proposes a whole block of drafts per round from one drafter forward (see the module docstring).

    The drafter's cache holds the keys/values of every committed position before the current anchor, fed in position
    order. Which positions are new is derived from positions, not from counters: after a target forward that started at
    position ``verified_from``, the committed positions are ``[verified_from, len(input_ids) - 1)``; the last token
    of ``input_ids`` is the next anchor, not yet seen by the target.
    """

    requires_model_outputs = True

    def __init__(self, drafter, target, generation_config, input_ids, model_kwargs, target_tokenizer=None):
        # The drafter was checked against the target before generation started (`_validate_generation_mode`).
        if input_ids.shape[0] != 1:
            raise ValueError(
                f"DFlash through generate() serves one sequence at a time, got a batch of {input_ids.shape[0]}: "
                "call generate once per prompt."
            )
        past = model_kwargs.get("past_key_values", model_kwargs.get("cache"))  # renamed in transformers 5.24
        if past is not None and past.get_seq_length() > 0:
            raise ValueError(
                "DFlash needs the target to prefill the whole prompt (the drafter reads its hidden states), but "
                "`past_key_values` already holds tokens: pass a fresh cache or none."
            )
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("DFlash through generate() does not take padded input: pass the prompt unpadded.")

        self.drafter = drafter
        self.embed_tokens = target.get_input_embeddings()
        self.lm_head = target.get_output_embeddings()
        self.block_size, adaptive = draft_settings(drafter, generation_config)
        self.max_length = generation_config.max_length
        self.layer_ids = list(drafter.config.target_layer_ids)
        # Ask the verify forward for just the layers we read; a user asking for all hidden states gets all of them
        # (a partial list there breaks transformers' per-token output splitting).
        capture = True if generation_config.output_hidden_states else [i + 1 for i in self.layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": capture}
        self.draft_device, self.draft_dtype = drafter.device, drafter.dtype
        # Drafters with a draft distribution (DFlash2) sample their path at the request's temperature and return q.
        self.temperature = generation_config.temperature if generation_config.do_sample else None
        self.round_draft_logits: torch.Tensor | None = None  # [1, k, V] log q of the proposals, when sampled
        self.mask_ids = torch.full(
            (1, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long, device=input_ids.device
        )
        self.stop_strings = (
            StopStringCriteria(target_tokenizer, generation_config.stop_strings)
            if generation_config.stop_strings and target_tokenizer is not None
            else None
        )
        self.cache = DynamicCache()
        self.pending_context: list[torch.Tensor] = []
        self.verified_from = 0
        self.round_proposed: int | None = None  # None while the target prefills
        self.round_drafts: torch.LongTensor | None = None  # proposals plus one more draft, for the controller
        self.round_started = 0.0
        self.round_is_typical = True  # whether the controller may learn this round's cost (see get_candidates)
        self.controller = DraftLengthController(self.block_size - 1) if adaptive else None
        # Prompt lookup next to the drafter (adaptive mode only): its own acceptance estimates, same estimator.
        # Per call through transformers' prompt-lookup field, `generate(max_matching_ngram_size=n)` (0 = off).
        ngram = generation_config.max_matching_ngram_size
        self.lookup_ngram = (getattr(drafter, "prompt_lookup_ngram", 3) if ngram is None else ngram) if adaptive else 0
        self.lookup_rates = DraftLengthController(self.block_size - 1) if self.lookup_ngram else None
        self.round_from_lookup = False
        self.stats = drafter.last_stats = DFlashStats(self.block_size)
        # Time the head's matmul forms now (once per process), not inside a round whose cost the controller measures.
        sizes = self.controller.candidates if self.controller is not None else [self.block_size - 1]
        for num_drafts in sizes:  # k = 0: a shadow draft judges one row
            calibrate_head(self.lm_head, min(num_drafts + 1, self.block_size - 1))

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        """``input_ids [1, n]`` -> ``([1, n + k], None)`` with ``k <= B - 1`` drafts; round 1 proposes nothing."""
        now = time.perf_counter()
        if self.controller is not None and self.round_proposed is not None and self.round_is_typical:
            self.controller.record_cost(self.round_proposed, now - self.round_started)
        self.round_started = now
        if is_first_iteration:
            return input_ids, None
        self._collect_context(input_ids, model_outputs)
        anchor = input_ids.shape[1] - 1
        self.verified_from = anchor
        wanted = self.controller.choose() if self.controller is not None else self.block_size - 1
        shadow = self.controller is not None and self.controller.shadow
        # Never propose past max_length: the target's own token after the drafts must fit too.
        room = max(self.max_length - input_ids.shape[1] - 1, 0)
        num_drafts = min(wanted, room)
        self.round_drafts = None
        drafting = num_drafts > 0 or shadow
        # Not what a round of this size costs: a shadow round (plain + a drafter forward), or one whose drafter
        # forward reads more than a block of new context (the prompt, or what plain rounds left pending).
        fed = sum(features.shape[1] for features in self.pending_context)
        self.round_is_typical = not shadow and (not drafting or fed <= self.block_size)
        self.round_draft_logits = None  # a lookup round has no draft distribution: transformers compares samples
        lookup = self._prompt_lookup(input_ids, num_drafts, min(self.block_size - 1, room), shadow)
        self.round_from_lookup = lookup is not None
        if self.round_from_lookup:  # no drafter forward: its context stays pending, as in a plain round
            proposals, self.round_is_typical = lookup, False
        else:
            proposals = self._draft(input_ids, num_drafts) if drafting else input_ids[:, :0]
        proposals = self._stop_before_stop_strings(input_ids, proposals)
        self.round_proposed = proposals.shape[1]
        # With a draft distribution q, transformers' loop runs rejection sampling against it (accept u * q(d) < p(d),
        # resample from norm(max(p - q, 0))); without one it samples the target and compares (a one-hot q).
        draft_logits = self.round_draft_logits
        if draft_logits is not None and self.round_proposed > 0:
            draft_logits = draft_logits[:, : self.round_proposed]
        else:
            draft_logits = None
        return torch.cat([input_ids, proposals], dim=-1), draft_logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        if self.round_proposed is not None:
            self.stats.record(self.round_proposed, int(num_matches) + 1)
            if self.round_from_lookup:
                accepted = int(num_matches)
                self.lookup_rates.record_acceptance(min(accepted + 1, self.round_proposed), accepted)
            elif self.controller is not None and self.round_drafts is not None:
                accepted = int(num_matches)
                judged = min(accepted + 1, self.round_drafts.shape[1])
                if accepted == self.round_proposed and judged > accepted:  # the target's own token judges draft k+1
                    accepted += int(self.round_drafts[0, accepted] == input_ids[0, -1])
                self.controller.record_acceptance(judged, accepted)

    def _collect_context(self, input_ids, model_outputs) -> None:
        """Feed context: target features of positions ``[verified_from, n - 1)``, all committed, to the drafter."""
        committed = input_ids.shape[1] - 1
        features = extract_context_feature(model_outputs.hidden_states, self.layer_ids)
        self.pending_context.append(features[:, : committed - self.verified_from])

    def _draft(self, input_ids, num_drafts) -> torch.LongTensor:
        """Draft: one drafter forward over ``[anchor, mask x (B-1)]`` -> ``[1, num_drafts]`` proposals (the drafter's
        `propose`: argmax for DFlash, the path selector for DFlash2).

        One more draft than proposed (when the block has it) is kept in ``round_drafts`` for the controller.
        """
        device = self.draft_device
        context = torch.cat(self.pending_context, dim=1).to(device)
        self.pending_context = []
        anchor = input_ids.shape[1] - 1
        position_ids = torch.arange(self.cache.get_seq_length(), anchor + self.block_size, device=device)[None]
        block_ids = torch.cat([input_ids[:, -1:], self.mask_ids], dim=-1)
        noise = self.drafter.embed_block(self.embed_tokens, block_ids).to(device=device, dtype=self.draft_dtype)
        with torch.no_grad():
            hidden = self.drafter(
                noise_embedding=noise,
                target_hidden=context,
                position_ids=position_ids,
                past_key_values=self.cache,
                use_cache=True,
            ).last_hidden_state
            # A 2-D [k + 1, H] input: a 3-D slice keeps the stride of the full block in its batch dimension, and
            # torch.matmul then copies the whole transposed lm_head weight on every call (65 ms per round in bf16).
            rows = hidden[0, 1 : 2 + num_drafts].to(device=self.lm_head.weight.device, dtype=self.lm_head.weight.dtype)
            drafts, draft_logits = self.drafter.propose(self.lm_head, rows, input_ids[0, -1], self.temperature)
        self.round_drafts = drafts[None].to(input_ids.device)
        if draft_logits is not None:
            self.round_draft_logits = draft_logits[None, :num_drafts]
        return self.round_drafts[:, :num_drafts]

    def _prompt_lookup(self, input_ids, num_drafts: int, budget: int, shadow: bool) -> torch.LongTensor | None:
        """The prompt-lookup continuation when it is expected to commit more tokens per second than the drafter's
        choice this round (``num_drafts`` drafts, 0 = plain decoding), else None; at most ``budget`` tokens (the block
        and max_length allow).

        Answers repeat the prompt's identifiers and phrases, which a drafter of a small target often misses. Both
        sources are judged by the same estimator (`DraftLengthController`): expected committed tokens over the
        measured cost of verifying that many tokens (a lookup round skips the drafter forward, so the estimate is
        conservative for it). Shadow rounds stay with the drafter: they exist to judge it.
        """
        if self.lookup_rates is None or shadow or 0 not in self.controller.cost:  # costs not measured yet
            return None
        continuation = prompt_lookup(input_ids[0], self.lookup_ngram, budget)
        if continuation is None:
            return None
        controller, found = self.controller, continuation.shape[0]
        lookup_rate = self.lookup_rates.expected_tokens(found) / controller.estimated_cost(found)
        drafter_rate = controller.expected_tokens(num_drafts) / controller.estimated_cost(num_drafts)
        return continuation[None] if lookup_rate > drafter_rate else None

    def _stop_before_stop_strings(self, input_ids, proposals):
        """Keep drafts short of the first one that completes a stop string.

        transformers checks stopping criteria only after a round, so an accepted draft that completes a stop string
        mid-block would let tokens past it through. Cutting the proposals just before it keeps every earlier stop at
        the end of a round; the target's own token then completes the stop string exactly where plain decoding stops.
        """
        if self.stop_strings is None:
            return proposals
        for k in range(1, proposals.shape[1] + 1):
            if self.stop_strings(torch.cat([input_ids, proposals[:, :k]], dim=-1), None).any():
                return proposals[:, : k - 1]
        return proposals


# transformers fills `num_assistant_tokens` / `num_assistant_tokens_schedule` that a call left unset with these.
_UNSET_NUM_ASSISTANT_TOKENS, _ADAPTIVE_SCHEDULES = 20, ("heuristic", "heuristic_transient")


def draft_settings(drafter, generation_config) -> tuple[int, bool]:
    """``(block size, adaptive)`` for one ``generate`` call, from transformers' assisted-decoding arguments.

    ``num_assistant_tokens=k`` drafts blocks of ``k + 1`` (anchor + k drafts; at most the drafter's ``block_size``,
    ``k=0`` is plain decoding). ``num_assistant_tokens_schedule="heuristic"`` (or ``"heuristic_transient"``) lets
    `DraftLengthController` choose up to ``k`` drafts per round; ``"constant"`` with an explicit ``k`` always
    proposes ``k``. transformers fills what the call left unset with 20 and ``"constant"`` (indistinguishable from
    an explicit 20): then the drafter's defaults hold, ``config.block_size`` and ``adaptive_block_size``.
    """
    block_size = drafter.config.block_size
    adaptive = getattr(drafter, "adaptive_block_size", True)
    num_drafts = generation_config.num_assistant_tokens
    explicit = num_drafts is not None and num_drafts != _UNSET_NUM_ASSISTANT_TOKENS
    if explicit:
        if int(num_drafts) != num_drafts or num_drafts < 0:
            raise ValueError(f"num_assistant_tokens must be a whole number >= 0, got {num_drafts!r}.")
        block_size = min(block_size, int(num_drafts) + 1)
    if generation_config.num_assistant_tokens_schedule in _ADAPTIVE_SCHEDULES:
        adaptive = True
    elif explicit:
        adaptive = False
    return block_size, adaptive and block_size > 1


def prompt_lookup(tokens: torch.LongTensor, max_ngram: int, num_tokens: int) -> torch.LongTensor | None:
    """Prompt lookup: find the latest earlier occurrence of the last ``n`` tokens of ``tokens [n_ctx]`` (longest
    ``n <= max_ngram`` first) and return the ``num_tokens`` tokens that followed it, or None.

    What followed it runs up to the end of ``tokens``; past that the copy goes on over its own output (a loop of
    period ``d`` repeats every ``d`` tokens), so a repetition gets a full block, not the few tokens before the end.
    """
    length = tokens.shape[0]
    if num_tokens < 1:
        return None
    for n in range(min(max_ngram, length - 1), 0, -1):
        windows = tokens[: length - 1].unfold(0, n, 1)  # windows ending before the last token: [length - n, n]
        starts = (windows == tokens[length - n :]).all(dim=1).nonzero().flatten()
        if starts.numel():
            followed = tokens[int(starts[-1]) + n :]
            return followed.repeat(-(-num_tokens // followed.shape[0]))[:num_tokens]
    return None


_FASTER_TRANSPOSED: dict[tuple, bool] = {}  # (dtype, rows, weight shape) -> W @ rows.T beats rows @ W.T


def head_argmax(lm_head, rows: torch.Tensor) -> torch.LongTensor:
    """``argmax(lm_head(rows))`` for a few rows ``[M, H]`` -> ``[M]``, in whichever matmul form is faster here.

    For a handful of rows, CPU kernels differ a lot between ``rows @ W.T`` and ``W @ rows.T``: fp32 on this
    project's AMD EPYC takes 21 ms vs 6 ms for 3 rows of SmolLM2's 49152 x 576 head, bf16 is faster the other way.
    On CPU, the first call for each (dtype, M, head shape) times both forms once and keeps the faster. A head that
    is not a bias-free ``nn.Linear``, or one on an accelerator, is simply called.
    """
    if not _is_plain_cpu_head(lm_head):
        return lm_head(rows).argmax(dim=-1)
    weight = lm_head.weight
    if calibrate_head(lm_head, rows.shape[0]):
        return (weight @ rows.T).argmax(dim=0)
    return (rows @ weight.T).argmax(dim=-1)


def calibrate_head(lm_head, num_rows: int) -> bool:
    """Whether ``W @ rows.T`` is the faster form for ``num_rows`` rows on this head; timed on first use."""
    if not _is_plain_cpu_head(lm_head):
        return False
    weight = lm_head.weight
    key = (weight.dtype, num_rows, tuple(weight.shape))
    if key not in _FASTER_TRANSPOSED:
        rows = torch.zeros(num_rows, weight.shape[1], dtype=weight.dtype)
        _FASTER_TRANSPOSED[key] = _fastest_time(lambda: weight @ rows.T) < _fastest_time(lambda: rows @ weight.T)
    return _FASTER_TRANSPOSED[key]


def _is_plain_cpu_head(lm_head) -> bool:
    return isinstance(lm_head, torch.nn.Linear) and lm_head.bias is None and lm_head.weight.device.type == "cpu"


def _fastest_time(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def extract_context_feature(hidden_states, layer_ids) -> torch.Tensor:
    """Concatenate the target features the drafter reads: ``[b, T, H]`` each -> ``[b, T, F * H]``.

    ``hidden_states`` is the target's ``output_hidden_states`` tuple, whose entry 0 is the embedding output; layer id
    ``i`` therefore reads ``hidden_states[i + 1]``, the output of decoder layer ``i``.
    """
    offset = 1
    return torch.cat([hidden_states[layer_id + offset] for layer_id in layer_ids], dim=-1)


class DFlashDrafterMixin:
    """What makes a module a DFlash drafter for `generate` and for z-lab's ``spec_generate``."""

    _is_dflash_drafter = True
    last_stats: DFlashStats | None = None
    # The default for calls that do not choose (see `draft_settings`): choose the number of drafts per round from
    # measured costs and acceptance (`DraftLengthController`); False always proposes block_size - 1 drafts (as the
    # reference does). Per call: generate(..., num_assistant_tokens=k, num_assistant_tokens_schedule=...).
    adaptive_block_size: bool = True
    # With the adaptive block size: longest n-gram prompt lookup matches (0 = off; per call:
    # `generate(max_matching_ngram_size=n)`). A round proposes the lookup's continuation instead of the drafter's
    # block when that is expected to commit more tokens per second.
    prompt_lookup_ngram: int = 3
    # Batches of at least this many rows run the batched loop (`batch_generation_dflash`); smaller ones run
    # transformers' assisted loop with `DFlashCandidateGenerator`. 1 sends single prompts there too (tests).
    batched_from: int = 2

    def make_candidate_generator(self, target, generation_config, input_ids, model_kwargs, target_tokenizer=None):
        return DFlashCandidateGenerator(self, target, generation_config, input_ids, model_kwargs, target_tokenizer)

    def embed_block(self, embed_tokens, block_ids: torch.LongTensor) -> torch.Tensor:
        """Noise embeddings ``[1, B, H]`` of ``block_ids [1, B]``.

        With ``input_embedding_scale`` configured: z-lab's raw table lookup times the scale, on all B rows (it
        bypasses any scaling inside the target's embedding module). Without it: the target's embedding module, which
        is what this project's trainer feeds and equals the raw lookup for targets whose embedding does not scale.
        """
        scale = getattr(self.config, "input_embedding_scale", None)
        if scale is None:
            return embed_tokens(block_ids)
        return torch.nn.functional.embedding(block_ids, embed_tokens.weight) * scale

    def _logit_transform(self) -> tuple[float | None, float | None]:
        """``(output_multiplier, softcap)``, ``None`` where the checkpoint sets none (a softcap <= 0 is none)."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return getattr(self.config, "output_multiplier", None), cap if cap is not None and cap > 0 else None

    def transform_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """z-lab's draft logits: ``logits * output_multiplier``, then ``tanh(logits / c) * c`` for a softcap
        ``c > 0`` (full vocabulary, the head's dtype, before any top-k)."""
        multiplier, cap = self._logit_transform()
        if multiplier is not None:
            logits = logits * multiplier
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def propose(self, lm_head, rows: torch.Tensor, anchor: torch.Tensor, temperature: float | None = None):
        """Draft tokens from the draft hidden states ``rows [M, H]`` (block rows ``1..M``) -> ``(tokens [M], None)``.

        DFlash drafts greedily (the argmax of the transformed logits) and has no draft distribution to return;
        ``anchor`` and ``temperature`` serve drafters that walk a path (DFlash2).
        """
        if self._logit_transform() == (None, None):
            return head_argmax(lm_head, rows), None
        return self.transform_logits(lm_head(rows)).argmax(dim=-1), None

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens=2048, stop_token_ids=None, temperature=0.0, **kwargs):
        """z-lab's API: speculative generation of ``input_ids [b, n]`` -> ``[b, n + m]`` with the same round logic.

        ``temperature < 1e-5`` is greedy; otherwise plain temperature sampling (no top-k/top-p), as the reference.
        Generation ends after the first token in ``stop_token_ids`` (inclusive). A batch (``b > 1``) is left-padded
        with its ``attention_mask`` passed along (``kwargs`` go to ``generate``); rows that end early are padded with
        ``pad_token_id`` (default: the first stop token).
        """
        sampling = temperature >= 1e-5
        options = dict(max_new_tokens=max_new_tokens, do_sample=sampling, assistant_model=self)
        if sampling:
            options.update(temperature=temperature, top_k=0, top_p=1.0)
        if stop_token_ids is not None:
            options["eos_token_id"] = list(stop_token_ids)
            options.setdefault("pad_token_id", list(stop_token_ids)[0])
        return target.generate(input_ids, **(options | kwargs))


def is_dflash_drafter(model) -> bool:
    return bool(getattr(model, "_is_dflash_drafter", False))


# Drafter classes of z-lab's own remote code (``dflash.py``), which this project can adopt (see `as_dflash_drafter`).
REMOTE_DRAFTER_CLASSES = ("DFlashDraftModel", "DFlash2DraftModel")


def as_dflash_drafter(model):
    """The DFlash drafter to run for ``assistant_model``, or ``None`` for any other assistant.

    Ours (this package or a checkpoint's remote code) are used as they are. A drafter built by z-lab's own remote code
    (``AutoModel.from_pretrained("z-lab/...", trust_remote_code=True)``) is adopted once: our class of the same
    architecture holding the very same parameter tensors (`modeling_dflash.adopt_remote_drafter`), so no weight is
    copied. A plain transformers model built from a DFlash config (no ``trust_remote_code``) is refused with the fix.
    """
    if model is None or is_dflash_drafter(model):
        return model
    if not getattr(model.config, "dflash_config", None):
        return None
    if type(model).__name__ in REMOTE_DRAFTER_CLASSES:
        adopted = _ADOPTED.get(model)
        if adopted is None:
            from .modeling_dflash import adopt_remote_drafter

            adopted = _ADOPTED[model] = adopt_remote_drafter(model)
        return adopted
    raise ValueError(
        f"The assistant is a plain {type(model).__name__} built from a DFlash drafter config: it was loaded without "
        "the DFlash code. Load it with `AutoModel.from_pretrained(path, trust_remote_code=True)` or "
        "`dflash_hf.DFlashDraftModel.from_pretrained(path)`."
    )


_ADOPTED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # z-lab's module -> our drafter on its weights


_EXPECTED_PARAMETERS = ("generation_config", "input_ids", "logits_processor", "model_kwargs", "assistant_model")


def _other_assisted_mode(generation_config) -> bool:
    """Whether the call asks for another assisted mode (transformers' own DFlash, prompt lookup, early exit, MTP)."""
    return (
        generation_config.speculation_type == "dflash"
        or generation_config.prompt_lookup_num_tokens is not None
        or generation_config.assistant_early_exit is not None
        or getattr(generation_config, "use_mtp", False)
    )


def _check_transformers_internals() -> None:
    """The dispatch leans on private generation internals: fail loudly if they moved."""
    parameters = inspect.signature(GenerationMixin._get_candidate_generator).parameters
    missing = [p for p in _EXPECTED_PARAMETERS if p not in parameters]
    if missing or not all(
        hasattr(GenerationMixin, name) for name in ("_validate_generation_mode", "_assisted_decoding")
    ) or not hasattr(CandidateGenerator, "update_candidate_strategy"):
        raise RuntimeError(
            f"dflash-hf supports transformers {SUPPORTED_TRANSFORMERS}, but transformers {transformers.__version__} "
            f"changed the assisted-generation internals it hooks into (missing: {missing or 'hooks'}). "
            f"Install a supported version: pip install 'transformers{SUPPORTED_TRANSFORMERS}'."
        )


def install_dflash_dispatch() -> None:
    """Make ``generate(assistant_model=drafter)`` pick `DFlashCandidateGenerator` for DFlash drafters. Idempotent.

    Wraps two private methods of ``GenerationMixin`` once per process (whichever copy of this file comes first:
    the package or a checkpoint's remote code; each drafter builds its own generator through
    ``make_candidate_generator``):

    * ``_validate_generation_mode``: checks the drafter against the target with errors that name the fix, before
      transformers' generic vocabulary check;
    * ``_get_candidate_generator``: returns the drafter's generator. Other assistants, prompt lookup, early exit,
      MTP and an explicit ``speculation_type="dflash"`` (transformers' built-in generator) are passed through;
    * ``_assisted_decoding``: a batch (``drafter.batched_from`` rows or more) runs the batched loop of
      ``batch_generation_dflash`` instead of transformers' one-sequence loop.
    """
    if getattr(GenerationMixin._get_candidate_generator, "_dflash_dispatch", False):
        return
    _check_transformers_internals()
    original_validate = GenerationMixin._validate_generation_mode
    original_get = GenerationMixin._get_candidate_generator
    original_assisted = GenerationMixin._assisted_decoding

    def _assisted_decoding(self, input_ids, *args, generation_config=None, assistant_model=None, **kwargs):
        drafter = None if _other_assisted_mode(generation_config) else as_dflash_drafter(assistant_model)
        if drafter is not None and input_ids.shape[0] >= getattr(drafter, "batched_from", 2):
            from .batch_generation_dflash import batched_dflash_decoding  # the batched loop (a sibling file)

            return batched_dflash_decoding(
                self, drafter, input_ids, *args, generation_config=generation_config, assistant_model=assistant_model,
                **kwargs,
            )
        return original_assisted(
            self, input_ids, *args, generation_config=generation_config, assistant_model=assistant_model, **kwargs
        )

    def _validate_generation_mode(self, generation_mode, generation_config, generation_mode_kwargs):
        assistant = as_dflash_drafter(generation_mode_kwargs.get("assistant_model"))
        if assistant is not None:
            if generation_config.num_beams > 1:
                raise ValueError("DFlash drafts one sequence: beam search is not supported; use num_beams=1.")
            if generation_config.output_attentions and self.config._attn_implementation != "eager":
                raise ValueError(
                    "output_attentions=True with speculative decoding needs the target loaded with "
                    "attn_implementation='eager'."
                )
            if generation_config.cache_implementation in ("static", "offloaded_static", "hybrid", "sliding_window"):
                raise ValueError(
                    "DFlash rolls the target's cache back after every round and needs a dynamic cache: drop "
                    f"cache_implementation={generation_config.cache_implementation!r}."
                )
            check_drafter_fits_target(assistant, self)
        return original_validate(self, generation_mode, generation_config, generation_mode_kwargs)

    def _get_candidate_generator(
        self,
        generation_config,
        input_ids,
        inputs_tensor,
        logits_processor,
        model_kwargs,
        assistant_model=None,
        target_tokenizer=None,
        assistant_tokenizer=None,
    ):
        other_mode = _other_assisted_mode(generation_config)
        if not other_mode and type(assistant_model).__name__ == "MuseGlimmerAssistantModel":
            raise ValueError(
                "transformers' built-in DFlash drafter (MuseGlimmerAssistantModel) runs with its own generator: pass "
                "`speculation_type='dflash'` to generate, or convert it with `dflash-hf convert SRC DST --to zlab` and "
                "load it with `dflash_hf.DFlashDraftModel.from_pretrained(DST)`."
            )
        drafter = None if other_mode else as_dflash_drafter(assistant_model)
        if drafter is not None:
            generator = drafter.make_candidate_generator(
                target=self,
                generation_config=generation_config,
                input_ids=input_ids,
                model_kwargs=model_kwargs,
                target_tokenizer=target_tokenizer,
            )
            if drafter is not assistant_model:  # an adopted z-lab drafter: its statistics land on the user's object
                assistant_model.last_stats = drafter.last_stats
            return generator
        return original_get(
            self,
            generation_config=generation_config,
            input_ids=input_ids,
            inputs_tensor=inputs_tensor,
            logits_processor=logits_processor,
            model_kwargs=model_kwargs,
            assistant_model=assistant_model,
            target_tokenizer=target_tokenizer,
            assistant_tokenizer=assistant_tokenizer,
        )

    _get_candidate_generator._dflash_dispatch = True
    GenerationMixin._validate_generation_mode = _validate_generation_mode
    GenerationMixin._get_candidate_generator = _get_candidate_generator
    GenerationMixin._assisted_decoding = _assisted_decoding


__all__ = [
    "DFlashCandidateGenerator",
    "DFlashDrafterMixin",
    "as_dflash_drafter",
    "DFlashStats",
    "DraftLengthController",
    "check_drafter_fits_target",
    "draft_settings",
    "extract_context_feature",
    "head_argmax",
    "install_dflash_dispatch",
]
