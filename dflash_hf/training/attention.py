"""Block-sparse attention for DFlash training on a CPU: only the scores a block can see are computed.

With every block of a sequence in one forward (see `blocks`), the dense grid is ``[N*B, S + N*B]``; a block of
``B`` queries sees the context before its anchor and its own ``B`` keys, so all but ``N*B x B`` of the right-hand
``N*B x N*B`` square is masked (47/48 of it at 48 anchors), and on a CPU SDPA computes every masked score (forward
and backward). This computes the two parts that can be seen:

* context: ``[N*B, S]`` scores, one matmul against the shared context keys, masked to ``kv < anchor``;
* blocks: ``[N, B, B]`` scores, a batched matmul of each block against its own keys;

then one softmax over both, and ``softmax @ [context values; block values]``. The same picture as the dense
`build_block_mask`, so the same outputs and gradients (tests pin it against SDPA with the dense mask).

Registered with transformers' `AttentionInterface` as ``block_sparse``; the drafter reaches it through
``config._attn_implementation`` and gets the layout as the keyword argument ``block_layout``, which the drafter's
forward hands to every attention call. A layer with its own position rule (causal or sliding window) passes that
rule as an additive ``attention_mask`` over the dense grid; its two seen parts are added in.
"""

from dataclasses import dataclass

import torch
from transformers import AttentionInterface

BLOCK_SPARSE = "block_sparse"


@dataclass
class BlockLayout:
    """Where the blocks of a training forward sit: ``anchors [b, N]`` (ascending) and ``keep [b, N]`` (False for a
    padded block, which sees only itself), as `blocks.sample_anchors` returns them."""

    anchors: torch.LongTensor
    keep: torch.BoolTensor

    def context_bias(self, seq_len: int, dtype: torch.dtype) -> torch.Tensor:
        """``[b, 1, N, 1, S]`` additive: 0 where block ``n`` sees context key ``j`` (``j < anchor_n``, kept blocks),
        the dtype's minimum elsewhere."""
        seen = torch.arange(seq_len, device=self.anchors.device) < self.anchors[:, :, None]
        seen = seen & self.keep[:, :, None]
        bias = torch.zeros(seen.shape, dtype=dtype, device=seen.device).masked_fill(~seen, torch.finfo(dtype).min)
        return bias[:, None, :, None, :]


def block_sparse_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    block_layout: BlockLayout | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """``query [b, H, N*B, d]``, ``key``/``value`` ``[b, KV, S + N*B, d]`` (``H = g * KV``, query head ``h`` reads kv
    head ``h // g``) -> ``[b, N*B, H, d]``, the layout transformers' attention functions return.

    ``attention_mask``: None, or the layer's own position rule as an additive ``[b, 1, N*B, S + N*B]`` mask.
    """
    if block_layout is None:
        raise ValueError(f"attn_implementation {BLOCK_SPARSE!r} is for training forwards: pass block_layout=.")
    if dropout:
        raise ValueError(f"attn_implementation {BLOCK_SPARSE!r} has no dropout; the drafter trains without it.")
    batch, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    groups = heads // kv_heads
    num = block_layout.anchors.shape[1]
    block = q_len // num
    seq_len = key.shape[2] - q_len
    scaling = dim**-0.5 if scaling is None else scaling

    # queries grouped per kv head and per block: [b, KV, N, g*B, d], scaled here (d wide) rather than as scores (S + B)
    q = query.view(batch, kv_heads, groups, num, block, dim).transpose(2, 3).reshape(batch, kv_heads, num, -1, dim)
    q = q * scaling
    ctx_key, ctx_value = key[:, :, :seq_len], value[:, :, :seq_len]
    own_key = key[:, :, seq_len:].view(batch, kv_heads, num, block, dim)
    own_value = value[:, :, seq_len:].view(batch, kv_heads, num, block, dim)

    ctx_scores = (q.reshape(batch, kv_heads, -1, dim) @ ctx_key.transpose(-1, -2)).view(
        batch, kv_heads, num, groups * block, seq_len)
    ctx_scores = ctx_scores + block_layout.context_bias(seq_len, ctx_scores.dtype)
    own_scores = q @ own_key.transpose(-1, -2)  # [b, KV, N, g*B, B]
    if attention_mask is not None:
        ctx_rule, own_rule = _seen_parts(attention_mask, seq_len, num, block, groups)
        ctx_scores, own_scores = ctx_scores + ctx_rule, own_scores + own_rule
    # In the scores' dtype: a bf16 softmax accumulates in float32 and rounds once, so its output equals a float32
    # softmax rounded to bf16, without the two dtype copies of every score forward and backward.
    probs = torch.cat([ctx_scores, own_scores], dim=-1).softmax(dim=-1)
    ctx_probs, own_probs = probs.split([seq_len, block], dim=-1)
    out = (ctx_probs.reshape(batch, kv_heads, -1, seq_len) @ ctx_value).view(batch, kv_heads, num, -1, dim)
    out = out + own_probs @ own_value  # [b, KV, N, g*B, d]
    out = out.view(batch, kv_heads, num, groups, block, dim).permute(0, 2, 4, 1, 3, 5)
    return out.reshape(batch, q_len, heads, dim), None


def _seen_parts(mask: torch.Tensor, seq_len: int, num: int, block: int, groups: int):
    """An additive ``[b, 1, N*B, S + N*B]`` mask cut to the two seen parts, shaped like the scores:
    context ``[b, 1, N, g*B, S]`` and own block ``[b, 1, N, g*B, B]`` (the same rule for every head)."""
    batch = mask.shape[0]
    ctx = mask[:, :, :, :seq_len].reshape(batch, 1, num, 1, block, seq_len)
    squares = mask[:, :, :, seq_len:].reshape(batch, 1, num, block, num, block)
    own = torch.diagonal(squares, dim1=2, dim2=4).permute(0, 1, 4, 2, 3)  # [b, 1, N, B, B]
    own = own.reshape(batch, 1, num, 1, block, block)
    expand = (batch, 1, num, groups, block)
    return (ctx.expand(*expand, seq_len).reshape(batch, 1, num, -1, seq_len),
            own.expand(*expand, block).reshape(batch, 1, num, -1, block))


AttentionInterface.register(BLOCK_SPARSE, block_sparse_attention_forward)

__all__ = ["BLOCK_SPARSE", "BlockLayout", "block_sparse_attention_forward"]
