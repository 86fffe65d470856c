"""The benchmark harness on a tiny random Qwen3 target and a tiny DFlash drafter (no assets needed)."""

import argparse
import json

import pytest
import torch
from conftest import VOCAB, tiny_drafter, tiny_target

from dflash_hf.bench import (
    ALL_METHODS,
    BenchPrompt,
    Method,
    PhaseProfiler,
    build_methods,
    first_difference,
    machine_info,
    measure_verify_curve,
    run_once,
    run_suite,
)
from dflash_hf.bench_cli import add_bench_parser, run_bench
from dflash_hf.bench_report import interpolate_r, isa_text, render_markdown, write_report
from dflash_hf.loading import cpu_name

BLOCK, NEW = 4, 16


@pytest.fixture(scope="module")
def models():
    target = tiny_target("qwen3")
    return target, tiny_drafter(target, block_size=BLOCK)


def prompts():
    generator = torch.Generator().manual_seed(7)
    return [BenchPrompt(ds, f"{ds}-{i}", torch.randint(4, VOCAB, (1, 10), generator=generator))
            for ds, i in (("toy_a", 0), ("toy_b", 0))]


@pytest.fixture(scope="module")
def greedy_result(models):
    target, drafter = models
    return run_suite(target, prompts(), drafter, max_new_tokens=NEW, repeats=2, context_len=32, verify_repeats=2,
                     config={"target": "tiny-qwen3"}, progress=False)


def test_every_method_runs_interleaved(greedy_result):
    runs = greedy_result["runs"]
    assert {r["method"] for r in runs} == set(ALL_METHODS)
    assert len(runs) == 2 * 2 * len(ALL_METHODS)
    first_in_order = {r["method"] for r in runs if r["slot"] == 0}
    assert len(first_in_order) > 1  # the order rotates between repeats
    assert all(r["new_tokens"] == NEW for r in runs)


def test_every_method_is_token_identical_to_greedy_in_fp32(greedy_result):
    assert all(r["identical"] and r["first_diff"] is None for r in greedy_result["runs"])
    assert all(row["identical_prompts"] == row["num_prompts"] for row in greedy_result["summary"])


def test_oracle_accepts_whole_blocks(greedy_result):
    for run in (r for r in greedy_result["runs"] if r["method"] == "oracle"):
        assert run["acceptance_lengths"][:-1] == [BLOCK] * (len(run["acceptance_lengths"]) - 1)
        assert 1 <= run["acceptance_lengths"][-1] <= BLOCK
    oracle = next(row for row in greedy_result["summary"] if row["method"] == "oracle" and row["dataset"] == "all")
    assert oracle["histogram"][BLOCK] > 0 and oracle["per_position_acceptance"] == [1.0] * (BLOCK - 1)


def test_phases_add_up_and_cost_model_bounds_the_speedup(greedy_result):
    for run in greedy_result["runs"]:
        phases = run["phases_s"]
        assert min(phases.values()) >= 0 and phases["verify"] > 0 and phases["prefill"] > 0
        assert (phases["draft"] > 0) == (run["method"] in ("dflash", "dflash_nolookup", "dflash_builtin", "oracle"))
        if run["method"] == "oracle":  # its "drafts" are a slice of the reference: no drafter, no head
            assert phases["draft"] < 0.1 * phases["verify"]
        assert run["target_forwards"] == len(run["acceptance_lengths"]) + 1
        assert sum(run["acceptance_lengths"]) == run["decode_tokens"]
    rows = {(r["dataset"], r["method"]): r for r in greedy_result["summary"]}
    assert rows[("all", "greedy")]["speedup"] == pytest.approx(1.0)
    dflash = rows[("all", "dflash")]
    assert dflash["c"] > 0 and dflash["r_block"] is not None and dflash["ceiling"] > dflash["predicted_speedup"]
    assert greedy_result["verify_curve"]["r"][1] == 1.0
    # the spread of speedups paired run by run with plain greedy on the same prompt in the same repeat
    assert rows[("all", "greedy")]["speedup_range"] == [1.0, 1.0]
    plain = {(r["prompt_id"], r["repeat"]): r["decode_tok_s"] for r in greedy_result["runs"] if r["method"] == "greedy"}
    paired = [r["decode_tok_s"] / plain[r["prompt_id"], r["repeat"]] for r in greedy_result["runs"]
              if r["method"] == "dflash"]
    assert len(paired) == dflash["runs"] and dflash["speedup_range"] == [min(paired), max(paired)]


def test_report_writes_json_markdown_and_plots_that_round_trip(greedy_result, tmp_path):
    paths = write_report(greedy_result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert set(data) == {"config", "machine", "verify_curve", "runs", "summary"}
    assert {"cpu", "cores", "torch_threads", "dtype", "torch", "transformers", "loadavg"} <= set(data["machine"])
    assert {"decode_tok_s", "ttft_s", "phases_s", "acceptance_lengths", "proposed_lengths", "first_diff"} <= set(
        data["runs"][0])
    assert {"speedup", "tau", "histogram", "per_position_acceptance", "identical_prompts", "first_diffs"} <= set(
        data["summary"][0])
    markdown = paths["markdown"].read_text()
    assert markdown == render_markdown(data)  # renders from JSON read back too
    assert "| toy_a | oracle |" in markdown and "r(k)" in markdown
    for kind in ("speedup", "acceptance"):
        assert paths[kind].stat().st_size > 1000


def profiled_dflash_run(target, drafter) -> dict:
    """The record of one profiled dflash-hf run on the first prompt; the profiler is removed afterwards."""
    profiler = PhaseProfiler(target, drafter)
    try:
        (method,) = build_methods(drafter, ["dflash"])
        return run_once(target, method, prompts()[0].input_ids, NEW, profiler)[0]
    finally:
        profiler.remove()


def test_recorded_rounds_match_the_generator_stats(models):
    target, drafter = models
    record = profiled_dflash_run(target, drafter)
    assert record["acceptance_lengths"] == drafter.last_stats.acceptance_lengths
    assert record["proposed_lengths"] == drafter.last_stats.proposed_lengths
    assert "_get_candidate_generator" not in vars(target)  # the profiler leaves the target as it found it


def test_draft_head_is_one_hooked_call_per_drafted_round_and_the_bench_counts_it(models, monkeypatch):
    """Every round that runs the drafter makes one `DFlashDraftHead` call that module hooks see (here a global
    forward hook, as a profiler installs); the bench counts draft forwards with its own hook on that module."""
    from torch.nn.modules.module import register_module_forward_hook

    from dflash_hf import DFlashDraftHead

    target, drafter = models
    rows = []
    handle = register_module_forward_hook(
        lambda module, args, output: rows.append(output[0].shape[1]) if isinstance(module, DFlashDraftHead) else None
    )
    try:
        record = profiled_dflash_run(target, drafter)
    finally:
        handle.remove()
    drafted = [k for k in drafter.last_stats.proposed_lengths if k > 0]  # fixed blocks: no shadow or lookup rounds
    assert len(drafted) > 1 and record["draft_forwards"] == len(rows) == len(drafted)
    assert rows == [min(k + 1, BLOCK - 1) for k in drafted]  # one draft more than proposed, where the block has it

    monkeypatch.setattr(DFlashDraftHead, "__call__", DFlashDraftHead.forward)  # the same drafts, but no hooks run
    record = profiled_dflash_run(target, drafter)
    assert record["draft_forwards"] == 0 and drafter.last_stats.proposed_lengths[0] > 0


def test_sampling_runs_without_oracle(models):
    target, drafter = models
    result = run_suite(target, prompts()[:1], drafter, methods=("greedy", "pld3", "dflash", "oracle"),
                       max_new_tokens=8, repeats=1, temperature=0.8, context_len=16, verify_repeats=1, progress=False)
    assert {r["method"] for r in result["runs"]} == {"greedy", "pld3", "dflash"}
    assert next(r for r in result["runs"] if r["method"] == "greedy")["identical"]  # same seed, same samples


def test_first_difference_interpolation_and_verify_curve(models):
    reference = torch.tensor([[1, 2, 3, 4, 5]])
    assert first_difference(reference, reference, 2) is None
    assert first_difference(torch.tensor([[1, 2, 3, 9, 5]]), reference, 2) == 1
    assert first_difference(torch.tensor([[1, 2, 3]]), reference, 2) == 1
    assert interpolate_r({1: 1.0, 2: 1.5, 4: 2.5}, 3) == pytest.approx(2.0)
    assert interpolate_r({"1": 1.0, "4": 2.0}, 8) is None
    assert Method("greedy").block == 1
    with pytest.raises(ValueError, match="needs a DFlash drafter"):
        build_methods(None, ["dflash"])
    curve = measure_verify_curve(models[0], ks=(2, 4), context_len=8, repeats=1)
    assert sorted(curve["r"]) == [1, 2, 4] and all(len(t) == 1 for t in curve["t_s"].values())


def test_a_second_drafter_runs_interleaved_as_its_own_method(models):
    """``other_drafters`` (``bench --compare-draft NAME=PATH``): ``dflash@NAME`` runs in the same rotation as the
    others, token-identical in fp32, with its own drafter forwards hooked into the draft phase and its own tau."""
    target, drafter = models
    other = tiny_drafter(target, block_size=BLOCK, seed=5)
    calls = []
    hook = other.register_forward_hook(lambda *_: calls.append(1))
    try:
        result = run_suite(target, prompts()[:1], drafter, ("greedy", "dflash"), max_new_tokens=NEW, repeats=2,
                           context_len=32, verify_repeats=1, progress=False, other_drafters={"seed5": other})
    finally:
        hook.remove()
    runs = [r for r in result["runs"] if r["method"] == "dflash@seed5"]
    assert len(runs) == 2 and len({r["slot"] for r in runs}) == 2  # rotated with the other two methods
    assert all(r["identical"] and r["phases_s"]["draft"] > 0 for r in runs)
    rows = {r["method"]: r for r in result["summary"] if r["dataset"] == "all"}
    assert set(rows) == {"greedy", "dflash", "dflash@seed5"} and rows["dflash@seed5"]["block"] == BLOCK
    result["config"].update(drafter="default", compare_drafters={"seed5": "runs/seed5/final"})
    assert "drafter default, dflash@seed5 = runs/seed5/final, max_new_tokens" in render_markdown(result)
    # the second drafter drafted every round of its runs (plus the warm-up's)
    assert len(calls) >= sum(len(r["acceptance_lengths"]) for r in runs)


def test_a_smaller_block_is_asked_per_call_of_every_drafter_and_a_shorter_drafter_is_refused(models):
    target, drafter = models
    other = tiny_drafter(target, block_size=BLOCK, seed=5, adaptive=True)
    methods = {m.name: m for m in build_methods(drafter, ("greedy", "dflash", "oracle"), block_size=2,
                                                other_drafters={"o": other})}
    assert {name: m.block for name, m in methods.items()} == {"greedy": 1, "dflash": 2, "oracle": 2, "dflash@o": 2}
    assert methods["dflash"].generate_kwargs["num_assistant_tokens"] == 1
    assert methods["dflash"].generate_kwargs["num_assistant_tokens_schedule"] == "constant"  # not adaptive
    assert methods["dflash@o"].generate_kwargs["num_assistant_tokens_schedule"] == "heuristic"  # adaptive
    own_block = build_methods(drafter, ("dflash",), other_drafters={"o": other})
    assert all("num_assistant_tokens" not in m.generate_kwargs for m in own_block)  # their own block: nothing asked
    with pytest.raises(ValueError, match="drafts blocks of 2, fewer than 4"):
        build_methods(drafter, ("dflash",), other_drafters={"short": tiny_drafter(target, block_size=2)})


def test_compare_draft_needs_a_name_before_any_model_loads(capsys):
    from dflash_hf.cli import main

    assert main(["bench", "--compare-draft", "runs/run11/final"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err and "NAME=PATH" in err
    assert main(["bench", "--compare-draft", "a=x", "--batch-size", "4"]) == 1
    assert "per-prompt benchmark only" in capsys.readouterr().err


def test_bench_parser_defaults_and_options():
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--quick", "--draft", "random", "--temperature", "0.7"])
    assert args.func is run_bench and args.quick and args.draft == "random" and args.temperature == 0.7
    assert args.methods.split(",") == list(ALL_METHODS) and args.threads == 1


def test_bench_dtype_auto_is_resolved_before_the_target_loads(monkeypatch, capsys):
    from dflash_hf import bench_cli, loading

    class Loaded(Exception):  # stops the bench before any model work: only the resolved dtype is under test
        pass

    asked = []

    def load_target(spec, dtype):
        asked.append(dtype)
        raise Loaded

    monkeypatch.setattr(bench_cli, "load_target", load_target)
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    for native, expected in ((None, "float32"), ("a CPU with AVX-512 BF16", "bfloat16")):
        monkeypatch.setattr(loading, "native_bf16", lambda native=native: native)
        with pytest.raises(Loaded):
            run_bench(parser.parse_args(["bench", "--dtype", "auto", "--methods", "greedy"]))
        assert asked[-1] == expected and f"dtype: {expected} (auto: " in capsys.readouterr().out
    assert parser.parse_args(["bench"]).dtype == "float32"  # the protocol's default is unchanged


def test_bench_prompts_can_skip_the_prompts_a_drafter_was_trained_on(monkeypatch):
    from conftest import char_tokenizer

    from dflash_hf import assets
    from dflash_hf.bench_cli import load_bench_prompts
    from dflash_hf.errors import DFlashUserError

    records = [{"id": str(i), "turns": [f"q{i}"]} for i in range(5)]
    monkeypatch.setattr(assets, "load_prompts", lambda name, limit=None: records[:limit])
    tokenizer = char_tokenizer()
    assert [p.id for p in load_bench_prompts(tokenizer, ["toy@3"], 4, chat=False)] == ["3", "4"]
    assert [p.id for p in load_bench_prompts(tokenizer, ["toy"], 2, chat=False)] == ["0", "1"]
    for bad in ("toy@x", "toy@5"):
        with pytest.raises(DFlashUserError, match="toy"):
            load_bench_prompts(tokenizer, [bad], 2, chat=False)


def test_divergence_margin_tells_a_near_tie_from_a_real_difference():
    from dflash_hf.bench import divergence_margin, float32_twin

    target = tiny_target("qwen3")  # untied head: one row can be made an exact twin of another
    prompt = torch.randint(4, VOCAB, (1, 8), generator=torch.Generator().manual_seed(3))
    reference = target.generate(prompt, max_new_tokens=6, do_sample=False)
    with torch.no_grad():
        logits = target(reference[:, :10]).logits[0, -1]
    first, second = logits.topk(2).indices.tolist()
    parted = reference.clone()
    parted[0, 10] = second  # committed the runner-up at generated index 2
    margin = divergence_margin(target, parted, reference, prompt_len=8, position=2)
    assert margin["gap"] == pytest.approx(float(logits[first] - logits[second])) and margin["gap"] > 0
    assert margin["error"] == 0.0 and margin["near_tie"] is False
    # in bf16 the gap is judged against bf16's own error on the two logits, measured against a float32 twin
    low = tiny_target("qwen3").to(torch.bfloat16)
    twin = float32_twin(low)
    assert twin.dtype == torch.float32 and not twin._forward_hooks
    with torch.no_grad():
        exact = twin(reference[:, :10]).logits[0, -1]
    margin = divergence_margin(low, parted, reference, 8, 2, exact=twin)
    assert margin["gap"] == pytest.approx(float(exact[first] - exact[second]), abs=1e-5) and margin["error"] > 0
    assert margin["near_tie"] == (float(exact.max() - exact[second]) <= 4 * margin["error"])
    with torch.no_grad():
        target.lm_head.weight[second] = target.lm_head.weight[first]  # an exact tie
    margin = divergence_margin(target, parted, reference, prompt_len=8, position=2)
    assert margin == {"gap": 0.0, "error": 0.0, "near_tie": True}
    third = int(logits.topk(3).indices[2])
    with torch.no_grad():
        target.lm_head.weight[third] = target.lm_head.weight[first]  # a three-way tie: ours need not be in the top 2
    parted[0, 10] = third
    assert divergence_margin(target, parted, reference, prompt_len=8, position=2)["near_tie"] is True
    assert divergence_margin(target, parted[:, :10], reference, 8, 2)["near_tie"] is None


def test_divergence_margin_in_a_batch_also_measures_the_padded_batched_forward():
    """A batch parting is judged against the rounding of the prefix run left-padded among the batch's other rows too:
    in float32 that forward equals the row alone (the padding is masked out as in a batched generate), in bf16 its
    error counts as well."""
    from dflash_hf.bench import divergence_margin, float32_twin

    target = tiny_target("qwen3")
    gen = torch.Generator().manual_seed(5)
    prompt = torch.randint(4, VOCAB, (1, 8), generator=gen)
    reference = target.generate(prompt, max_new_tokens=6, do_sample=False)
    neighbours = [torch.randint(4, VOCAB, (1, n), generator=gen) for n in (3, 17)]  # one shorter, one longer
    with torch.no_grad():
        logits = target(reference[:, :10]).logits[0, -1]
    parted = reference.clone()
    parted[0, 10] = int(logits.topk(2).indices[1])
    alone = divergence_margin(target, parted, reference, 8, 2)
    among = divergence_margin(target, parted, reference, 8, 2, neighbours=neighbours)
    assert alone["error"] == 0.0 and among["error"] < 1e-4 and among["gap"] == alone["gap"]
    low = tiny_target("qwen3").to(torch.bfloat16)
    twin = float32_twin(low)
    alone = divergence_margin(low, parted, reference, 8, 2, exact=twin)
    calls = []
    low.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.get("attention_mask")),
                                  with_kwargs=True)
    among = divergence_margin(low, parted, reference, 8, 2, exact=twin, neighbours=neighbours)
    batched = [mask for mask in calls if mask is not None]
    assert len(batched) == 1 and batched[0].shape == (3, 17)  # the prefix (10 tokens) beside the rows of 3 and 17
    assert batched[0][0].tolist() == [0] * 7 + [1] * 10 and batched[0][1].tolist() == [0] * 14 + [1] * 3
    assert among["error"] >= alone["error"] > 0 and among["gap"] == alone["gap"]


def test_draft_phase_covers_the_whole_draft_including_the_head(models, monkeypatch):
    """The drafter's own hooks nest inside the draft head's: the head's logits after the drafter forward are draft
    time too."""
    import time

    from dflash_hf import generation_dflash

    target, drafter = models
    real_head_logits = generation_dflash.head_logits

    def slow_head_logits(lm_head, rows):
        time.sleep(0.01)
        return real_head_logits(lm_head, rows)

    monkeypatch.setattr(generation_dflash, "head_logits", slow_head_logits)
    record = profiled_dflash_run(target, drafter)
    drafting_rounds = sum(1 for k in record["proposed_lengths"] if k > 0)
    assert drafting_rounds > 0
    assert record["phases_s"]["draft"] >= 0.01 * drafting_rounds
    assert record["phases_s"]["context"] < 0.005 * drafting_rounds


def test_oracle_settles_on_the_continuation_it_commits(models):
    """A reference the oracle does not reproduce (as after a bf16 near-tie) is replaced by the oracle's own output."""
    from dflash_hf.bench import _set_oracle_reference

    target, drafter = models
    ids = prompts()[0].input_ids
    greedy = target.generate(ids, max_new_tokens=NEW, do_sample=False)
    wrong = greedy.clone()
    wrong[0, ids.shape[1] + 5] = (wrong[0, ids.shape[1] + 5] + 1) % VOCAB
    methods = build_methods(drafter, ["greedy", "oracle"])
    profiler = PhaseProfiler(target, drafter)
    try:
        _set_oracle_reference(target, methods, ids, wrong, NEW, profiler)
        oracle = methods[1].generate_kwargs["assistant_model"]
        assert torch.equal(oracle.reference, greedy)
        record, output = run_once(target, methods[1], ids, NEW, profiler)
    finally:
        profiler.remove()
    assert torch.equal(output, greedy) and set(record["acceptance_lengths"][:-1]) == {BLOCK}


def test_prediction_charges_each_round_its_own_verify_size():
    from dflash_hf.bench_report import _cost_model

    curve = {"r": {1: 1.0, 2: 1.8, 4: 1.5, 8: 1.9, 16: 2.5}, "median_s": {1: 0.04}}
    phases = {"draft": 2.0, "context": 0.0, "verify": 50.0, "glue": 0.0}
    greedy = {"phase_ms_per_round": {"draft": 0.0, "context": 0.0, "verify": 40.0, "glue": 0.0}}
    # half the rounds plain (r(1) = 1), half with 3 drafts (r(4) = 1.5): mean r 1.25, not r(2.5) on the curve
    row = {"phase_ms_per_round": phases, "block": 16, "tau": 2.0, "proposal_counts": {0: 10, 3: 10}}
    model = _cost_model(row, greedy, curve)
    assert model["r_rounds"] == pytest.approx(1.25)
    assert model["predicted_speedup"] == pytest.approx(2.0 / (1.25 + 2.0 / 40.0))


def test_pooled_speedup_is_all_tokens_over_all_time_where_the_median_is_a_typical_run():
    from dflash_hf.bench_report import summarize

    def record(method, prompt_id, tokens, seconds):
        block = 1 if method == "greedy" else 16
        return {"dataset": "set", "method": method, "prompt_id": prompt_id, "repeat": 0, "block": block,
                "decode_tokens": tokens, "decode_s": seconds, "decode_tok_s": tokens / seconds, "ttft_s": 0.1,
                "acceptance_lengths": [1] * tokens, "proposed_lengths": [0] * tokens, "first_diff": None,
                "phases_s": {"draft": 0.0, "context": 0.0, "verify": seconds, "glue": 0.0}}

    # greedy 10 tok/s on all three prompts; the drafter 40, 20 and 30 tok/s, but its fast run is the long one
    runs = [record("greedy", p, 100, 10.0) for p in "abc"]
    runs += [record("dflash", "a", 400, 10.0), record("dflash", "b", 100, 5.0), record("dflash", "c", 60, 2.0)]
    row = next(r for r in summarize(runs) if r["dataset"] == "all" and r["method"] == "dflash")
    assert row["speedup"] == pytest.approx(3.0)  # the median run, 30 tok/s
    assert row["pooled_tok_s"] == pytest.approx(560 / 17.0)
    assert row["pooled_speedup"] == pytest.approx((560 / 17.0) / 10.0)
    machine = {"cpu": "x", "cores": 2, "torch_threads": 1, "dtype": "float32", "torch": "t", "transformers": "t",
               "loadavg": [0]}
    config = {"max_new_tokens": 1, "repeats": 1, "temperature": 0.0}
    assert "| 3.00× | 3.29× |" in render_markdown({"machine": machine, "config": config, "summary": summarize(runs)})


def test_batch_benchmark_times_whole_batches_and_checks_every_row(models):
    from dflash_hf.bench import batch_report, generated_tokens, run_batch_benchmark

    target, drafter = models
    generator = torch.Generator().manual_seed(3)
    batch_prompts = [BenchPrompt("toy", str(i), torch.randint(4, VOCAB, (1, 3 + 5 * i), generator=generator))
                     for i in range(3)]
    result = run_batch_benchmark(target, batch_prompts, drafter, batch_size=2, max_new_tokens=8, progress=False)
    summary = result["summary"]
    assert summary["rows"] == summary["rows_equal"] == 3  # batches of 2 and 1, every row identical
    assert summary["greedy"]["tokens"] == summary["dflash"]["tokens"] == 3 * 8
    assert len(result["runs"]) == 4 and summary["speedup"] > 0 and summary["cpu_speedup"] > 0
    assert all(run["cpu_seconds"] > 0 for run in result["runs"])
    assert "| dflash | 24 |" in batch_report(result)
    assert result["partings"] == [] and "parted" not in batch_report(result)
    dflash_runs = [run for run in result["runs"] if run["method"] == "dflash"]
    assert summary["rounds"] == sum(run["rounds"] for run in dflash_runs)
    assert all(1 <= run["rounds"] <= 8 - 1 for run in dflash_runs)  # the prefill commits token 1, a round >= 1 more
    assert 0 <= summary["drafted_rounds"] <= summary["rounds"]
    assert f"in {summary['drafted_rounds']} of its {summary['rounds']} rounds" in batch_report(result)
    rows = torch.tensor([[9, 9, 5, 2, 0, 0], [9, 9, 5, 6, 7, 8]])  # prompt width 2, EOS 2 then padding
    assert generated_tokens(rows, 2, [2]) == 2 + 4


def test_batch_benchmark_locates_where_a_row_parted_and_asks_if_it_was_a_near_tie(models, monkeypatch):
    """A DFlash row that differs from plain batched greedy is reported with the generated index of its first
    difference, counted in that row without its left padding, and the float32 margin there."""
    from dflash_hf.bench import batch_report, run_batch_benchmark

    target, drafter = models
    generator = torch.Generator().manual_seed(4)
    batch_prompts = [BenchPrompt("toy", str(i), torch.randint(4, VOCAB, (1, 3 + 6 * i), generator=generator))
                     for i in range(2)]
    generate = type(target).generate

    def spoiled(self, *args, **kwargs):  # DFlash's row 0 (the shorter prompt) gets a wrong token at generated index 5
        output = generate(self, *args, **kwargs)
        if kwargs.get("assistant_model") is not None and kwargs["max_new_tokens"] == 8:
            output = output.clone()
            width = args[0].shape[1]
            output[0, width + 5] = (output[0, width + 5] + 1) % VOCAB
        return output

    monkeypatch.setattr(type(target), "generate", spoiled)
    result = run_batch_benchmark(target, batch_prompts, drafter, batch_size=2, max_new_tokens=8, progress=False)
    assert result["summary"]["rows_equal"] == 1
    (parting,) = result["partings"]
    assert (parting["prompt_id"], parting["position"], parting["group"]) == ("0", 5, 0)
    assert parting["near_tie"] is False and parting["gap"] > 0  # a token the target does not rank first
    assert "0 @ 5 (gap" in batch_report(result) and "NOT a near-tie" in batch_report(result)


def test_machine_line_names_the_cpu_family_and_its_vector_unit(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 1\n"
                       "model name\t: AMD EPYC\nflags\t\t: fpu avx2\n\nprocessor\t: 1\ncpu family\t: 99\n")
    assert cpu_name(str(cpuinfo)) == "AMD EPYC (family 23 model 1)"  # the first processor's, not the last's
    machine = {"cpu": "AMD EPYC (family 23 model 1)", "isa": "AVX2", "native_bf16": None}
    assert isa_text(machine) == ", AVX2, bf16 emulated"
    amx = dict(machine, isa="AVX512", native_bf16="a CPU with AMX")
    assert isa_text(amx) == ", AVX512, native bf16 (a CPU with AMX)"
    assert isa_text({"cpu": "AMD EPYC"}) == ""  # a run recorded before the field existed still renders
    recorded = machine_info(torch.float32)
    assert recorded["isa"] == torch.backends.cpu.get_cpu_capability() and "native_bf16" in recorded
