"""Random-anchor blocks for DFlash training: anchors, block inputs, the block attention mask, labels and weights.

Pure tensor functions, no model. Shapes: ``b`` batch, ``S`` sequence length (context), ``N`` blocks per sequence,
``B`` block size. All blocks of a sequence are drafted side by side in one drafter forward::

    keys    = [context 0..S-1 | block_0 (B) | block_1 (B) | ... | block_{N-1} (B)]
    queries = [block_0 | block_1 | ... | block_{N-1}]

Block ``n`` is ``[input_ids[a_n], MASK x (B-1)]`` at positions ``a_n .. a_n+B-1``. It sees the context strictly
before its anchor (``kv < a_n``: at inference the anchor is the last committed token, whose target hidden state
does not exist yet), itself bidirectionally, and no other block. Row ``k`` of block ``n`` predicts
``input_ids[a_n + k]`` (same position, no shift), with weight ``exp(-(k-1)/gamma)`` for ``k >= 1``; on a sampled
answer, the target's greedy prediction there instead, while the block's tokens stay on its greedy path.

These are the two pitfalls SpecForge PR #473 fixed (``kv <= anchor`` and labels shifted by one); the tests pin both.
"""

import torch


def sample_anchors(
    loss_mask: torch.Tensor, block_size: int, num_anchors: int, generator: torch.Generator | None = None
) -> tuple[torch.LongTensor, torch.BoolTensor]:
    """Draw up to ``num_anchors`` distinct anchors per sequence among response positions, sorted ascending.

    A position ``p`` is a valid anchor when ``loss_mask[p] == 1`` and ``p <= S - B`` (the whole block fits in the
    sequence). Sequences with fewer valid anchors than the batch's largest draw are padded at the end:
    ``keep[i, n]`` is False for padding, whose anchor is set to 0.

    Returns ``anchors [b, N]`` and ``keep [b, N]`` with ``N = min(num_anchors, max valid count)`` (may be 0).
    """
    batch, seq_len = loss_mask.shape
    positions = torch.arange(seq_len, device=loss_mask.device)
    valid = loss_mask.bool() & (positions <= seq_len - block_size)
    counts = valid.sum(dim=1)
    num = int(min(num_anchors, int(counts.max()) if batch else 0))
    if num == 0:
        empty = torch.zeros(batch, 0, dtype=torch.long, device=loss_mask.device)
        return empty, empty.bool()
    # Random scores for valid positions, -1 elsewhere: the top `num` scores are a uniform draw without replacement.
    scores = torch.rand(batch, seq_len, generator=generator, device="cpu").to(loss_mask.device)
    scores = scores.masked_fill(~valid, -1.0)
    picked = scores.topk(num, dim=1).indices
    keep = torch.arange(num, device=loss_mask.device)[None, :] < counts[:, None].clamp(max=num)
    # topk puts valid positions (scores >= 0) first; sort the kept ones ascending and park padding at the end.
    sort_key = picked.masked_fill(~keep, seq_len)
    anchors = sort_key.sort(dim=1).values.masked_fill(~keep, 0)
    return anchors, keep


def build_block_inputs(
    input_ids: torch.LongTensor,
    anchors: torch.LongTensor,
    block_size: int,
    mask_token_id: int,
    keep: torch.BoolTensor | None = None,
) -> tuple[torch.LongTensor, torch.LongTensor]:
    """Block token ids and positions for one drafter forward over all blocks.

    Returns ``noise_ids [b, N*B]`` (``[input_ids[anchor], mask x (B-1)]`` per block; padded blocks are all mask)
    and ``position_ids [b, S + N*B]`` (``0..S-1`` for the context, then ``anchor..anchor+B-1`` per block).
    """
    batch, seq_len = input_ids.shape
    num = anchors.shape[1]
    noise = torch.full((batch, num, block_size), mask_token_id, dtype=input_ids.dtype, device=input_ids.device)
    anchor_tokens = input_ids.gather(1, anchors)
    if keep is not None:
        anchor_tokens = anchor_tokens.masked_fill(~keep, mask_token_id)
    noise[:, :, 0] = anchor_tokens
    offsets = torch.arange(block_size, device=input_ids.device)
    block_positions = (anchors[:, :, None] + offsets).reshape(batch, num * block_size)
    context_positions = torch.arange(seq_len, device=input_ids.device).expand(batch, -1)
    return noise.reshape(batch, num * block_size), torch.cat([context_positions, block_positions], dim=1)


def build_block_mask(
    anchors: torch.LongTensor, keep: torch.BoolTensor, seq_len: int, block_size: int
) -> torch.BoolTensor:
    """Boolean attention mask ``[b, 1, N*B, S + N*B]``, True = may attend.

    Context key ``j`` is visible to block ``n`` iff ``j < anchors[n]`` (strictly) and the block is kept; block keys
    are visible only within the same block (bidirectional). A padded block sees only itself, so no row is empty
    (no NaN); its loss weight is zero.
    """
    batch, num = anchors.shape
    device = anchors.device
    row_block = torch.arange(num * block_size, device=device) // block_size  # [N*B]
    row_anchor = anchors[:, row_block]  # [b, N*B]
    row_keep = keep[:, row_block]
    context = torch.arange(seq_len, device=device)[None, None, :] < row_anchor[:, :, None]
    context = context & row_keep[:, :, None]
    same_block = (row_block[:, None] == row_block[None, :]).expand(batch, -1, -1)
    return torch.cat([context, same_block], dim=2)[:, None]


def block_mask_mod(anchors: torch.LongTensor, keep: torch.BoolTensor, seq_len: int, block_size: int):
    """`build_block_mask` as a FlexAttention ``mask_mod(b, h, q_idx, kv_idx) -> bool``: the same picture, turned
    into a block-sparse ``BlockMask`` whose fully masked tiles the kernel skips (most of the grid: a block sees only
    the context before its anchor and itself)."""

    def mask_mod(b, h, q_idx, kv_idx):
        block = q_idx // block_size
        sees_context = (kv_idx < seq_len) & (kv_idx < anchors[b, block]) & keep[b, block]
        same_block = (kv_idx >= seq_len) & ((kv_idx - seq_len) // block_size == block)
        return sees_context | same_block

    return mask_mod


def build_flex_block_mask(anchors: torch.LongTensor, keep: torch.BoolTensor, seq_len: int, block_size: int):
    """A FlexAttention ``BlockMask`` for `block_mask_mod` (what the drafter takes with ``flex_attention``)."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, num = anchors.shape
    return create_block_mask(block_mask_mod(anchors, keep, seq_len, block_size), B=batch, H=None,
                             Q_LEN=num * block_size, KV_LEN=seq_len + num * block_size, device=anchors.device)


def block_labels_and_weights(
    input_ids: torch.LongTensor,
    loss_mask: torch.Tensor,
    anchors: torch.LongTensor,
    keep: torch.BoolTensor,
    block_size: int,
    gamma: float | None,
    next_ids: torch.LongTensor | None = None,
) -> tuple[torch.LongTensor, torch.Tensor]:
    """Same-position labels and loss weights ``[b, N*B]``.

    Row ``k`` of block ``n`` (position ``p = anchor_n + k``) learns the token greedy decoding puts at ``p`` after
    the anchor: ``next_ids[p - 1]``, the target's prediction after token ``p - 1`` (``next_ids=None``: the sequence
    is the target's own greedy answer, so that token is ``input_ids[p]``). That is the greedy continuation of the
    anchor only while the sequence itself stayed on it, so a row counts only when every token between the anchor
    and it is the target's prediction (``input_ids[q] == next_ids[q - 1]`` for ``anchor < q < p``): on a sampled
    answer a block learns the greedy path up to the first sampled departure and nothing after it.

    ``weights = keep * in_bounds * (k > 0) * on_greedy_path * loss_mask[p] * exp(-(k-1)/gamma)`` (``gamma=None`` or
    ``<= 0``: uniform). Positions past the sequence get label 0, weight 0.
    """
    batch, seq_len = input_ids.shape
    num = anchors.shape[1]
    offsets = torch.arange(block_size, device=input_ids.device)
    label_pos = anchors[:, :, None] + offsets  # [b, N, B]
    in_bounds = label_pos < seq_len
    clamped = label_pos.clamp(max=seq_len - 1).reshape(batch, -1)
    tokens = input_ids.gather(1, clamped).reshape(batch, num, block_size)
    if next_ids is None:
        labels, on_path = tokens, torch.ones_like(tokens, dtype=torch.float32)
    else:
        predicted = next_ids.gather(1, (clamped - 1).clamp(min=0)).reshape(batch, num, block_size)
        labels = torch.cat([tokens[:, :, :1], predicted[:, :, 1:]], dim=2)
        # follows[k]: token k of the block is the prediction after token k - 1 (k = 0, the anchor, needs nothing)
        follows = (tokens == predicted) | (offsets == 0)
        on_path = torch.cat([torch.ones_like(follows[:, :, :1]), follows[:, :, :-1]], dim=2).cumprod(dim=2).float()
    labels = labels.masked_fill(~in_bounds, 0)
    response = loss_mask.to(torch.float32).gather(1, clamped).reshape(batch, num, block_size)
    decay = decay_weights(block_size, gamma, device=input_ids.device)
    weights = keep[:, :, None].float() * in_bounds.float() * on_path * response * decay
    return labels.reshape(batch, -1), weights.reshape(batch, -1)


def decay_weights(block_size: int, gamma: float | None, device=None) -> torch.Tensor:
    """``[B]``: 0 at the anchor, ``exp(-(k-1)/gamma)`` at block position ``k >= 1`` (1 when gamma is None/<= 0)."""
    k = torch.arange(block_size, device=device, dtype=torch.float32)
    if gamma is None or gamma <= 0:
        weights = torch.ones(block_size, device=device)
    else:
        weights = torch.exp(-(k - 1) / gamma)
    weights[0] = 0.0
    return weights


def default_gamma(block_size: int) -> float:
    """The paper's decay: 7 for B=16, 5 for B=10, 4 for B=8; otherwise scaled like B/2 - 1 (at least 1)."""
    return {16: 7.0, 10: 5.0, 8: 4.0}.get(block_size, max(1.0, block_size / 2 - 1))


__all__ = [
    "block_labels_and_weights",
    "block_mask_mod",
    "build_block_inputs",
    "build_block_mask",
    "build_flex_block_mask",
    "decay_weights",
    "default_gamma",
    "sample_anchors",
]
