"""scripts/heldout_samples.py: the held-out samples are the documented slices, and the rule decides as written."""

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("heldout_samples", REPO / "scripts" / "heldout_samples.py")
heldout_samples = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(heldout_samples)
corpus_prompts = heldout_samples.corpus_prompts


@pytest.fixture
def datasets(tmp_path, monkeypatch):
    """Numbered stand-ins for prepare's dataset files: record i of gsm8k.jsonl has id gsm8k/i, and so on."""
    for name, size in {"gsm8k": 1319, "humaneval": 164, "mtbench": 80, "sharegpt": 10100}.items():
        lines = [json.dumps({"id": f"{name}/{i}", "turns": [f"prompt {i}"]}) for i in range(size)]
        (tmp_path / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(corpus_prompts, "DATASETS", tmp_path)


@pytest.mark.parametrize(
    "name, first, last",
    [
        ("gsm5", "gsm8k/1000", "gsm8k/1004"),
        ("gsm12", "gsm8k/1005", "gsm8k/1016"),
        ("he12", "humaneval/5", "humaneval/16"),
        ("mt5", "mtbench/0", "mtbench/4"),
        ("mt24", "mtbench/17", "mtbench/40"),
        ("sg12", "sharegpt/10005", "sharegpt/10016"),
    ],
)
def test_samples_are_the_documented_slices(datasets, name, first, last):
    prompts = heldout_samples.sample_prompts(name)
    assert (prompts[0]["id"], prompts[-1]["id"]) == (first, last)
    assert len(prompts) == heldout_samples.ALL_SAMPLES[name][2]


@pytest.mark.parametrize("kind", ["writing", "questions"])
def test_composed_samples_are_the_five_prompts_the_corpus_leaves_unanswered(kind):
    parts = json.loads(corpus_prompts.COMPOSED_PARTS[kind].read_text())
    every = corpus_prompts.composed_requests(parts, kind)
    assert heldout_samples.sample_prompts(kind[:2] + "5") == every[-5:]


def rounds_with(**changes) -> dict[str, int]:
    rounds = {name: 100 for name in heldout_samples.SAMPLES}
    rounds.update(changes)
    return rounds


def test_verdict_needs_fewer_rounds_and_six_samples_ahead():
    base = rounds_with()
    six_ahead = rounds_with(gsm5=99, he5=99, mt5=99, sg5=99, wr5=99, qu5=99)
    assert heldout_samples.verdict(base, six_ahead).startswith("beats")
    # fewer in all but ahead on one only: the eleventh sample is asked for, then decides
    one_ahead = rounds_with(gsm5=90, he5=101)
    assert "evaluate mt24" in heldout_samples.verdict(base, one_ahead)
    assert heldout_samples.verdict({**base, "mt24": 500}, {**one_ahead, "mt24": 499}).startswith("beats")
    assert heldout_samples.verdict({**base, "mt24": 500}, {**one_ahead, "mt24": 500}).startswith("does not beat")
    # ahead on seven but more rounds in all
    seven_ahead_more_in_all = rounds_with(**{name: 99 for name in list(base)[:7]}, mt12=110)
    assert heldout_samples.verdict(base, seven_ahead_more_in_all).startswith("does not")


def test_compare_reads_eval_outputs(tmp_path):
    for folder, value in (("base", 10), ("cand", 9)):
        (tmp_path / folder).mkdir()
        for name in heldout_samples.SAMPLES:
            result = {"results": [{"block_size": 16, "tau": 2.0, "rounds": value}]}
            (tmp_path / folder / f"{name}.json").write_text(json.dumps(result))
    base, cand = heldout_samples.rounds(tmp_path / "base"), heldout_samples.rounds(tmp_path / "cand")
    assert heldout_samples.verdict(base, cand) == "beats the baseline (90 rounds against 100, ahead on 10 of 10)"
    (tmp_path / "cand" / "qu5.json").unlink()
    assert heldout_samples.verdict(base, heldout_samples.rounds(tmp_path / "cand")) == "incomplete: no result for qu5"


@pytest.mark.parametrize("cores, tie_break", [(1, False), (2, False), (2, True), (3, True)])
def test_queues_hold_every_sample_once_and_balance_the_prompts(cores, tie_break):
    split = heldout_samples.queues(cores, tie_break)
    expected = heldout_samples.ALL_SAMPLES if tie_break else heldout_samples.SAMPLES
    assert len(split) == cores and sorted(n for queue in split for n in queue) == sorted(expected)
    loads = [sum(heldout_samples.ALL_SAMPLES[n][2] for n in queue) for queue in split]
    assert max(loads) - min(loads) <= max(size for _, _, size in heldout_samples.ALL_SAMPLES.values())
