"""CI's share of the randomized losslessness cases (`tests/fuzz.py`; ``scripts/fuzz.sh N`` runs more)."""

import pytest
from fuzz import REPRODUCER, check, draw_case

from dflash_hf import generation_dflash

CI_CASES = 300
CHUNK = 50


@pytest.mark.parametrize("start", range(0, CI_CASES, CHUNK))
def test_random_cases_are_lossless(start):
    failures = [failure for seed in range(start, start + CHUNK) if (failure := check(seed))]
    assert not failures, "\n".join(failures)


def test_ci_cases_cover_the_space():
    """The CI seeds reach every corner the harness draws from, so a bug in one of them has a case to show up in."""
    cases = [draw_case(seed) for seed in range(CI_CASES)]
    assert {c["arch"] for c in cases} == {"qwen3", "llama"}
    assert {c["block_size"] for c in cases} == set(range(1, 17))
    assert {c["stop_mode"] for c in cases} == {"none", "eos_inside", "eos_last", "stop_string"}
    assert {(c["target_attn"], c["draft_attn"]) for c in cases} == {(a, b) for a in ("eager", "sdpa") for b in ("eager", "sdpa")}
    assert any("sliding_attention" in c["layer_types"] for c in cases)
    assert any(c["layer_ids"] != sorted(set(c["layer_ids"])) for c in cases)  # unsorted or repeated ids
    assert {c["adaptive"] for c in cases} == {c["pinned"] for c in cases} == {c["sample"] for c in cases} == {True, False}
    assert min(c["prompt_len"] for c in cases) == 1 and max(c["prompt_len"] for c in cases) > 250
    assert min(c["max_new_tokens"] for c in cases) == 1 and max(c["max_new_tokens"] for c in cases) > 150


def test_harness_catches_a_real_bug_and_prints_a_reproducer(monkeypatch):
    """Power check: without the stop-string cut, accepted drafts run past a stop string; the harness must see it."""
    monkeypatch.setattr(generation_dflash.DFlashCandidateGenerator, "_stop_before_stop_strings", lambda self, ids, p: p)
    failures = [failure for seed in (19, 25, 29) if (failure := check(seed))]
    assert failures and all(REPRODUCER.format(seed="") in failure for failure in failures)
    assert all(draw_case(seed)["stop_mode"] == "stop_string" for seed in (19, 25, 29))
