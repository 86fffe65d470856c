"""``dflash-hf generate --compare``: warm-up, interleaved medians, and a parting explained on the spot."""

import torch
from conftest import save_chat_target, tiny_drafter
from transformers import AutoModelForCausalLM, AutoTokenizer

from dflash_hf import loading
from dflash_hf.cli import main
from dflash_hf.demo import explain_parting


def test_compare_in_float32_reports_identical_outputs_and_medians(tmp_path, capsys):
    target_dir = save_chat_target(tmp_path / "target")
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    tiny_drafter(target, block_size=4).save_pretrained(tmp_path / "draft")
    argv = ["generate", "Tell me a story.", "--target", str(target_dir), "--draft", str(tmp_path / "draft"),
            "--max-new-tokens", "24", "--dtype", "float32", "--compare", "--compare-runs", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "dtype: float32 (asked for)" in out and "prompt: Tell me a story." in out
    assert "(medians of 2 interleaved runs each); speedup" in out
    assert "identical outputs: True" in out


def test_held_out_demo_runs_the_first_prompt_of_each_held_out_set_and_sums_up(tmp_path, monkeypatch, capsys):
    from dflash_hf import assets

    asked = []

    def prompts(name, limit=None):
        asked.append((name, limit))
        return [{"id": f"{name}/{i}", "turns": [f"Question {i} of {name}."]} for i in range(limit)]

    monkeypatch.setattr(assets, "load_prompts", prompts)
    target_dir = save_chat_target(tmp_path / "target")
    tiny_drafter(AutoModelForCausalLM.from_pretrained(target_dir), block_size=4).save_pretrained(tmp_path / "draft")
    argv = ["generate", "--held-out", "--target", str(target_dir), "--draft", str(tmp_path / "draft"),
            "--max-new-tokens", "12", "--dtype", "float32", "--compare", "--compare-runs", "1"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert asked == [("gsm8k", 1001), ("humaneval", 1), ("mtbench", 1)]  # GSM8K 0-999 trained the drafter
    assert "prompt (gsm8k/1000): Question 1000 of gsm8k." in out and "prompt (mtbench/0): Question 0" in out
    assert out.count("speedup") == 4 and out.count("identical outputs: True") == 3
    summary = out.strip().splitlines()[-1]
    assert summary.startswith("over 3 held-out prompts: speedup ") and summary.endswith("identical outputs: 3 of 3")
    assert "gsm8k/1000 " in summary and "HumanEval" not in summary and "humaneval/0 " in summary

    assert main(argv + ["--temperature", "0.8"]) == 0  # sampled texts differ by design: no identity count
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert summary.startswith("over 3 held-out prompts: speedup ") and "identical" not in summary


def test_held_out_and_a_prompt_are_refused_together(capsys):
    assert main(["generate", "hi", "--held-out"]) == 1
    assert "pass a PROMPT or --held-out, not both" in capsys.readouterr().err


def test_parting_is_explained_with_the_float32_gap(tmp_path):
    target_dir = save_chat_target(tmp_path / "target")
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = torch.tensor([[5, 6, 7, 8]])
    exact = AutoModelForCausalLM.from_pretrained(target_dir)
    logits = exact(prompt).logits[0, -1]
    top, low = int(logits.argmax()), int(logits.argmin())
    plain = torch.cat([prompt, torch.tensor([[low]])], dim=1)
    ours = torch.cat([prompt, torch.tensor([[top]])], dim=1)
    assert "NOT expected in float32" in explain_parting(exact, tokenizer, ours, plain, 4, 0)

    half = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16)
    line = explain_parting(half, tokenizer, ours, plain, 4, 0)  # ours is the float32 top token: a tie at worst
    assert "they part at token 0" in line and "near-tie" in line and "identical in float32" in line
    assert "within 4 x the dtype's error" in line  # the rule `divergence_margin` applies, stated as applied
    line = explain_parting(half, tokenizer, plain, ours, 4, 0)  # ours is the float32 bottom token
    assert "NOT a near-tie" in line


def test_auto_dtype_follows_native_bf16(monkeypatch):
    monkeypatch.setattr(loading, "native_bf16", lambda: "a CPU with AMX")
    assert loading.resolve_dtype("auto")[0] == "bfloat16"
    monkeypatch.setattr(loading, "native_bf16", lambda: None)
    assert loading.resolve_dtype("auto") == ("float32", loading.resolve_dtype("auto")[1])
    assert loading.resolve_dtype("float32") == ("float32", "asked for")
    dtype, why = loading.resolve_dtype("bfloat16")  # honoured, with the reason it will be slow
    assert dtype == "bfloat16" and "emulated, float32 is faster" in why
    monkeypatch.setattr(loading, "native_bf16", lambda: "a CPU with AMX")
    assert loading.resolve_dtype("bfloat16") == ("bfloat16", "asked for")


def test_negative_temperature_is_refused_before_loading(capsys):
    assert main(["generate", "hi", "--temperature", "-1", "--target", "/nonexistent"]) == 1
    assert "--temperature -1.0 is negative" in capsys.readouterr().err
