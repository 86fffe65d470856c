"""The ``dflash-hf`` command line: argument parsing only; the work is done by the package's functions.

Each subcommand is one pair of functions, ``_add_<name>_parser(subparsers)`` and ``_run_<name>(args)``, registered
in :data:`_SUBCOMMANDS`. Errors the user can fix are printed as one line on stderr, with exit status 1.
"""

from __future__ import annotations

import argparse
import sys

from .arguments import add_dtype_argument
from .errors import DFlashUserError


def _add_prepare_parser(subparsers) -> None:
    from .assets import DATASETS, DTYPES

    p = subparsers.add_parser(
        "prepare",
        help="convert the default target (SmolLM2-135M-Instruct) and cache the prompt datasets, offline",
        description="Convert the default target once and write the datasets as JSONL into the cache "
        "($DFLASH_HF_CACHE, else $XDG_CACHE_HOME/dflash-hf, else ~/.cache/dflash-hf).",
    )
    p.add_argument("--cache-dir", help="cache root (default: see above)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="dtype of the converted target")
    p.add_argument("--datasets", nargs="*", choices=list(DATASETS), default=list(DATASETS), metavar="NAME",
                   help=f"datasets to cache (default: all of {', '.join(DATASETS)}; none with an empty list)")
    p.add_argument("--skip-target", action="store_true", help="do not convert the target")


def _run_prepare(args) -> None:
    from .assets import check_prerequisites, default_target_path, prepare_datasets, prepare_default_target

    convert = not args.skip_target and default_target_path(args.cache_dir, args.dtype) is None
    check_prerequisites(target=convert, datasets=args.datasets)  # everything missing, in one message
    if not args.skip_target:
        print(f"target: {prepare_default_target(args.cache_dir, dtype=args.dtype, progress=True)}")
    if args.datasets:
        for name, path in prepare_datasets(args.cache_dir, args.datasets, progress=True).items():
            print(f"{name}: {path}")


DEFAULT_PROMPT = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?"


def _add_generate_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "generate",
        help="generate with DFlash, streaming the answer; --compare also runs plain decoding",
        description="Stream an answer as the target commits it, then print tokens/s, the mean acceptance length "
        "(tau) and the acceptance histogram. Greedy unless --temperature > 0.",
    )
    p.add_argument("prompt", nargs="?", help="the prompt (default: a GSM8K question)")
    p.add_argument("--held-out", action="store_true",
                   help="instead of PROMPT, run the first held-out prompt of each bench set (GSM8K from 1000, "
                   "HumanEval, MT-Bench: math, code, chat; what the demo runs) and sum up with --compare")
    p.add_argument("--target", default="default", help="target model folder, or 'default' (SmolLM2-135M-Instruct)")
    p.add_argument("--draft", default="default", help="drafter folder, 'default' (shipped drafter) or 'none'")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 = greedy (default); > 0 samples at this temperature (no top-k / top-p)")
    add_dtype_argument(p, "auto", "dtype of the target")
    p.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True, help="apply the chat template")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding: warm-up, interleaved timed runs, medians, token comparison")
    p.add_argument("--compare-runs", type=int, default=2, help="timed runs of each path with --compare")
    p.add_argument("--seed", type=int, default=0, help="random seed for sampling (--temperature > 0)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default 1; oversubscription is slow)")


def _run_generate(args) -> None:
    from .demo import run_generate

    if args.held_out and args.prompt is not None:
        raise DFlashUserError("pass a PROMPT or --held-out, not both")
    args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if not args.prompt.strip():
        raise DFlashUserError("the prompt is empty: pass some text, e.g. dflash-hf generate 'What is 2+2?'")
    if not args.temperature >= 0:  # also refuses nan
        raise DFlashUserError(f"--temperature {args.temperature} is negative or not a number: pass 0 (greedy) or a "
                              "positive value")
    if args.max_new_tokens < 1:
        raise DFlashUserError(f"--max-new-tokens {args.max_new_tokens}: pass at least 1")
    if args.compare_runs < 1:
        raise DFlashUserError(f"--compare-runs {args.compare_runs}: pass at least 1")
    run_generate(args)


def _add_card_parser(subparsers) -> None:
    p = subparsers.add_parser("card", help="write a Hub model card (README.md) into a drafter folder")
    p.add_argument("draft_dir")
    p.add_argument("--target", dest="target_name", required=True,
                   help="the target's Hub id, e.g. HuggingFaceTB/SmolLM2-135M-Instruct (the card's base_model)")
    p.add_argument("--draft-name", help="the drafter's Hub id used in the usage snippets")


def _run_card(args) -> None:
    from .hub import write_model_card

    print(write_model_card(args.draft_dir, target_name=args.target_name, draft_name=args.draft_name))


def _add_convert_parser(subparsers) -> None:
    p = subparsers.add_parser(
        "convert", help="convert a drafter between the z-lab layout and transformers' built-in drafter layout"
    )
    p.add_argument("src_dir")
    p.add_argument("dst_dir")
    p.add_argument("--to", choices=["builtin", "zlab"], required=True)
    p.add_argument("--overwrite", action="store_true", help="replace dst_dir if it exists (default: refuse)")


def _run_convert(args) -> None:
    from .hub import convert_checkpoint

    print(convert_checkpoint(args.src_dir, args.dst_dir, to=args.to, overwrite=args.overwrite))


def _add_push_parser(subparsers) -> None:
    p = subparsers.add_parser("push", help="validate a drafter folder and upload it to the Hub")
    p.add_argument("draft_dir")
    p.add_argument("repo_id")
    p.add_argument("--dry-run", action="store_true", help="list what would be uploaded, upload nothing")
    p.add_argument("--private", action="store_true")


def _run_push(args) -> None:
    from .hub import push_to_hub

    for name, size in push_to_hub(args.draft_dir, args.repo_id, dry_run=args.dry_run, private=args.private):
        print(f"{size:>12,d}  {name}")
    print("dry run: nothing uploaded" if args.dry_run else f"uploaded to {args.repo_id}")


def _delegated(module: str, adder: str):
    """A subcommand whose parser lives next to its logic and sets ``func``."""

    def add(subparsers) -> None:
        import importlib

        getattr(importlib.import_module(module, __package__), adder)(subparsers)

    return add, lambda args: args.func(args)


_SUBCOMMANDS = {
    "prepare": (_add_prepare_parser, _run_prepare),
    "generate": (_add_generate_parser, _run_generate),
    "distill": _delegated(".training.cli", "add_distill_parser"),
    "features": _delegated(".training.cli", "add_features_parser"),
    "train": _delegated(".training.cli", "add_train_parser"),
    "eval": _delegated(".training.cli", "add_eval_parser"),
    "train-all": _delegated(".training.cli", "add_train_all_parser"),
    "draft-vocab": _delegated(".training.cli", "add_draft_vocab_parser"),
    "average": _delegated(".training.cli", "add_average_parser"),
    "bench": _delegated(".bench_cli", "add_bench_parser"),
    "card": (_add_card_parser, _run_card),
    "convert": (_add_convert_parser, _run_convert),
    "push": (_add_push_parser, _run_push),
}


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of :data:`_SUBCOMMANDS`."""
    from . import __version__

    parser = argparse.ArgumentParser(
        prog="dflash-hf", description="DFlash speculative-decoding drafters for Hugging Face transformers."
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add_parser, _ in _SUBCOMMANDS.values():
        add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit status (0 on success, 1 for an error the user can fix, 2 for bad usage)."""
    args = build_parser().parse_args(argv)
    try:
        _SUBCOMMANDS[args.command][1](args)
    except (DFlashUserError, ValueError, OSError) as err:  # OSError: missing, unwritable or non-folder paths
        print(f"dflash-hf {args.command}: error: {err}", file=sys.stderr)
        return 1
    return 0
