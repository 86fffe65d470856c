"""A straightforward re-implementation of the reference DFlash round (z-lab ``dflash_generate``), for parity tests.

Written independently of the package on purpose: plain tensor algebra (own RMSNorm, RoPE from the formula, explicit
softmax attention), the reference loop's buffer and cache bookkeeping, and the target's ``output_hidden_states``.
The newer keys and DFlash2 (docs/dflash2-reference.md) are read here from the raw ``config.json`` dict with z-lab's
rule (``dflash_config`` first, then the top level) and applied with explicit loops: the causal/window mask, the
two-tap dynamic convolution, the embedding scale, the logits multiplier and softcap, and the path selector.
"""

import torch
import torch.nn.functional as F
from transformers import DynamicCache


def rms(weight, x, eps):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rope(x, positions, theta):
    """``x [heads, T, d]`` rotated at absolute ``positions [T]`` (rotate-half convention)."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = positions.float()[:, None] * inv_freq[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * cos + torch.cat([-x2, x1], -1) * sin


def draft_value(raw: dict | None, name: str, default=None):
    """z-lab's ``_draft_value``: ``dflash_config`` first, then the top level, then ``default``."""
    if raw is None:
        return default
    return (raw.get("dflash_config") or {}).get(name, raw.get(name, default))


def dynamic_conv(weights, prefix, x, side, kernel, taps, group_size):
    """``out[t] = sum_o (base[side, o] + dyn[t, side, o] per group) * x[t - o]`` with explicit loops; ``x [Q, H]``."""
    base = weights[prefix + "base_kernel"]
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for o in range(taps):
            if t - o >= 0:
                out[t] += (base[side, o] + kernel[t, side, o].repeat_interleave(group_size)) * x[t - o]
    return out


class ReferenceDrafter:
    """The drafter forward written out by hand; keeps per-layer context keys/values only.

    ``raw`` is the checkpoint's ``config.json`` dict: with it, the mask follows z-lab's rules (causal iff the top-level
    ``is_causal`` is true, or, absent, on sliding layers; the window ``|q - k| < W`` on sliding layers, one-sided when
    causal) and DFlash2 layers wrap both sublayers in the dynamic convolution. Without it: DFlash, unmasked.
    """

    def __init__(self, drafter, raw: dict | None = None):
        self.d, self.c, self.raw = drafter, drafter.config, raw
        self.w = drafter.state_dict()
        self.keys = [None] * self.c.num_hidden_layers
        self.values = [None] * self.c.num_hidden_layers
        self.context_positions = torch.zeros(0, dtype=torch.long)

    def allowed(self, i, block_positions):
        """``[Q, K]`` boolean mask of layer ``i`` over keys at (all context so far, block) positions."""
        keys = torch.cat([self.context_positions, block_positions])
        distance = block_positions[:, None] - keys[None, :]
        allowed = torch.ones_like(distance, dtype=torch.bool)
        if self.raw is None:
            return allowed
        sliding = self.raw.get("layer_types", ["full_attention"] * 99)[i] == "sliding_attention"
        causal = bool(self.raw["is_causal"]) if self.raw.get("is_causal") is not None else sliding
        if causal:
            allowed &= distance >= 0
        if sliding:
            window = self.raw["sliding_window"]
            allowed &= distance < window
            if not causal:
                allowed &= distance > -window
        return allowed

    def conv(self, name, i, x, side, kernel):
        taps, group = draft_value(self.raw, "conv_kernel_size"), draft_value(self.raw, "conv_group_size")
        return dynamic_conv(self.w, f"layers.{i}.{name}.", x, side, kernel, taps, group)

    def kernel(self, name, i, x):
        taps, group = draft_value(self.raw, "conv_kernel_size"), draft_value(self.raw, "conv_group_size")
        projection = self.w[f"layers.{i}.{name}.kernel_projection.weight"]
        return (x @ projection.T).view(x.shape[0], 2, taps, x.shape[1] // group)

    @torch.no_grad()
    def __call__(self, noise, features, context_positions, block_positions):
        d, c = self.d, self.c
        eps, hd = c.rms_norm_eps, c.head_dim
        theta = c.rope_parameters["rope_theta"]
        ctx = rms(d.hidden_norm.weight, features[0] @ d.fc.weight.T, eps)  # [C, H]
        x = noise[0]  # [Q, H]
        dflash2 = draft_value(self.raw, "conv_kernel_size") is not None
        self.context_positions = torch.cat([self.context_positions, context_positions])  # every cached key's position
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = rms(layer.input_layernorm.weight, x, eps)
            if dflash2:
                kernel = self.kernel("attention_conv", i, h)
                h = self.conv("attention_conv", i, h, 0, kernel)
            q = rms(a.q_norm.weight, (h @ a.q_proj.weight.T).view(len(h), -1, hd), eps).transpose(0, 1)
            kc = rms(a.k_norm.weight, (ctx @ a.k_proj.weight.T).view(len(ctx), -1, hd), eps).transpose(0, 1)
            vc = (ctx @ a.v_proj.weight.T).view(len(ctx), -1, hd).transpose(0, 1)
            kb = rms(a.k_norm.weight, (h @ a.k_proj.weight.T).view(len(h), -1, hd), eps).transpose(0, 1)
            vb = (h @ a.v_proj.weight.T).view(len(h), -1, hd).transpose(0, 1)
            q, kb, kc = rope(q, block_positions, theta), rope(kb, block_positions, theta), rope(kc, context_positions, theta)
            if self.keys[i] is not None:
                kc, vc = torch.cat([self.keys[i], kc], 1), torch.cat([self.values[i], vc], 1)
            self.keys[i], self.values[i] = kc, vc
            k, v = torch.cat([kc, kb], 1), torch.cat([vc, vb], 1)
            groups = q.shape[0] // k.shape[0]
            k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
            scores = (q @ k.transpose(1, 2) * hd**-0.5).masked_fill(~self.allowed(i, block_positions), float("-inf"))
            attn = torch.softmax(scores, dim=-1) @ v  # [heads, Q, hd]
            out = attn.transpose(0, 1).reshape(len(x), -1) @ a.o_proj.weight.T
            x = x + (self.conv("attention_conv", i, out, 1, kernel) if dflash2 else out)
            m = rms(layer.post_attention_layernorm.weight, x, eps)
            if dflash2:
                kernel = self.kernel("mlp_conv", i, m)
                m = self.conv("mlp_conv", i, m, 0, kernel)
            out = (F.silu(m @ layer.mlp.gate_proj.weight.T) * (m @ layer.mlp.up_proj.weight.T)) @ layer.mlp.down_proj.weight.T
            x = x + (self.conv("mlp_conv", i, out, 1, kernel) if dflash2 else out)
        return rms(d.norm.weight, x, eps)[None]

    def logits(self, head_weight, rows):
        """``rows [M, H]`` -> draft logits ``[M, V]``: ``x output_multiplier``, then the softcap when set."""
        logits = rows @ head_weight.T
        multiplier = draft_value(self.raw, "output_multiplier")
        if multiplier is not None:
            logits = logits * multiplier
        cap = draft_value(self.raw, "final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def propose(self, head_weight, rows, anchor: int) -> torch.LongTensor:
        """Greedy drafts ``[M]``: the argmax (DFlash), or DFlash2's walk over the sorted top-K from ``anchor``."""
        logits = self.logits(head_weight, rows)
        top_k = draft_value(self.raw, "selector_top_k")
        if top_k is None:
            return logits.argmax(-1)
        path, previous = [], anchor
        projected = rows @ self.w["candidate_selector.hidden_projection.weight"].T  # [M, r]
        predecessor = self.w["candidate_selector.predecessor_codebook"]
        successor = self.w["candidate_selector.successor_codebook"]
        for t in range(len(rows)):
            unary, candidates = logits[t].topk(top_k)
            pairwise = (successor[candidates] * (predecessor[previous] * projected[t])).sum(-1)
            previous = int(candidates[(unary + pairwise).argmax()])
            path.append(previous)
        return torch.tensor(path)

    def embed(self, embedding_weight, block_ids):
        """Noise rows: the raw table lookup times ``input_embedding_scale`` when the checkpoint sets it."""
        scale = draft_value(self.raw, "input_embedding_scale")
        rows = embedding_weight[block_ids]
        return rows if scale is None else rows * scale


class ModelDrafter:
    """`ReferenceDrafter`'s interface over the drafter's own forward, called as z-lab's loop calls it
    (``noise_embedding``, ``target_hidden``, ``position_ids`` over the new context and the block, a ``DynamicCache``
    that keeps context keys only): the reference loop at the model's speed, for timing it (scripts/gpu_speed.py)."""

    def __init__(self, drafter, raw: dict | None = None):
        if raw is not None:
            raise ValueError("ModelDrafter runs the model as it is configured: pass raw=None")
        self.d, self.cache = drafter, DynamicCache()

    @torch.no_grad()
    def __call__(self, noise, features, context_positions, block_positions):
        positions = torch.cat([context_positions, block_positions]).to(noise.device)[None]
        return self.d(noise_embedding=noise, target_hidden=features, position_ids=positions,
                      past_key_values=self.cache).last_hidden_state

    def propose(self, head_weight, rows, anchor: int) -> torch.LongTensor:
        return (rows @ head_weight.T).argmax(-1)


@torch.no_grad()
def reference_generate(target, drafter, input_ids, max_new_tokens, propose=None, raw=None, implementation=None):
    """The reference loop. Returns (tokens ``[1, n + m]``, per-round drafter proposals).

    ``propose(round, anchor_position, real_proposals)`` may pin what is proposed to the target (default: the
    drafter's own proposals), mirroring ``tests.oracle``. ``raw``: the checkpoint's ``config.json`` dict, whose DFlash
    values are then read here (see `ReferenceDrafter`). ``implementation``: the drafter's implementation,
    `ReferenceDrafter` (default: written out by hand) or `ModelDrafter` (the model's forward).
    """
    config = drafter.config
    block, mask_id, layer_ids = config.block_size, config.mask_token_id, config.target_layer_ids
    if raw is not None:
        block, mask_id = draft_value(raw, "block_size", 16), draft_value(raw, "mask_token_id")
        layer_ids = draft_value(raw, "target_layer_ids")
    reference = (implementation or ReferenceDrafter)(drafter, raw)
    embed, head = target.get_input_embeddings(), target.get_output_embeddings()
    n = input_ids.shape[1]
    max_length = n + max_new_tokens
    cache = DynamicCache()
    out = target(input_ids, past_key_values=cache, use_cache=True, output_hidden_states=True)
    tokens = torch.cat([input_ids, out.logits[:, -1:].argmax(-1)], dim=1)
    pending = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)  # features of positions 0..n-1
    fed = 0
    rounds = []
    while tokens.shape[1] < max_length:
        anchor = tokens.shape[1] - 1
        num_drafts = min(block - 1, max_length - tokens.shape[1] - 1)
        drafts = tokens[:, :0]
        if num_drafts > 0:
            block_ids = torch.tensor([[tokens[0, -1].item()] + [mask_id] * (block - 1)], device=tokens.device)
            noise = embed(block_ids) if raw is None else reference.embed(embed.weight, block_ids)
            hidden = reference(noise, pending, torch.arange(fed, anchor), torch.arange(anchor, anchor + block))
            fed, pending = anchor, pending[:, :0]
            drafts = reference.propose(head.weight, hidden[0, 1 : 1 + num_drafts], int(tokens[0, -1]))[None]
            rounds.append(drafts)
            if propose is not None:
                drafts = propose(len(rounds) - 1, anchor, drafts)
        verify = torch.cat([tokens[:, -1:], drafts], dim=1)
        out = target(verify, past_key_values=cache, use_cache=True, output_hidden_states=True)
        posterior = out.logits.argmax(-1)
        accepted = int((drafts == posterior[:, :-1]).cumprod(dim=1).sum())
        tokens = torch.cat([tokens, drafts[:, :accepted], posterior[:, accepted : accepted + 1]], dim=1)
        cache.crop(-(drafts.shape[1] - accepted))
        features = torch.cat([out.hidden_states[i + 1] for i in layer_ids], dim=-1)
        pending = torch.cat([pending, features[:, : accepted + 1]], dim=1)
    return tokens[:, :max_length], rounds
