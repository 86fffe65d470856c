"""The demo's comparison in process CPU time, which a busy core distorts less than wall time: plain greedy against
DFlash on the default GSM8K-style prompt (fp32, 128 new tokens), a warm-up, then ``REPEATS`` interleaved pairs; prints
the medians, their ratio and τ per run (docs/controller.md).

    taskset -c 0 .venv/bin/python scripts/demo_cpu_time.py [DRAFT_DIR|default] [REPEATS]
"""

import statistics
import sys
import time

import torch

from dflash_hf.assets import encode_chat
from dflash_hf.cli import DEFAULT_PROMPT
from dflash_hf.loading import load_drafter, load_target


def timed_generate(target, inputs, **options) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of one ``generate`` call."""
    cpu, wall = time.process_time(), time.perf_counter()
    with torch.inference_mode():
        target.generate(**inputs, **options)
    return time.process_time() - cpu, time.perf_counter() - wall


def main(draft: str = "default", repeats: int = 3) -> None:
    torch.set_num_threads(1)
    target, tokenizer = load_target("default", "float32")
    drafter = load_drafter(draft, target)
    inputs = encode_chat(tokenizer, DEFAULT_PROMPT, chat=True)
    options = dict(max_new_tokens=128, do_sample=False, pad_token_id=tokenizer.eos_token_id)
    timed_generate(target, inputs, **options)
    timed_generate(target, inputs, assistant_model=drafter, **options)
    plain, dflash, taus = [], [], []
    for _ in range(repeats):
        plain.append(timed_generate(target, inputs, **options))
        dflash.append(timed_generate(target, inputs, assistant_model=drafter, **options))
        taus.append(round(drafter.last_stats.mean_acceptance_length, 2))
    for unit, i in (("cpu", 0), ("wall", 1)):
        p, d = statistics.median(t[i] for t in plain), statistics.median(t[i] for t in dflash)
        print(f"{unit}: plain {p:.2f} s, DFlash {d:.2f} s: {p / d:.3f}x")
    print(f"drafter dtype {drafter.dtype}; tau per run {taus}")


if __name__ == "__main__":
    main(*(sys.argv[1:2] or ["default"]), *[int(a) for a in sys.argv[2:3]])
