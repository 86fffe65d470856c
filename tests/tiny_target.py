"""A tiny random target with a byte-level ChatML tokenizer, built offline in a second (tests only)."""

import json
from pathlib import Path

import torch

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tokenizer():
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


def make_target(path, arch: str = "qwen3", num_layers: int = 4, hidden: int = 64, seed: int = 0) -> Path:
    """Save a tiny random target + tokenizer under ``path``; returns the path."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    path = Path(path)
    tokenizer = make_tokenizer()
    vocab = len(tokenizer)
    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=num_layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                  bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(seed)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(head_dim=hidden // 4, **common))
    else:
        model = LlamaForCausalLM(LlamaConfig(**common))
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def mask_token_id(tokenizer) -> int:
    return tokenizer.convert_tokens_to_ids("<mask>")


def write_prompts(path, n: int, bad_lines: int = 0) -> Path:
    path = Path(path)
    lines = [json.dumps({"id": f"p{i}", "turns": [f"Tell me about topic {i}."]}) for i in range(n)]
    for j in range(bad_lines):
        lines.insert(1 + j, "{not json")
    path.write_text("\n".join(lines) + "\n")
    return path
