"""DFlash drafter training: self-distillation data, random-anchor blocks, trainer, evaluation, CLI parsers.

    dflash-hf distill --target DIR --prompts prompts.jsonl --out data/
    dflash-hf train   --target DIR --data data/ --output-dir run/
    dflash-hf eval    --target DIR --draft run/final --prompts heldout.jsonl

See ``docs/training.md``.
"""
