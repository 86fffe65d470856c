"""``dflash-hf bench``: argument parsing and model/prompt loading; the work is done by `dflash_hf.bench`."""

import argparse
import time

from .arguments import COUNT, NON_NEGATIVE, add_dtype_argument
from .bench import ALL_METHODS
from .errors import DFlashUserError
from .loading import load_drafter, load_target, resolve_dtype

DATASETS = ("gsm8k@1000", "humaneval", "mtbench")  # GSM8K 0-999 trained the shipped drafter
QUICK = {"num_prompts": 2, "max_new_tokens": 32, "repeats": 1, "verify_repeats": 3, "context_len": 128}


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Register ``bench`` on ``subparsers``; the parsed namespace carries ``func=run_bench``."""
    p = subparsers.add_parser(
        "bench",
        help="benchmark greedy, prompt lookup, DFlash and an oracle on one target, interleaved",
        description="Runs every method on the same target, prompts, chat template, dtype and thread count, "
        "interleaved prompt by prompt with rotated order, then measures r(k). Writes bench.json (raw runs + "
        "summary), bench.md and speedup/acceptance plots into --out.",
    )
    p.add_argument("--target", help="target folder (default: the prepared SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help="drafter folder, or 'random' for an untrained drafter (tau ~ 1: overhead "
                   "only); default: the drafter shipped for the default target")
    p.add_argument("--compare-draft", action="append", default=[], metavar="NAME=PATH",
                   help="another drafter for the same target, run as method dflash@NAME interleaved with the others, "
                   "so that two drafters are compared in the same state of the machine (repeatable)")
    p.add_argument("--block-size", type=COUNT, help="draft smaller blocks than the drafter's (sweep 4/8/16 on "
                   "CPU); set per call through generate's num_assistant_tokens")
    p.add_argument("--datasets", default=",".join(DATASETS),
                   help="comma-separated datasets, NAME or NAME@START to skip the first START prompts "
                   "(default: %(default)s: the shipped drafter was trained on GSM8K 0-999)")
    p.add_argument("--num-prompts", type=COUNT, default=10, help="prompts per dataset (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=COUNT, default=128, help="(default: %(default)s)")
    p.add_argument("--repeats", type=COUNT, default=3, help="timed repeats per prompt and method (default: %(default)s)")
    p.add_argument("--methods", default=",".join(ALL_METHODS), help="comma-separated (default: %(default)s)")
    p.add_argument("--temperature", type=NON_NEGATIVE, default=0.0,
                   help="0 = greedy (default); > 0 samples every method (the oracle is then skipped)")
    add_dtype_argument(p, "float32", "target and drafter dtype")
    p.add_argument("--threads", type=COUNT, default=1, help="torch threads (default: %(default)s)")
    p.add_argument("--no-chat", action="store_true", help="encode prompts as plain text, not chat messages")
    p.add_argument("--context-len", type=COUNT, default=256, help="cached context for r(k) (default: %(default)s)")
    p.add_argument("--verify-repeats", type=COUNT, default=7, help="repeats for r(k) (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="bench-results", help="output folder (default: %(default)s)")
    p.add_argument("--batch-size", type=COUNT,
                   help="tokens/s of whole left-padded batches of this many prompts, plain batched greedy vs DFlash "
                   "(greedy only; writes bench-batch.json) instead of the per-prompt benchmark")
    p.add_argument("--quick", action="store_true",
                   help="smoke run under 3 minutes: 2 prompts per dataset, 32 new tokens, 1 repeat")
    p.set_defaults(func=run_bench)
    return p


def run_bench(args) -> None:
    """Load the target, drafter and prompts, run `bench.run_suite` and write the report."""
    import torch

    from .bench import run_suite
    from .bench_report import write_report

    torch.set_num_threads(args.threads)
    compare = compare_draft_paths(args.compare_draft)
    if compare and args.batch_size:
        raise DFlashUserError("--compare-draft runs in the per-prompt benchmark only: drop it or --batch-size")
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, value)
    args.dtype, why = resolve_dtype(args.dtype)
    print(f"dtype: {args.dtype} ({why})")
    target, tokenizer = load_target(args.target, args.dtype)
    target_name = args.target or "default"
    methods = [m for m in args.methods.split(",") if m]
    needs_drafter = any(m.startswith("dflash") or m == "oracle" for m in methods)
    drafter = load_drafter(args.draft, target, args.dtype, tokenizer) if needs_drafter else None
    if needs_drafter and drafter is None:
        raise DFlashUserError("no drafter is shipped for the default target yet: pass --draft PATH, --draft random, "
                              "or --methods greedy,pld3,pld10")
    draft_name = args.draft or "default"
    block_size = (args.block_size or drafter.config.block_size) if drafter is not None else None
    others = {name: load_drafter(path, target, args.dtype, tokenizer) for name, path in compare.items()}
    prompts = load_bench_prompts(tokenizer, args.datasets.split(","), args.num_prompts, chat=not args.no_chat)
    if args.batch_size:
        run_batch_bench(args, target, tokenizer, drafter, prompts, block_size)
        return
    config = {"target": target_name, "drafter": draft_name, "block_size": block_size,
              "compare_drafters": compare,
              "chat": not args.no_chat, "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    result = run_suite(target, prompts, drafter, methods, args.max_new_tokens, args.repeats, args.temperature,
                       args.seed, args.context_len, args.verify_repeats, config, block_size=block_size,
                       other_drafters=others)
    paths = write_report(result, args.out)
    print(paths["markdown"].read_text())
    print("\n".join(f"{kind}: {path}" for kind, path in paths.items()))


def compare_draft_paths(specs: list[str]) -> dict[str, str]:
    """``--compare-draft NAME=PATH`` flags -> ``{NAME: PATH}``, checked before any model loads."""
    paths = {}
    for spec in specs:
        name, _, path = spec.partition("=")
        if not name or not path or "@" in name or name in paths:
            raise DFlashUserError(f"--compare-draft {spec!r}: write NAME=PATH, with a NAME of its own (no '@'), e.g. "
                                  "--compare-draft run11=runs/run11/final")
        paths[name] = path
    return paths


def dataset_records(datasets, limit) -> list[tuple[str, dict]]:
    """``limit`` prompt records (``{"id", "turns"}``) of each dataset, as ``(dataset name, record)`` pairs.

    ``name@start`` skips the first ``start`` prompts of a dataset (``gsm8k@1000``: prompts the shipped drafter was
    not trained on).
    """
    from .assets import load_prompts

    records = []
    for spec in datasets:
        name, _, start = spec.partition("@")
        if start and not start.isdigit():
            raise DFlashUserError(f"--datasets entry {spec!r}: expected NAME or NAME@START with START a number")
        first = int(start or 0)
        found = load_prompts(name, first + limit)[first:]
        if not found:
            raise DFlashUserError(f"--datasets entry {spec!r}: {name} has no prompts from index {first}")
        records += [(name, record) for record in found]
    return records


def load_bench_prompts(tokenizer, datasets, limit, chat=True):
    """`dataset_records`, encoded with `dflash_hf.assets.encode_chat` into `BenchPrompt`s."""
    from .assets import encode_chat
    from .bench import BenchPrompt

    return [BenchPrompt(name, str(r["id"]), encode_chat(tokenizer, r["turns"], chat=chat)["input_ids"])
            for name, r in dataset_records(datasets, limit)]


def run_batch_bench(args, target, tokenizer, drafter, prompts, block_size) -> None:
    """``bench --batch-size N``: `bench.run_batch_benchmark` on the loaded prompts; bench-batch.json + a table."""
    import json
    from pathlib import Path

    from .bench import batch_report, run_batch_benchmark

    if drafter is None or args.temperature > 0:
        raise DFlashUserError("--batch-size compares greedy DFlash with plain batched greedy: it needs a drafter "
                              "(--methods with dflash) and --temperature 0")
    if tokenizer.pad_token_id is None:
        raise DFlashUserError("--batch-size pads prompts on the left: the target's tokenizer needs a pad token")
    extra = {"num_assistant_tokens": block_size - 1} if args.block_size else {}
    result = run_batch_benchmark(target, prompts, drafter, args.batch_size, args.max_new_tokens, args.repeats,
                                 pad_token_id=tokenizer.pad_token_id, generate_kwargs=extra)
    result["config"] = {"target": args.target or "default", "drafter": args.draft or "default",
                        "datasets": args.datasets, "dtype": args.dtype, "threads": args.threads,
                        "block_size": block_size, "adaptive": not args.block_size}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench-batch.json").write_text(json.dumps(result, indent=1))
    print(batch_report(result))
    print(f"json: {out / 'bench-batch.json'}")
