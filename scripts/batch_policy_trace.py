"""What the batched controller chooses, round by round, and what those rounds cost: batched DFlash on held-out GSM8K
(gsm8k@1000), interleaved with plain batched greedy on the same batch. Per call: process CPU seconds of both, the
sizes whose costs the call started with (remembered from earlier calls of this process), its probes (drafted rounds
of a size it had no cost for), the rounds by kind (plain / shadow / drafted with k drafts) with their median CPU cost
as a multiple of the call's median plain round at the same batch size, what the controller believed a round of that
kind costs, and tau; and the call in plain-round units (each round's CPU time over that median), against the
NEW_TOKENS steps of plain batched greedy: an estimate of the speed ratio that a busy core distorts less than the
CPU-time ratio of two calls.

    taskset -c 0 .venv/bin/python scripts/batch_policy_trace.py BATCH NEW_TOKENS REPEATS [old] [margin10] [fresh] \
        [bfloat16]

(e.g. ``8 64 4 fresh``; ``bfloat16``: both models in bf16, else float32). Extra methods, interleaved with the others:
``old`` runs the policy before the exploration ledger (commit 82c483e: the base `DraftLengthController.choose`, no unit
warm-up); ``margin10`` the current one with a margin of 10 %; ``fresh`` the current one without the memory of round
costs across calls (every call probes again).
"""
import collections, statistics, sys, time
import torch
from batch_setup import held_out_batch, load_models
import dflash_hf.batch_generation_dflash as bg

B, NEW, REPS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
target, tok, drafter = load_models("bfloat16" if "bfloat16" in sys.argv[4:] else "float32")
ids, mask = held_out_batch(tok, B)
rounds, probes, starts = [], [], []
real_round = bg.BatchedDFlashLoop._round


def traced_round(self):
    controller = self.controller
    cpu = time.process_time()
    real_round(self)
    k = controller.last_choice
    kind = "s" if controller.shadow else k
    rounds.append((kind, self.batch, time.process_time() - cpu, controller.estimated_cost(k) if k else 1.0))
    probes.append(controller.last_probe)


real_choose = bg.BatchDraftLengthController.choose


def traced_choose(self):
    if not hasattr(self, "last_choice"):  # the call's first round: the sizes it starts with costs for
        starts.append(sorted(k for k in self.cost if k))
    self.last_choice = real_choose(self)
    self.last_probe = self.last_choice > 0 and self.last_choice not in self.cost  # a size this call never timed
    return self.last_choice


bg.BatchedDFlashLoop._round = traced_round
bg.BatchDraftLengthController.choose = traced_choose
NewController = bg.BatchDraftLengthController


class Margin10Controller(NewController):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.margin = 0.1


class FreshController(NewController):
    """Without the memory of round costs across calls (`RoundCostMemory`): every call measures them afresh."""

    def __init__(self, max_drafts, batch_size, memory=None):
        super().__init__(max_drafts, batch_size)


class OldController(NewController):
    def choose(self):
        self.last_choice = bg.DraftLengthController.choose(self)
        return self.last_choice

    def record_round(self, proposed, shadow, seconds, committed, typical):
        if not shadow and typical:
            self.record_cost(proposed, seconds)


opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
with torch.no_grad():
    for kw in ({}, dict(assistant_model=drafter)):
        target.generate(ids, attention_mask=mask, **dict(opts, max_new_tokens=4), **kw)
cpu, calls = collections.defaultdict(list), collections.defaultdict(list)
methods = ["greedy", "dflash"] + [m for m in sys.argv[4:] if m != "bfloat16"]
controllers = {"old": OldController, "margin10": Margin10Controller, "fresh": FreshController}
for rep in range(REPS):
    for name in methods[rep % len(methods):] + methods[:rep % len(methods)]:
        rounds.clear(), probes.clear(), starts.clear()
        bg.BatchDraftLengthController = controllers.get(name, NewController)
        start = time.process_time()
        with torch.no_grad():
            target.generate(ids, attention_mask=mask, **opts, **({} if name == "greedy" else dict(assistant_model=drafter)))
        cpu[name].append(time.process_time() - start)
        if name == "greedy":
            continue
        plain = collections.defaultdict(list)
        for kind, b, seconds, _ in rounds:
            if kind == 0:
                plain[b].append(seconds)
        unit = {b: statistics.median(v) for b, v in plain.items()}
        kinds = collections.defaultdict(list)
        for kind, b, seconds, believed in rounds:
            if b in unit:
                kinds[kind].append((seconds / unit[b], believed))
        summary = "  ".join(
            f"{kind}: {len(v)} rounds, cost {statistics.median(c for c, _ in v):.2f} (believed {statistics.median(b for _, b in v):.2f})"
            for kind, v in sorted(kinds.items(), key=lambda item: str(item[0])))
        units = sum(seconds / unit[b] for _, b, seconds, _ in rounds if b in unit)
        calls[name].append((sum(probes), units))
        print(f"rep {rep} {name}: starts with costs of sizes {starts[0] if starts else '-'}, {sum(probes)} probes, "
              f"tau {drafter.last_stats.mean_acceptance_length:.2f}, {len(rounds)} rounds, "
              f"{units:.1f} plain-round units (greedy: {NEW} steps -> {NEW / units:.3f}x): {summary}")
        print("  sequence:", "".join("s" if kind == "s" else str(kind) if kind < 10 else "F" for kind, *_ in rounds))
    print(f"rep {rep}: " + ", ".join(f"{m} {cpu[m][-1]:.2f}" for m in methods) + " s CPU", flush=True)
g = statistics.median(cpu["greedy"])
for m in methods[1:]:
    d = statistics.median(cpu[m])
    print(f"median: greedy {g:.2f}, {m} {d:.2f} s CPU -> {m}/greedy {g / d:.3f}x; per call (probes, plain-round "
          "units): " + ", ".join(f"({p}, {u:.1f})" for p, u in calls[m]))
