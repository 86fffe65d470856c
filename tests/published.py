"""Checkpoint folders in each published drafter layout, written from the documented configs and safetensors header
shapes (docs/dflash-reference.md §5, docs/dflash2-reference.md), with random weights; and a stand-in for z-lab's own
remote code (``dflash.py``) to load them with ``trust_remote_code=True``."""

import json
import shutil
from pathlib import Path

import torch
from conftest import MASK_ID
from safetensors.torch import save_file

STANDIN = Path(__file__).parent / "zlab_dflash_standin.py"


def base_config(target, *, block_size, num_layers=2, target_layer_ids=(1, 3), **top_level) -> dict:
    """A z-lab drafter ``config.json`` for a tiny target (hidden 64, heads 4/2 of 16): Qwen3 keys + ``dflash_config``."""
    t = target.config
    config = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": 16,
        "vocab_size": t.vocab_size,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "max_position_embeddings": 1024,
        "layer_types": ["full_attention"] * num_layers,
        "attention_bias": False,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "num_target_layers": t.num_hidden_layers,
        "dtype": "bfloat16",
        "dflash_config": {"block_size": block_size, "mask_token_id": MASK_ID, "target_layer_ids": list(target_layer_ids)},
    }
    config.update(top_level)
    return config


def gemma_style_config(target, block_size=4, window=6) -> dict:
    """v1 with the newer keys: scale and multiplier inside ``dflash_config``, a top-level softcap (as Gemma-4 v1
    drafters carry it) and a top-level ``is_causal``; a sliding layer with a short window and a full one."""
    config = base_config(
        target, block_size=block_size, final_logit_softcapping=3.0, is_causal=True, sliding_window=window,
        layer_types=["sliding_attention", "full_attention"], use_sliding_window=True,
    )  # fmt: skip
    config["dflash_config"].update(input_embedding_scale=8.0, output_multiplier=0.5)
    return config


def dflash2_config(target, block_size=4, window=2048, is_causal=False) -> dict:
    """Muse-Glimmer-30B-DFlash2-like: all layers sliding, top-level ``is_causal``, no ``auto_map``, the DFlash2 keys,
    the logits multiplier and softcap inside ``dflash_config``."""
    config = base_config(
        target, block_size=block_size, architectures=["DFlash2DraftModel"], is_causal=is_causal,
        sliding_window=window, layer_types=["sliding_attention"] * 2, rope_parameters={"rope_theta": 5e5},
    )  # fmt: skip
    config["dflash_config"].update(
        conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=5,
        output_multiplier=0.19611613513818404, final_logit_softcapping=20.0,
    )  # fmt: skip
    return config


def weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """The safetensors header of a published checkpoint: un-prefixed names, no embedding, no lm_head."""
    hidden, head_dim, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    nested = config["dflash_config"]
    shapes = {
        "fc.weight": (hidden, len(nested["target_layer_ids"]) * hidden),
        "hidden_norm.weight": (hidden,),
        "norm.weight": (hidden,),
    }
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
            p + "self_attn.q_proj.weight": (q_dim, hidden), p + "self_attn.k_proj.weight": (kv_dim, hidden),
            p + "self_attn.v_proj.weight": (kv_dim, hidden), p + "self_attn.o_proj.weight": (hidden, q_dim),
            p + "self_attn.q_norm.weight": (head_dim,), p + "self_attn.k_norm.weight": (head_dim,),
            p + "mlp.gate_proj.weight": (ffn, hidden), p + "mlp.up_proj.weight": (ffn, hidden),
            p + "mlp.down_proj.weight": (hidden, ffn),
        }  # fmt: skip
        if "conv_kernel_size" in nested:
            taps, groups = nested["conv_kernel_size"], hidden // nested["conv_group_size"]
            for conv in ("attention_conv", "mlp_conv"):
                shapes |= {p + f"{conv}.base_kernel": (2, taps, hidden),
                           p + f"{conv}.kernel_projection.weight": (2 * taps * groups, hidden)}
    if "selector_rank" in nested:
        rank = nested["selector_rank"]
        shapes |= {
            "candidate_selector.hidden_projection.weight": (rank, hidden),
            "candidate_selector.predecessor_codebook": (config["vocab_size"], rank),
            "candidate_selector.successor_codebook": (config["vocab_size"], rank),
        }
    return shapes


def random_weights(config: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 weights of a plausible scale: norms near 1, base kernels near identity, sizeable dynamic kernels and
    codebooks (so that the convolution and the selector change the drafts)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(config).items():
        noise = torch.randn(shape, generator=generator)
        if name.endswith("norm.weight"):
            tensor = 1.0 + 0.1 * noise
        elif name.endswith("base_kernel"):
            tensor = 0.3 * noise
            tensor[:, 0] += 1.0
        elif "codebook" in name:
            tensor = noise
        else:
            tensor = noise * shape[-1] ** -0.5
        weights[name] = tensor.to(torch.bfloat16).contiguous()
    return weights


def write_checkpoint(folder, config: dict, seed: int = 0, remote_code: bool = False) -> Path:
    """Write ``config.json`` and ``model.safetensors``; with ``remote_code``, z-lab's ``dflash.py`` stand-in and its
    ``auto_map`` (as the z-lab v1 repositories ship them)."""
    folder = Path(folder)
    folder.mkdir(parents=True)
    if remote_code:
        architecture = config["architectures"][0]
        config = dict(config, auto_map={"AutoModel": f"dflash.{architecture}"})
        shutil.copy(STANDIN, folder / "dflash.py")
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    save_file(random_weights(config, seed), folder / "model.safetensors", metadata={"format": "pt"})
    return folder
