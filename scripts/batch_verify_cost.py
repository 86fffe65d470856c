"""r_b(k) for batched DFlash: the cost of one target forward over ``b`` rows x ``k + 1`` tokens on a cached
``200``-token context (the drafter's feature layers captured, logits argmaxed, as a verify round does), relative to a
plain batched step (``k = 0``), for b = 1, 4, 8; wall and process CPU time, medians of 5 after a warm-up.

    taskset -c 0 .venv/bin/python scripts/batch_verify_cost.py [float32|bfloat16]
"""

import statistics
import sys
import time

import torch
from transformers.cache_utils import DynamicCache

from dflash_hf.loading import load_drafter, load_target


def main(dtype: str = "float32", context_len: int = 200) -> None:
    torch.set_num_threads(1)
    target, tokenizer = load_target("default", dtype)
    drafter = load_drafter("default", target, dtype, tokenizer)
    layers = [i + 1 for i in drafter.config.target_layer_ids]
    vocab = target.config.vocab_size
    for batch in (1, 4, 8):
        generator = torch.Generator().manual_seed(0)
        cache = DynamicCache()
        wall, cpu = {n: [] for n in (1, 2, 4, 8, 16)}, {n: [] for n in (1, 2, 4, 8, 16)}
        with torch.no_grad():
            target(input_ids=torch.randint(0, vocab, (batch, context_len), generator=generator), past_key_values=cache,
                   use_cache=True, logits_to_keep=1)
            for repeat in range(6):  # the first pass is a warm-up
                for n in wall:
                    ids = torch.randint(0, vocab, (batch, n), generator=generator)
                    positions = torch.arange(context_len, context_len + n)[None].expand(batch, -1)
                    start, cpu_start = time.perf_counter(), time.process_time()
                    out = target(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions,
                                 attention_mask=torch.ones(batch, context_len + n, dtype=torch.long),
                                 output_hidden_states=layers)
                    out.logits.float().argmax(-1)
                    if repeat:
                        wall[n].append(time.perf_counter() - start)
                        cpu[n].append(time.process_time() - cpu_start)
                    cache.crop(-n)
        w = {n: statistics.median(v) for n, v in wall.items()}
        c = {n: statistics.median(v) for n, v in cpu.items()}
        print(f"b={batch}: t(1) {w[1] * 1e3:.1f} ms wall, {c[1] * 1e3:.1f} ms CPU; r(k) wall/CPU: "
              + " ".join(f"r({n - 1}) {w[n] / w[1]:.2f}/{c[n] / c[1]:.2f}" for n in w if n > 1), flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:2])
