"""DFlash drafter training: self-distillation data, random-anchor blocks, trainer, evaluation, CLI parsers.

    dflash-hf distill --target DIR --prompts prompts.jsonl --out data/
    dflash-hf train   --target DIR --data data/ --output-dir run/
    dflash-hf eval    --target DIR --draft run/final --prompts heldout.jsonl

See ``docs/training.md``.
"""

from .blocks import (
    block_labels_and_weights,
    build_block_inputs,
    build_block_mask,
    decay_weights,
    default_gamma,
    render_mask,
    sample_anchors,
)

__all__ = [
    "block_labels_and_weights",
    "build_block_inputs",
    "build_block_mask",
    "decay_weights",
    "default_gamma",
    "render_mask",
    "sample_anchors",
]
