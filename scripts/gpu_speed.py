"""Issue 17's GPU measurement: our generator against transformers' built-in one and the reference loop, per round.

    python scripts/gpu_speed.py --target DIR --draft DIR --prompts P.jsonl ... --out OUT   (scripts/gpu_speed.sh)

Two setups, each with four methods run in a rotated order per repeat after an untimed warm-up:

* **smollm2**: the converted SmolLM2-135M-Instruct target and the shipped drafter, held-out prompts (natural tau);
* **qwen3**: a random-weight Qwen3 target built from a config (~2 B parameters, ``--qwen3 tiny`` for the CPU
  rehearsal) and a random drafter; every method proposes the target's own greedy continuation cut at slot
  ``--accept`` (the pinned-acceptance oracle of ``tests/oracle.py``; the drafter still runs every round), so tau is
  ``accept + 1`` for all of them and the timings compare loops, not drafters.

Methods: ``greedy`` (plain ``generate``), ``dflash`` (ours: ``generate(assistant_model=draft)``, its adaptive block
size and prompt lookup; SmolLM2 only), ``dflash_full`` (ours drafting full blocks as the next two do, so that tau and
the proposals are theirs), ``builtin`` (transformers' ``speculation_type="dflash"``) and ``reference`` (z-lab's loop
shape, written out in ``tests/reference.py`` and run on the drafter's own forward, `ModelDrafter`). Timings use
`PhaseProfiler`'s hooks, which synchronise the GPU at every phase boundary: per round, **verify** is the target's
forwards after the prefill, **draft** the drafter and its head, **glue** the rest (context feeding, acceptance, cache
crops, Python). Results go
to ``OUT/speed.json`` (every run) and ``OUT/speed.md`` (the table), rewritten after each setup so that a run cut
short still leaves what it measured.
"""

import argparse
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # the pinned-acceptance oracle and the reference loop are the tests' own

from oracle import corrupted, pin  # noqa: E402
from reference import ModelDrafter, reference_generate  # noqa: E402

from dflash_hf.bench import Method, PhaseProfiler, run_once  # noqa: E402

METHODS = ("greedy", "dflash", "dflash_full", "builtin", "reference")
PINNED_METHODS = ("greedy", "dflash_full", "builtin", "reference")  # a random drafter: ours would not draft
QWEN3 = {  # Qwen3-1.7B's shape, untied head: ~2.0 B parameters
    "full": dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28, num_attention_heads=16,
                 num_key_value_heads=8, head_dim=128, vocab_size=151936),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512),
}


# ---------------------------------------------------------------------------------------------------- pinning
@contextmanager
def pinned_builtin(continuation, accept: int, vocab: int):
    """transformers' built-in DFlash generator, its proposals replaced as `oracle.corrupted` says (its drafter still
    runs); the class method is patched for the duration, since the profiler already shadows the instance's."""
    from transformers.generation.candidate_generator import DFlashTokenCandidateGenerator

    original = DFlashTokenCandidateGenerator.get_candidates

    def get_candidates(self, input_ids, *args, **kwargs):
        candidates, logits = original(self, input_ids, *args, **kwargs)
        num = candidates.shape[1] - input_ids.shape[1]
        if num > 0:
            drafts = corrupted(continuation, input_ids.shape[1], num, accept, vocab).to(candidates.device)
            candidates = torch.cat([input_ids, drafts], dim=1)
        return candidates, logits

    DFlashTokenCandidateGenerator.get_candidates = get_candidates
    try:
        yield
    finally:
        DFlashTokenCandidateGenerator.get_candidates = original


# ----------------------------------------------------------------------------------------------------- one run
def run_method(name, target, drafter, input_ids, max_new_tokens, profiler, pinned=None) -> dict:
    """One timed run of method ``name``; ``pinned = (continuation, accept)`` forces the acceptance."""
    vocab = target.config.vocab_size
    if name == "reference":
        propose = None
        if pinned is not None:
            continuation, accept = pinned

            def propose(_round, anchor, real):
                return corrupted(continuation, anchor + 1, real.shape[1], accept, vocab)
        trace = profiler.reset()
        t0 = profiler.clock()
        output, _ = reference_generate(target, drafter, input_ids, max_new_tokens, propose,
                                       implementation=ModelDrafter)
        total = profiler.clock() - t0
    else:
        full_blocks = {"num_assistant_tokens": drafter.config.block_size - 1,
                       "num_assistant_tokens_schedule": "constant"}
        kwargs = {"greedy": {}, "dflash": {"assistant_model": drafter},
                  "dflash_full": {"assistant_model": drafter, **full_blocks},
                  "builtin": {"assistant_model": drafter, "speculation_type": "dflash"}}[name]
        if pinned is not None and name.startswith("dflash"):
            pin(drafter, pinned[0], cuts=lambda _round, n: pinned[1])
        context = pinned_builtin(*pinned, vocab) if pinned is not None and name == "builtin" else _nothing()
        with context:
            record, output = run_once(target, Method(name, kwargs), input_ids, max_new_tokens, profiler)
        if pinned is not None and name.startswith("dflash"):
            del drafter.make_candidate_generator  # unpinned again
        trace, total = profiler.trace, record["total_s"]
    new = output.shape[1] - input_ids.shape[1]
    rounds = max(len(trace.forwards) - 1, 1)
    prefill, verify = (trace.forwards[0] if trace.forwards else 0.0), sum(trace.forwards[1:])
    return {"method": name, "new_tokens": new, "total_s": total, "tokens_per_s": new / total,
            "tau": (new - 1) / rounds, "rounds": rounds, "prefill_s": prefill, "verify_s": verify,
            "draft_s": trace.draft_s, "glue_s": max(total - prefill - verify - trace.draft_s, 0.0),
            "output": output[0, input_ids.shape[1]:].tolist()}


@contextmanager
def _nothing():
    yield


def bench_setup(label, target, drafter, prompts, methods, max_new_tokens, repeats, deadline, accept=None) -> list[dict]:
    """Every prompt: plain greedy (the pinned continuation), a warm-up of each method on the first, then
    ``repeats`` x all methods in a rotated order, while time is left before ``deadline``."""
    profiler = PhaseProfiler(target, drafter)
    records = []
    try:
        for p, input_ids in enumerate(prompts):
            if time.monotonic() > deadline:
                break
            plain = run_method("greedy", target, drafter, input_ids, max_new_tokens, profiler)
            continuation = torch.tensor([input_ids[0].tolist() + plain["output"]], device=input_ids.device)
            pinned = (continuation, accept) if accept is not None else None
            if p == 0:
                for name in methods:  # warm-up: allocator, kernels, lazy imports
                    run_method(name, target, drafter, input_ids, min(max_new_tokens, 32), profiler, pinned)
            for r in range(repeats):
                if time.monotonic() > deadline:
                    break
                shift = (p * repeats + r) % len(methods)
                for slot, name in enumerate(methods[shift:] + methods[:shift]):
                    record = run_method(name, target, drafter, input_ids, max_new_tokens, profiler, pinned)
                    record.update(setup=label, prompt=p, repeat=r, slot=slot,
                                  identical=record["output"] == plain["output"])
                    del record["output"]
                    records.append(record)
                    print(f"{label} p{p} r{r} {name:11s} {record['tokens_per_s']:8.1f} tok/s  tau {record['tau']:.2f}"
                          f"  identical={record['identical']}", flush=True)
    finally:
        profiler.remove()
    return records


# ----------------------------------------------------------------------------------------------------- report
def summarize(records: list[dict]) -> list[dict]:
    """Per setup and method: median tokens/s, pooled tau, per-round medians of draft/verify/glue (ms) and shares."""
    rows = []
    for setup in dict.fromkeys(r["setup"] for r in records):
        for method in dict.fromkeys(r["method"] for r in records if r["setup"] == setup):
            runs = [r for r in records if r["setup"] == setup and r["method"] == method]
            per_round = {k: statistics.median(r[f"{k}_s"] / r["rounds"] for r in runs) * 1e3
                         for k in ("draft", "verify", "glue")}
            round_ms = sum(per_round.values())
            rows.append({"setup": setup, "method": method, "runs": len(runs),
                         "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
                         "tau": sum(r["new_tokens"] - 1 for r in runs) / sum(r["rounds"] for r in runs),
                         **{f"{k}_ms": v for k, v in per_round.items()},
                         "glue_share": per_round["glue"] / round_ms if round_ms else 0.0,
                         "identical": all(r["identical"] for r in runs)})
    for row in rows:
        base = {r["method"]: r["tokens_per_s"] for r in rows if r["setup"] == row["setup"]}
        row["vs_greedy"] = row["tokens_per_s"] / base["greedy"] if base.get("greedy") else None
        ours = base.get("dflash_full")  # ours at the same blocks (and tau) as builtin and reference
        row["ours_vs_this"] = ours / row["tokens_per_s"] if ours else None
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| setup | method | runs | tok/s | × greedy | dflash_full ÷ this | tau | draft ms/round | "
             "verify ms/round | glue ms/round | glue share | identical |", "|" + "---|" * 12]
    for r in rows:
        lines.append(f"| {r['setup']} | {r['method']} | {r['runs']} | {r['tokens_per_s']:.1f} | "
                     f"{r['vs_greedy'] or 0:.2f} | {r['ours_vs_this'] or 0:.2f} | {r['tau']:.2f} | "
                     f"{r['draft_ms']:.2f} | {r['verify_ms']:.2f} | {r['glue_ms']:.2f} | "
                     f"{100 * r['glue_share']:.1f} % | {r['identical']} |")
    return "\n".join(lines) + "\n"


def write(out: Path, records: list[dict], info: dict) -> None:
    rows = summarize(records)
    (out / "speed.json").write_text(json.dumps({"info": info, "summary": rows, "runs": records}, indent=2))
    (out / "speed.md").write_text(f"{json.dumps(info)}\n\n{table(rows)}")
    print(table(rows), flush=True)


# ------------------------------------------------------------------------------------------------------- setups
def smollm2_setup(args, device, dtype):
    from dflash_hf.assets import encode_chat
    from dflash_hf.loading import load_drafter, load_target
    from dflash_hf.training.data import read_prompts

    target, tokenizer = load_target(args.target, dtype=args.dtype, device=device)
    drafter = load_drafter(args.draft, target, dtype=args.dtype)
    prompts = []
    for path in args.prompts:
        found, _ = read_prompts(path, limit=args.num_prompts)
        prompts += [encode_chat(tokenizer, p.text)["input_ids"].to(device) for p in found]
    return target, drafter, prompts


def qwen3_setup(args, device, dtype):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_hf import DFlashConfig, DFlashDraftModel

    config = Qwen3Config(**QWEN3[args.qwen3], max_position_embeddings=4096, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        target = Qwen3ForCausalLM(config).to(dtype).eval()
        with torch.no_grad():  # a decisive head: random logits are near-ties, which bf16 rounds either way
            target.lm_head.weight.mul_(args.head_scale)
        draft_config = DFlashConfig.from_target_config(config, mask_token_id=config.vocab_size - 1,
                                                       num_hidden_layers=args.draft_layers, block_size=16)
        drafter = DFlashDraftModel(draft_config).to(dtype).eval()
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, config.vocab_size - 1, (1, args.qwen3_prompt_len), generator=generator).to(device)
               for _ in range(args.num_prompts)]
    params = sum(p.numel() for p in target.parameters())
    print(f"qwen3 {args.qwen3}: {params / 1e9:.2f} B parameters, drafter {args.draft_layers} layers", flush=True)
    return target, drafter, prompts, params


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", required=True, help="the converted SmolLM2 folder")
    parser.add_argument("--draft", default="default", help="its drafter (default: the shipped one)")
    parser.add_argument("--prompts", nargs="+", required=True, help="prompt files (held-out sets)")
    parser.add_argument("--num-prompts", type=int, default=2, help="prompts per file / random Qwen3 prompts")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--qwen3", default="full", choices=list(QWEN3) + ["none"])
    parser.add_argument("--qwen3-prompt-len", type=int, default=128)
    parser.add_argument("--draft-layers", type=int, default=5, help="layers of the random Qwen3 drafter")
    parser.add_argument("--accept", type=int, default=5, help="drafts accepted per round on Qwen3 (tau = accept+1)")
    parser.add_argument("--head-scale", type=float, default=8.0)
    parser.add_argument("--seconds", type=float, default=400, help="no new repeat starts after this")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    start = time.monotonic()
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    import transformers

    info = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "dtype": args.dtype,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "max_new_tokens": args.max_new_tokens, "repeats": args.repeats, "accept": args.accept}
    share = args.seconds / (2 if args.qwen3 != "none" else 1)
    target, drafter, prompts = smollm2_setup(args, device, dtype)
    records = bench_setup("smollm2", target, drafter, prompts, METHODS, args.max_new_tokens, args.repeats,
                          start + share)
    write(out, records, info)
    del target, drafter
    if args.qwen3 != "none":
        target, drafter, prompts, params = qwen3_setup(args, device, dtype)
        info["qwen3_params"] = params
        records += bench_setup(f"qwen3-{args.qwen3}", target, drafter, prompts, PINNED_METHODS, args.max_new_tokens,
                               args.repeats, start + args.seconds, accept=args.accept)
        write(out, records, info)


if __name__ == "__main__":
    main()
