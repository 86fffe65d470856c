"""The DFlash drafter: a few Qwen3-style layers that draft a whole block in one non-causal forward.

This file travels as remote code inside every saved drafter, so it imports only ``torch``, ``transformers`` and its
flat siblings (``configuration_dflash``, ``generation_dflash``).

Shapes used below: ``b`` batch, ``C`` new context positions, ``Q`` block (query) positions, ``H`` hidden size,
``F = len(target_layer_ids)``. Weight names match the published z-lab drafts: ``fc``, ``hidden_norm``,
``layers.{i}.self_attn.{q,k,v,o}_proj``, ``q_norm``, ``k_norm``, ``mlp.{gate,up,down}_proj``,
``input_layernorm``, ``post_attention_layernorm``, ``norm``. There is no embedding and no ``lm_head``: the drafter
borrows the target's.
"""

import errno
import os
import re
import shutil
from pathlib import Path

import torch
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, and_masks, create_block_mask
from transformers.cache_utils import Cache, DynamicCache
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Attention,
    Qwen3DecoderLayer,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    eager_attention_forward,
    rotate_half,
)

from .configuration_dflash import DFlashConfig
from .generation_dflash import DFlashDrafterMixin, extract_context_feature, install_dflash_dispatch

# transformers 5.24 renamed the output's cache field to ``cache`` (the old name warns on every call); 5.23 has only
# ``past_key_values``. Build outputs under the name the installed version declares.
_OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x [b, heads, T, d]`` with ``cos``/``sin`` ``[b, T, d]`` for the same T positions."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class DFlashAttention(Qwen3Attention):
    """Queries from the block; keys/values from ``concat(context, block)``; no causal mask.

    Each layer projects the same fused context feature with its own ``k_proj``/``v_proj`` (then ``k_norm`` and RoPE
    at the context's absolute positions). The cache keeps only context keys/values: block keys/values are appended
    after the cache update and dropped after the forward, unless ``cache_block`` is set (transformers' built-in
    generator crops the block from its ``DFlashCache`` itself).
    """

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        # Never causal: with SDPA, `is_causal=True` and q_len < kv_len would silently keep only the first q_len keys.
        self.is_causal = False

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        past_key_values: Cache | None = None,
        cache_block: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """``hidden_states [b, Q, H]`` (block), ``context [b, C, H]`` (fused features), embeddings for C + Q positions."""
        batch, q_len, _ = hidden_states.shape
        ctx_len = context.shape[1]
        cos, sin = position_embeddings

        query = self.q_norm(self.q_proj(hidden_states).view(batch, q_len, -1, self.head_dim)).transpose(1, 2)
        kv_input = torch.cat([context, hidden_states], dim=1)
        key = self.k_norm(self.k_proj(kv_input).view(batch, ctx_len + q_len, -1, self.head_dim)).transpose(1, 2)
        value = self.v_proj(kv_input).view(batch, ctx_len + q_len, -1, self.head_dim).transpose(1, 2)
        query = apply_rotary(query, cos[:, -q_len:], sin[:, -q_len:])
        key = apply_rotary(key, cos, sin)

        if past_key_values is not None:
            if cache_block:
                key, value = past_key_values.update(key, value, self.layer_idx)
            else:
                ctx_key, ctx_value = past_key_values.update(key[:, :, :ctx_len], value[:, :, :ctx_len], self.layer_idx)
                key = torch.cat([ctx_key, key[:, :, ctx_len:]], dim=2)
                value = torch.cat([ctx_value, value[:, :, ctx_len:]], dim=2)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        output, _ = attention_interface(
            self,
            query,
            key,
            value,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            sliding_window=self.sliding_window,
            is_causal=False,
            **kwargs,
        )
        return self.o_proj(output.reshape(batch, q_len, -1))


class DFlashDecoderLayer(Qwen3DecoderLayer):
    """Pre-norm block stream; the context is not normalised per layer (it was by ``hidden_norm``)."""

    def __init__(self, config: DFlashConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.self_attn = DFlashAttention(config, layer_idx)

    def forward(self, hidden_states, context, position_embeddings, attention_mask, past_key_values, cache_block, **kwargs):
        residual = hidden_states
        hidden_states = self.self_attn(
            self.input_layernorm(hidden_states),
            context=context,
            position_embeddings=position_embeddings,
            attention_mask=attention_mask,
            past_key_values=past_key_values,
            cache_block=cache_block,
            **kwargs,
        )
        hidden_states = residual + hidden_states
        return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))


class DFlashDraftModel(DFlashDrafterMixin, Qwen3PreTrainedModel):
    """DFlash drafter (z-lab layout). Pass it as ``assistant_model`` to a target's ``generate``.

    Two call contracts share one forward:

    * z-lab's: ``forward(noise_embedding=[b, Q, H], target_hidden=[b, C, F*H], position_ids=[b, C + Q],
      past_key_values=DynamicCache)``; the cache keeps context keys/values only.
    * transformers' built-in ``DFlashTokenCandidateGenerator``: ``forward(noise_embeds=, context_hidden_states=,
      position_ids=, attention_mask=, past_key_values=DFlashCache)``; block keys/values are cached too, and that
      generator crops them.

    Both return ``last_hidden_state [b, Q, H]`` after the final ``norm``; row ``k`` predicts the token at block
    position ``k`` (row 0, the anchor, is not a prediction).
    """

    config_class = DFlashConfig
    config: DFlashConfig
    decoder_layer_class = DFlashDecoderLayer
    base_model_prefix = ""
    main_input_name = "noise_embedding"
    _no_split_modules = ["DFlashDecoderLayer"]
    _can_record_outputs = {}

    def __init__(self, config: DFlashConfig):
        super().__init__(config)
        install_dflash_dispatch()
        self.layers = nn.ModuleList(self.decoder_layer_class(config, i) for i in range(config.num_hidden_layers))
        self.fc = nn.Linear(len(config.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.post_init()

    @property
    def block_size(self) -> int:
        return self.config.block_size

    @property
    def target_layer_ids(self) -> list[int]:
        return self.config.target_layer_ids

    @property
    def mask_token_id(self) -> int:
        return self.config.mask_token_id

    def save_pretrained(self, save_directory, **kwargs):
        """transformers' ``save_pretrained``, safe against a killed process and a full disk.

        Everything is written to a hidden ``.tmp-save-PID`` folder inside ``save_directory`` and then moved into place
        file by file (``os.replace``), so a file under its final name is always complete: a kill between the moves
        leaves complete files of the old and the new save, and the next save finishes the job. The staging folder of
        a failed save is removed, that of a killed one by the next save; weight files of an earlier save that this
        one does not write (other shards) are removed, as transformers does. ``push_to_hub=True`` saves in place.
        """
        if kwargs.get("push_to_hub"):
            return super().save_pretrained(save_directory, **kwargs)
        directory = Path(save_directory)
        directory.mkdir(parents=True, exist_ok=True)
        for stale in directory.glob(".tmp-save-*"):
            if not _process_alive(int(stale.name.rsplit("-", 1)[1])):
                shutil.rmtree(stale, ignore_errors=True)
        staging = directory / f".tmp-save-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        try:
            super().save_pretrained(staging, **kwargs)
            written = sorted(p.name for p in staging.iterdir())
            for name in sorted(written, key=lambda name: name == "config.json"):  # config last: it names the weights
                os.replace(staging / name, directory / name)
        except Exception as error:
            if "No space left" in str(error) or getattr(error, "errno", None) == errno.ENOSPC:
                raise OSError(errno.ENOSPC, f"No space left on device while saving the drafter to {directory}; no "
                              "half-written file was kept: free some space and save again") from error
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        if kwargs.get("is_main_process", True):
            for path in directory.iterdir():
                if path.name not in written and _WEIGHT_FILE.fullmatch(path.name):
                    path.unlink()

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        """Load a drafter in any published layout; ``DFlashDraftModel.from_pretrained`` picks the class the checkpoint
        declares in ``architectures`` (``DFlashDraftModel`` or ``DFlash2DraftModel``) and refuses others by name."""
        if cls is DFlashDraftModel and not isinstance(kwargs.get("config"), DFlashConfig):
            drafter_class = _drafter_class(pretrained_model_name_or_path, kwargs)
            if drafter_class is not cls:
                return drafter_class.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)

    @staticmethod
    def remote_weight_name(name: str) -> str:
        """Our name for a weight of z-lab's remote-code module (identical for DFlash)."""
        return name

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """``[b, C, F*H]`` concatenated target features -> ``[b, C, H]`` fused context (``fc`` then ``hidden_norm``)."""
        return self.hidden_norm(self.fc(target_hidden))

    def forward(
        self,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool = False,
        attention_mask: torch.Tensor | None = None,
        *,
        noise_embeds: torch.Tensor | None = None,
        context_hidden_states: torch.Tensor | None = None,
        cache: Cache | None = None,
        cached_positions: torch.LongTensor | None = None,
        **kwargs,
    ) -> BaseModelOutputWithPast:
        r"""
        noise_embedding (`[b, Q, H]`): target embeddings of ``[last verified token, mask x (Q - 1)]`` (training: all
            blocks of a sequence side by side).
        target_hidden (`[b, C, F*H]`): target features of the C positions not yet in the cache, see
            `extract_context_feature`.
        position_ids (`[b, C + Q]`): absolute positions of the new context positions, then of the block positions.
            Defaults to ``cache length + arange(C + Q)``.
        attention_mask: a 4D mask ``[b, 1, Q, cache + C + Q]`` (additive, or boolean for SDPA) is used as given
            (training uses one to keep blocks apart); with ``flex_attention``, a ``BlockMask`` over the same
            ``[Q, cache + C + Q]`` grid; a 2D padding mask ``[b, cache + C + Q]`` becomes a key mask; ``None`` means
            every block row sees every key. Sliding-window layers add their window to it.
        noise_embeds, context_hidden_states, cache: the built-in generator's names (``cache`` is what
            transformers 5.24 calls ``past_key_values``).
        cached_positions (`[b, cache]`): absolute positions of the cached keys, for causal and sliding-window layers;
            defaults to ``arange(cache)`` (a cache fed in position order; the batched loop's cache has holes).
        """
        cache_block = noise_embeds is not None  # transformers' built-in contract: it crops the block itself
        past_key_values = past_key_values if past_key_values is not None else cache
        noise = noise_embeds if cache_block else noise_embedding
        features = context_hidden_states if cache_block else target_hidden
        if noise is None or features is None:
            raise ValueError("DFlashDraftModel needs the block embeddings and the target's context features.")
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()

        context = self.project_context(features.to(self.fc.weight.dtype))
        past_len = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = torch.arange(past_len, past_len + context.shape[1] + noise.shape[1], device=noise.device)
            position_ids = position_ids.unsqueeze(0).expand(noise.shape[0], -1)
        position_embeddings = self.rotary_emb(noise, position_ids)
        masks = self._layer_masks(attention_mask, position_ids, past_len, noise, cached_positions)

        hidden_states = noise
        for layer, mask in zip(self.layers, masks):
            hidden_states = layer(
                hidden_states,
                context=context,
                position_embeddings=position_embeddings,
                attention_mask=mask,
                past_key_values=past_key_values,
                cache_block=cache_block,
                **kwargs,
            )
        outputs = {"last_hidden_state": self.norm(hidden_states), _OUTPUT_CACHE_FIELD: past_key_values}
        return BaseModelOutputWithPast(**outputs)

    def _layer_masks(self, attention_mask, position_ids, past_len, noise, cached_positions=None) -> list:
        """One mask per layer: the caller's mask AND-ed with the layer's position rule (`_position_rule`: causal
        and/or windowed, see `DFlashConfig.layer_is_causal`). Each distinct mask is built once (additive tensors, or
        ``BlockMask`` when the caller passed one); ``None`` where nothing is masked."""
        window = self.config.sliding_window
        kinds = [
            (kind == "sliding_attention" and window is not None, self.config.layer_is_causal(i))
            for i, kind in enumerate(self.config.layer_types)
        ]
        if isinstance(attention_mask, BlockMask):
            built = {
                kind: self._restricted_block_mask(attention_mask, position_ids, past_len, *kind, cached_positions)
                for kind in set(kinds)
            }
            return [built[kind] for kind in kinds]

        allowed = None  # boolean [b, 1, Q, K], True = may attend
        if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            allowed = attention_mask[:, None, None, :].bool()
        elif attention_mask is not None and attention_mask.dim() == 4:
            allowed = attention_mask if attention_mask.dtype == torch.bool else attention_mask == 0
        query_positions, key_positions = _query_key_positions(position_ids, past_len, noise.shape[1], cached_positions)
        distance = query_positions[:, None, :, None] - key_positions[:, None, None, :]  # [b, 1, Q, K]: q - k
        built = {}
        for kind in set(kinds):
            rule = _position_rule(distance, *kind, window)
            if rule is not None and bool(rule.all()):  # e.g. a window longer than everything seen so far
                rule = None
            combined = allowed if rule is None else rule if allowed is None else allowed & rule
            built[kind] = None if combined is None else _additive(combined, noise.dtype)
        return [built[kind] for kind in kinds]

    def _restricted_block_mask(self, block_mask: BlockMask, position_ids, past_len, sliding, causal,
                               cached_positions=None) -> BlockMask:
        """FlexAttention: the caller's ``BlockMask`` AND-ed with the layer's position rule."""
        if not sliding and not causal:
            return block_mask
        q_len, kv_len = block_mask.shape[-2:]
        query_positions, key_positions = _query_key_positions(position_ids, past_len, q_len, cached_positions)
        window = self.config.sliding_window

        def position_rule(b, h, q_idx, kv_idx):
            return _position_rule(query_positions[b, q_idx] - key_positions[b, kv_idx], sliding, causal, window)

        return create_block_mask(and_masks(block_mask.mask_mod, position_rule), B=position_ids.shape[0], H=None,
                                 Q_LEN=q_len, KV_LEN=kv_len, device=position_ids.device)


_WEIGHT_FILE = re.compile(r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?")


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` still runs (its staging folder may be in use)."""
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _position_rule(distance: torch.Tensor, sliding: bool, causal: bool, window: int | None) -> torch.Tensor | None:
    """Which keys a block row may see, from ``distance = query position - key position`` (z-lab's mask rules).

    Causal layers hide later block rows (``distance >= 0``). Sliding layers hide keys ``window`` or more positions
    back, and, when not causal, also ``window`` or more positions ahead. ``None``: no restriction.
    """
    rules = []
    if causal:
        rules.append(distance >= 0)
    if sliding:
        rules.append(distance < window)
        if not causal:
            rules.append(distance > -window)
    if not rules:
        return None
    allowed = rules[0]
    for rule in rules[1:]:
        allowed = allowed & rule
    return allowed


_HUB_KWARGS = ("cache_dir", "force_download", "local_files_only", "token", "revision", "subfolder")


def _drafter_class(path, kwargs) -> type:
    """The drafter class a checkpoint's ``config.json`` declares, with a clear error for what this package cannot load."""
    from transformers import PretrainedConfig

    config, _ = PretrainedConfig.get_config_dict(path, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})
    architectures = config.get("architectures") or ["DFlashDraftModel"]
    if config.get("model_type") == "muse_glimmer_assistant":
        raise ValueError(
            f"{path} is in transformers' built-in layout (muse_glimmer_assistant): load it with "
            "`MuseGlimmerAssistantModel.from_pretrained`, or convert it first with `dflash-hf convert`."
        )
    if "DFlash2DraftModel" in architectures:
        from .modeling_dflash2 import DFlash2DraftModel

        return DFlash2DraftModel
    if "DFlashDraftModel" in architectures:
        return DFlashDraftModel
    raise ValueError(
        f"{path} declares architectures {architectures}; dflash-hf loads DFlash (`DFlashDraftModel`) and DFlash2 "
        "(`DFlash2DraftModel`) drafters only."
    )


def adopt_remote_drafter(model) -> "DFlashDraftModel":
    """Our drafter around the parameters of one built by z-lab's own remote code (``dflash.DFlashDraftModel``, or
    ``DFlash2DraftModel``): same architecture, same weight names, the very same tensors (nothing is copied).

    Raises a `ValueError` naming a loader that works when z-lab's module does not hold the published weight names.
    """
    if type(model).__name__ == "DFlash2DraftModel":
        from .modeling_dflash2 import DFlash2DraftModel as drafter_class
    else:
        drafter_class = DFlashDraftModel
    config = DFlashConfig.from_dict(model.config.to_dict())
    config._attn_implementation = model.config._attn_implementation or "sdpa"
    with torch.device("meta"):  # no second copy of the weights, not even for a moment
        drafter = drafter_class(config)
    # keep_vars: the very Parameter objects, so that a later `model.to(...)` moves the adopted drafter's weights too.
    state = {drafter_class.remote_weight_name(n): t for n, t in model.state_dict(keep_vars=True).items()}
    missing, unexpected = drafter.load_state_dict(state, strict=False, assign=True)
    if missing or unexpected:
        raise ValueError(
            f"Cannot run z-lab's {type(model).__name__} as a DFlash assistant: its weights do not match the published "
            f"layout (missing {sorted(missing)[:4]}, unexpected {sorted(unexpected)[:4]}). Load the checkpoint with "
            "`dflash_hf.DFlashDraftModel.from_pretrained(path)` instead."
        )
    drafter.rotary_emb = Qwen3RotaryEmbedding(config).to(model.device)  # its buffers are not in the state dict
    return drafter.train(model.training)


def _query_key_positions(position_ids, past_len: int, q_len: int, cached=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Absolute positions of the block's queries ``[b, Q]`` and of every key ``[b, cache + C + Q]``. The cached
    context covers positions ``[0, past_len)`` (the single-sequence generator feeds it in order) unless ``cached``
    ``[b, past_len]`` gives them."""
    if cached is None:
        cached = torch.arange(past_len, device=position_ids.device).expand(position_ids.shape[0], -1)
    return position_ids[:, -q_len:], torch.cat([cached, position_ids], dim=1)


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean ``True = attend`` mask -> additive mask (0 or the dtype's minimum), which eager and SDPA both take."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


__all__ = ["DFlashDraftModel", "adopt_remote_drafter", "extract_context_feature"]
