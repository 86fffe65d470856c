"""Typed settings of ``distill``, ``features``, ``train``, ``eval`` and ``train-all``: what the library functions take.

The command lines (`dflash_hf.training.cli`) parse flags into these and call the functions; from Python, build them
directly, e.g. ``train(TrainConfig(target=..., data=..., output_dir=..., mask_token_id=16, max_steps=100))``. Field
names are the flags' (``--max-new-tokens`` -> ``max_new_tokens``), and defaults are the flags' defaults.
"""

import argparse
import json
from dataclasses import dataclass, field, fields


@dataclass(kw_only=True)
class RunConfig:
    """What every stage needs: the target model and how to run."""

    target: str  # local folder of the target model (config, weights, tokenizer)
    device: str | None = None  # cpu, cuda, cuda:1 ... (None: cuda if available)
    seed: int = 0  # sampling, init, data order, anchors
    quiet: bool = False  # no progress bars
    threads: int | None = None  # torch.set_num_threads (CPU); applied by the command line


@dataclass(kw_only=True)
class GenerationOptions:
    """How the target answers the prompts in ``distill`` (and the first stage of ``train-all``)."""

    batch_size: int = 16  # prompts generated together (left padding)
    max_new_tokens: int = 512  # longest response the target writes
    temperature: float = 0.0  # 0 = greedy; > 0 samples the target's answers
    max_prompt_length: int = 2048  # skip (and report) longer templated prompts
    shard_size: int = 256  # prompts per shard (the unit of resumption)
    no_features: bool = False  # store tokens only; training then runs the target online for features
    num_features: int = 5  # feature layers when no target_layer_ids are given (build_target_layer_ids)
    chat_template_kwargs: dict | None = None  # passed to apply_chat_template, e.g. {"enable_thinking": False}


@dataclass(kw_only=True)
class DistillConfig(RunConfig, GenerationOptions):
    """``dflash-hf distill``: the target answers ``prompts``; its answers (and features) become shards in ``out``."""

    prompts: list[str]  # JSONL/JSON prompt files (turns/ShareGPT/prompt)
    out: str  # output folder of shard-*.safetensors + manifest.json
    limit: int | None = None  # use at most this many prompts
    dtype: str = "float32"  # target dtype
    target_layer_ids: list[int] | None = None  # feature layers (None: build_target_layer_ids)
    time_budget: float | None = None  # seconds; no new shard starts after this
    draft: str | None = None  # a DFlash drafter folder for the target: batches decode with batched DFlash (same tokens)


@dataclass(kw_only=True)
class FeaturesConfig(RunConfig):
    """``dflash-hf features``: token-only shards in ``data`` -> the same shards with features, in ``out``."""

    data: str
    out: str
    dtype: str = "float32"
    batch_size: int = 8  # sequences per teacher-forced forward
    target_layer_ids: list[int] | None = None  # None: the shards' ids, else build_target_layer_ids
    num_features: int = 5  # feature layers when no ids are known


@dataclass(kw_only=True)
class TrainOptions:
    """The drafter, its blocks and loss, the optimisation and run control of ``train`` (see `add_train_parser`)."""

    # drafter
    mask_token_id: int  # an unused row of the target's vocabulary for masked block slots (SmolLM2: 16)
    num_draft_layers: int = 5
    block_size: int = 16
    target_layer_ids: list[int] | None = None  # None: the shards' ids, else build_target_layer_ids
    intermediate_size: int | None = None  # drafter MLP width (None: the target's)
    init_from: str | None = None  # start from this trained drafter folder (fresh optimizer and schedule)
    add_draft_layers: int = 0  # with init_from: append this many layers that start as the identity
    new_layers_lr_scale: float = 1.0  # the appended layers' learning rate, as a multiple of lr
    warm_start: bool = False  # copy the target's top layers and final norm into the drafter
    attn_implementation: str = "auto"  # auto, block_sparse, flex_attention, sdpa or eager (training only)
    # blocks and loss
    num_anchors: int = 512
    gamma: float | None = None  # loss decay exp(-(k-1)/gamma); None: default_gamma(block_size); <= 0: uniform
    sample_positions: bool = False
    train_vocab: int = 0  # loss over the N most frequent response tokens only (0 = the full vocabulary)
    kd_weight: float = 0.0  # the share of the loss that is KL to the target's distribution (online features only)
    max_length: int = 3072
    online_features: bool = False
    # optimisation
    lr: float = 6e-4
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.04
    warmup_steps: int | None = None
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    adam_eps: float = 1e-8
    max_grad_norm: float = 1.0
    fc_max_grad_norm: float = 1.0
    batch_size: int = 1  # sequences per micro-batch per process
    grad_accum: int = 1
    epochs: int = 6
    max_steps: int | None = None
    schedule: str = "steps"  # steps: warm-up + cosine over the steps; time: over time_budget too, whichever ends first
    bf16: bool | None = None  # bf16 autocast; None: where the device computes bf16 natively (`resolve_autocast`)
    target_dtype: str = "float32"
    # run control
    time_budget: float | None = None
    stop_after: int | None = None
    log_every: int = 10
    save_every: int = 1000
    keep_checkpoints: int = 3
    final_dtype: str = "bfloat16"
    final_max_shard_size: str | None = None
    export_dir: str | None = None  # also write the drafter (final_dtype, no code files) and log here, periodically
    export_every: float = 60.0  # seconds between exports to export_dir


@dataclass(kw_only=True)
class TrainConfig(RunConfig, TrainOptions):
    """``dflash-hf train``: a drafter trained on the shards in ``data``, run folder ``output_dir``."""

    data: str | list[str]  # folder(s) of shard-*.safetensors from `dflash-hf distill`: one shuffled mix
    output_dir: str  # run folder: checkpoints/, latest, final/, log.jsonl
    resume: str | None = None  # 'auto' (OUT/latest if any), a run folder or a checkpoint folder


@dataclass(kw_only=True)
class EvalConfig(RunConfig):
    """``dflash-hf eval``: tau of the drafter ``draft`` per block size, by generating (``prompts``) or teacher-forced
    on distilled shards (``data``)."""

    draft: str
    prompts: list[str] | None = None
    data: str | None = None
    limit: int | None = None  # at most this many prompts (or sequences); None: all
    block_sizes: list[int] = field(default_factory=lambda: [4, 8, 16])
    max_new_tokens: int = 128
    dtype: str = "float32"
    draft_dtype: str = "float32"
    chat_template_kwargs: dict | None = None
    output: str | None = None  # write the results as JSON here


@dataclass(kw_only=True)
class TrainAllConfig(RunConfig):
    """``dflash-hf train-all``: distill ``prompts`` (up to ``distill_fraction`` of ``budget`` seconds) into
    ``out/data``, train into ``out/train`` for the rest, optionally evaluate on ``eval_prompts``."""

    prompts: list[str]
    out: str
    budget: float
    training: TrainOptions
    generation: GenerationOptions = field(default_factory=GenerationOptions)
    distill_fraction: float = 0.3
    limit: int | None = None
    eval_prompts: list[str] | None = None


def from_args(config_class, args: argparse.Namespace, **overrides):
    """``config_class`` filled from the parsed flags of the same names (and ``overrides``)."""
    values = {f.name: getattr(args, f.name) for f in fields(config_class) if hasattr(args, f.name)}
    return config_class(**(values | overrides))


def json_object(text: str | None) -> dict | None:
    """``--chat-template-kwargs``: a JSON object, or None."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except ValueError as error:
        raise ValueError(f"--chat-template-kwargs is not valid JSON ({error}): pass an object, e.g. "
                         '\'{"enable_thinking": false}\'') from None
    if not isinstance(value, dict):
        raise ValueError(f"--chat-template-kwargs must be a JSON object, got {text!r}")
    return value


__all__ = [
    "DistillConfig",
    "EvalConfig",
    "FeaturesConfig",
    "GenerationOptions",
    "RunConfig",
    "TrainAllConfig",
    "TrainConfig",
    "TrainOptions",
]
