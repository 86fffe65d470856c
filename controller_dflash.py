"""Round control for DFlash generation: what each round proposes, what it cost, and what its verification taught.

This file travels as remote code inside every saved drafter (next to ``generation_dflash.py``, which plans every round
through `RoundController`), so it imports only ``torch``.

* `DFlashStats`: per-call acceptance statistics (``draft.last_stats``);
* `DraftLengthController`: the adaptive block size -- expected committed tokens per unit of measured round cost;
* `RoundCostMemory`: the round costs a drafter measured, kept across its ``generate`` calls (`remembered_round_costs`);
* `RoundController`: one sequence's rounds -- the size, shadow drafts, prompt lookup against the drafter;
* `prompt_lookup_match`: the n-gram continuation prompt lookup proposes.

docs/controller.md explains the rules and the measurements behind them.
"""

import time
from dataclasses import dataclass, field

import torch


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


class RoundCostMemory:
    """What rounds cost, remembered across ``generate`` calls of one process: each drafted size's cost in plain rounds
    (``cost[k]``, ``k > 0``) and a drafter forward's (``drafter_cost``), as the last call's controller left them.

    One memory serves one `round_cost_key` (the loop, batch size, block size, sampling, threads, the target's shape,
    attention, dtypes and devices: what a cost in plain rounds depends on, not the prompt) and lives on the drafter
    (`remembered_round_costs`). A call's `DraftLengthController` starts from it (`recall`): a remembered size counts
    as measured -- no probe, no growing one size at a time -- while the unit (a plain round's seconds) is timed again
    in every call, and writes every cost it measures back at once (`remember_size`, `remember_drafter`), so a call
    that ends early or raises has already left what it measured. Acceptance is not remembered: it belongs to the text.

    Stale costs (a neighbour process, a much longer context) are what the call's moving average corrects, and each
    call leaves the corrected value for the next. A cost remembered too low is never below a plain round (`recall`)
    and is timed by every round drafted at that size; the batched controller books such rounds at what they realized
    (`BatchDraftLengthController`), so it cannot draft on it past its exploration budget. A cost remembered too high
    (a stall during a size's only probe) would keep that size, and the sizes above it, from being tried again: a size
    not timed in ``forget_after`` calls is forgotten, and probed again when the acceptance makes it look worth it.
    """

    forget_after = 16

    def __init__(self):
        self.cost: dict[int, float] = {}
        self.drafter_cost: float | None = None
        self.calls = 0  # calls that recalled this memory
        self.timed: dict[int, int] = {}  # the call that last timed each size

    def recall(self) -> tuple[dict[int, float], float | None]:
        """A call starts: the remembered costs of the sizes timed in the last ``forget_after`` calls (at least a plain
        round each: a drafted round verifies at least a plain round's token) and the drafter forward's."""
        self.calls += 1
        for size in [k for k, call in self.timed.items() if self.calls - call > self.forget_after]:
            del self.cost[size], self.timed[size]
        return {k: max(cost, 1.0) for k, cost in self.cost.items()}, self.drafter_cost

    def remember_size(self, size: int, cost: float) -> None:
        self.cost[size], self.timed[size] = cost, self.calls

    def remember_drafter(self, cost: float) -> None:
        self.drafter_cost = cost


def round_cost_key(loop: str, target, drafter, batch_size: int, block_size: int, do_sample: bool) -> tuple:
    """What a round's cost in plain rounds depends on, besides the context: the loop (``"single"``: transformers'
    assisted loop, ``"batched"``), rows per round, the block (the drafter always reads all of it), sampling (verify
    processes every position), torch's threads, the target's shape and attention, and both models' dtypes and
    devices."""
    config = target.config.get_text_config()
    shape = tuple(getattr(config, name, None) for name in ("hidden_size", "num_hidden_layers", "vocab_size"))
    return (loop, batch_size, block_size, bool(do_sample), torch.get_num_threads(), type(target).__name__, shape,
            getattr(target.config, "_attn_implementation", None), str(target.dtype), str(target.device),
            str(drafter.dtype), str(drafter.device))


def remembered_round_costs(drafter, key: tuple) -> RoundCostMemory:
    """The drafter's `RoundCostMemory` for ``key`` (`round_cost_key`), created empty on first use. It is kept on the
    drafter module (``drafter.round_costs``, not in its state dict): the costs are of this drafter in this process."""
    memories = getattr(drafter, "round_costs", None)
    if memories is None:
        memories = drafter.round_costs = {}
    return memories.setdefault(key, RoundCostMemory())


class DraftLengthController:
    """Adaptive block size: how many drafts to propose next round, from measured costs and recent acceptance.

    A round that proposes ``k`` drafts commits ``E[k] = 1 + sum_{j<=k} prod_{i<=j} p_i`` tokens on average, where
    ``p_i`` is the rate at which draft ``i`` is accepted given that drafts ``1..i-1`` were. It costs ``cost[k]``
    **plain rounds** (drafter forward + verifying ``k + 1`` tokens + glue, over the wall time of a plain round),
    measured on this target in this call. Costs are kept as ratios to a running plain-round time, measured in the
    same stretch of the call, so a neighbour that slows the whole machine down leaves them, and the choices, as they
    were. When all ``k`` drafts are accepted, draft ``k + 1`` (drafted, not proposed) is judged against the target's
    own token, so the estimates can climb towards longer blocks.

    The controller proposes the ``k`` with the most tokens per plain round, ``k = 0`` (plain decoding, rate 1) unless
    drafting beats it by ``margin``: near break-even, estimation noise would otherwise make drafting lose more often
    than win. A size never measured is priced at a lower bound (the cost of the largest measured smaller size, and at
    least a plain round plus a drafter forward) and is tried only once the next smaller size has been measured, so
    the block grows 3 -> 7 -> 15 as measurements justify it. Two estimates of ``p`` serve two decisions: a fast moving
    average (``fast_rate``) picks the block size, and plain decoding is chosen only when a slow one (``slow_rate``, a
    memory of ~16 judgements) agrees: a good drafter has streaks of rejections (at ``p_1 = 0.55``, four in a row
    every ~25 rounds), and quitting on one would lose many rounds of drafting.

    Evidence while plain decoding wins comes from **shadow drafts** (``shadow`` set with ``k = 0``): the round decodes
    plainly but the drafter runs and its draft 1 is judged against the target's token. A shadow costs a drafter
    forward, which a useless drafter never repays, so they come out of an **exploration budget**: ``allowance`` plain
    rounds up front (the first round, whose drafter forward reads the prompt, is a shadow) plus ``explore_share`` of
    the rounds decoded since. A drafter that never fits the text thus costs at most that share of plain decoding, and
    one that starts to fit it is noticed within ``c / explore_share`` rounds (``c``: a drafter forward in plain rounds).
    A shadow round is priced by its drafter forward, timed on its own (`ForwardTimer`), and the rest of it is a plain
    round that keeps the unit current: priced as the round's excess over a plain-round average instead, a drafter
    forward looks free whenever that average runs high (stale, after a slow stretch), its price decays towards 0, and
    every round becomes a shadow (docs/controller.md).

    The unit itself must not run high: against a plain-round time set too high, drafted rounds look cheap, the call
    drafts every round, and no plain round is left to correct it. So the unit is a running mean of its first
    ``1 / fast_rate`` samples (one slow first decode step counts as one sample among five, not as the estimate) before
    it becomes a moving average, and after ``refresh_every`` rounds that did not time it (drafted or looked up) one is
    decoded plainly (at most 1/16 of a drafting gain).

    With a ``memory`` (`RoundCostMemory`) the costs start where earlier calls left them and every measured one is
    written back to it; the plain round is still timed first in every call.
    """

    refresh_every = 16

    # The exploration budget: half a plain round up front plus 0.75 % of the rounds. Against twice that
    # (docs/controller.md), it cut the shadows on text the drafter cannot guess (MT-Bench: 12-14 -> 4-5 per 128
    # tokens) and did not notice text the drafter can guess any later (GSM8K, HumanEval, ShareGPT).
    explore_share, allowance = 0.0075, 0.5

    # A drafter forward, in plain rounds, until a shadow round measures it (fp32 SmolLM2 on an AVX2 EPYC: 0.3-0.5).
    assumed_drafter_cost = 0.5

    def __init__(self, max_drafts: int, fast_rate: float = 0.2, slow_rate: float = 1 / 16,
                 explore_share: float | None = None, allowance: float | None = None, margin: float = 0.05,
                 memory: RoundCostMemory | None = None):
        self.candidates = sorted({0, max_drafts} | {2**i - 1 for i in range(2, 10) if 2**i - 1 < max_drafts})
        self.rates = (fast_rate, slow_rate)
        self.acceptance = [[0.5] * max_drafts for _ in self.rates]  # fast and slow p_i, conditional
        self.observations = [0] * max_drafts  # judgements per draft position
        self.judged = 0  # drafts 1..judged have been observed at least once
        self.step_seconds: float | None = None  # a plain round's wall time, moving average
        self.cost: dict[int, float] = {}  # measured round cost per size, in plain rounds (cost[0] = 1 once timed)
        self.drafter_cost: float | None = None  # a drafter forward, in plain rounds (from shadow rounds)
        self.explore_share = self.explore_share if explore_share is None else explore_share
        self.allowance = self.allowance if allowance is None else allowance
        self.margin = margin
        self.rounds, self.explored = 0, 0.0  # rounds chosen; plain rounds spent on shadow drafts
        self.since_plain = 0  # rounds since the last one that timed the unit
        self.refreshing = False  # set by `choose`: a plain round that re-times the unit (nothing else proposed)
        self.unit_samples = 0  # plain rounds timed
        self.shadow = False  # set by `choose`: draft without proposing, to judge draft 1
        self.memory = memory
        if memory is not None:  # never cost[0]: "measured" means this call has timed its unit
            self.cost, self.drafter_cost = memory.recall()

    def expected_tokens(self, num_drafts: int, slow: bool = False) -> float:
        """``E[k]``; a draft position never judged yet is assumed as good as the last judged one."""
        acceptance = self.acceptance[int(slow)]
        expected, reach, p = 1.0, 1.0, 0.5
        for i in range(num_drafts):
            p = acceptance[i] if i < self.judged or not self.judged else p
            reach *= p
            expected += reach
        return expected

    def rate(self, num_drafts: int, slow: bool = False) -> float:
        """Expected tokens per plain round's time when proposing ``num_drafts`` (plain decoding: 1)."""
        return self.expected_tokens(num_drafts, slow) / self.estimated_cost(num_drafts)

    def best(self, slow: bool = False, limit: int | None = None) -> int:
        """The size (at most ``limit``) with the most expected tokens per unit time, if it beats plain decoding by
        ``margin``; else 0. Sizes whose next smaller size was never measured wait for that measurement."""
        sizes = [k for i, k in enumerate(self.candidates) if (limit is None or k <= limit)
                 and (k == 0 or k in self.cost or self.candidates[i - 1] in self.cost)]
        best = max(sizes, key=lambda k: self.rate(k, slow))
        return best if best and self.rate(best, slow) >= 1 + self.margin else 0

    def choose(self) -> int:
        """Drafts to propose next round; sets ``shadow`` for a plain round that should judge a draft anyway."""
        self.rounds += 1
        self.since_plain += 1
        first = self.rounds == 1
        self.shadow = first  # the first round: the drafter reads the prompt and is judged once
        if first or 0 not in self.cost:  # then plain decoding: every other cost is a multiple of it
            return self._charge_shadow()
        self.refreshing = self.since_plain > self.refresh_every
        if self.refreshing:
            return 0
        best = self.best() or self.best(slow=True)
        if best > 0:
            return best
        self.shadow = self.shadow_affordable()
        return self._charge_shadow()

    def shadow_affordable(self) -> bool:
        """Whether the exploration budget has room for one more shadow round at its expected price."""
        return self.explored + self.shadow_price() <= self.allowance + self.explore_share * self.rounds

    def _charge_shadow(self) -> int:
        """Charge a shadow round's expected price to the exploration budget when it is chosen (`record_shadow_cost`
        corrects it to the measured price); returns 0, the drafts it proposes."""
        if self.shadow:
            self.explored += self.shadow_price()
        return 0

    def shadow_price(self) -> float:
        """What a shadow round is expected to cost on top of a plain round, in plain rounds."""
        return self.drafter_cost if self.drafter_cost is not None else self.assumed_drafter_cost

    def estimated_cost(self, num_drafts: int) -> float:
        """Measured cost in plain rounds; for a size not measured yet, a lower bound: verifying more tokens costs no
        less than the largest measured smaller size, and a drafted round no less than a plain round plus a drafter
        forward."""
        if num_drafts in self.cost:
            return self.cost[num_drafts]
        smaller = max((self.cost[k] for k in self.cost if k < num_drafts), default=1.0)
        return max(smaller, 1.0 + self.shadow_price())

    def record_acceptance(self, judged: int, accepted: int) -> None:
        """Drafts ``1..judged`` were compared with the committed tokens; the first ``accepted`` matched."""
        for i in range(judged):  # a running mean over the first 1/rate judgements, then a moving average
            self.observations[i] += 1
            for rate, acceptance in zip(self.rates, self.acceptance):
                weight = max(rate, 1.0 / (self.observations[i] + 1))
                acceptance[i] += weight * (float(i < accepted) - acceptance[i])
        self.judged = max(self.judged, judged)

    def record_cost(self, proposed: int, seconds: float) -> None:
        """A round that proposed ``proposed`` drafts took ``seconds``: plain rounds update the plain-round time (a
        running mean of the first samples, then `moving_cost`), drafted ones their cost in plain rounds."""
        if proposed == 0:
            self.unit_samples, self.since_plain = self.unit_samples + 1, 0
            if self.unit_samples * self.rates[0] <= 1:
                previous = self.step_seconds or 0.0
                self.step_seconds = previous + (seconds - previous) / self.unit_samples
            else:
                self.step_seconds = moving_cost(self.step_seconds, seconds, self.rates[0])
            self.cost[0] = 1.0
        elif proposed in self.candidates and self.step_seconds:
            self.cost[proposed] = moving_cost(self.cost.get(proposed), seconds / self.step_seconds, self.rates[0])
            if self.memory is not None:
                self.memory.remember_size(proposed, self.cost[proposed])

    def record_drafted_cost(self, proposed: int, seconds: float, drafter_seconds: float, typical: bool) -> None:
        """A round that proposed ``proposed`` drafts took ``seconds``, ``drafter_seconds`` of them in its drafter
        forward: its size's cost (`record_cost`). When not ``typical`` -- the forward also read the context that plain
        rounds left pending -- that forward counts at a typical one's price (`shadow_price`). Left untimed instead, a
        size first drafted after a plain stretch kept its lower-bound price, was never remembered, and every call
        probed it again (batch 4, held-out GSM8K: a round of 7 drafts costing 2.5-3.7 plain rounds, believed 2.1)."""
        if not typical:
            if not self.step_seconds:
                return
            seconds = max(seconds - drafter_seconds, 0.0) + self.shadow_price() * self.step_seconds
        self.record_cost(proposed, seconds)

    def record_shadow_cost(self, seconds: float, drafter_seconds: float, typical: bool = True) -> None:
        """A shadow round took ``seconds``, ``drafter_seconds`` of them in its drafter forward: the rest is a plain
        round (`record_cost`), and the forward, in plain rounds, replaces the round's expected price in the
        exploration budget and, when ``typical`` (it read no more than a block of new context), measures a drafter
        forward. Callers that do not time shadow rounds leave the expected price charged."""
        self.record_cost(0, max(seconds - drafter_seconds, 0.0))
        if not self.step_seconds:
            return
        charged = self.shadow_price()
        extra = drafter_seconds / self.step_seconds
        if typical:
            self.drafter_cost = moving_cost(self.drafter_cost, extra, self.rates[0])
            if self.memory is not None:
                self.memory.remember_drafter(self.drafter_cost)
        self.explored += extra - charged


def moving_cost(previous: float | None, sample: float, rate: float) -> float:
    """A moving average of costs; one sample counts as at most twice the estimate, so that a one-off stall (a garbage
    collection: 230 ms against 40) cannot price a size out of the choice for good, while a lasting change is followed
    within a few samples."""
    if previous is None:
        return sample
    return previous + rate * (min(sample, 2 * previous) - previous)


class ForwardTimer:
    """How long a stretch of work on ``device`` took, read after the round that ran it: wall time on a CPU; on a
    CUDA device a pair of events, since its kernels run asynchronously (read once the verify step has synchronised
    the host, they cost no synchronisation of their own)."""

    def __init__(self, device: torch.device):
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if device.type == "cuda" else None
        self.started = self.elapsed = 0.0

    def __enter__(self) -> "ForwardTimer":
        if self.events is not None:
            self.events[0].record()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.events is not None:
            self.events[1].record()
        self.elapsed = time.perf_counter() - self.started

    def seconds(self) -> float:
        if self.events is None:
            return self.elapsed
        self.events[1].synchronize()
        return self.events[0].elapsed_time(self.events[1]) / 1000.0


@dataclass
class DraftRound:
    """One round, planned by `RoundController.choose` and kept by it until the target has verified the round.

    The plan: ``num_drafts`` drafts wanted (0 = plain decoding); ``shadow``: the drafter runs anyway, to judge its
    draft 1; ``continuation``: the prompt-lookup continuation ``[k]`` found this round after a ``match``-token n-gram
    (judged against the committed tokens whether proposed or not), and ``lookup``: its first tokens ``[1, k']`` when proposed instead of the drafter's
    block. The draft phase fills ``drafts [1, M]`` (the drafter's, one more than proposed where the block has it, for
    the controller), ``context_read`` (new context positions its forward read) and ``drafter_time`` (how long that
    forward took); trimming fills ``proposed``.
    """

    num_drafts: int
    shadow: bool = False
    continuation: torch.LongTensor | None = None
    match: int = 0
    lookup: torch.LongTensor | None = None
    drafts: torch.LongTensor | None = None
    context_read: int = 0
    drafter_time: ForwardTimer | None = None
    proposed: int = 0

    @property
    def runs_drafter(self) -> bool:
        return self.lookup is None and (self.num_drafts > 0 or self.shadow)


class RoundController:
    """The generator's round bookkeeping: what each round proposes, what it cost, and what its verification taught.

    Adaptive (``adaptive=True``): `DraftLengthController` (``sizes``) picks the number of drafts from acceptance and
    from round costs this object measures -- the wall time from one ``get_candidates`` to the next, charged to the
    round's size only when typical of it (`record_round_cost`) -- and runs its shadow rounds. Prompt lookup
    (``lookup_ngram > 0``) proposes its continuation instead when that is expected to commit more tokens per unit
    time, judged by an estimator of its own (``lookup_rates``, with the verify costs of lookup rounds). Looking up
    costs no forward, so its continuation is judged against the committed tokens every round, proposed or not: its
    acceptance estimate never goes stale, and the choice depends on the text rather than on when lookup last ran.
    Fixed blocks: always ``block_size - 1`` drafts, nothing timed. Every verified round lands in ``stats``. ``memory``
    and ``lookup_memory`` (`RoundCostMemory`): the drafter's and the lookup's round costs start where earlier calls
    left them. The lookup's matter as much: until a lookup size is timed it is priced at a plain round (it runs no
    drafter), while verifying 4 tokens costs ~2 plain rounds in fp32 on a CPU, so every call would otherwise propose
    its first matches on that price, and lose them where the answer does not copy the prompt.
    """

    def __init__(self, block_size: int, adaptive: bool, lookup_ngram: int, stats: DFlashStats,
                 memory: RoundCostMemory | None = None, lookup_memory: RoundCostMemory | None = None):
        self.block_size, self.stats = block_size, stats
        self.sizes = DraftLengthController(block_size - 1, memory=memory) if adaptive else None
        self.lookup_ngram = lookup_ngram if adaptive else 0
        # Lookup acceptance per matched n-gram length (a 3-gram match continues the text far more often than a
        # 1-gram one); one table of lookup costs, in plain rounds (no drafter forward), serves them all.
        self.lookup_rates = None
        self.lookup_memory = lookup_memory
        if self.lookup_ngram:
            costs = {0: 1.0, **(lookup_memory.recall()[0] if lookup_memory is not None else {})}
            self.lookup_rates = {n: DraftLengthController(block_size - 1) for n in range(1, self.lookup_ngram + 1)}
            for estimator in self.lookup_rates.values():
                estimator.cost, estimator.drafter_cost = costs, 0.0
        self.current: DraftRound | None = None  # None while the target prefills
        self.started = 0.0

    def head_rows(self) -> list[int]:
        """The numbers of block rows a round may ask of the draft head (``k + 1`` for ``k`` drafts, at most B - 1;
        a shadow draft, k = 0, judges one row)."""
        sizes = self.sizes.candidates if self.sizes is not None else [self.block_size - 1]
        return [min(k + 1, self.block_size - 1) for k in sizes]

    def start_round(self) -> None:
        """A round begins, so the previous one has ended: charge its wall time (`record_round_cost`)."""
        now = time.perf_counter()
        if self.sizes is not None and self.current is not None:
            self.record_round_cost(self.current, now - self.started)
        self.started = now

    def record_round_cost(self, round: DraftRound, seconds: float) -> None:
        """Charge a round's wall time to what it was: a lookup round to the lookup's verify cost (no drafter forward),
        a shadow round to the drafter forward and the exploration budget, a plain or drafted round to its size. A
        drafter forward that read more than a block of new context (the prompt, or what plain rounds left pending)
        is not typical: a shadow's does not price the drafter forward, and a drafted round's counts at a typical
        forward's price (`DraftLengthController.record_drafted_cost`)."""
        sizes, typical = self.sizes, round.context_read <= self.block_size
        if round.lookup is not None and round.proposed > 0:
            if sizes.step_seconds and round.proposed in sizes.candidates:
                costs = self.lookup_rates[1].cost  # shared by every n-gram length
                costs[round.proposed] = moving_cost(costs.get(round.proposed), seconds / sizes.step_seconds,
                                                    sizes.rates[0])
                if self.lookup_memory is not None:
                    self.lookup_memory.remember_size(round.proposed, costs[round.proposed])
        elif round.shadow:
            sizes.record_shadow_cost(seconds, round.drafter_time.seconds(), typical)
        elif round.proposed:
            sizes.record_drafted_cost(round.proposed, seconds, round.drafter_time.seconds(), typical)
        elif typical:
            sizes.record_cost(0, seconds)

    def choose(self, input_ids, room: int) -> DraftRound:
        """Plan this round for ``input_ids [1, n]``: how many drafts (at most ``room``, what max_length leaves) and
        from where (the drafter, or prompt lookup)."""
        wanted = self.sizes.choose() if self.sizes is not None else self.block_size - 1
        shadow = self.sizes is not None and self.sizes.shadow
        self.current = DraftRound(min(wanted, room), shadow)
        self.current.lookup = self._prompt_lookup(input_ids, self.current, min(self.block_size - 1, room))
        return self.current

    def _prompt_lookup(self, input_ids, round: DraftRound, budget: int) -> torch.LongTensor | None:
        """Find the prompt-lookup continuation (at most ``budget`` tokens, what the block and max_length allow) into
        ``round.continuation``; return its first ``k`` tokens ``[1, k]`` when that is expected to commit more tokens
        per unit time than the drafter's choice this round (``round.num_drafts`` drafts, 0 = plain decoding), else
        None.

        Answers repeat the prompt's identifiers and phrases, which a drafter of a small target often misses. Both
        sources are judged by the same estimator (`DraftLengthController`): expected committed tokens over the cost
        of the round in plain rounds -- for lookup, the measured verify cost of lookup rounds of that size, bounded
        below by the largest measured smaller one until measured. Shadow rounds stay with the drafter: they exist to
        judge it (the continuation is still judged).
        """
        if self.lookup_rates is None:
            return None
        match = prompt_lookup_match(input_ids[0], self.lookup_ngram, budget)
        if match is None:
            return None
        round.continuation, round.match = match
        sizes, estimator = self.sizes, self.lookup_rates[round.match]
        if round.shadow or sizes.refreshing or 0 not in sizes.cost:  # a round for the drafter or the unit
            return None
        # Both estimates must agree: a lookup hit is often a lone word the answer shares with the prompt, after which
        # the fast estimate alone would propose, and lose, the next round; copying streaks convince both quickly.
        limit = round.continuation.shape[0]
        size = min(estimator.best(limit=limit), estimator.best(slow=True, limit=limit))
        if not size:
            return None
        drafter_rate = sizes.rate(round.num_drafts) if round.num_drafts else 1.0
        rate = min(estimator.rate(size), estimator.rate(size, slow=True))
        return round.continuation[None, :size] if rate > drafter_rate else None

    def record_verification(self, committed: torch.LongTensor) -> None:
        """The target committed ``committed [a + 1]`` this round: the current round's first ``a`` proposals, then its
        own token."""
        round = self.current
        if round is None:  # the prefill
            return
        accepted = committed.shape[0] - 1
        self.stats.record(round.proposed, accepted + 1)
        if round.continuation is not None:  # judged every round: proposed or not, looking up cost nothing
            judged = min(committed.shape[0], round.continuation.shape[0])
            matches = int((round.continuation[:judged] == committed[:judged]).long().cumprod(dim=0).sum())
            self.lookup_rates[round.match].record_acceptance(min(matches + 1, judged), matches)
        if round.lookup is None and self.sizes is not None and round.drafts is not None:
            judged = min(accepted + 1, round.drafts.shape[1])
            if accepted == round.proposed and judged > accepted:  # the target's own token judges draft k+1
                accepted += int(round.drafts[0, accepted] == committed[-1])
            self.sizes.record_acceptance(judged, accepted)



def prompt_lookup_match(tokens: torch.LongTensor, max_ngram: int, num_tokens: int) -> tuple[torch.LongTensor, int] | None:
    """Prompt lookup with the length of its match: ``(continuation [num_tokens], n)`` for the latest earlier
    occurrence of the last ``n`` tokens of ``tokens [n_ctx]``, longest ``n <= max_ngram`` first, or None.

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
            return followed.repeat(-(-num_tokens // followed.shape[0]))[:num_tokens], n
    return None
