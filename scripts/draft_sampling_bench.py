"""Greedy vs sampled DFlash drafts when sampling: tau and tokens/s on one target (docs/sampling.md has the numbers).

For every prompt and seed, each temperature and block setting runs plain sampling and then DFlash with
``draft_sampling="greedy"`` (argmax drafts, one-hot q) and ``"sample"`` (drafts drawn from the drafter's warped
softmax, q handed to the verifier), in alternating order. Plain temperature sampling (no top-k / top-p), as
``dflash-hf bench``. tau = tokens committed per verify round (plain rounds of the adaptive block size count as 1).

    nice -n 8 .venv/bin/python scripts/draft_sampling_bench.py --num-prompts 3 --seeds 0,1 --out draft-sampling.json
"""

import argparse
import json
import statistics
import time

import torch

from dflash_hf.bench_cli import load_bench_prompts
from dflash_hf.loading import load_drafter, load_target

MODES = ("greedy", "sample")
BLOCKS = {"fixed16": {"num_assistant_tokens": 15, "num_assistant_tokens_schedule": "constant"}, "adaptive": {}}


def run(target, input_ids, max_new_tokens, temperature, seed, **options):
    """One timed ``generate`` -> (new tokens, seconds)."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    with torch.no_grad():
        out = target.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens,
                              do_sample=True, temperature=temperature, top_k=0, top_p=1.0, **options)
    return out.shape[1] - input_ids.shape[1], time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", default="gsm8k@1000,mtbench")
    parser.add_argument("--num-prompts", type=int, default=3, help="per dataset")
    parser.add_argument("--temperatures", default="0.7,1.0")
    parser.add_argument("--blocks", default="fixed16,adaptive", help=f"comma-separated of {', '.join(BLOCKS)}")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--out", default="draft-sampling.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    target, tokenizer = load_target("default", "float32")
    drafter = load_drafter(None, target, "float32", tokenizer)
    prompts = load_bench_prompts(tokenizer, args.datasets.split(","), args.num_prompts)
    temperatures = [float(t) for t in args.temperatures.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    blocks = args.blocks.split(",")
    run(target, prompts[0].input_ids, 8, 1.0, 0, assistant_model=drafter)  # warm-up (head calibration)
    records = []
    for index, prompt in enumerate(prompts):
        for seed in seeds:
            for temperature in temperatures:
                tokens, seconds = run(target, prompt.input_ids, args.max_new_tokens, temperature, seed)
                records.append(dict(prompt=f"{prompt.dataset}/{prompt.id}", seed=seed, temperature=temperature,
                                    method="plain", tokens=tokens, seconds=seconds, tau=1.0))
                for block in blocks:
                    order = MODES if (index + seed) % 2 == 0 else MODES[::-1]
                    for mode in order:
                        tokens, seconds = run(target, prompt.input_ids, args.max_new_tokens, temperature, seed,
                                              assistant_model=drafter, draft_sampling=mode, **BLOCKS[block])
                        stats = drafter.last_stats
                        records.append(dict(prompt=f"{prompt.dataset}/{prompt.id}", seed=seed,
                                            temperature=temperature, method=f"{block}/{mode}", tokens=tokens,
                                            seconds=seconds, tau=stats.mean_acceptance_length,
                                            committed=sum(stats.acceptance_lengths), rounds=stats.num_rounds))
                        print(json.dumps(records[-1]), flush=True)
    summary = {}
    for temperature in temperatures:
        for method in ["plain"] + [f"{b}/{m}" for b in blocks for m in MODES]:
            rows = [r for r in records if r["temperature"] == temperature and r["method"] == method]
            tokens, seconds = sum(r["tokens"] for r in rows), sum(r["seconds"] for r in rows)
            rounds = sum(r.get("rounds", 0) for r in rows)
            summary[f"T={temperature} {method}"] = dict(
                tau=round(sum(r.get("committed", 0) for r in rows) / rounds, 3) if rounds else 1.0,
                tau_mean_of_runs=round(statistics.mean(r["tau"] for r in rows), 3),
                tok_s=round(tokens / seconds, 2), runs=len(rows))
    for key, value in summary.items():
        print(f"{key:28s} {value}")
    with open(args.out, "w") as handle:
        json.dump({"args": vars(args), "summary": summary, "records": records}, handle, indent=1)


if __name__ == "__main__":
    main()
