"""The DFlash2 drafter: DFlash plus a two-tap dynamic convolution in every layer and a path selector over top-K drafts.

This file travels as remote code inside every saved DFlash2 drafter, so it imports only ``torch``, ``transformers`` and
its flat siblings. It loads the published layout (``architectures: ["DFlash2DraftModel"]``, ``model_type: qwen3``, no
``auto_map``, un-prefixed weights, bare codebook keys); what `save_pretrained` writes adds ``auto_map`` and this code.

Beyond DFlash's weights (see ``modeling_dflash``), with ``H`` hidden, ``G = H / conv_group_size`` groups,
``K = conv_kernel_size`` taps, ``r = selector_rank`` and ``V`` the vocabulary:

* ``layers.{i}.{attention_conv, mlp_conv}.base_kernel [2, K, H]`` (side, tap, channel) and
  ``.kernel_projection.weight [2*K*G, H]`` (row = side*K*G + tap*G + g): `DFlash2DynamicConv`;
* ``candidate_selector.hidden_projection.weight [r, H]``, ``candidate_selector.predecessor_codebook [V, r]``,
  ``candidate_selector.successor_codebook [V, r]``: `DFlash2CandidateSelector`.
"""

import torch
from torch import nn
from transformers import initialization as init

from .configuration_dflash import DFlashConfig
from .modeling_dflash import DFlashDecoderLayer, DFlashDraftModel


class DFlash2DynamicConv(nn.Module):
    """A causal convolution along the block with ``K`` taps, whose kernel is a learned base plus a per-row, per-group
    correction predicted from the sublayer's normed input.

    Wrapped around a sublayer: `prepare` convolves the sublayer's input with side 0 of the kernel and returns the
    dynamic kernel, `finish` convolves the sublayer's output with side 1 of the same kernel. The block start is zero
    padded (the anchor row has no earlier taps); context rows never pass through it.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        hidden = config.hidden_size
        self.num_taps, self.group_size = config.conv_kernel_size, config.conv_group_size
        self.num_groups = hidden // self.group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, self.num_taps, hidden))
        self.kernel_projection = nn.Linear(hidden, 2 * self.num_taps * self.num_groups, bias=False)

    def prepare(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states [b, L, H]`` -> (side-0 convolution ``[b, L, H]``, dynamic kernel ``[b, L, 2, K, G]``)."""
        batch, length, _ = hidden_states.shape
        dynamic = self.kernel_projection(hidden_states).view(batch, length, 2, self.num_taps, self.num_groups)
        return self._convolve(hidden_states, dynamic, side=0), dynamic

    def finish(self, hidden_states: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        """The sublayer's output ``[b, L, H]`` convolved with side 1 of the kernel `prepare` returned."""
        return self._convolve(hidden_states, dynamic, side=1)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, side: int) -> torch.Tensor:
        """``out[t, c] = sum_o (base[side, o, c] + dynamic[t, side, o, c // group_size]) * x[t - o, c]``, accumulated
        per tap as the reference does (``out += base * x_o`` then ``out = addcmul(out, dynamic, x_o)``)."""
        out = torch.zeros_like(x)
        for tap in range(self.num_taps):
            shifted = nn.functional.pad(x, (0, 0, tap, 0))[:, : x.shape[1]]  # x[t - tap], zeros before the block
            per_channel = dynamic[:, :, side, tap].repeat_interleave(self.group_size, dim=-1)  # [b, L, H]
            out = out + self.base_kernel[side, tap] * shifted
            out = torch.addcmul(out, per_channel, shifted)
        return out


class DFlash2DecoderLayer(DFlashDecoderLayer):
    """A DFlash layer with the dynamic convolution wrapped around both sublayers (block rows only)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.attention_conv = DFlash2DynamicConv(config)
        self.mlp_conv = DFlash2DynamicConv(config)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, past_key_values, cache_block, **kwargs):
        residual = hidden_states
        attention_input, kernel = self.attention_conv.prepare(self.input_layernorm(hidden_states))
        attention_output = self.self_attn(
            attention_input,
            context=context,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_block=cache_block,
            **kwargs,
        )
        hidden_states = residual + self.attention_conv.finish(attention_output, kernel)
        mlp_input, kernel = self.mlp_conv.prepare(self.post_attention_layernorm(hidden_states))
        return hidden_states + self.mlp_conv.finish(self.mlp(mlp_input), kernel)


class DFlash2CandidateSelector(nn.Module):
    """Picks one of the top-K candidates per block position by a greedy walk from the anchor.

    The score of candidate ``c`` at position ``t`` after token ``prev`` is the draft logit of ``c`` plus a low-rank
    pairwise term ``<predecessor_codebook[prev] * hidden_projection(h_t), successor_codebook[c]>``.
    """

    def __init__(self, config: DFlashConfig):
        super().__init__()
        rank = config.selector_rank
        self.hidden_projection = nn.Linear(config.hidden_size, rank, bias=False)
        # Bare parameters, as published (the reference's nn.Embedding adds a ".weight" to these names).
        self.predecessor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(config.vocab_size, rank))

    def walk(self, unary, candidates, draft_hidden, anchor, temperature: float | None = None):
        """``unary``/``candidates [M, K]`` (top-K logits and ids), ``draft_hidden [M, H]``, ``anchor`` (token id) ->
        ``(path [M], draft_logits)``.

        ``temperature`` None walks greedily and returns no ``draft_logits``; otherwise each step samples from
        ``q_t = softmax(S_t / T)`` and ``draft_logits [M, V]`` (float32) holds ``S_t / T`` on the candidates and
        ``-inf`` elsewhere, so that ``softmax(draft_logits[t])`` is ``q_t`` given the realised predecessor.
        """
        projected = self.hidden_projection(draft_hidden)  # [M, r]
        previous = anchor.reshape(1)
        path, scores = [], []
        for t in range(candidates.shape[0]):
            query = self.predecessor_codebook[previous] * projected[t : t + 1]  # [1, r]
            score = unary[t : t + 1] + torch.einsum(
                "br,bkr->bk", query, self.successor_codebook[candidates[t : t + 1]]
            )  # [1, K]
            if temperature is None:
                choice = score.argmax(dim=-1)
            else:
                score = score.float() / temperature
                choice = torch.multinomial(score.softmax(dim=-1), num_samples=1)[:, 0]
                scores.append(score)
            previous = candidates[t, choice]
            path.append(previous)
        path = torch.cat(path)
        if temperature is None:
            return path, None
        draft_logits = torch.full(
            (candidates.shape[0], self.successor_codebook.shape[0]), float("-inf"), device=candidates.device
        )
        return path, draft_logits.scatter(1, candidates, torch.cat(scores))


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2 drafter. Pass it as ``assistant_model`` to a target's ``generate``: greedy output equals plain greedy,
    and sampling runs rejection sampling against the selector's distribution ``q`` (lossless).

    The forward is DFlash's (same call contracts, same masks) with `DFlash2DecoderLayer`; the drafts come from
    `propose`: logits of rows ``1..B-1`` (transformed as in DFlash), their top-K, then the selector's walk.
    """

    decoder_layer_class = DFlash2DecoderLayer
    _no_split_modules = ["DFlash2DecoderLayer"]

    def __init__(self, config: DFlashConfig):
        _check_dflash2_config(config)
        super().__init__(config)
        self.candidate_selector = DFlash2CandidateSelector(config)
        self.post_init()

    @staticmethod
    def remote_weight_name(name: str) -> str:
        """z-lab's remote code holds the codebooks as ``nn.Embedding`` (``...codebook.weight``); ours are bare."""
        return name.removesuffix(".weight") if name.endswith("_codebook.weight") else name

    def _init_weights(self, module):
        super()._init_weights(module)
        if isinstance(module, DFlash2DynamicConv):  # identity at init: tap 0 passes its input, no dynamic part
            identity = torch.zeros_like(module.base_kernel)
            identity[:, 0] = 1.0
            init.copy_(module.base_kernel, identity)
        elif isinstance(module, DFlash2CandidateSelector):
            init.normal_(module.predecessor_codebook, std=self.config.initializer_range)
            init.normal_(module.successor_codebook, std=self.config.initializer_range)

    def propose(self, lm_head, rows: torch.Tensor, anchor: torch.Tensor, temperature: float | None = None, warp=None):
        """Draft hidden states ``rows [M, H]`` -> ``(path [M], draft_logits [M, V] or None)``, see
        `DFlash2CandidateSelector.walk`. ``temperature`` None: the greedy walk. ``warp`` (the target's logits
        processors) is not applied: the reference's q is ``softmax(S_t / T)`` over the selector's candidates."""
        logits = self.transform_logits(lm_head(rows))  # full (or draft) vocabulary, the head's dtype, before top-k
        unary, candidates = logits.topk(min(self.config.selector_top_k, logits.shape[-1]), dim=-1, sorted=False)
        vocab_ids = getattr(lm_head, "vocab_ids", None)  # a `DraftVocabHead`: columns -> token ids
        if vocab_ids is not None:
            candidates = vocab_ids[candidates]
        device = self.candidate_selector.successor_codebook.device
        return self.candidate_selector.walk(
            unary.to(device), candidates.to(device), rows.to(device=device, dtype=self.dtype), anchor.to(device),
            temperature,
        )  # fmt: skip


def _check_dflash2_config(config: DFlashConfig) -> None:
    required = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
    missing = [name for name in required if getattr(config, name) is None]
    if missing:
        raise ValueError(
            f"A DFlash2 drafter config needs {', '.join(missing)} (in `dflash_config`); this checkpoint has none: "
            "it is not a DFlash2 drafter, load it with `DFlashDraftModel`."
        )
    if config.hidden_size % config.conv_group_size:
        raise ValueError(
            f"conv_group_size {config.conv_group_size} does not divide hidden_size {config.hidden_size}; the dynamic "
            "kernel is shared by groups of that many channels."
        )
    if not 1 <= config.selector_top_k <= config.vocab_size:
        raise ValueError(f"selector_top_k must be in 1..vocab_size ({config.vocab_size}), got {config.selector_top_k}")


__all__ = ["DFlash2CandidateSelector", "DFlash2DraftModel", "DFlash2DynamicConv"]
