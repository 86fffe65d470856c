"""DFlash drafter training: self-distillation data, random-anchor blocks, trainer, evaluation, CLI parsers.

    dflash-hf distill --target DIR --prompts prompts.jsonl --out data/
    dflash-hf train   --target DIR --data data/ --output-dir run/
    dflash-hf eval    --target DIR --draft run/final --prompts heldout.jsonl

From Python, each command is a function of a typed config (`dflash_hf.training.config`): ``distill(DistillConfig)``,
``add_features(FeaturesConfig)``, ``train(TrainConfig)``, ``evaluate(EvalConfig)``, ``train_all(TrainAllConfig)``.
See ``docs/training.md``.
"""

from . import config
from .config import *  # noqa: F403  (the typed configs: DistillConfig, TrainConfig, ...)
from .pipeline import train_all

__all__ = [*config.__all__, "train_all"]
