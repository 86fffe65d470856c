"""DFlash inside ``target.generate(..., assistant_model=draft)``: the candidate generator and its dispatch.

This file travels as remote code inside every saved drafter, so it imports only ``torch`` and ``transformers``.

One speculative round, in the order transformers' assisted-decoding loop runs it (`DFlashCandidateGenerator`'s
``get_candidates`` reads as the first four steps):

1. **feed context** (``feed_context``): the target features of exactly the positions committed since the last round
   (the whole prompt after prefill; anchor + accepted drafts afterwards);
2. **choose size** (`RoundController.choose`): how many drafts, and from where -- the drafter, or prompt lookup when
   its continuation is expected to commit more tokens per second; fixed blocks always propose ``B - 1``;
3. **draft** (``draft``): for the drafter, one `DFlashDraftHead` call -- embed ``[last token, mask x (B-1)]`` with the
   target's embedding, run the drafter once, and on rows ``1..B-1`` of the target's ``lm_head`` take the argmax
   (greedy drafts) or sample (``draft_sampling="sample"``, see 5), returning the draft distribution q when sampled;
4. **trim** (``trim``): cut the proposals before one that completes a stop string (and q with them);
5. **verify** and 6. **accept**: transformers' loop runs the target on the block and keeps the longest matching prefix
   plus the target's own next token. Greedy: first mismatch. Sampling, ``draft_sampling="sample"``: each draft is
   sampled from the drafter's own distribution q (DFlash: its logits warped by the target's logits processors,
   `sample_drafts`; DFlash2: the path selector), and the generator returns q, so the loop runs rejection sampling
   against it (accept ``u * q(d) < p(d)``, else resample from ``norm(max(p - q, 0))``). ``draft_sampling="greedy"``:
   argmax drafts and no draft distribution, so the loop samples the target and accepts drafts while they equal the
   sample (rejection sampling with a one-hot q). Both are exact target sampling; see `draft_sampling_mode` for the
   choice. ``update_candidate_strategy`` hands the result to the controller (`RoundController.record_verification`),
   which also times the rounds for the adaptive block size.

Dispatch: `install_dflash_dispatch` wraps ``GenerationMixin._get_candidate_generator`` (and the mode validation
before it) so that a DFlash drafter passed as ``assistant_model`` gets `DFlashCandidateGenerator`. Every other
assistant, and ``speculation_type="dflash"`` (transformers' own DFlash generator), go to transformers unchanged.
"""

import inspect
import logging
import time
import weakref
import torch
import transformers
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.stopping_criteria import StopStringCriteria

from .controller_dflash import (
    DFlashStats, DraftRound, ForwardTimer, RoundController, remembered_round_costs, round_cost_key,
)

logger = logging.getLogger(__name__)

SUPPORTED_TRANSFORMERS = ">=5.23,<5.25"


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


class DFlashDraftHead(nn.Module):
    """The draft head of one round: the drafter over ``[anchor, mask x (B-1)]`` and the target's ``lm_head`` on the
    block's rows -> drafts.

    A module of its own, composing the drafter with the target's embedding and head (no weights of its own), so
    that each round's draft is one call that module hooks (``register_forward_hook``) and profilers see, head included
    (`head_logits` may multiply by the head's weight without calling ``lm_head``). The single-sequence generator and
    the batched loop (`batch_generation_dflash`) both draft through it.
    """

    def __init__(self, drafter, embed_tokens, lm_head, prompt_ids: torch.LongTensor | None = None):
        super().__init__()
        # With a draft vocabulary (`config.draft_vocab`) only its rows of the target's head, plus the tokens of
        # ``prompt_ids`` (the prompts of this call): see `DraftVocabHead`.
        self.drafter, self.embed_tokens = drafter, embed_tokens
        self.lm_head = draft_vocab_head(drafter, lm_head, prompt_ids)
        self.draft_device, self.draft_dtype = drafter.device, drafter.dtype
        # Plain DFlash drafts every row of a batch independently (one head matmul for all); drafters that walk a path
        # (DFlash2) propose row by row. (By name: a checkpoint's remote code has its own copy of the mixin.)
        self.rows_independent = type(drafter).propose.__qualname__ == DFlashDrafterMixin.propose.__qualname__

    @torch.no_grad()
    def forward(
        self, block_ids, context, position_ids, cache, num_rows: int, temperature: float | None = None, warp=None,
        **batch_inputs,
    ):
        """``block_ids [b, B]`` (anchor, masks), ``context [b, C, F*H]`` (target features not yet in ``cache``),
        ``position_ids [b, C + B]`` -> ``(drafts [b, M], draft logits [b, M, V] or None)`` for block rows ``1..M``,
        ``M = num_rows``, by the drafter's `propose`: greedy (``temperature`` None) the argmax for DFlash and the
        greedy path for DFlash2, no q; sampled, drafts drawn from q = ``softmax(draft logits)`` -- for DFlash the
        logits warped by ``warp`` (the target's logits processors, see `sample_drafts`; one sequence only), else
        divided by ``temperature``; for DFlash2 the path selector's.

        ``batch_inputs`` (the batched loop's): ``attention_mask [b, cache + C + B]`` (its slot mask) and
        ``cached_positions [b, cache]``, passed to the drafter."""
        drafter, weight = self.drafter, self.lm_head.weight
        noise = drafter.embed_block(self.embed_tokens, block_ids).to(device=self.draft_device, dtype=self.draft_dtype)
        hidden = drafter(
            noise_embedding=noise,
            target_hidden=context,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            **batch_inputs,
        ).last_hidden_state
        # A 2-D [M, H] input: a 3-D slice keeps the stride of the full block in its batch dimension, and
        # torch.matmul then copies the whole transposed lm_head weight on every call (65 ms per round in bf16).
        rows = hidden[:, 1 : 1 + num_rows].to(device=weight.device, dtype=weight.dtype)  # [b, M, H]
        batch = rows.shape[0]
        if batch > 1 and self.rows_independent:
            drafts, logits = drafter.propose(self.lm_head, rows.reshape(-1, rows.shape[-1]), None, temperature, warp)
            return drafts.view(batch, -1), None if logits is None else logits.view(batch, num_rows, -1)
        proposed = [drafter.propose(self.lm_head, rows[i], block_ids[i, 0], temperature, warp) for i in range(batch)]
        drafts = torch.stack([tokens for tokens, _ in proposed])
        return drafts, None if proposed[0][1] is None else torch.stack([q for _, q in proposed])


class DraftVocabHead(nn.Linear):
    """The target's ``lm_head`` restricted to the drafter's draft vocabulary ``vocab_ids [N]`` (sorted token ids):
    logits ``[M, N]`` over those tokens only, from a copy of their ``N x H`` rows.

    The head is most of a drafter call on a CPU (SmolLM2: 49,152 x 576 fp32, 113 MB read per call); a drafter trained
    with ``--train-vocab 8192`` never learned to rank the other tokens, so drafting from its 8,192 rows (19 MB)
    gives the same drafts for a sixth of the cost. Losslessness is untouched: the target verifies every draft, and a
    sampled draft's q is zero outside the vocabulary (`DFlashDrafterMixin.propose`), which rejection sampling
    handles exactly. ``vocab_ids`` maps a logit column back to its token id; ``vocab_size`` is the full vocabulary's.
    """

    def __init__(self, lm_head: nn.Module, vocab_ids: torch.LongTensor):
        nn.Module.__init__(self)
        weight = lm_head.weight.detach()
        self.in_features, self.out_features, self.vocab_size = weight.shape[1], len(vocab_ids), weight.shape[0]
        self.weight = nn.Parameter(weight[vocab_ids.to(weight.device)], requires_grad=False)
        self.register_parameter("bias", None)
        self.register_buffer("vocab_ids", vocab_ids.to(weight.device), persistent=False)

    def full_vocabulary(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits [M, N]`` -> ``[M, V]``: the same values at their token ids, ``-inf`` elsewhere."""
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        return full.index_copy_(1, self.vocab_ids.to(logits.device), logits)


def draft_vocab_head(drafter, lm_head: nn.Module, prompt_ids: torch.LongTensor | None = None) -> nn.Module:
    """The head ``drafter`` drafts from: ``lm_head`` itself, or a `DraftVocabHead` on its rows of
    ``config.draft_vocab`` and of the tokens in ``prompt_ids`` (any shape; padding included is harmless).

    Answers copy names and identifiers from their prompt, and a drafter reads the prompt: on held-out GSM8K the
    shipped drafter drafts "Jones" or " patients" (outside its 8,192 trained tokens) and they are accepted, so the
    prompt's own tokens (a few hundred rows) join the vocabulary for the call.
    """
    vocab = getattr(drafter.config, "draft_vocab", None)
    weight = getattr(lm_head, "weight", None)
    if not vocab or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return lm_head
    ids = torch.tensor(vocab, dtype=torch.long)
    if prompt_ids is not None:
        ids = torch.cat([ids, prompt_ids.flatten().to("cpu", torch.long)]).unique()  # sorted, distinct
    return DraftVocabHead(lm_head, ids)


class DFlashCandidateGenerator(CandidateGenerator):
    """Proposes a whole block of drafts per round from one drafter forward (see the module docstring).

    The drafter's cache holds the keys/values of every committed position before the current anchor, fed in position
    order. Which positions are new is derived from positions, not from counters: after a target forward that started at
    position ``verified_from``, the committed positions are ``[verified_from, len(input_ids) - 1)``; the last token
    of ``input_ids`` is the next anchor, not yet seen by the target.
    """

    requires_model_outputs = True

    def __init__(
        self, drafter, target, generation_config, input_ids, model_kwargs, target_tokenizer=None, logits_processor=None
    ):
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
        self.draft_head = DFlashDraftHead(
            drafter, target.get_input_embeddings(), target.get_output_embeddings(), prompt_ids=input_ids
        )
        self.block_size, adaptive = draft_settings(drafter, generation_config)
        self.max_length = generation_config.max_length
        self.layer_ids = list(drafter.config.target_layer_ids)
        # Ask the verify forward for just the layers we read; a user asking for all hidden states gets all of them
        # (a partial list there breaks transformers' per-token output splitting).
        capture = True if generation_config.output_hidden_states else [i + 1 for i in self.layer_ids]
        self.model_kwargs_overrides = {"output_hidden_states": capture}
        # Sampled drafts: the drafter samples at the request's temperature (DFlash also through the target's logits
        # processors, `sample_drafts`) and returns q; None drafts greedily (argmax, no q).
        sampled = generation_config.do_sample and draft_sampling_mode(drafter, generation_config) == "sample"
        self.temperature = generation_config.temperature if sampled else None
        self.logits_processor = logits_processor
        self.mask_ids = torch.full(
            (1, self.block_size - 1), drafter.config.mask_token_id, dtype=torch.long, device=input_ids.device
        )
        self.stop_strings = (
            StopStringCriteria(target_tokenizer, generation_config.stop_strings)
            if generation_config.stop_strings and target_tokenizer is not None
            else None
        )
        self.cache = DynamicCache()
        self.pending_context: list[torch.Tensor] = []  # target features fed but not yet read by a drafter forward
        self.verified_from = 0
        # Prompt lookup next to the drafter (adaptive mode only), per call through transformers' prompt-lookup field:
        # `generate(max_matching_ngram_size=n)` (0 = off).
        ngram = generation_config.max_matching_ngram_size
        lookup_ngram = getattr(drafter, "prompt_lookup_ngram", 3) if ngram is None else ngram
        # Round costs in plain rounds are the process's, not the prompt's: start from what earlier calls measured.
        memory = lookup_memory = None
        if adaptive:
            key = round_cost_key("single", target, drafter, 1, self.block_size, generation_config.do_sample)
            memory = remembered_round_costs(drafter, key)
            if lookup_ngram:
                lookup_memory = remembered_round_costs(drafter, (*key, "prompt lookup"))
        self.controller = RoundController(
            self.block_size, adaptive, lookup_ngram, DFlashStats(self.block_size), memory=memory,
            lookup_memory=lookup_memory,
        )
        drafter.last_stats = self.controller.stats
        # Time the head's matmul forms now (once per process), not inside a round whose cost the controller measures.
        for num_rows in self.controller.head_rows():
            calibrate_head(self.draft_head.lm_head, num_rows)

    def get_candidates(self, input_ids, model_kwargs=None, model_outputs=None, is_first_iteration=False, **kwargs):
        """One round: feed context -> choose size -> draft -> trim.

        ``input_ids [1, n]`` -> ``([1, n + k], draft log q [1, k, V] or None)`` with ``k <= B - 1`` proposals; the
        first call (the target's prefill) proposes nothing.
        """
        self.controller.start_round()
        if is_first_iteration:
            return input_ids, None
        self.feed_context(input_ids, model_outputs)
        # Never propose past max_length: the target's own token after the drafts must fit too.
        round = self.controller.choose(input_ids, room=max(self.max_length - input_ids.shape[1] - 1, 0))
        proposals, draft_logits = self.draft(input_ids, round)
        proposals, draft_logits = self.trim(input_ids, proposals, draft_logits)
        round.proposed = proposals.shape[1]
        return torch.cat([input_ids, proposals], dim=-1), draft_logits

    def update_candidate_strategy(self, input_ids, scores, num_matches):
        self.controller.record_verification(input_ids[0, -(int(num_matches) + 1) :])

    def feed_context(self, input_ids, model_outputs) -> None:
        """Feed context: target features of positions ``[verified_from, n - 1)``, all committed, to the drafter."""
        committed = input_ids.shape[1] - 1
        features = extract_context_feature(model_outputs.hidden_states, self.layer_ids)
        self.pending_context.append(features[:, : committed - self.verified_from])
        self.verified_from = committed

    def draft(self, input_ids, round: DraftRound):
        """Draft: the round's proposals ``[1, k]`` and their draft distribution (log q ``[1, k, V]``, or None): the
        prompt-lookup continuation, the drafter's block, or nothing (plain decoding).

        Without a draft distribution transformers' loop samples the target and compares (a one-hot q); with one it
        runs rejection sampling against it (accept ``u * q(d) < p(d)``, resample from ``norm(max(p - q, 0))``).
        """
        if round.lookup is not None:  # no drafter forward: its context stays pending, as in a plain round
            return round.lookup, None
        if not round.runs_drafter:
            return input_ids[:, :0], None
        return self.draft_block(input_ids, round)

    def draft_block(self, input_ids, round: DraftRound):
        """The drafter's ``round.num_drafts`` proposals from one `DFlashDraftHead` call over ``[anchor, mask x (B-1)]``
        and all pending context; a shadow round (0 proposals) still drafts, to judge draft 1.

        One more draft than proposed (when the block has it) is kept in ``round.drafts`` for the controller.
        """
        device = self.draft_head.draft_device
        context = torch.cat(self.pending_context, dim=1).to(device)
        self.pending_context = []
        anchor = input_ids.shape[1] - 1
        position_ids = torch.arange(self.cache.get_seq_length(), anchor + self.block_size, device=device)[None]
        block_ids = torch.cat([input_ids[:, -1:], self.mask_ids], dim=-1)
        num_rows = min(round.num_drafts + 1, self.block_size - 1)
        with ForwardTimer(device) as round.drafter_time:
            drafts, draft_logits = self.draft_head(
                block_ids, context, position_ids, self.cache, num_rows, self.temperature, self._draft_warp(input_ids)
            )
        round.context_read = context.shape[1]
        if draft_logits is not None:
            # The controller judges the draft after the proposals (and a shadow round's only draft) by equality with
            # the target's sampled token. A sampled draft equals it with probability sum p*q, well below its chance of
            # acceptance, sum min(p, q), and would price drafting out; q's argmax, judged as in greedy mode, does not.
            extra = draft_logits[:, round.num_drafts :].argmax(dim=-1).to(drafts.device)
            drafts = torch.cat([drafts[:, : round.num_drafts], extra], dim=-1)
            draft_logits = draft_logits[:, : round.num_drafts]
        round.drafts = drafts.to(input_ids.device)
        return round.drafts[:, : round.num_drafts], draft_logits

    def _draft_warp(self, input_ids):
        """The target's logits processors as the verify step applies them to block position ``t``: on the ids before
        it, ``input_ids`` plus drafts ``1..t-1`` (see `sample_drafts`); None when drafting greedily or without
        processors (temperature only)."""
        if self.temperature is None or self.logits_processor is None:
            return None
        return lambda drafts, scores: self.logits_processor(torch.cat([input_ids, drafts[None]], dim=-1), scores)

    def trim(self, input_ids, proposals, draft_logits):
        """Trim: keep the proposals short of the first one that completes a stop string, and the draft distribution
        (if any) to the proposals kept (None when none is)."""
        proposals = self._stop_before_stop_strings(input_ids, proposals)
        if draft_logits is None or proposals.shape[1] == 0:
            return proposals, None
        return proposals, draft_logits[:, : proposals.shape[1]]

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


DRAFT_SAMPLING_MODES = ("greedy", "sample")


def draft_sampling_mode(drafter, generation_config) -> str:
    """How drafts are chosen when ``generate`` samples: ``"sample"`` draws them from the drafter's distribution q and
    hands q to the verifier, ``"greedy"`` proposes argmax drafts (a one-hot q).

    Per call ``generate(..., draft_sampling="greedy")`` (a `GenerationConfig` field that `install_dflash_dispatch`
    registers, so ``target.generation_config.draft_sampling`` and a passed ``generation_config`` work too); a call that
    sets none uses the drafter's default, ``drafter.draft_sampling``.
    """
    mode = getattr(generation_config, "draft_sampling", None) or getattr(drafter, "draft_sampling", "greedy")
    if mode not in DRAFT_SAMPLING_MODES:
        raise ValueError(f"draft_sampling must be 'greedy' or 'sample', got {mode!r}.")
    return mode


def sample_drafts(logits: torch.Tensor, warp) -> tuple[torch.LongTensor, torch.Tensor]:
    """Sample one draft per row of ``logits [M, V]`` (block rows ``1..M``) -> ``(drafts [M], scores [M, V])``.

    Row ``t`` is warped as the verify step warps the target's logits at that block position, ``warp(drafts[:t],
    row)`` (float32, ``[1, V]`` in and out), and its draft is drawn from ``softmax(scores[t])``: ``scores`` is the draft
    distribution q that transformers' rejection sampling reads (``softmax`` of the candidate logits). Processors
    that read the ids before a position (repetition penalty, n-gram bans, min length) see the drafts before it.
    """
    drafts, scores = logits.new_empty(0, dtype=torch.long), []
    for row in logits.float():
        warped = warp(drafts, row[None])
        drafts = torch.cat([drafts, torch.multinomial(warped.softmax(dim=-1), num_samples=1)[0]])
        scores.append(warped)
    return drafts, torch.cat(scores)


_FASTER_TRANSPOSED: dict[tuple, bool] = {}  # (dtype, rows, (head rows to a power of 2, H)) -> W @ rows.T is faster


def head_argmax(lm_head, rows: torch.Tensor) -> torch.LongTensor:
    """``argmax(lm_head(rows))`` for a few rows ``[M, H]`` -> ``[M]``, in whichever matmul form is faster here.

    For a handful of rows, CPU kernels differ a lot between ``rows @ W.T`` and ``W @ rows.T``: fp32 on this
    project's AMD EPYC takes 21 ms vs 6 ms for 3 rows of SmolLM2's 49152 x 576 head, bf16 is faster the other way.
    On CPU, the first call for each (dtype, M, head shape) times both forms once and keeps the faster. A head that
    is not a bias-free ``nn.Linear``, or one on an accelerator, is simply called.
    """
    return head_logits(lm_head, rows).argmax(dim=-1)


def head_logits(lm_head, rows: torch.Tensor) -> torch.Tensor:
    """``lm_head(rows)`` for a few rows ``[M, H]`` -> ``[M, V]``, in the faster matmul form (see `head_argmax`)."""
    if not _is_plain_cpu_head(lm_head):
        return lm_head(rows)
    if calibrate_head(lm_head, rows.shape[0]):
        return (lm_head.weight @ rows.T).T
    return rows @ lm_head.weight.T


def calibrate_head(lm_head, num_rows: int) -> bool:
    """Whether ``W @ rows.T`` is the faster form for ``num_rows`` rows on this head; timed on first use."""
    if not _is_plain_cpu_head(lm_head):
        return False
    weight = lm_head.weight
    # Head sizes within a power of two share a choice: a `DraftVocabHead` has a few rows more or less per prompt.
    key = (weight.dtype, num_rows, (1 << (weight.shape[0] - 1).bit_length(), weight.shape[1]))
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
    # What rounds cost with this drafter in this process, per `round_cost_key` (`RoundCostMemory`): set on first use.
    round_costs: dict | None = None
    # The default for calls that do not choose (see `draft_settings`): choose the number of drafts per round from
    # measured costs and acceptance (`DraftLengthController`); False always proposes block_size - 1 drafts (as the
    # reference does). Per call: generate(..., num_assistant_tokens=k, num_assistant_tokens_schedule=...).
    adaptive_block_size: bool = True
    # With the adaptive block size: longest n-gram prompt lookup matches (0 = off; per call:
    # `generate(max_matching_ngram_size=n)`). A round proposes the lookup's continuation instead of the drafter's
    # block when that is expected to commit more tokens per second.
    prompt_lookup_ngram: int = 3
    # When sampling: "sample" draws the drafts from the drafter's own distribution q and verifies against it, "greedy"
    # proposes argmax drafts (see `draft_sampling_mode`; per call: `generate(draft_sampling=...)`). Both are exact.
    draft_sampling: str = "sample"
    # Batches of at least this many rows run the batched loop (`batch_generation_dflash`); smaller ones run
    # transformers' assisted loop with `DFlashCandidateGenerator`. 1 sends single prompts there too (tests).
    batched_from: int = 2

    def make_candidate_generator(
        self, target, generation_config, input_ids, model_kwargs, target_tokenizer=None, logits_processor=None
    ):
        return DFlashCandidateGenerator(
            self, target, generation_config, input_ids, model_kwargs, target_tokenizer, logits_processor
        )

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

    def propose(self, lm_head, rows: torch.Tensor, anchor: torch.Tensor, temperature: float | None = None, warp=None):
        """Draft tokens from the draft hidden states ``rows [M, H]`` (block rows ``1..M``) -> ``(tokens [M],
        draft_logits [M, V] or None)``.

        ``lm_head`` is the target's head or a `DraftVocabHead` (then drafts and q stay inside the draft vocabulary).
        ``temperature`` None: greedy drafts, the argmax of the transformed logits, and no draft distribution.
        Otherwise each draft is sampled from ``q = softmax(draft_logits)``, the transformed logits warped by ``warp``
        (the target's logits processors, see `sample_drafts`) or, without it, divided by ``temperature``. ``anchor``
        serves drafters that walk a path (DFlash2).
        """
        logits = self.transform_logits(head_logits(lm_head, rows))  # [M, V], or [M, N] from a `DraftVocabHead`
        vocab_ids = getattr(lm_head, "vocab_ids", None)
        if temperature is None:
            best = logits.argmax(dim=-1)
            return (best if vocab_ids is None else vocab_ids[best]), None
        if vocab_ids is not None:  # q over the draft vocabulary, zero elsewhere
            logits = lm_head.full_vocabulary(logits)
        return sample_drafts(logits, warp or (lambda drafts, scores: scores / temperature))

    @torch.no_grad()
    def spec_generate(self, target, input_ids, max_new_tokens=2048, stop_token_ids=None, temperature=0.0, **kwargs):
        """z-lab's API: speculative generation of ``input_ids [b, n]`` -> ``[b, n + m]`` with the same round logic.

        ``temperature < 1e-5`` is greedy; otherwise plain temperature sampling (no top-k/top-p), as the reference.
        Generation ends after the first token in ``stop_token_ids`` (inclusive). A batch (``b > 1``) is left-padded
        with its ``attention_mask`` passed along (``kwargs`` go to ``generate``); rows that end early are padded with
        ``pad_token_id`` (default: the first stop token).
        """
        options = dict(max_new_tokens=max_new_tokens, assistant_model=self)
        options |= sampling_options(temperature if temperature >= 1e-5 else 0.0)
        if stop_token_ids is not None:
            options["eos_token_id"] = list(stop_token_ids)
            options.setdefault("pad_token_id", list(stop_token_ids)[0])
        return target.generate(input_ids, **(options | kwargs))


def sampling_options(temperature: float) -> dict:
    """``generate`` options for ``temperature``: greedy at 0, otherwise plain temperature sampling (no top-k / top-p,
    as z-lab's reference samples) -- the one place this project turns a temperature into sampling settings."""
    if temperature <= 0:
        return {"do_sample": False}
    return {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}


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
    # A documented generate argument: `generate(draft_sampling=...)` updates only fields GenerationConfig has (anything
    # else is refused as an unused model kwarg); unset, the drafter's default holds (`draft_sampling_mode`). Registered
    # even when an older copy of this file installed the dispatch first.
    if not hasattr(GenerationConfig, "draft_sampling"):
        GenerationConfig.draft_sampling = None
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
            # The target's processors warp sampled drafts as they warp the target's logits; a drafter whose code
            # predates them (an older checkpoint's remote code) is not handed them.
            accepts_processors = "logits_processor" in inspect.signature(drafter.make_candidate_generator).parameters
            generator = drafter.make_candidate_generator(
                target=self,
                generation_config=generation_config,
                input_ids=input_ids,
                model_kwargs=model_kwargs,
                target_tokenizer=target_tokenizer,
                **({"logits_processor": logits_processor} if accepts_processors else {}),
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
    "DFlashDraftHead",
    "DFlashDrafterMixin",
    "DraftVocabHead",
    "as_dflash_drafter",
    "DFlashStats",
    "DraftLengthController",
    "DraftRound",
    "RoundController",
    "check_drafter_fits_target",
    "draft_sampling_mode",
    "draft_settings",
    "draft_vocab_head",
    "extract_context_feature",
    "head_argmax",
    "head_logits",
    "install_dflash_dispatch",
    "sample_drafts",
    "sampling_options",
]
