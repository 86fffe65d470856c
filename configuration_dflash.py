"""DFlash drafter configuration in the published z-lab layout.

This file travels as remote code inside every saved drafter (``save_pretrained`` copies it), so it imports only
``torch``/``transformers``.

A published drafter ``config.json`` is a Qwen3 config plus three DFlash entries::

    "model_type": "qwen3", "architectures": ["DFlashDraftModel"],
    "block_size": 16,                      # top level (Qwen3/LLaMA drafts) or inside dflash_config (newer drafts)
    "num_target_layers": 36,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}

Every DFlash value is read as z-lab's current code reads it (``_draft_value``): ``dflash_config`` first, then the top
level, then the default. Besides ``block_size``, ``mask_token_id`` and ``target_layer_ids`` that covers the newer keys
(`DRAFT_VALUE_KEYS`): ``input_embedding_scale``, ``output_multiplier``, ``final_logit_softcapping`` (Gemma-style
drafters) and DFlash2's ``conv_kernel_size``, ``conv_group_size``, ``selector_rank``, ``selector_top_k``. A top-level
``is_causal`` sets the block's self-attention mask (see `DFlashConfig.layer_is_causal`).

dflash-hf adds one optional key, ``dflash_config.draft_vocab``: the sorted token ids the drafter drafts from (its
training loss covered only those, ``dflash-hf train --train-vocab N``). Drafts then come from those rows of the
target's ``lm_head`` only (see ``generation_dflash.DraftVocabHead``): 8,192 of SmolLM2's 49,152 rows cut the head's
cost per round ~6x, and verification is unchanged, so output stays exact. It lives in the config rather than as a
tensor in the weights so that the weight set stays the published one (vLLM, SGLang and
``hub.validate_for_publishing`` check it name by name); engines that do not know the key draft over the full
vocabulary, as do checkpoints without it.

`DFlashConfig` exposes all of them as top-level attributes (``block_size``, ``target_layer_ids`` and ``mask_token_id``
are the contract of transformers' built-in DFlash generator), and writes the z-lab layout back: the DFlash values
inside ``dflash_config`` (where vLLM reads them), plus the legacy ``rope_theta``/``rope_scaling`` keys that other
loaders (MLX, vLLM, SGLang) read.
"""

import json
import re
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

# Newer optional values, read `dflash_config` first and the top level second (None = absent: the default applies).
DRAFT_VALUE_KEYS = (
    "input_embedding_scale",  # noise embeddings = raw embedding rows x scale (default 1)
    "output_multiplier",  # draft logits x multiplier (default 1)
    "final_logit_softcapping",  # then tanh(logits / c) * c when c > 0 (default none)
    "conv_kernel_size",  # DFlash2: taps of the dynamic convolution
    "conv_group_size",  # DFlash2: channels per dynamic-kernel group
    "selector_rank",  # DFlash2: rank of the path selector's pairwise score
    "selector_top_k",  # DFlash2: candidates per block position
)


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Default target layers to read context features from, exactly as the reference code picks them.

    One drafter layer reads the middle layer; otherwise the ids are spread uniformly from layer 1 to layer
    ``L - 3`` with Python's ``round`` (half to even): 36 target layers, 5 features -> ``[1, 9, 17, 25, 33]``;
    32 -> 4 gives ``[1, 10, 20, 29]``. Index ``i`` means the output of decoder layer ``i``, i.e. ``hidden_states[i + 1]``.
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    return [int(round(start + i * (end - start) / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@strict
class DFlashConfig(Qwen3Config):
    r"""Configuration of a DFlash drafter: a Qwen3-style stack conditioned on target hidden states.

    Args (beyond the Qwen3 fields ``hidden_size``, ``intermediate_size``, heads, ``head_dim``, ``rms_norm_eps``,
    rope, ``layer_types``, ``sliding_window``, ``attention_bias``, ``vocab_size``):
        block_size (`int`, defaults to 16):
            Tokens per drafted block ``[last verified token, mask x (block_size - 1)]``.
        num_target_layers (`int`, *optional*):
            Number of decoder layers of the target this drafter was trained for.
        dflash_config (`dict`, *optional*):
            ``{"target_layer_ids": [...], "mask_token_id": int}`` as stored in published checkpoints.
        target_layer_ids (`list[int]`, *optional*):
            Same as ``dflash_config["target_layer_ids"]``; defaults to `build_target_layer_ids`.
        mask_token_id (`int`, *optional*):
            Same as ``dflash_config["mask_token_id"]``: a row of the target's vocabulary used for masked slots.
        is_causal (`bool`, *optional*):
            Top level only. Whether block rows attend causally to the block; absent, only sliding-window layers do.
        input_embedding_scale, output_multiplier, final_logit_softcapping, conv_kernel_size, conv_group_size,
        selector_rank, selector_top_k (*optional*):
            See `DRAFT_VALUE_KEYS`; a value inside ``dflash_config`` wins over the top level.
        draft_vocab (`list[int]`, *optional*):
            ``dflash_config["draft_vocab"]``: sorted, distinct token ids the drafter drafts from (see the module
            docstring); ``None`` drafts over the whole vocabulary.
    """

    model_type = "qwen3"  # what published drafts declare, and what vLLM/SGLang expect

    block_size: int = 16
    num_target_layers: int | None = None
    dflash_config: dict | None = None
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = None
    is_causal: bool | None = None
    input_embedding_scale: float | None = None
    output_multiplier: float | None = None
    final_logit_softcapping: float | None = None
    conv_kernel_size: int | None = None
    conv_group_size: int | None = None
    selector_rank: int | None = None
    selector_top_k: int | None = None
    draft_vocab: list[int] | None = None

    def __post_init__(self, **kwargs):
        # Qwen3Config drops `sliding_window` unless `use_sliding_window`; drafts that declare sliding layers in
        # `layer_types` must keep their window, or attention silently becomes full.
        window = self.sliding_window
        super().__post_init__(**kwargs)
        if self.layer_types and "sliding_attention" in self.layer_types and window is not None:
            self.sliding_window = window

        # z-lab's order for every DFlash value: dflash_config, then the top level, then the default.
        nested = dict(self.dflash_config or {})
        for name in ("block_size", "target_layer_ids", "mask_token_id", "draft_vocab", *DRAFT_VALUE_KEYS):
            if nested.get(name) is not None:
                setattr(self, name, nested[name])
        if self.target_layer_ids is None and self.num_target_layers is not None:
            self.target_layer_ids = build_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
        nested.update(target_layer_ids=self.target_layer_ids, mask_token_id=self.mask_token_id)
        self.dflash_config = nested
        self._validate_dflash_fields()

    def layer_is_causal(self, layer_idx: int) -> bool:
        """Whether layer ``layer_idx``'s block rows attend causally within the block (z-lab's rule): the top-level
        ``is_causal`` when set, otherwise causal exactly on ``sliding_attention`` layers."""
        if self.is_causal is not None:
            return bool(self.is_causal)
        return self.layer_types[layer_idx] == "sliding_attention"

    def _validate_dflash_fields(self):
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.target_layer_ids is not None:
            if not self.target_layer_ids or min(self.target_layer_ids) < 0:
                raise ValueError(f"target_layer_ids must be non-negative layer indices, got {self.target_layer_ids}")
            if self.num_target_layers is not None and max(self.target_layer_ids) >= self.num_target_layers:
                raise ValueError(
                    f"target_layer_ids {self.target_layer_ids} reach past the target's {self.num_target_layers} "
                    f"layers (index i reads the output of decoder layer i); use ids below {self.num_target_layers}."
                )
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (vocab_size {self.vocab_size}); "
                "pick a reserved or unused row of the target's vocabulary."
            )
        if self.draft_vocab is not None:
            ids = list(self.draft_vocab)
            if not ids or ids != sorted(set(ids)) or ids[0] < 0 or ids[-1] >= self.vocab_size:
                raise ValueError(
                    f"draft_vocab must be a non-empty sorted list of distinct token ids in [0, {self.vocab_size}) "
                    f"(got {len(ids)} ids); write it with `dflash-hf draft-vocab` or set it to None."
                )

    def to_dict(self) -> dict[str, Any]:
        """The z-lab layout: DFlash ids nested in ``dflash_config``, legacy rope keys restored."""
        output = super().to_dict()
        output.pop("target_layer_ids", None)
        output.pop("mask_token_id", None)
        if self.is_causal is None:  # unset: write no key, as published configs do
            output.pop("is_causal", None)
        newer = {name: output.pop(name, None) for name in (*DRAFT_VALUE_KEYS, "draft_vocab")}
        nested = {k: v for k, v in (self.dflash_config or {}).items() if k != "draft_vocab"}  # the attribute rules
        output["dflash_config"] = {
            **nested,
            **{name: value for name, value in newer.items() if value is not None},
            "target_layer_ids": self.target_layer_ids,
            "mask_token_id": self.mask_token_id,
            "block_size": self.block_size,
        }
        rope = dict(self.rope_parameters or {})
        output["rope_theta"] = rope.get("rope_theta")
        scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "partial_rotary_factor")}
        output["rope_scaling"] = None if scaling.get("rope_type", "default") == "default" else scaling
        return output

    def to_json_string(self, use_diff: bool = True) -> str:
        """transformers' JSON, with ``draft_vocab`` (thousands of ids) on one line instead of one line per id."""
        text = super().to_json_string(use_diff)
        if self.draft_vocab is None:
            return text
        return re.sub(r'"draft_vocab": \[[^\]]*\]', lambda _: f'"draft_vocab": {json.dumps(list(self.draft_vocab))}',
                      text, count=1)

    @classmethod
    def from_target_config(
        cls,
        target_config,
        *,
        mask_token_id: int,
        num_hidden_layers: int = 5,
        block_size: int = 16,
        target_layer_ids: list[int] | None = None,
        **overrides,
    ) -> "DFlashConfig":
        """A drafter config matching a target (hidden sizes, heads, vocab, rope) for training a new drafter.

        ``target_layer_ids`` defaults to one feature per drafter layer, chosen by `build_target_layer_ids`.
        """
        text = target_config.get_text_config()
        num_target_layers = text.num_hidden_layers
        if target_layer_ids is None:
            target_layer_ids = build_target_layer_ids(num_target_layers, num_hidden_layers)
        fields = dict(
            hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size,
            num_attention_heads=text.num_attention_heads,
            num_key_value_heads=getattr(text, "num_key_value_heads", None) or text.num_attention_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads,
            vocab_size=text.vocab_size,
            rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6),
            rope_parameters=dict(text.rope_parameters) if getattr(text, "rope_parameters", None) else None,
            max_position_embeddings=text.max_position_embeddings,
            hidden_act=getattr(text, "hidden_act", "silu"),
            num_hidden_layers=num_hidden_layers,
            layer_types=["full_attention"] * num_hidden_layers,
            num_target_layers=num_target_layers,
            block_size=block_size,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            tie_word_embeddings=False,
            bos_token_id=getattr(text, "bos_token_id", None),
            eos_token_id=getattr(text, "eos_token_id", None),
            pad_token_id=getattr(text, "pad_token_id", None),
            architectures=["DFlashDraftModel"],
        )
        fields.update(overrides)
        return cls(**fields)


__all__ = ["DRAFT_VALUE_KEYS", "DFlashConfig", "build_target_layer_ids"]
