"""What the batch scripts share (`batch_plain_parity.py`, `batch_policy_trace.py`, `batch_round_phases.py`): the
default target and its shipped drafter on one torch thread (float32 unless a script is given a dtype), and a
left-padded batch of held-out GSM8K prompts (gsm8k@1000). Imported as a sibling module: `python scripts/<script>.py`
puts scripts/ on the path."""
import torch

from dflash_hf.bench import left_pad
from dflash_hf.bench_cli import load_bench_prompts
from dflash_hf.loading import load_drafter, load_target


def load_models(dtype: str = "float32"):
    """``(target, tokenizer, drafter)``: the prepared default target and the shipped drafter in ``dtype``, 1 thread."""
    torch.set_num_threads(1)
    target, tokenizer = load_target(None, dtype)
    return target, tokenizer, load_drafter(None, target, dtype, tokenizer)


def held_out_batch(tokenizer, batch_size: int):
    """``(input_ids, attention_mask)`` of the first ``batch_size`` held-out GSM8K prompts, padded on the left."""
    prompts = load_bench_prompts(tokenizer, ["gsm8k@1000"], batch_size)
    return left_pad([p.input_ids for p in prompts], tokenizer.pad_token_id)
