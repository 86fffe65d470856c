"""The held-out samples drafters are chosen on (docs/training.md, runs 21-31), and the rule that compares two drafters.

    python scripts/heldout_samples.py prompts DIR            # DIR/<sample>.jsonl, one file per sample
    python scripts/heldout_samples.py queues 2               # the samples split over two cores
    bash scripts/heldout_eval.sh DRAFT OUT                   # dflash-hf eval on each sample -> OUT/<sample>.json
    python scripts/heldout_samples.py compare BASE CAND      # rounds per sample, total, and the rule's verdict

Ten samples, none of which any shipped drafter was trained on: GSM8K test 1000-1004 and 1005-1016, HumanEval 0-4 and
5-16, MT-Bench 81-85 and 86-97 (first turns), ShareGPT entries 10000-10004 and 10005-10016, and the last five prompts
of ``writing.jsonl`` and ``questions.jsonl`` (``scripts/corpus_prompts.py``, which leaves them unanswered). An
eleventh, MT-Bench 98-121, breaks a tie. The rule, fixed before any evaluation: a candidate beats the baseline if it
takes fewer rounds over the ten samples in all *and* fewer on at least six of them; if only the total holds, the
eleventh sample decides. Rounds, not τ, because a round is what costs a target forward.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import corpus_prompts  # noqa: E402

# sample name -> (dataset file, first index, count); composed files come from corpus_prompts
SAMPLES = {
    "gsm5": ("gsm8k", 1000, 5),
    "he5": ("humaneval", 0, 5),
    "mt5": ("mtbench", 0, 5),
    "sg5": ("sharegpt", 10000, 5),
    "wr5": ("writing", 4825, 5),
    "qu5": ("questions", 5605, 5),
    "gsm12": ("gsm8k", 1005, 12),
    "sg12": ("sharegpt", 10005, 12),
    "he12": ("humaneval", 5, 12),
    "mt12": ("mtbench", 5, 12),
}
TIE_BREAK = {"mt24": ("mtbench", 17, 24)}
ALL_SAMPLES = {**SAMPLES, **TIE_BREAK}
AHEAD_NEEDED = 6


def sample_prompts(name: str) -> list[dict]:
    """The prompts of sample ``name`` as ``{"id", "turns"}`` records."""
    source, start, count = ALL_SAMPLES[name]
    if source in corpus_prompts.COMPOSED_PARTS:
        parts = json.loads(corpus_prompts.COMPOSED_PARTS[source].read_text())
        entries = corpus_prompts.composed_requests(parts, source)
    else:
        entries = corpus_prompts.read(f"{source}.jsonl")
    return entries[start : start + count]


def queues(cores: int, tie_break: bool = False) -> list[list[str]]:
    """The samples split over ``cores`` queues of about equal prompts: largest first, each to the lightest queue."""
    names = sorted(ALL_SAMPLES if tie_break else SAMPLES, key=lambda name: -ALL_SAMPLES[name][2])
    split = [[] for _ in range(cores)]
    for name in names:
        min(split, key=lambda queue: sum(ALL_SAMPLES[n][2] for n in queue)).append(name)
    return split


def rounds(folder: Path) -> dict[str, int]:
    """Rounds per sample from the ``dflash-hf eval --output`` files in ``folder`` (the first block size's)."""
    found = {}
    for name in ALL_SAMPLES:
        path = folder / f"{name}.json"
        if path.is_file():
            found[name] = json.loads(path.read_text())["results"][0]["rounds"]
    return found


def verdict(base: dict[str, int], cand: dict[str, int]) -> str:
    """The rule's answer for ``cand`` against ``base`` (rounds per sample)."""
    missing = [name for name in SAMPLES if name not in base or name not in cand]
    if missing:
        return f"incomplete: no result for {', '.join(missing)}"
    total_base, total_cand = sum(base[n] for n in SAMPLES), sum(cand[n] for n in SAMPLES)
    ahead = sum(cand[n] < base[n] for n in SAMPLES)
    if total_cand >= total_base:
        return f"does not beat the baseline ({total_cand} rounds against {total_base})"
    if ahead >= AHEAD_NEEDED:
        return f"beats the baseline ({total_cand} rounds against {total_base}, ahead on {ahead} of {len(SAMPLES)})"
    tie = [name for name in TIE_BREAK if name in base and name in cand]
    if not tie:
        return f"fewer rounds but ahead on only {ahead}: evaluate {', '.join(TIE_BREAK)} to decide"
    name = tie[0]
    outcome = "beats" if cand[name] < base[name] else "does not beat"
    return f"{outcome} the baseline on the tie-break ({name}: {cand[name]} against {base[name]})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prompts = commands.add_parser("prompts", help="write one JSONL per sample into DIR")
    prompts.add_argument("dir", type=Path)
    prompts.add_argument("--tie-break", action="store_true", help="also the eleventh sample")
    split = commands.add_parser("queues", help="print the samples as N lines of names, one queue per core")
    split.add_argument("cores", type=int)
    split.add_argument("--tie-break", action="store_true", help="also the eleventh sample")
    compare = commands.add_parser("compare", help="rounds per sample of two eval folders, and the verdict")
    compare.add_argument("base", type=Path)
    compare.add_argument("cand", type=Path)
    args = parser.parse_args()
    if args.command == "prompts":
        args.dir.mkdir(parents=True, exist_ok=True)
        for name in ALL_SAMPLES if args.tie_break else SAMPLES:
            corpus_prompts.write(args.dir / f"{name}.jsonl", sample_prompts(name))
        return
    if args.command == "queues":
        print("\n".join(" ".join(queue) for queue in queues(args.cores, args.tie_break)))
        return
    base, cand = rounds(args.base), rounds(args.cand)
    for name in ALL_SAMPLES:
        if name in base and name in cand:
            print(f"{name:6s} {base[name]:6d} -> {cand[name]:6d}  ({cand[name] - base[name]:+d})")
    print(verdict(base, cand))


if __name__ == "__main__":
    main()
