"""Randomized losslessness: seeded cases over tiny targets and drafters, each a one-line reproducer.

Every case is drawn from ``random.Random(seed)`` alone, so ``scripts/fuzz.sh --case SEED`` replays it exactly. A case
builds a random tiny target (Qwen3 or Llama; hidden 32-64, 2-4 layers, eager or SDPA, float32) and a random drafter
(1-3 layers, target layer ids anywhere in range and in any order, block size 1-16, sliding-window layers, eager or
SDPA, adaptive block size on or off), a prompt of 1-300 tokens and ``max_new_tokens`` of 1-200, and optionally:

* an EOS token taken from the target's own continuation (inside a block, or the last allowed token);
* a stop string taken from the continuation (character tokenizer of `conftest.char_tokenizer`);
* forced acceptance: the drafter proposes the target's continuation, corrupted at a random slot per round
  (`oracle.pin`), so rounds with full, partial and zero acceptance all occur;
* sampling instead of greedy (random temperature / top-k / top-p).

Greedy cases must equal plain greedy token for token; sampling cases must give the same tokens twice under the same
seed (that sampling follows the target's distribution is tested statistically in ``tests/test_sampling.py``).

    python tests/fuzz.py 500              # cases 0..499
    python tests/fuzz.py 500 --start 7000 # cases 7000..7499
    python tests/fuzz.py --case 1234      # replay one case, printing its parameters
    python tests/fuzz.py 10000 --seconds 1500  # as many as fit in 25 minutes
"""

import argparse
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402
from conftest import VOCAB, char_tokenizer  # noqa: E402  (pins torch to one thread, offline hub)
from oracle import pin  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dflash_hf import DFlashConfig, DFlashDraftModel  # noqa: E402

REPRODUCER = "scripts/fuzz.sh --case {seed}"
_TOKENIZER = None


def draw_case(seed: int) -> dict:
    """All parameters of case ``seed`` (plain Python values, printable)."""
    rng = random.Random(seed)
    heads = rng.choice([2, 4])
    hidden = rng.choice([32, 48, 64]) if heads == 2 else rng.choice([32, 64])
    target_layers = rng.randint(2, 4)
    draft_layers = rng.randint(1, 3)
    block_size = rng.choice([1, 2, 3, 4, 8, 16]) if rng.random() < 0.5 else rng.randint(1, 16)
    stop_mode = rng.choices(["none", "eos_inside", "eos_last", "stop_string"], weights=[5, 2, 1, 2])[0]
    sliding = rng.random() < 0.3
    return dict(
        seed=seed,
        arch=rng.choice(["qwen3", "llama"]),
        hidden=hidden,
        heads=heads,
        kv_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
        target_layers=target_layers,
        vocab=VOCAB if stop_mode == "stop_string" else rng.randint(16, 200),
        target_attn=rng.choice(["eager", "sdpa"]),
        draft_attn=rng.choice(["eager", "sdpa"]),
        draft_layers=draft_layers,
        layer_ids=[rng.randrange(target_layers) for _ in range(rng.randint(1, 3))],
        block_size=block_size,
        sliding_window=rng.randint(1, 24) if sliding else None,
        layer_types=[rng.choice(["full_attention", "sliding_attention"]) if sliding else "full_attention"
                     for _ in range(draft_layers)],
        adaptive=rng.random() < 0.4,
        prompt_len=rng.randint(1, 300) if rng.random() < 0.3 else rng.randint(1, 40),
        max_new_tokens=min(200, int(2 ** rng.uniform(0, 7.7))),  # log-uniform 1..200: short runs are cheap
        stop_mode=stop_mode,
        stop_at=rng.random(),  # where in the continuation the EOS / stop string is taken from
        stop_len=rng.randint(1, 3),
        pinned=rng.random() < 0.5,
        sample=rng.random() < 0.15,
        temperature=round(rng.uniform(0.3, 1.5), 2),
        top_k=rng.choice([None, 0, 5, 20]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5]),
        weights_seed=rng.randrange(2**31),
    )


def build(case: dict):
    """Target, drafter and prompt of a case."""
    torch.manual_seed(case["weights_seed"])
    hidden, heads = case["hidden"], case["heads"]
    common = dict(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=case["target_layers"],
                  num_attention_heads=heads, num_key_value_heads=case["kv_heads"], head_dim=hidden // heads,
                  vocab_size=case["vocab"], max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                  pad_token_id=0, tie_word_embeddings=case["arch"] == "llama")
    config = Qwen3Config(**common) if case["arch"] == "qwen3" else LlamaConfig(**common)
    config._attn_implementation = case["target_attn"]
    target = (Qwen3ForCausalLM if case["arch"] == "qwen3" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():  # clear winners: fp32 greedy must not hinge on near-ties between batched and single steps
        target.get_output_embeddings().weight.mul_(8.0)
    target.generation_config.eos_token_id = None
    target.generation_config.pad_token_id = 0

    overrides = dict(layer_types=case["layer_types"])
    if case["sliding_window"] is not None:
        overrides["sliding_window"] = case["sliding_window"]
    draft_config = DFlashConfig.from_target_config(
        target.config, mask_token_id=(case["weights_seed"] >> 3) % case["vocab"], num_hidden_layers=case["draft_layers"],
        block_size=case["block_size"], target_layer_ids=case["layer_ids"], **overrides,
    )
    draft_config._attn_implementation = case["draft_attn"]
    drafter = DFlashDraftModel(draft_config).eval()
    drafter.adaptive_block_size = case["adaptive"]
    generator = torch.Generator().manual_seed(case["weights_seed"])
    prompt = torch.randint(1, case["vocab"], (1, case["prompt_len"]), generator=generator)
    return target, drafter, prompt


def tokenizer():
    global _TOKENIZER
    if _TOKENIZER is None:
        _TOKENIZER = char_tokenizer()
    return _TOKENIZER


def stopping(case: dict, continuation: torch.LongTensor, prompt_len: int) -> dict:
    """EOS / stop-string options taken from the target's own continuation (a token it really emits)."""
    generated = continuation[0, prompt_len:]
    if case["stop_mode"] == "none" or len(generated) == 0:
        return {}
    if case["stop_mode"] == "eos_last":
        return {"eos_token_id": int(generated[-1])}
    position = int(case["stop_at"] * len(generated))
    if case["stop_mode"] == "eos_inside":
        return {"eos_token_id": int(generated[position])}
    text = tokenizer().decode(generated[position : position + case["stop_len"]])
    return {"stop_strings": [text], "tokenizer": tokenizer()} if text.strip() else {}


def plain_with_eos(continuation: torch.LongTensor, prompt_len: int, eos: int) -> torch.LongTensor:
    """Plain greedy semantics of an EOS: the continuation up to and including its first EOS."""
    hits = (continuation[0, prompt_len:] == eos).nonzero()
    return continuation if len(hits) == 0 else continuation[:, : prompt_len + int(hits[0]) + 1]


def pinned_cuts(case: dict):
    """Per round, the slot whose draft is corrupted (``n`` = none): a seeded mix of full, zero and partial."""
    rng = random.Random(case["seed"] * 31 + 7)
    return lambda round_index, n: rng.choice([n, n, 0, rng.randint(0, n)])


@torch.no_grad()
def run_case(case: dict) -> None:
    """Raise AssertionError describing the first difference; return None when the case holds."""
    target, drafter, prompt = build(case)
    n = case["max_new_tokens"]
    prompt_len = prompt.shape[1]
    continuation = target.generate(prompt, max_new_tokens=n, do_sample=False)
    options = stopping(case, continuation, prompt_len)

    def speculative(**generate_options):
        if case["pinned"]:  # the same pinned rounds for every call
            pin(drafter, continuation, pinned_cuts(case))
        return target.generate(prompt, max_new_tokens=n, assistant_model=drafter, **generate_options, **options)

    if case["sample"]:
        sampling = dict(do_sample=True, temperature=case["temperature"], top_k=case["top_k"], top_p=case["top_p"])
        torch.manual_seed(case["seed"])
        first = speculative(**sampling)
        torch.manual_seed(case["seed"])
        second = speculative(**sampling)
        # The adaptive block size follows measured round times, and every proposed position draws from the RNG:
        # only fixed block sizes replay a seed exactly.
        if not case["adaptive"]:
            assert torch.equal(first, second), "sampling under one seed gave two different outputs"
        assert prompt_len < first.shape[1] <= prompt_len + n, f"sampled {first.shape[1] - prompt_len} tokens"
        return

    if "eos_token_id" in options:
        expected = plain_with_eos(continuation, prompt_len, options["eos_token_id"])
    elif options:
        expected = target.generate(prompt, max_new_tokens=n, do_sample=False, **options)
    else:
        expected = continuation
    out = speculative(do_sample=False)
    if not torch.equal(out, expected):
        raise AssertionError(describe_difference(target, out, expected, prompt_len))
    stats = drafter.last_stats
    assert all(1 <= a <= case["block_size"] for a in stats.acceptance_lengths), stats.acceptance_lengths
    assert sum(stats.acceptance_lengths) + 1 == out.shape[1] - prompt_len, "rounds do not add up to the output"


def describe_difference(target, out, expected, prompt_len) -> str:
    """Where the outputs part, and the target's top-2 logit margin there (a near-tie would be numerical)."""
    length = min(out.shape[1], expected.shape[1])
    differ = (out[0, :length] != expected[0, :length]).nonzero()
    if len(differ) == 0:
        return f"lengths differ: got {out.shape[1] - prompt_len} new tokens, plain greedy {expected.shape[1] - prompt_len}"
    position = int(differ[0])
    logits = target(expected[:, :position]).logits[0, -1]
    top = logits.topk(2).values
    return (f"token {position - prompt_len} differs: got {int(out[0, position])}, plain greedy "
            f"{int(expected[0, position])} (target's top-2 margin there {float(top[0] - top[1]):.2e})")


def check(seed: int) -> str | None:
    """None when case ``seed`` holds, else a one-line failure with its reproducer."""
    try:
        run_case(draw_case(seed))
    except Exception as error:  # noqa: BLE001 - any exception is a finding, reported with its reproducer
        message = str(error).splitlines()[0] if str(error) else ""
        return f"FAIL {REPRODUCER.format(seed=seed)}  # {type(error).__name__}: {message}"
    return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("count", nargs="?", type=int, default=100, help="number of cases")
    parser.add_argument("--start", type=int, default=0, help="seed of the first case")
    parser.add_argument("--case", type=int, help="replay one case verbosely")
    parser.add_argument("--seconds", type=float, help="stop after this much time (the summary counts what ran)")
    args = parser.parse_args(argv)
    if args.case is not None:
        case = draw_case(args.case)
        print(case)
        try:
            run_case(case)
        except Exception:
            traceback.print_exc()
            return 1
        print("ok")
        return 0
    started, failures, done = time.perf_counter(), 0, 0
    for seed in range(args.start, args.start + args.count):
        if args.seconds is not None and time.perf_counter() - started > args.seconds:
            break
        failure = check(seed)
        done += 1
        if failure:
            failures += 1
            print(failure, flush=True)
        if done % 500 == 0:
            print(f"... {done} cases, {failures} failures, {time.perf_counter() - started:.0f} s", flush=True)
    elapsed = time.perf_counter() - started
    print(f"{done} cases (seeds {args.start}..{args.start + done - 1}), {failures} failures, {elapsed:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
