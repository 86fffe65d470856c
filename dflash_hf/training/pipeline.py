"""``train-all`` as a library function: distill, train and (optionally) evaluate within one wall-clock budget.

    from dflash_hf.training import TrainAllConfig, TrainOptions, train_all

    train_all(TrainAllConfig(target="path/to/target", prompts=["prompts.jsonl"], out="run", budget=3600,
                             training=TrainOptions(mask_token_id=16, final_max_shard_size="15MB")))

Rerunning with the same ``out`` resumes both stages (finished shards are kept, training resumes from ``out/train``).
"""

import time
from dataclasses import asdict, fields
from pathlib import Path

from ..loading import resolve_device
from .config import DistillConfig, EvalConfig, RunConfig, TrainAllConfig, TrainConfig
from .distill import distill
from .trainer import train


def train_all(config: TrainAllConfig) -> dict:
    """Distill ``config.prompts`` into ``out/data`` for up to ``distill_fraction`` of the budget, train into
    ``out/train`` for 95% of what is left (room for the final save), then evaluate ``out/train/final`` on
    ``eval_prompts`` into ``out/eval.json`` if given. On a GPU the target answers in bf16; training autocasts to bf16
    where the device computes it natively (`resolve_autocast`) unless ``training.bf16`` says otherwise. Returns the
    training summary."""
    start = time.monotonic()
    out, training = Path(config.out), config.training
    run = {f.name: getattr(config, f.name) for f in fields(RunConfig)}
    on_gpu = resolve_device(config.device).startswith("cuda")
    distill(DistillConfig(
        **run, **asdict(config.generation), prompts=config.prompts, out=str(out / "data"), limit=config.limit,
        dtype="bfloat16" if on_gpu else training.target_dtype, target_layer_ids=training.target_layer_ids,
        time_budget=config.budget * config.distill_fraction,
    ))
    remaining = config.budget - (time.monotonic() - start)
    options = asdict(training) | {"time_budget": max(1.0, remaining * 0.95)}
    summary = train(TrainConfig(**run, **options, data=str(out / "data"), output_dir=str(out / "train"),
                                resume="auto"))
    if config.eval_prompts:
        from .evaluate import evaluate

        evaluate(EvalConfig(**run, draft=summary["final"], prompts=config.eval_prompts, dtype=training.target_dtype,
                            chat_template_kwargs=config.generation.chat_template_kwargs,
                            output=str(out / "eval.json")))
    return summary


__all__ = ["train_all"]
