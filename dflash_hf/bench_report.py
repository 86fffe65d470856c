"""Benchmark report: per-method summaries, the cost model, JSON, a Markdown table and PNG plots.

Cost model (docs: landscape §5.1): a round costs ``r(k) + c + o`` decode steps and commits tau tokens, so
``S = tau / (r(k) + c + o)``. ``r`` comes from `dflash_hf.bench.measure_verify_curve`; ``c`` (draft) and ``o``
(context + glue) are each method's per-round phase times over ``t(1)``, greedy's verify time per round in the same
interleaved runs.

Speedups against greedy: ``speedup`` is the median run's decode speed over greedy's median, ``pooled`` all runs'
decode tokens over all their decode time against greedy's (the aggregate; over runs of different lengths the median
run is not it), ``paired range`` each run against greedy on the same prompt and repeat.
"""

import json
import statistics
from pathlib import Path

from .controller_dflash import DFlashStats

PHASES = ("draft", "context", "verify", "glue")


def interpolate_r(r: dict, k: float) -> float | None:
    """``r(k)`` from the measured curve, linear between measured ``k``; None outside it."""
    points = sorted((int(key), value) for key, value in r.items())
    for (k0, r0), (k1, r1) in zip(points, points[1:]):
        if k0 <= k <= k1:
            return r0 + (r1 - r0) * (k - k0) / (k1 - k0)
    return dict(points).get(k)


def summarize(records: list[dict], verify_curve: dict | None = None) -> list[dict]:
    """One row per (dataset, method), datasets in order of appearance then ``"all"``, methods in run order."""
    datasets = list(dict.fromkeys(r["dataset"] for r in records)) + ["all"]
    methods = list(dict.fromkeys(r["method"] for r in records))
    rows = []
    for dataset in datasets:
        subset = [r for r in records if dataset in ("all", r["dataset"])]
        runs = {m: [r for r in subset if r["method"] == m] for m in methods}
        by_method = [_summarize_method(dataset, m, runs[m]) for m in methods]
        by_method = [row for row in by_method if row is not None]
        greedy = next((row for row in by_method if row["method"] == "greedy"), None)
        plain = {(r["prompt_id"], r["repeat"]): r["decode_tok_s"] for r in runs.get("greedy", [])}
        for row in by_method:
            row["speedup"] = row["decode_tok_s"] / greedy["decode_tok_s"] if greedy else None
            row["pooled_speedup"] = row["pooled_tok_s"] / greedy["pooled_tok_s"] if greedy else None
            paired = _paired_speedups(runs[row["method"]], plain)
            row["speedup_range"] = [min(paired), max(paired)] if paired else None
            if verify_curve is not None:
                row.update(_cost_model(row, greedy, verify_curve))
        rows += by_method
    return rows


def _paired_speedups(runs, plain: dict) -> list[float]:
    """Each run's decode speed over plain greedy's on the same prompt in the same repeat (interleaved with it, so
    both saw the same machine): their spread is the run-to-run noise a speedup is read against."""
    return [r["decode_tok_s"] / plain[r["prompt_id"], r["repeat"]]
            for r in runs if (r["prompt_id"], r["repeat"]) in plain]


def _summarize_method(dataset, method, runs) -> dict | None:
    if not runs:
        return None
    block = runs[0]["block"]
    stats = DFlashStats(block)
    for run in runs:
        stats.acceptance_lengths += run["acceptance_lengths"]
        stats.proposed_lengths += run["proposed_lengths"]
    per_round = {p: statistics.median(r["phases_s"][p] / max(len(r["acceptance_lengths"]), 1) for r in runs)
                 for p in PHASES}
    identical, first_diffs = _identity(runs)
    return {
        "dataset": dataset,
        "method": method,
        "runs": len(runs),
        "block": block,
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in runs),
        "decode_tok_s_min": min(r["decode_tok_s"] for r in runs),
        "decode_tok_s_max": max(r["decode_tok_s"] for r in runs),
        "pooled_tok_s": _pooled_tok_s(runs),
        "ttft_s": statistics.median(r["ttft_s"] for r in runs),
        "tau": stats.mean_acceptance_length if stats.acceptance_lengths else 1.0,
        "proposal_counts": {k: stats.proposed_lengths.count(k) for k in sorted(set(stats.proposed_lengths))},
        "histogram": stats.histogram,
        "per_position_acceptance": stats.per_position_acceptance,
        "phase_ms_per_round": {p: 1e3 * t for p, t in per_round.items()},
        "identical_prompts": identical,
        "num_prompts": identical + len(first_diffs),
        "first_diffs": first_diffs,
    }


def _pooled_tok_s(runs) -> float:
    """All runs' decode tokens over all their decode time (0 when none took any), as ``decode_tok_s`` is per run."""
    seconds = sum(r["decode_s"] for r in runs)
    return sum(r["decode_tokens"] for r in runs) / seconds if seconds > 0 else 0.0


def _identity(runs) -> tuple[int, list[dict]]:
    """Prompts whose every run equals the reference, and for the others ``{"dataset", "prompt_id", "position",
    "gap", "error", "near_tie"}`` of the earliest parting (from greedy runs, else None)."""
    by_prompt: dict[tuple, list] = {}
    for run in runs:
        by_prompt.setdefault((run["dataset"], run["prompt_id"]), []).append(run)
    diffs = []
    for (dataset, prompt_id), prompt_runs in by_prompt.items():
        parted = [r for r in prompt_runs if r["first_diff"] is not None]
        if parted:
            first = min(parted, key=lambda r: r["first_diff"])
            margin = first.get("divergence") or {"gap": None, "error": None, "near_tie": None}
            diffs.append({"dataset": dataset, "prompt_id": prompt_id, "position": first["first_diff"], **margin})
    return len(by_prompt) - len(diffs), diffs


def _cost_model(row, greedy, verify_curve) -> dict:
    """``c``, ``o`` and ``r``; predicted speedups and the ceiling (see the module docstring).

    The unit ``t(1)`` is greedy's verify time per round in the same runs (interleaved, at the real context
    lengths), else the curve's one-token time. ``r_in_run`` is this method's verify time per round in that unit;
    the prediction charges each round the curve at the tokens it verified (``r_rounds``: the mean of ``r(1 + k)``
    over the rounds' proposal counts ``k``), so prompt lookup's short rounds and the adaptive generator's plain
    rounds are not charged ``r(B)``; the ceiling assumes every round verifies and commits ``B``.
    """
    ms = row["phase_ms_per_round"]
    t1_ms = greedy["phase_ms_per_round"]["verify"] if greedy else 1e3 * _by_int(verify_curve["median_s"], 1)
    c, o = ms["draft"] / t1_ms, (ms["context"] + ms["glue"]) / t1_ms
    r_k = _mean_r(verify_curve["r"], row.get("proposal_counts") or {0: 1})
    r_b = interpolate_r(verify_curve["r"], row["block"])
    model = {"t1_ms": t1_ms, "c": c, "o": o, "r_in_run": ms["verify"] / t1_ms, "r_block": r_b, "r_rounds": r_k,
             "predicted_speedup": None, "predicted_speedup_with_o": None, "ceiling": None}
    if row["block"] > 1 and r_k is not None and r_b is not None:
        model.update(predicted_speedup=row["tau"] / (r_k + c), predicted_speedup_with_o=row["tau"] / (r_k + c + o),
                     ceiling=row["block"] / (r_b + c))
    return model


def _mean_r(curve: dict, proposal_counts: dict) -> float | None:
    """Mean of ``r(1 + k)`` over rounds, ``proposal_counts[k]`` rounds having proposed ``k`` tokens."""
    values = [(interpolate_r(curve, 1 + int(k)), n) for k, n in proposal_counts.items()]
    if any(r is None for r, _ in values):
        return None
    return sum(r * n for r, n in values) / sum(n for _, n in values)


# ---------------------------------------------------------------------------------------------------------------
# Output
# ---------------------------------------------------------------------------------------------------------------


def _fmt(value, spec=".2f", suffix=""):
    return "–" if value is None else f"{value:{spec}}{suffix}"


def isa_text(machine: dict) -> str:
    """The machine line's vector unit and bf16, e.g. ``, AVX2, bf16 emulated`` or ``, AVX512, native bf16 (a CPU
    with AMX)``; empty for a run recorded before the bench kept them."""
    if "isa" not in machine:
        return ""
    bf16 = f"native bf16 ({machine['native_bf16']})" if machine.get("native_bf16") else "bf16 emulated"
    return f", {machine['isa']}, {bf16}"


def render_markdown(result: dict) -> str:
    """The summary table, the r(k) curve and the machine line as Markdown."""
    machine, config = result["machine"], result["config"]
    lines = [
        f"Machine: {machine['cpu']}{isa_text(machine)}, {machine['cores']} cores, "
        f"{machine['torch_threads']} torch thread(s), {machine['dtype']}, torch {machine['torch']}, "
        f"transformers {machine['transformers']}, load average {machine['loadavg']}.",
        f"Run: {config.get('target')}, drafter {config.get('drafter')}"
        + "".join(f", dflash@{name} = {path}" for name, path in (config.get("compare_drafters") or {}).items())
        + f", max_new_tokens {config['max_new_tokens']}, {config['repeats']} repeat(s), "
        f"temperature {config['temperature']}.",
        "",
        "| dataset | method | decode tok/s | TTFT ms | speedup | pooled | paired range | tau | identical | draft / "
        "context / verify / glue ms per round | r in run | predicted S | with o | ceiling |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["summary"]:
        phases = " / ".join(f"{row['phase_ms_per_round'][p]:.1f}" for p in PHASES)
        spread = row.get("speedup_range")
        spread = f"{spread[0]:.2f}–{spread[1]:.2f}×" if spread else "–"
        lines.append(
            f"| {row['dataset']} | {row['method']} | {row['decode_tok_s']:.1f} | {1e3 * row['ttft_s']:.0f} | "
            f"{_fmt(row['speedup'], '.2f', '×')} | {_fmt(row.get('pooled_speedup'), '.2f', '×')} | {spread} | "
            f"{row['tau']:.2f} | "
            f"{row['identical_prompts']}/{row['num_prompts']} | {phases} | {_fmt(row.get('r_in_run'))} | "
            f"{_fmt(row.get('predicted_speedup'), '.2f', '×')} | "
            f"{_fmt(row.get('predicted_speedup_with_o'), '.2f', '×')} | {_fmt(row.get('ceiling'), '.2f', '×')} |"
        )
    lines += _divergence_lines(result["summary"], result["config"].get("temperature"))
    curve = result.get("verify_curve")
    if curve is not None:
        ks = sorted(int(k) for k in curve["r"])
        lines += [
            "",
            f"r(k) = t(verify k) / t(decode 1), cached context {curve['context_len']}, "
            f"t(1) = {1e3 * _by_int(curve['median_s'], 1):.1f} ms:",
            "",
            "| k | " + " | ".join(str(k) for k in ks) + " |",
            "|---|" + "---|" * len(ks),
            "| r(k) | " + " | ".join(f"{_by_int(curve['r'], k):.2f}" for k in ks) + " |",
        ]
    return "\n".join(lines) + "\n"


def _divergence_lines(summary, temperature) -> list[str]:
    """Where outputs parted from plain greedy, and whether each parting is a floating-point near-tie."""
    rows = [r for r in summary if r["dataset"] != "all" and r["first_diffs"]]
    if not rows:
        return []
    if temperature:
        return ["", "Sampling: outputs differ from the reference sample by design (different random draws)."]
    lines = ["", "Prompts that parted from plain greedy: generated index of the first difference; float32 logit gap "
             "(reference token - ours) there and the dtype's error on those logits, from one forward of the "
             "reference prefix; near-tie = our token within 4 x error of the float32 top logit:", ""]
    for row in rows:
        lines.append(f"- {row['dataset']} / {row['method']}: " + "; ".join(map(parting_text, row["first_diffs"])))
    return lines


def parting_text(parting: dict) -> str:
    """``"ID @ position (gap G, error E, near-tie)"`` for one output that parted from plain greedy
    (``{"prompt_id", "position", "gap", "error", "near_tie"}``, see `bench.divergence_margin`)."""
    d = parting
    kind = "near-tie" if d["near_tie"] else "NOT a near-tie" if d["near_tie"] is False else "length"
    return f"{d['prompt_id']} @ {d['position']} (gap {_fmt(d['gap'], '.3f')}, error {_fmt(d.get('error'), '.3f')}, {kind})"


def _by_int(mapping, k):
    """Look up ``k`` whether the keys are ints (in memory) or strings (read back from JSON)."""
    return mapping[k] if k in mapping else mapping[str(k)]


def plot_results(summary: list[dict], out_dir: Path) -> list[Path]:
    """``speedup.png`` (per dataset, per method) and ``acceptance.png`` (histograms over all datasets)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = [d for d in dict.fromkeys(r["dataset"] for r in summary) if d != "all"]
    methods = list(dict.fromkeys(r["method"] for r in summary))
    rows = {(r["dataset"], r["method"]): r for r in summary}
    width = 0.8 / len(methods)
    fig, ax = plt.subplots(figsize=(1.5 + 1.6 * len(datasets), 3.5))
    for i, method in enumerate(methods):
        values = [rows.get((d, method), {}).get("speedup") or 0.0 for d in datasets]
        ax.bar([x + i * width for x in range(len(datasets))], values, width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(datasets))], datasets)
    ax.set_ylabel("decode speedup over greedy")
    ax.legend(fontsize="small")
    fig.tight_layout()
    speedup = out_dir / "speedup.png"
    fig.savefig(speedup, dpi=120)
    plt.close(fig)

    speculative = [m for m in methods if rows[("all", m)]["block"] > 1]
    fig, axes = plt.subplots(1, max(len(speculative), 1), figsize=(3 * max(len(speculative), 1), 3), squeeze=False)
    for ax, method in zip(axes[0], speculative):
        counts = rows[("all", method)]["histogram"]
        total = sum(counts) or 1
        ax.bar(range(len(counts)), [c / total for c in counts])
        ax.set_title(f"{method} (tau {rows[('all', method)]['tau']:.2f})", fontsize="small")
        ax.set_xlabel("tokens committed per round")
    axes[0][0].set_ylabel("fraction of rounds")
    fig.tight_layout()
    acceptance = out_dir / "acceptance.png"
    fig.savefig(acceptance, dpi=120)
    plt.close(fig)
    return [speedup, acceptance]


def write_report(result: dict, out_dir) -> dict[str, Path]:
    """Write ``bench.json`` (config, machine, r(k), raw runs, summary), ``bench.md`` and the plots."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "bench.json", "markdown": out_dir / "bench.md"}
    paths["json"].write_text(json.dumps(result, indent=1) + "\n")
    paths["markdown"].write_text(render_markdown(result))
    paths["speedup"], paths["acceptance"] = plot_results(result["summary"], out_dir)
    return paths
