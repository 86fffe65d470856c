"""``dflash-hf generate``: stream one answer with DFlash, report speed and acceptance, optionally against plain decoding.

``--compare`` warms both paths up, then times them interleaved (plain, DFlash, plain, DFlash, ...) and reports
medians, so neither side pays for a cold start or for a burst of load on the other core. When the two outputs part,
it says where and why: in bf16 a floating-point near-tie (the float32 logits of the two tokens are closer than bf16
can tell apart) is the expected, harmless cause; anything else is a bug.
"""

import statistics
import time

import torch
from transformers import TextStreamer

from .assets import encode_chat
from .bench import divergence_margin, first_difference, float32_twin
from .generation_dflash import sampling_options
from .loading import load_drafter, load_target, resolve_dtype


def _timed_generate(target, inputs, streamer=None, **options):
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(**inputs, streamer=streamer, **options)
    return out, time.perf_counter() - start


def held_out_prompts() -> list[tuple[str, str]]:
    """``(id, text)`` of the first prompt of each held-out bench set (`bench_cli.DATASETS`: GSM8K from 1000,
    HumanEval, MT-Bench): math, code and chat that no drafter shipped here was trained on. A fixed rule, not a pick."""
    from .bench_cli import DATASETS, dataset_records

    return [(str(record["id"]), record["turns"][0]) for _, record in dataset_records(DATASETS, 1)]


def run_generate(args) -> None:
    torch.set_num_threads(args.threads)
    prompts = held_out_prompts() if args.held_out else [(None, args.prompt)]
    dtype, why = resolve_dtype(args.dtype)
    print(f"dtype: {dtype} ({why})")
    target, tokenizer = load_target(args.target, dtype)
    drafter = load_drafter(args.draft, target)
    if drafter is None:
        print("No drafter: the default drafter for this target is not shipped yet (pass --draft DIR); "
              "running plain generation.")
    results = [generate_one(args, target, tokenizer, drafter, text, label) for label, text in prompts]
    if len(results) > 1 and args.compare and drafter is not None:
        print(summarize(results))


def generate_one(args, target, tokenizer, drafter, text: str, label: str | None = None) -> dict | None:
    """Stream one answer with DFlash and print its speed and acceptance; with ``--compare``, time it against plain
    decoding (`compare`) and return that comparison."""
    inputs = encode_chat(tokenizer, text, chat=args.chat)
    options = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    options |= sampling_options(args.temperature)
    print(f"prompt{f' ({label})' if label else ''}: {text}\n")

    if args.compare and drafter is not None:  # warm-up: first calls pay for kernel selection and allocations
        warm = options | dict(max_new_tokens=min(16, args.max_new_tokens))
        _timed_generate(target, inputs, **warm)
        _timed_generate(target, inputs, assistant_model=drafter, **warm)
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    dflash_options = options | ({"assistant_model": drafter} if drafter is not None else {})
    if args.temperature > 0:
        torch.manual_seed(args.seed)
    out, seconds = _timed_generate(target, inputs, streamer, **dflash_options)
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    print(f"\n{new_tokens} tokens in {seconds:.2f} s: {new_tokens / seconds:.1f} tokens/s")
    if drafter is None:
        return None
    stats = drafter.last_stats
    print(f"mean acceptance length (tau): {stats.mean_acceptance_length:.2f} over {stats.num_rounds} rounds")
    print("acceptance histogram (tokens committed per round: rounds): "
          + ", ".join(f"{n}: {c}" for n, c in enumerate(stats.histogram) if c))
    if not args.compare:
        return None
    result = compare(target, tokenizer, inputs, options, drafter, out, runs=args.compare_runs, seed=args.seed)
    print()
    return result | {"label": label}


def summarize(results: list[dict]) -> str:
    """One line over several compared prompts: the speedup on the time both paths take for all the answers (each
    answer's tokens at each path's median tokens/s), the per-prompt speedups, and (greedy) how many outputs were
    identical."""
    plain = sum(r["new_tokens"] / r["plain_tokens_per_s"] for r in results)
    dflash = sum(r["new_tokens"] / r["dflash_tokens_per_s"] for r in results)
    each = ", ".join(f"{r['label']} {r['dflash_tokens_per_s'] / r['plain_tokens_per_s']:.2f}x" for r in results)
    line = f"over {len(results)} held-out prompts: speedup {plain / dflash:.2f}x on the total time ({each})"
    if any(r["sampled"] for r in results):  # sampled texts differ by design
        return line
    return f"{line}; identical outputs: {sum(r['first_difference'] is None for r in results)} of {len(results)}"


def compare(target, tokenizer, inputs, options: dict, drafter, dflash_out, runs: int = 2, seed: int = 0) -> dict:
    """Time plain decoding and DFlash interleaved (``runs`` each, after the streamed run), print medians and whether
    the outputs are identical; explain a greedy parting with the float32 logit gap. Sampled runs of both paths use
    the same seed (the outputs then differ by design: the drafter changes how random numbers are consumed)."""
    plain_times, dflash_times, plain = [], [], None  # tokens/s of each run
    for _ in range(runs):
        for name, extra, times in (("plain", {}, plain_times), ("dflash", {"assistant_model": drafter}, dflash_times)):
            torch.manual_seed(seed)
            out, seconds = _timed_generate(target, inputs, **options, **extra)
            times.append((out.shape[1] - inputs["input_ids"].shape[1]) / seconds)
            if name == "plain":
                plain = out
    plain_rate, dflash_rate = statistics.median(plain_times), statistics.median(dflash_times)
    kind = "sampled" if options.get("do_sample") else "greedy"
    print(f"plain {kind}: {plain_rate:.1f} tokens/s; DFlash: {dflash_rate:.1f} tokens/s (medians of {runs} "
          f"interleaved runs each); speedup {dflash_rate / plain_rate:.2f}x")
    prompt_len = inputs["input_ids"].shape[1]
    position = first_difference(dflash_out, plain, prompt_len)
    if options.get("do_sample"):
        print("sampling: both paths draw from the target's distribution; their texts differ by design")
    elif position is None:
        print("identical outputs: True")
    else:
        print(explain_parting(target, tokenizer, dflash_out, plain, prompt_len, position))
    return {"plain_tokens_per_s": plain_rate, "dflash_tokens_per_s": dflash_rate,
            "new_tokens": plain.shape[1] - prompt_len, "first_difference": position, "sampled": kind == "sampled"}


def explain_parting(target, tokenizer, dflash_out, plain, prompt_len: int, position: int) -> str:
    """One line: where greedy DFlash and plain decoding part, both tokens, and the float32 logit gap against the
    dtype's measured error there (a near-tie is rounding, not a bug)."""
    at = prompt_len + position
    if at >= dflash_out.shape[1] or at >= plain.shape[1]:
        return f"identical outputs: False (one stops at token {position}, the other goes on)"
    ours, theirs = (tokenizer.decode([int(t[0, at])]) for t in (dflash_out, plain))
    margin = divergence_margin(target, dflash_out, plain, prompt_len, position, exact=float32_twin(target))
    head = f"identical outputs: False: they part at token {position} (DFlash {ours!r}, plain {theirs!r})"
    if target.dtype == torch.float32:
        return f"{head}: NOT expected in float32 -- please report it"
    if margin["near_tie"]:
        # `divergence_margin`'s rule: our token within 4 x the dtype's error of the float32 top logit.
        return (f"{head}: a {target.dtype} near-tie: float32 logit gap {abs(margin['gap']):.3f}, within 4 x the "
                f"dtype's error {margin['error']:.3f} there; identical in float32")
    return (f"{head}: float32 gap {abs(margin['gap']):.3f}, more than 4 x the dtype's error {margin['error']:.3f}: "
            "NOT a near-tie -- please report it")
