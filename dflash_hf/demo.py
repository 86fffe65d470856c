"""``dflash-hf generate``: stream one answer with DFlash, report speed and acceptance, optionally against plain
decoding with the same settings."""

import time

import torch
from transformers import TextStreamer

from .assets import encode_chat
from .loading import load_drafter, load_target


def _timed_generate(target, inputs, streamer=None, **options):
    start = time.perf_counter()
    with torch.inference_mode():
        out = target.generate(**inputs, streamer=streamer, **options)
    return out, time.perf_counter() - start


def run_generate(args) -> None:
    torch.set_num_threads(args.threads)
    target, tokenizer = load_target(args.target, args.dtype)
    drafter = load_drafter(args.draft, target)
    if drafter is None:
        print("No drafter: the default drafter for this target is not shipped yet (pass --draft DIR); "
              "running plain generation.")
    inputs = encode_chat(tokenizer, args.prompt, chat=args.chat)
    options = dict(max_new_tokens=args.max_new_tokens, pad_token_id=tokenizer.eos_token_id)
    options |= dict(do_sample=True, temperature=args.temperature) if args.temperature > 0 else dict(do_sample=False)
    if drafter is not None:
        options["assistant_model"] = drafter

    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out, seconds = _timed_generate(target, inputs, streamer, **options)
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    print(f"\n{new_tokens} tokens in {seconds:.2f} s: {new_tokens / seconds:.1f} tokens/s")
    if drafter is not None:
        stats = drafter.last_stats
        print(f"mean acceptance length (tau): {stats.mean_acceptance_length:.2f} over {stats.num_rounds} rounds")
        print("acceptance histogram (tokens committed per round: rounds): "
              + ", ".join(f"{n}: {c}" for n, c in enumerate(stats.histogram) if c))
    if args.compare:
        # Like with like: the same options without the drafter (sampled against sampled, greedy against greedy).
        options.pop("assistant_model", None)
        plain, plain_seconds = _timed_generate(target, inputs, **options)
        plain_tokens = plain.shape[1] - inputs["input_ids"].shape[1]
        mode = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature:g}"
        # Greedy DFlash is lossless token for token; two samples agree only in distribution, so no token check.
        same = f"identical outputs: {torch.equal(out, plain)}" if args.temperature == 0 else (
            "outputs are independent samples of the same distribution")
        print(f"plain decoding ({mode}): {plain_tokens / plain_seconds:.1f} tokens/s; "
              f"speedup {(new_tokens / seconds) / (plain_tokens / plain_seconds):.2f}x; {same}")
