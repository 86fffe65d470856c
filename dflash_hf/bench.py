"""Benchmark harness: plain greedy, prompt lookup, DFlash (dflash-hf and transformers' built-in) and an oracle,
interleaved prompt by prompt on one target, with a per-round phase budget and the CPU cost model.

Protocol (``docs``: landscape §5.3): every method sees the same target, prompts, dtype, threads and
``max_new_tokens``; for each prompt an untimed plain run gives the reference output, then every repeat runs all
methods in a rotated order. Each run records wall time, time to first token (streamer), new tokens, the rounds'
proposed/committed lengths and the time spent in each round phase:

* **verify**: target forwards after the prefill (forward pre/post hooks on the target);
* **draft**: drafter forwards plus the target ``lm_head`` called outside a target forward (for dflash-hf's
  generator: its `DFlashDraftHead` calls, head included, seen by forward hooks; they are counted too);
* **context**: the rest of the candidate generator's ``get_candidates`` (feeding target features, lookups);
* **glue**: the rest of the decode window (acceptance, cache crops, stopping criteria, streamer).

The report side (summary, Markdown, plots) lives in `dflash_hf.bench_report`.
"""

import os
import platform
import statistics
import time
import types
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.cache_utils import DynamicCache
from transformers.generation.streamers import BaseStreamer

from .bench_report import parting_text
from .generation_dflash import DFlashCandidateGenerator, DFlashDrafterMixin, sampling_options
from .loading import cpu_name, native_bf16

# dflash_nolookup: dflash without prompt lookup next to the drafter (the drafter alone, adaptive block size)
ALL_METHODS = ("greedy", "pld3", "pld10", "dflash", "dflash_nolookup", "dflash_builtin", "oracle")
VERIFY_KS = (1, 2, 4, 8, 16)


# ---------------------------------------------------------------------------------------------------------------
# Oracle: proposals are the reference continuation, so every draft is accepted and only verify + overhead is paid
# ---------------------------------------------------------------------------------------------------------------


class ReferenceHead(nn.Module):
    """The oracle's draft head: the ``num_drafts`` tokens of ``reference [1, total]`` from position ``start`` on."""

    def __init__(self, reference: torch.LongTensor):
        super().__init__()
        self.reference = reference

    def forward(self, start: int, num_drafts: int) -> torch.LongTensor:
        return self.reference[:, start : start + num_drafts]


class OracleCandidateGenerator(DFlashCandidateGenerator):
    """Proposes the true continuation instead of running the drafter: tau = B, cost = verify + overhead."""

    def __init__(self, *args, reference: torch.LongTensor, **kwargs):
        super().__init__(*args, **kwargs)
        self.draft_head = ReferenceHead(reference)  # a module call, so the profiler's draft hooks see it as ours

    def draft_block(self, input_ids, round):
        self.pending_context = []  # the features are collected as usual, but nothing consumes them
        return self.draft_head(input_ids.shape[1], round.num_drafts).to(input_ids.device), None


class OracleDrafter(DFlashDrafterMixin, nn.Module):
    """A weightless stand-in for ``drafter`` whose generator proposes ``reference`` (``[1, prompt + new]``)."""

    adaptive_block_size = False  # the ceiling is measured at the drafter's full block

    def __init__(self, drafter):
        super().__init__()
        self.config = drafter.config
        self.device, self.dtype = drafter.device, drafter.dtype
        self.reference: torch.LongTensor | None = None

    def make_candidate_generator(self, target, generation_config, input_ids, model_kwargs, target_tokenizer=None):
        return OracleCandidateGenerator(
            self, target, generation_config, input_ids, model_kwargs, target_tokenizer, reference=self.reference
        )


# ---------------------------------------------------------------------------------------------------------------
# Methods
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Method:
    """One decoding method: extra ``generate`` kwargs and the most tokens one round can commit (``block``)."""

    name: str
    generate_kwargs: dict = field(default_factory=dict)
    block: int = 1


def build_methods(drafter=None, names=ALL_METHODS, temperature: float = 0.0, block_size: int | None = None,
                  other_drafters: dict | None = None) -> list[Method]:
    """The methods in ``names`` (see `ALL_METHODS`); the DFlash ones need ``drafter``; no oracle when sampling.
    Each of ``other_drafters`` (``{name: drafter}``) adds a method ``dflash@name``: ``dflash`` with that drafter.

    ``block_size`` (at most the drafter's) runs ours and the oracle at smaller blocks through ``generate``'s
    ``num_assistant_tokens`` (the drafter is not changed); transformers' built-in generator always drafts the
    drafter's ``config.block_size``, so it is refused with another size.
    """
    if drafter is not None and block_size not in (None, drafter.config.block_size):
        if not 1 <= block_size <= drafter.config.block_size:
            raise ValueError(f"--block-size {block_size} is outside 1..{drafter.config.block_size} (the drafter's)")
        if "dflash_builtin" in names:
            raise ValueError("dflash_builtin always drafts the drafter's block_size: drop it or --block-size")
    block = drafter.config.block_size if block_size is None and drafter is not None else block_size
    methods = []
    for name in names:
        if name == "greedy":
            methods.append(Method(name))
        elif name.startswith("pld"):
            num = int(name[3:])
            methods.append(Method(name, {"prompt_lookup_num_tokens": num}, num + 1))
        elif name in ("dflash", "dflash_nolookup", "dflash_builtin", "oracle"):
            if drafter is None:
                raise ValueError(f"method {name!r} needs a DFlash drafter")
            if name == "oracle" and temperature > 0:
                continue  # the greedy continuation is no oracle for a sampled one
            kwargs = {
                "dflash": {"assistant_model": drafter},
                "dflash_nolookup": {"assistant_model": drafter, "max_matching_ngram_size": 0},
                "dflash_builtin": {"assistant_model": drafter, "speculation_type": "dflash"},
                "oracle": {"assistant_model": OracleDrafter(drafter)},
            }[name]
            adaptive = name in ("dflash", "dflash_nolookup") and drafter.adaptive_block_size
            methods.append(Method(name, kwargs | _block_kwargs(drafter, block, adaptive), block))
        else:
            raise ValueError(f"unknown method {name!r}; choose from {', '.join(ALL_METHODS)}")
    for name, other in (other_drafters or {}).items():
        if other.config.block_size < block:
            raise ValueError(f"drafter {name!r} drafts blocks of {other.config.block_size}, fewer than {block}: "
                             f"compare them at --block-size {other.config.block_size}")
        kwargs = {"assistant_model": other} | _block_kwargs(other, block, other.adaptive_block_size)
        methods.append(Method(f"dflash@{name}", kwargs, block))
    return methods


def _block_kwargs(drafter, block: int, adaptive: bool) -> dict:
    """``generate`` kwargs that draft blocks of ``block`` with ``drafter`` when that is not its own block size: per
    call, with the adaptive choice as the drafter's default says."""
    if block == drafter.config.block_size:
        return {}
    return {"num_assistant_tokens": block - 1, "num_assistant_tokens_schedule": "heuristic" if adaptive else "constant"}


# ---------------------------------------------------------------------------------------------------------------
# Instrumentation of one generate call
# ---------------------------------------------------------------------------------------------------------------


class TimingStreamer(BaseStreamer):
    """Records when the first generated tokens arrive (the first ``put`` is the prompt) and how many they were."""

    def __init__(self):
        self.puts = 0
        self.first_time: float | None = None
        self.first_tokens = 0

    def put(self, value):
        self.puts += 1
        if self.puts == 2:
            self.first_time = time.perf_counter()
            self.first_tokens = value.numel()

    def end(self):
        pass


@dataclass
class RunTrace:
    """What the hooks saw during one ``generate`` call (times in seconds)."""

    forwards: list[float] = field(default_factory=list)  # target forward durations; [0] is the prefill
    draft_s: float = 0.0
    draft_calls: int = 0  # dflash-hf's draft-head calls (one per round that ran the drafter)
    candidates_s: float = 0.0
    proposed: list[int] = field(default_factory=list)
    committed: list[int] = field(default_factory=list)


class PhaseProfiler:
    """Hooks on the target (forward, ``lm_head``), the drafters and dflash-hf's draft head, and wrappers on the
    candidate generator's public round calls.

    Installed once for a whole benchmark so that every method pays the same (microsecond) hook cost. The
    candidate generator is reached through an instance attribute shadowing ``target._get_candidate_generator``;
    each dflash-hf generator's `DFlashDraftHead` (``generator.draft_head``) gets the draft hooks when it is built.
    On a GPU every clock reading first waits for the queued kernels (``torch.cuda.synchronize``), so that a phase
    is charged for its own kernels rather than for the moment they were launched.
    """

    def __init__(self, target, *drafters):
        self.target, self.trace = target, RunTrace()
        self.sync = target.device.type == "cuda"
        self._in_verify = False
        self._handles = []
        self._hook(target, self._verify_start, self._verify_end)
        self._hook(target.get_output_embeddings(), self._draft_start, self._draft_end)
        for drafter in drafters:
            if drafter is not None:
                self._hook(drafter, self._draft_start, self._draft_end)
        self._draft_t0, self._draft_depth = 0.0, 0
        self._verify_t0 = 0.0

        def _get_candidate_generator(model, *args, **kwargs):  # the class's method, dispatch included, at call time
            return self._wrap_generator(type(model)._get_candidate_generator(model, *args, **kwargs))

        target._get_candidate_generator = types.MethodType(_get_candidate_generator, target)

    def _hook(self, module, start, end):
        self._handles.append(module.register_forward_pre_hook(lambda *_: start()))
        self._handles.append(module.register_forward_hook(lambda *_: end()))

    def clock(self) -> float:
        """``time.perf_counter()``, after the GPU's queued work has finished (see the class docstring)."""
        if self.sync:
            torch.cuda.synchronize()
        return time.perf_counter()

    def _verify_start(self):
        self._in_verify, self._verify_t0 = True, self.clock()

    def _verify_end(self):
        self.trace.forwards.append(self.clock() - self._verify_t0)
        self._in_verify = False

    def _draft_start(self):
        if not self._in_verify:  # nested draft scopes (the drafter inside the draft head) count once, outermost
            if self._draft_depth == 0:
                self._draft_t0 = self.clock()
            self._draft_depth += 1

    def _draft_end(self):
        if not self._in_verify and self._draft_depth > 0:
            self._draft_depth -= 1
            if self._draft_depth == 0:
                self.trace.draft_s += self.clock() - self._draft_t0

    def _wrap_generator(self, generator):
        """Time ``get_candidates`` and record each round's proposed and committed lengths."""
        get_candidates, update = generator.get_candidates, generator.update_candidate_strategy
        state = {"proposed": 0, "rounds": 0}

        def timed_get_candidates(input_ids, *args, **kwargs):
            t0 = self.clock()
            candidates, logits = get_candidates(input_ids, *args, **kwargs)
            self.trace.candidates_s += self.clock() - t0
            state["proposed"] = candidates.shape[1] - input_ids.shape[1]
            return candidates, logits

        def recorded_update(input_ids, scores, num_matches):
            state["rounds"] += 1
            if state["rounds"] > 1:  # the first round's forward is the prefill (plus drafts, for prompt lookup)
                self.trace.proposed.append(state["proposed"])
                self.trace.committed.append(int(num_matches) + 1)
            return update(input_ids, scores, num_matches)

        generator.get_candidates, generator.update_candidate_strategy = timed_get_candidates, recorded_update
        head = getattr(generator, "draft_head", None)
        if head is not None:  # dflash-hf's head may multiply by the lm_head weight directly: time the head call whole
            head.register_forward_pre_hook(lambda *_: self._draft_start())
            head.register_forward_hook(lambda *_: self._draft_called())
        return generator

    def _draft_called(self):
        self.trace.draft_calls += 1
        self._draft_end()

    def reset(self) -> RunTrace:
        self.trace, self._draft_depth, self._in_verify = RunTrace(), 0, False
        return self.trace

    def remove(self):
        for handle in self._handles:
            handle.remove()
        del self.target._get_candidate_generator


def run_once(target, method: Method, input_ids, max_new_tokens: int, profiler: PhaseProfiler, temperature=0.0,
             seed=0) -> tuple[dict, torch.LongTensor]:
    """One timed ``generate`` call -> (raw record, output ids ``[1, prompt + new]``)."""
    trace, streamer = profiler.reset(), TimingStreamer()
    torch.manual_seed(seed)
    t0 = profiler.clock()
    with torch.no_grad():
        output = target.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            streamer=streamer,
            **sampling_options(temperature),
            **method.generate_kwargs,
        )
    total = profiler.clock() - t0
    new_tokens = output.shape[1] - input_ids.shape[1]
    ttft = (streamer.first_time or time.perf_counter()) - t0
    decode_s = total - ttft
    verify_s = sum(trace.forwards[1:])
    context_s = trace.candidates_s - trace.draft_s
    greedy_like = not trace.committed and len(trace.forwards) > 1
    committed = [1] * (len(trace.forwards) - 1) if greedy_like else trace.committed
    record = {
        "method": method.name,
        "new_tokens": new_tokens,
        "total_s": total,
        "ttft_s": ttft,
        "decode_s": decode_s,
        "decode_tokens": new_tokens - streamer.first_tokens,
        "decode_tok_s": (new_tokens - streamer.first_tokens) / decode_s if decode_s > 0 else 0.0,
        "target_forwards": len(trace.forwards),
        "draft_forwards": trace.draft_calls,
        "proposed_lengths": trace.proposed if not greedy_like else [0] * len(committed),
        "acceptance_lengths": committed,
        "phases_s": {
            "prefill": trace.forwards[0] if trace.forwards else 0.0,
            "verify": verify_s,
            "draft": trace.draft_s,
            "context": context_s,
            "glue": max(decode_s - verify_s - trace.draft_s - context_s, 0.0),
        },
    }
    return record, output


def first_difference(output: torch.LongTensor, reference: torch.LongTensor, prompt_len: int) -> int | None:
    """Index (in generated tokens) of the first token where ``output`` differs from ``reference``; None if equal."""
    a, b = output[0, prompt_len:].tolist(), reference[0, prompt_len:].tolist()
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def divergence_margin(target, output: torch.LongTensor, reference: torch.LongTensor, prompt_len: int,
                      position: int, exact=None, neighbours: list[torch.LongTensor] | None = None) -> dict:
    """Why ``output`` parted from ``reference`` at generated index ``position``: is it a floating-point near-tie?

    ``exact`` is the target in float32 (default: ``target`` itself, which must then be float32). One forward of the
    reference prefix in each gives float32 logits and the target dtype's rounding error on them. Returns ``gap``
    (float32 logit of the reference token minus ours), ``error`` (the largest |dtype logit - float32 logit| among the
    reference token, ours and the float32 top token) and ``near_tie``: our token is at most 4 x ``error`` (at least 4
    float32 units) below the float32 top logit -- closer than the dtype can tell apart (two or more tokens), so a
    verify over several tokens and a one-token decode may round either way.
    ``neighbours`` (``[1, n_j]`` rows) are the rows a batch ran beside this one: the prefix then also runs left-padded
    among them, as a batched ``generate`` runs it, and ``error`` is the larger of the two forwards' (a batch's other
    kernel shapes round differently from one row's).
    Past the end of one output (one stopped earlier) there is nothing to compare: all None.
    """
    at = prompt_len + position
    if at >= output.shape[1] or at >= reference.shape[1]:
        return {"gap": None, "error": None, "near_tie": None}
    exact = target if exact is None else exact
    prefix = reference[:, :at]
    with torch.no_grad():
        logits = target(prefix).logits[0, -1].float()
        exact_logits = logits if exact is target else exact(prefix.to(exact.device)).logits[0, -1].float().cpu()
        in_dtype = [logits] if not neighbours else [logits, _logits_among(target, prefix, neighbours)]
    ours, theirs, top = int(output[0, at]), int(reference[0, at]), int(exact_logits.argmax())
    error = max(float((row[t] - exact_logits[t]).abs()) for row in in_dtype for t in (ours, theirs, top))
    floor = 4 * torch.finfo(torch.float32).eps * float(exact_logits[top].abs())
    behind = float(exact_logits[top] - exact_logits[ours])
    gap = float(exact_logits[theirs] - exact_logits[ours])
    return {"gap": gap, "error": error, "near_tie": behind <= max(4 * error, floor)}


def _logits_among(target, prefix: torch.LongTensor, neighbours: list[torch.LongTensor]) -> torch.Tensor:
    """The logits after ``prefix`` ``[1, n]`` when it runs left-padded among ``neighbours``, with the position ids a
    batched ``generate`` derives from the attention mask, as float32."""
    ids, mask = left_pad([prefix.cpu(), *(row.cpu() for row in neighbours)], pad_token_id=0)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, positions = (t.to(prefix.device) for t in (ids, mask, positions))
    return target(ids, attention_mask=mask, position_ids=positions).logits[0, -1].float()


def float32_twin(target):
    """A float32 copy of ``target`` without its hooks, for `divergence_margin` (the target itself if float32)."""
    if target.dtype == torch.float32:
        return target
    twin = type(target)(target.config).eval()
    twin.load_state_dict({name: tensor.float() for name, tensor in target.state_dict().items()})
    return twin.to(device=target.device, dtype=torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# The interleaved benchmark
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class BenchPrompt:
    """An encoded prompt: ``input_ids [1, n]`` of dataset ``dataset``."""

    dataset: str
    id: str
    input_ids: torch.LongTensor


def run_benchmark(target, prompts: list[BenchPrompt], methods: list[Method], drafter=None, max_new_tokens=128,
                  repeats=3, temperature=0.0, seed=0, warmup=True, progress=True, other_drafters=()) -> list[dict]:
    """Every prompt: an untimed plain reference run, then ``repeats`` x all methods in a rotated order
    (``other_drafters``: the drafters of ``dflash@name`` methods, hooked like ``drafter``).

    Returns the raw per-run records (see `run_once`), each with ``dataset``, ``prompt_id``, ``repeat``, ``slot``
    (position in that repeat's order), ``identical``, ``first_diff`` (against the reference) and, for a greedy run
    that parted, ``divergence`` (see `divergence_margin`).
    """
    from tqdm.auto import tqdm

    plain = Method("reference")
    exact = None  # the float32 twin for divergence margins, made at the first greedy divergence
    profiler = PhaseProfiler(target, drafter, *other_drafters)
    records = []
    try:
        if warmup and prompts:
            _warm_up(target, prompts[0], methods, profiler, min(max_new_tokens, 8), temperature, seed)
        bar = tqdm(total=len(prompts) * repeats * len(methods), disable=not progress, desc="bench", unit="run")
        for p, prompt in enumerate(prompts):
            _, reference = run_once(target, plain, prompt.input_ids, max_new_tokens, profiler, temperature, seed)
            _set_oracle_reference(target, methods, prompt.input_ids, reference, max_new_tokens, profiler)
            for r in range(repeats):
                shift = (p * repeats + r) % len(methods)
                for slot, method in enumerate(methods[shift:] + methods[:shift]):
                    bar.set_postfix_str(f"{prompt.dataset}/{method.name}")
                    record, output = run_once(target, method, prompt.input_ids, max_new_tokens, profiler,
                                              temperature, seed)
                    diff = first_difference(output, reference, prompt.input_ids.shape[1])
                    record.update(dataset=prompt.dataset, prompt_id=prompt.id, repeat=r, slot=slot,
                                  block=method.block, identical=diff is None, first_diff=diff)
                    if diff is not None and not temperature:
                        exact = exact or float32_twin(target)
                        record["divergence"] = divergence_margin(target, output, reference,
                                                                 prompt.input_ids.shape[1], diff, exact)
                    records.append(record)
                    bar.update()
        bar.close()
    finally:
        profiler.remove()
    return records


def _warm_up(target, prompt, methods, profiler, max_new_tokens, temperature, seed):
    """One short untimed run of every method (allocator, kernels, lazy imports)."""
    _, reference = run_once(target, Method("reference"), prompt.input_ids, max_new_tokens, profiler, temperature, seed)
    _set_oracle_reference(target, methods, prompt.input_ids, reference, max_new_tokens, profiler)
    for method in methods:
        run_once(target, method, prompt.input_ids, max_new_tokens, profiler, temperature, seed)


def _set_oracle_reference(target, methods, prompt_ids, reference, max_new_tokens, profiler, attempts=4):
    """Give the oracle the continuation it will itself commit (untimed runs).

    In fp32 that is the greedy reference. In bf16 a verify over B tokens and a one-token decode may round a near-tie
    differently, and after such a parting every proposal from the reference would be rejected. So the oracle's own
    output becomes its reference until a run reproduces it (same proposals -> same verify shapes -> same numerics),
    at most ``attempts`` runs.
    """
    for method in methods:
        oracle = method.generate_kwargs.get("assistant_model")
        if not isinstance(oracle, OracleDrafter):
            continue
        oracle.reference = reference
        for _ in range(attempts):
            _, output = run_once(target, method, prompt_ids, max_new_tokens, profiler)
            if torch.equal(output, oracle.reference):
                break
            oracle.reference = output


# ---------------------------------------------------------------------------------------------------------------
# The cost model: r(k) on a cached context
# ---------------------------------------------------------------------------------------------------------------


def measure_verify_curve(target, ks=VERIFY_KS, context_len=256, repeats=7, seed=0) -> dict:
    """Time target forwards of ``k`` new tokens on a cached ``context_len``-token context, ``k`` interleaved.

    Returns ``{"context_len", "t_s": {k: [times]}, "median_s": {k: s}, "r": {k: median(k) / median(1)}}``.
    Each forward passes an attention mask and asks for ``k`` logits, as a verify round in ``generate`` does; the
    cache is cropped back after each one. DFlash verify rounds also return the target's hidden states at the
    drafter's layers; that extra is not part of this curve (compare ``r_in_run`` in the summary).
    """
    ks = sorted(set(ks) | {1})
    vocab = target.config.get_text_config().vocab_size
    generator = torch.Generator().manual_seed(seed)
    context = torch.randint(0, vocab, (1, context_len), generator=generator)
    cache = DynamicCache()
    times: dict[int, list[float]] = {k: [] for k in ks}
    with torch.no_grad():
        target(input_ids=context, past_key_values=cache, use_cache=True, logits_to_keep=1)
        for r in range(repeats + 1):  # the first pass is a warm-up
            for k in ks[r % len(ks):] + ks[: r % len(ks)]:
                new = torch.randint(0, vocab, (1, k), generator=generator)
                positions = torch.arange(context_len, context_len + k)
                t0 = time.perf_counter()
                target(input_ids=new, past_key_values=cache, use_cache=True, logits_to_keep=k,
                       attention_mask=torch.ones(1, context_len + k, dtype=torch.long),
                       cache_position=positions, position_ids=positions[None])
                elapsed = time.perf_counter() - t0
                cache.crop(-k)
                if r > 0:
                    times[k].append(elapsed)
    medians = {k: statistics.median(v) for k, v in times.items()}
    return {"context_len": context_len, "t_s": times, "median_s": medians,
            "r": {k: medians[k] / medians[1] for k in ks}}


def run_suite(target, prompts: list[BenchPrompt], drafter=None, methods=ALL_METHODS, max_new_tokens=128, repeats=3,
              temperature=0.0, seed=0, context_len=256, verify_repeats=7, config=None, progress=True,
              block_size=None, other_drafters: dict | None = None) -> dict:
    """The whole benchmark: interleaved runs, then r(k) for ``k`` in `VERIFY_KS` and every method's block.
    ``other_drafters`` (``{name: drafter}``) run as methods ``dflash@name`` (`build_methods`).

    Returns ``{"config", "machine", "verify_curve", "runs", "summary"}``, ready for `bench_report.write_report`.
    """
    from .bench_report import summarize

    method_list = build_methods(drafter, methods, temperature, block_size, other_drafters)
    machine = machine_info(target.dtype)  # load average before the run
    runs = run_benchmark(target, prompts, method_list, drafter, max_new_tokens, repeats, temperature, seed,
                         progress=progress, other_drafters=list((other_drafters or {}).values()))
    ks = sorted(set(VERIFY_KS) | {m.block for m in method_list})
    curve = measure_verify_curve(target, ks, context_len, verify_repeats, seed)
    machine["loadavg_after"] = machine_info(target.dtype)["loadavg"]
    config = dict(config or {}, methods=[m.name for m in method_list], max_new_tokens=max_new_tokens,
                  repeats=repeats, temperature=temperature, seed=seed, num_prompts=len(prompts),
                  datasets=list(dict.fromkeys(p.dataset for p in prompts)))
    return {"config": config, "machine": machine, "verify_curve": curve, "runs": runs,
            "summary": summarize(runs, curve)}


# ---------------------------------------------------------------------------------------------------------------
# Batches: throughput of the whole batch, plain batched greedy vs DFlash (``bench --batch-size N``)
# ---------------------------------------------------------------------------------------------------------------


def left_pad(rows: list[torch.LongTensor], pad_token_id: int) -> tuple[torch.LongTensor, torch.LongTensor]:
    """``[1, n_i]`` prompts -> ``(input_ids [b, max n], attention_mask)``, left-padded as
    ``tokenizer(..., padding=True, padding_side="left")`` does."""
    width = max(row.shape[-1] for row in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, width - row.shape[-1] :], mask[i, width - row.shape[-1] :] = row.reshape(-1), 1
    return ids, mask


def generated_tokens(output: torch.LongTensor, prompt_width: int, eos_ids) -> int:
    """New tokens of every row of ``output``, each up to and including its first EOS (the padding after it is not
    generated)."""
    total = 0
    for row in output[:, prompt_width:]:
        stops = torch.isin(row, torch.as_tensor(eos_ids)).nonzero() if eos_ids else torch.empty(0)
        total += int(stops[0]) + 1 if len(stops) else row.shape[0]
    return total


def run_batch_benchmark(target, prompts: list[BenchPrompt], drafter, batch_size: int, max_new_tokens=128, repeats=1,
                        pad_token_id=0, generate_kwargs=None, progress=True) -> dict:
    """Tokens per second of the whole batch, plain batched greedy vs DFlash on the same left-padded batches of
    ``batch_size`` consecutive prompts, interleaved (order rotated per repeat, one untimed warm-up call each).

    Returns ``{"batch_size", "runs": [...], "summary": {method: {"tokens", "seconds", "tok_s", "cpu_seconds",
    "cpu_tok_s"}, "speedup", "cpu_speedup", "rows_equal", "rows", "tau", "rounds", "drafted_rounds"}, "partings":
    [...]}``; DFlash's runs carry `round_counts` too, and the summary their sums. ``rows_equal`` counts
    DFlash rows identical to plain batched greedy's, and ``partings`` says where each other row parted from it (greedy
    only: ``{"group", "prompt_id", "position", "gap", "error", "near_tie"}``, `divergence_margin` on the row without
    its padding). ``cpu_*`` use the process's CPU time, which a busy neighbour on the same core distorts less than
    wall time.
    """
    eos = target.generation_config.eos_token_id
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    options = dict(max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad_token_id)
    methods = {"greedy": {}, "dflash": dict(assistant_model=drafter, **(generate_kwargs or {}))}
    groups = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    runs, rows_equal, rows, partings = [], 0, 0, []
    warm, exact = False, None
    for index, group in enumerate(groups):
        ids, mask = left_pad([p.input_ids for p in group], pad_token_id)
        if not warm:
            for kwargs in methods.values():
                with torch.no_grad():
                    target.generate(ids, attention_mask=mask, **dict(options, max_new_tokens=4), **kwargs)
            warm = True
        outputs = {}
        for repeat in range(repeats):
            names = list(methods)
            names = names[(index + repeat) % 2 :] + names[: (index + repeat) % 2]
            for name in names:
                start, cpu_start = time.perf_counter(), time.process_time()
                with torch.no_grad():
                    output = target.generate(ids, attention_mask=mask, **options, **methods[name])
                seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
                outputs[name] = output
                tokens = generated_tokens(output, ids.shape[1], eos_ids)
                runs.append({"group": index, "repeat": repeat, "method": name, "tokens": tokens, "seconds": seconds,
                             "cpu_seconds": cpu_seconds})
                if name == "dflash":
                    runs[-1].update(round_counts(drafter.last_stats))
        width = ids.shape[1]
        n = min(outputs["greedy"].shape[1], outputs["dflash"].shape[1]) - width
        plain, ours = outputs["greedy"][:, width : width + n], outputs["dflash"][:, width : width + n]
        for i, prompt in enumerate(group):
            rows += 1
            start = prompt.input_ids.shape[1]  # each row without its left padding, as it would run alone
            prompt_ids = prompt.input_ids.to(plain.device)
            reference = torch.cat([prompt_ids, plain[i : i + 1]], dim=-1)
            output = torch.cat([prompt_ids, ours[i : i + 1]], dim=-1)
            position = first_difference(output, reference, start)
            rows_equal += position is None
            if position is not None and not options["do_sample"]:
                exact = exact or float32_twin(target)
                neighbours = [torch.cat([other.input_ids.to(plain.device), plain[j : j + 1, :position]], dim=-1)
                              for j, other in enumerate(group) if j != i]
                margin = divergence_margin(target, output, reference, start, position, exact, neighbours)
                partings.append({"group": index, "prompt_id": prompt.id, "position": position, **margin})
        if progress:
            print(f"batch {index + 1}/{len(groups)} done", flush=True)
    summary = {}
    for name in methods:
        tokens = sum(r["tokens"] for r in runs if r["method"] == name)
        seconds = sum(r["seconds"] for r in runs if r["method"] == name)
        cpu = sum(r["cpu_seconds"] for r in runs if r["method"] == name)
        summary[name] = {"tokens": tokens, "seconds": seconds, "tok_s": tokens / seconds if seconds else 0.0,
                         "cpu_seconds": cpu, "cpu_tok_s": tokens / cpu if cpu else 0.0}
    for key, rate in (("speedup", "tok_s"), ("cpu_speedup", "cpu_tok_s")):
        base = summary["greedy"][rate]
        summary[key] = summary["dflash"][rate] / base if base else 0.0
    ours = [r for r in runs if r["method"] == "dflash"]
    summary.update(rows_equal=rows_equal, rows=rows, tau=statistics.fmean(r["tau"] for r in ours) if ours else 0.0,
                   rounds=sum(r["rounds"] for r in ours), drafted_rounds=sum(r["drafted_rounds"] for r in ours))
    return {"batch_size": batch_size, "max_new_tokens": max_new_tokens, "repeats": repeats, "runs": runs,
            "summary": summary, "partings": partings, "machine": machine_info(target.dtype)}


def round_counts(stats) -> dict:
    """``{"rounds", "drafted_rounds", "tau"}`` of one DFlash ``generate`` call: its verify forwards (of the whole
    batch) and how many of them verified drafts; a batch of one runs the single-sequence path (`DFlashStats`)."""
    if hasattr(stats, "num_batch_rounds"):
        rounds, drafted = stats.num_batch_rounds, stats.num_drafted_batch_rounds
    else:
        rounds, drafted = stats.num_rounds, sum(proposed > 0 for proposed in stats.proposed_lengths)
    return {"rounds": rounds, "drafted_rounds": drafted, "tau": stats.mean_acceptance_length}


def batch_report(result: dict) -> str:
    """A Markdown table of `run_batch_benchmark`'s summary."""
    s = result["summary"]
    lines = [
        f"batch size {result['batch_size']}, {result['max_new_tokens']} new tokens, {result['repeats']} repeat(s), "
        f"{s['rows']} rows ({s['rows_equal']} identical to plain batched greedy), tau {s['tau']:.2f}",
        "",
        "| method | tokens | seconds | tokens/s | CPU seconds | tokens per CPU second |",
        "|---|---|---|---|---|---|",
        *(f"| {m} | {s[m]['tokens']} | {s[m]['seconds']:.2f} | {s[m]['tok_s']:.1f} | {s[m]['cpu_seconds']:.2f} | "
          f"{s[m]['cpu_tok_s']:.1f} |" for m in ("greedy", "dflash")),
        "",
        f"speedup (DFlash / plain batched greedy): {s['speedup']:.2f}x wall, {s['cpu_speedup']:.2f}x CPU time",
        "",
        f"DFlash verified drafts in {s['drafted_rounds']} of its {s['rounds']} rounds (the others decoded plainly)",
    ]
    if result.get("partings"):
        lines += ["", "Rows that parted from plain batched greedy (generated index; float32 logit gap, reference "
                      "token - ours, and the dtype's error there; near-tie = within 4 x error of the float32 top "
                      "logit): " + "; ".join(map(parting_text, result["partings"]))]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------------
# Machine
# ---------------------------------------------------------------------------------------------------------------


def machine_info(dtype) -> dict:
    """CPU model, cores, torch threads, dtype, library versions and the load average (1/5/15 min)."""
    import transformers

    cpu = cpu_name()
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {
        "cpu": cpu,
        # what decides a CPU's speed here: the vector unit torch dispatches to and whether bf16 is native
        "isa": torch.backends.cpu.get_cpu_capability(),
        "native_bf16": native_bf16("cpu"),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "dtype": str(dtype).replace("torch.", ""),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "loadavg": load,
    }
