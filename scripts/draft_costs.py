"""What one drafted round costs on this machine, part by part: a plain decode step, verifying k + 1 tokens, the
drafter forward over Q block rows (bf16 and fp32 weights) and the head argmax of M rows over the full vocabulary and
over the shipped drafter's draft vocabulary. Wall and process CPU time in ms, medians of 15 calls after 3 warm-ups,
on the default GSM8K-style prompt plus 64 generated tokens (docs/controller.md).

    taskset -c 0 .venv/bin/python scripts/draft_costs.py
"""

import statistics
import time

import torch
from transformers.cache_utils import DynamicCache

from dflash_hf.assets import encode_chat
from dflash_hf.cli import DEFAULT_PROMPT
from dflash_hf.generation_dflash import DraftVocabHead, calibrate_head, extract_context_feature, head_logits
from dflash_hf.loading import load_drafter, load_target


def timed(fn, repeats: int = 15) -> tuple[float, float]:
    """Median wall and CPU milliseconds of ``fn()``."""
    for _ in range(3):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return statistics.median(wall) * 1e3, statistics.median(cpu) * 1e3


@torch.inference_mode()
def main() -> None:
    torch.set_num_threads(1)
    target, tokenizer = load_target("default", "float32")
    tokens = target.generate(**encode_chat(tokenizer, DEFAULT_PROMPT, chat=True), max_new_tokens=64, do_sample=False)
    cache = DynamicCache()
    hidden_states = target(tokens[:, :-1], past_key_values=cache, output_hidden_states=True).hidden_states
    results = {}

    def verify(k):
        def run():
            target(tokens[:, -1:].repeat(1, k + 1), past_key_values=cache)
            cache.crop(-(k + 1))
        return run

    for k in (0, 1, 3, 7, 15):
        results[f"target forward, {k + 1} token(s)"] = timed(verify(k))
    for dtype in ("bfloat16", "float32"):
        drafter = load_drafter("default", target, dtype)
        features = extract_context_feature(hidden_states, drafter.config.target_layer_ids)
        draft_cache = DynamicCache()
        embed = target.get_input_embeddings()
        drafter(noise_embedding=embed(tokens[:, :16]).to(drafter.dtype), target_hidden=features[:, :-2],
                past_key_values=draft_cache, use_cache=True)
        cached = draft_cache.get_seq_length()
        for rows in (2, 4, 16):
            noise = embed(tokens[:, -rows:]).to(drafter.dtype)
            positions = torch.arange(cached, cached + 2 + rows)[None]

            def forward():
                drafter(noise_embedding=noise, target_hidden=features[:, -2:], position_ids=positions,
                        past_key_values=draft_cache, use_cache=True)
                draft_cache.crop(-2)

            results[f"drafter forward, {dtype} weights, {rows} block rows"] = timed(forward)
    heads = {"full vocabulary": target.lm_head,
             "draft vocabulary": DraftVocabHead(target.lm_head, torch.tensor(drafter.config.draft_vocab))}
    for rows in (1, 2, 4, 8, 15):
        hidden = torch.randn(rows, target.config.hidden_size)
        for name, head in heads.items():
            calibrate_head(head, rows)
            results[f"head argmax, {rows} rows, {name} ({head.weight.shape[0]})"] = timed(
                lambda: head_logits(head, hidden).argmax(-1))
    for name, (wall, cpu) in results.items():
        print(f"{name:58s} wall {wall:7.2f} ms   cpu {cpu:7.2f} ms")


if __name__ == "__main__":
    main()
