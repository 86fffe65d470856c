"""A straightforward re-implementation of the reference DFlash round (z-lab ``dflash_generate``), for parity tests.

Written independently of the package on purpose: plain tensor algebra (own RMSNorm, RoPE from the formula, explicit
softmax attention), the reference loop's buffer and cache bookkeeping, and the target's ``output_hidden_states``.
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


class ReferenceDrafter:
    """The drafter forward written out by hand; keeps per-layer context keys/values only."""

    def __init__(self, drafter):
        self.d, self.c = drafter, drafter.config
        self.keys = [None] * self.c.num_hidden_layers
        self.values = [None] * self.c.num_hidden_layers

    @torch.no_grad()
    def __call__(self, noise, features, context_positions, block_positions):
        d, c = self.d, self.c
        eps, hd = c.rms_norm_eps, c.head_dim
        theta = c.rope_parameters["rope_theta"]
        ctx = rms(d.hidden_norm.weight, features[0] @ d.fc.weight.T, eps)  # [C, H]
        x = noise[0]  # [Q, H]
        for i, layer in enumerate(d.layers):
            a = layer.self_attn
            h = rms(layer.input_layernorm.weight, x, eps)
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
            attn = torch.softmax(q @ k.transpose(1, 2) * hd**-0.5, dim=-1) @ v  # [heads, Q, hd], no mask
            x = x + attn.transpose(0, 1).reshape(len(x), -1) @ a.o_proj.weight.T
            m = rms(layer.post_attention_layernorm.weight, x, eps)
            x = x + (F.silu(m @ layer.mlp.gate_proj.weight.T) * (m @ layer.mlp.up_proj.weight.T)) @ layer.mlp.down_proj.weight.T
        return rms(d.norm.weight, x, eps)[None]


@torch.no_grad()
def reference_generate(target, drafter, input_ids, max_new_tokens, propose=None):
    """The reference loop. Returns (tokens ``[1, n + m]``, per-round drafter proposals).

    ``propose(round, anchor_position, real_proposals)`` may pin what is proposed to the target (default: the
    drafter's own argmax), mirroring ``tests.oracle``.
    """
    config = drafter.config
    block, mask_id, layer_ids = config.block_size, config.mask_token_id, config.target_layer_ids
    reference = ReferenceDrafter(drafter)
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
            noise = embed(torch.tensor([[tokens[0, -1].item()] + [mask_id] * (block - 1)]))
            hidden = reference(noise, pending, torch.arange(fed, anchor), torch.arange(anchor, anchor + block))
            fed, pending = anchor, pending[:, :0]
            drafts = head(hidden[:, 1 : 1 + num_drafts]).argmax(-1)
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
