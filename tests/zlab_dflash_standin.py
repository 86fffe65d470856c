"""A stand-in for z-lab's remote code ``dflash.py``, copied into checkpoint folders by the tests.

It has z-lab's class names (``DFlashDraftModel``, ``DFlash2DraftModel``), module layout and weight names, reads its
values as z-lab's code does (``dflash_config`` first), and holds the DFlash2 codebooks as ``nn.Embedding`` (so the
published bare keys need z-lab's ``key_mapping``). It has no forward on purpose: dflash-hf must run its own math on
these modules' weights.
"""

import torch
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3PreTrainedModel, Qwen3RMSNorm, Qwen3RotaryEmbedding

CODEBOOK_KEY_MAPPING = {r"^candidate_selector\.(predecessor|successor)_codebook$": r"candidate_selector.\1_codebook.weight"}


def _draft_value(config, name, default=None):
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


class Qwen3DFlashAttention(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        head_dim, bias = config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)


class Qwen3DFlashDecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = Qwen3DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class GroupedDynamicCausalConv(nn.Module):
    def __init__(self, config):
        super().__init__()
        taps, groups = _draft_value(config, "conv_kernel_size"), config.hidden_size // _draft_value(config, "conv_group_size")
        self.base_kernel = nn.Parameter(torch.zeros(2, taps, config.hidden_size))
        self.kernel_projection = nn.Linear(config.hidden_size, 2 * taps * groups, bias=False)


class DFlash2DecoderLayer(Qwen3DFlashDecoderLayer):
    def __init__(self, config, layer_idx):
        super().__init__(config, layer_idx)
        self.attention_conv = GroupedDynamicCausalConv(config)
        self.mlp_conv = GroupedDynamicCausalConv(config)


class CandidateSelector(nn.Module):
    def __init__(self, config):
        super().__init__()
        rank = _draft_value(config, "selector_rank")
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Embedding(config.vocab_size, rank)
        self.successor_codebook = nn.Embedding(config.vocab_size, rank)


class DFlashDraftModel(Qwen3PreTrainedModel):
    layer_class = Qwen3DFlashDecoderLayer
    _no_split_modules = ["Qwen3DFlashDecoderLayer"]
    _can_record_outputs = {}

    def __init__(self, config):
        super().__init__(config)
        self.layers = nn.ModuleList(self.layer_class(config, i) for i in range(config.num_hidden_layers))
        self.target_layer_ids = _draft_value(config, "target_layer_ids")
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.block_size = _draft_value(config, "block_size", 16)
        self.mask_token_id = _draft_value(config, "mask_token_id")
        self.post_init()

    def forward(self, *args, **kwargs):
        raise NotImplementedError("stand-in: dflash-hf runs its own forward on these weights")


class DFlash2DraftModel(DFlashDraftModel):
    layer_class = DFlash2DecoderLayer

    def __init__(self, config):
        super().__init__(config)
        self.candidate_selector = CandidateSelector(config)
        self.post_init()
