"""``dflash-hf eval``: acceptance length tau of a drafter on held-out prompts, greedy, per block size.

Each block size is a ``generate`` argument (``num_assistant_tokens=B - 1`` with the ``"constant"`` schedule: full
blocks of B, see `draft_settings`), so one loaded drafter serves every size up to its own and is never changed. tau is
the mean number of tokens committed per verify round, the target's bonus token included (``draft.last_stats``),
pooled over all rounds of all prompts; the histogram counts rounds by committed tokens ``0..B``.
"""

import json
import logging
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..controller_dflash import DFlashStats
from ..loading import load_drafter, load_target, resolve_device
from .blocks import block_labels_and_weights, build_block_inputs, build_block_mask, sample_anchors
from .config import EvalConfig
from .data import ShardDataset, collate, read_prompts
from .distill import encode_prompt

logger = logging.getLogger(__name__)


@torch.no_grad()
def acceptance(target, draft, prompt_ids: list[list[int]], block_size: int, max_new_tokens: int,
               quiet: bool = True) -> dict:
    """Greedy DFlash generation of every prompt at ``block_size``; pooled tau, histogram, per-position acceptance.

    Every round proposes the whole block (the adaptive controller is off), so tau is the drafter's, at this size.
    """
    if not 1 <= block_size <= draft.config.block_size:
        raise ValueError(f"block size {block_size} is outside 1..{draft.config.block_size}, the drafter's block_size")
    fixed_blocks = dict(num_assistant_tokens=block_size - 1, num_assistant_tokens_schedule="constant")
    lengths, proposed, seconds, new_tokens = [], [], 0.0, 0
    for ids in tqdm(prompt_ids, desc=f"eval B={block_size}", disable=quiet, leave=False):
        input_ids = torch.tensor([ids], device=target.device)
        start = time.monotonic()
        out = target.generate(input_ids, assistant_model=draft, max_new_tokens=max_new_tokens, do_sample=False,
                              **fixed_blocks)
        seconds += time.monotonic() - start
        new_tokens += out.shape[1] - len(ids)
        lengths += draft.last_stats.acceptance_lengths
        proposed += draft.last_stats.proposed_lengths
    pooled = DFlashStats(block_size, acceptance_lengths=lengths, proposed_lengths=proposed)
    return {
        "block_size": block_size,
        "tau": pooled.mean_acceptance_length,
        "rounds": pooled.num_rounds,
        "histogram": pooled.histogram,
        "per_position_acceptance": pooled.per_position_acceptance,
        "new_tokens": new_tokens,
        "tokens_per_s": new_tokens / seconds if seconds else 0.0,
    }


@torch.no_grad()
def teacher_forced_tau(draft, embed_tokens, lm_head, samples: list[dict], block_size: int, num_anchors: int = 64,
                       seed: int = 0, offset_window: int = 128) -> dict:
    """tau at a fixed ``block_size`` measured on distilled sequences instead of by generating.

    The shards hold the target's own greedy answers and the features it computes for them, so a block anchored at
    response position ``a`` is accepted exactly as far as the drafter's argmax (full ``lm_head``) matches
    ``input_ids[a+1 : a+B]``: tau of that round = 1 + the matching prefix. ``samples`` are `ShardDataset` items
    with features; ``num_anchors`` random anchors per sequence (fixed by ``seed``). Returns pooled tau, the number
    of blocks, per-position acceptance (the share of blocks whose first ``k`` drafts all match) and
    ``tau_by_offset``: tau of the blocks anchored in each ``offset_window`` of response tokens ("0-127": the
    answer's first 128 tokens, where a short generation spends all its rounds).
    """
    generator = torch.Generator().manual_seed(seed)
    device = next(draft.parameters()).device
    accepted, offsets, counts = [], [], torch.zeros(block_size)
    for sample in samples:
        batch = {k: v.to(device) for k, v in collate([sample]).items()}
        anchors, keep = sample_anchors(batch["loss_mask"], block_size, num_anchors, generator)
        if anchors.shape[1] == 0:
            continue
        noise_ids, position_ids = build_block_inputs(batch["input_ids"], anchors, block_size,
                                                     draft.config.mask_token_id, keep)
        mask = build_block_mask(anchors, keep, batch["input_ids"].shape[1], block_size).to(device)
        hidden = draft(noise_embedding=embed_tokens(noise_ids), target_hidden=batch["features"].to(draft.dtype),
                       position_ids=position_ids, attention_mask=mask).last_hidden_state
        labels, weights = block_labels_and_weights(batch["input_ids"], batch["loss_mask"], anchors, keep, block_size,
                                                   None)
        hits = (lm_head(hidden[0]).argmax(-1) == labels[0]) & (weights[0] > 0)
        hits = hits.reshape(-1, block_size)[keep[0], 1:]  # [blocks, B-1]: draft k matches the target's token
        prefix = hits.int().cumprod(dim=1)
        accepted.append(prefix.sum(dim=1).cpu())
        counts[1:] += prefix.sum(dim=0).cpu().float()
        response_start = int(sample["loss_mask"].nonzero()[0])
        offsets.append(anchors[0, keep[0]].cpu() - response_start)
    lengths = torch.cat(accepted).float() if accepted else torch.zeros(0)
    windows = torch.cat(offsets) // offset_window if offsets else torch.zeros(0, dtype=torch.long)
    blocks = len(lengths)
    by_offset = {f"{w * offset_window}-{(w + 1) * offset_window - 1}":
                 {"tau": float(1 + lengths[windows == w].mean()), "blocks": int((windows == w).sum())}
                 for w in windows.unique().tolist()}
    return {"block_size": block_size, "tau": float(1 + lengths.mean()) if blocks else float("nan"), "blocks": blocks,
            "per_position_acceptance": (counts[1:] / max(blocks, 1)).tolist(), "tau_by_offset": by_offset}


def evaluate(config: EvalConfig) -> dict:
    """Run ``dflash-hf eval`` as ``config`` says (see `EvalConfig`); returns and optionally writes JSON."""
    torch.manual_seed(config.seed)
    device = resolve_device(config.device)
    target, tokenizer = load_target(config.target, dtype=config.dtype, device=device)
    draft = load_drafter(config.draft, target, dtype=config.draft_dtype)  # a folder, or "default": the shipped one
    if config.data:
        return evaluate_teacher_forced(config, target, draft)
    prompts, problems = read_prompts(config.prompts, limit=config.limit)
    for problem in problems:
        logger.warning("skipped prompt line %s", problem)
    prompt_ids = [encode_prompt(tokenizer, p.text, config.chat_template_kwargs) for p in prompts]
    print(f"{len(prompt_ids)} prompts, greedy, {config.max_new_tokens} new tokens each")
    results = {"draft": str(config.draft), "target": str(config.target), "num_prompts": len(prompt_ids),
               "max_new_tokens": config.max_new_tokens, "results": []}
    for block_size in config.block_sizes:
        result = acceptance(target, draft, prompt_ids, block_size, config.max_new_tokens, quiet=config.quiet)
        results["results"].append(result)
        print(f"B={block_size:>2}  tau={result['tau']:.3f}  rounds={result['rounds']}  "
              f"histogram={result['histogram']}  tok/s={result['tokens_per_s']:.1f}")
    if config.output:
        Path(config.output).write_text(json.dumps(results, indent=2))
    return results


def evaluate_teacher_forced(config: EvalConfig, target, draft) -> dict:
    """``dflash-hf eval --data DIR``: `teacher_forced_tau` on distilled shards (features stored, else one target
    forward per sequence), per block size."""
    from .distill import teacher_forced_features

    dataset = ShardDataset(config.data)
    samples = [dataset[i] for i in range(len(dataset))[: config.limit]]  # limit None: all
    layer_ids = list(draft.config.target_layer_ids)
    if not dataset.has_features or dataset.target_layer_ids != layer_ids:
        for sample in samples:
            ((sample["features"], _),) = teacher_forced_features(target, [sample["input_ids"].tolist()], layer_ids, 0)
    results = {"draft": str(config.draft), "data": str(config.data), "num_sequences": len(samples), "results": []}
    for block_size in config.block_sizes:
        result = teacher_forced_tau(draft, target.get_input_embeddings(), target.get_output_embeddings(), samples,
                                    block_size, seed=config.seed)
        results["results"].append(result)
        print(f"B={block_size:>2}  teacher-forced tau={result['tau']:.3f}  blocks={result['blocks']}")
        print("      by response position: " + ", ".join(
            f"{window} tau={part['tau']:.3f} ({part['blocks']} blocks)" for window, part in result["tau_by_offset"].items()))
    if config.output:
        Path(config.output).write_text(json.dumps(results, indent=2))
    return results


__all__ = ["acceptance", "evaluate", "evaluate_teacher_forced", "teacher_forced_tau"]
