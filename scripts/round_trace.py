"""What the single-sequence controller chooses, call after call in one process: DFlash through
``target.generate(assistant_model=draft)`` on one held-out prompt (fp32 default target, shipped drafter, greedy),
interleaved with plain greedy. Per call: process CPU seconds of both, tau, the rounds by kind (plain / shadow /
drafter / lookup with an n-gram match of n) with the drafts they proposed and accepted, what the lookup rounds
committed against what the controller priced them at, the shadow rounds' drafter forwards in plain rounds, the
exploration budget spent against the one allowed, and the unit (a plain round's seconds: the first sample, the
median, the value at the end of the call).

    taskset -c 0 .venv/bin/python scripts/round_trace.py DATASET INDEX CALLS [NEW_TOKENS]

(e.g. ``mtbench 0 4``: MT-Bench 81, four calls; datasets as in ``dflash-hf bench --datasets``).
"""
import collections, statistics, sys, time
import torch
from dflash_hf import controller_dflash
from dflash_hf.assets import encode_chat
from dflash_hf.bench_cli import dataset_records
from dflash_hf.loading import load_drafter, load_target

spec, index, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
new_tokens = int(sys.argv[4]) if len(sys.argv) > 4 else 128
torch.set_num_threads(1)
target, tokenizer = load_target("default", "float32")
drafter = load_drafter("default", target)
rounds, shadow_costs, unit_samples, controllers = [], [], [], []
Sizes, Rounds = controller_dflash.DraftLengthController, controller_dflash.RoundController
real_verification, real_shadow_cost, real_cost = (
    Rounds.record_verification, Sizes.record_shadow_cost, Sizes.record_cost)


def traced_verification(self, committed):
    round = self.current
    if round is not None:
        kind = f"lookup{round.match}" if round.lookup is not None else (
            "shadow" if round.shadow else "drafter" if round.proposed else "plain")
        # A lookup round's price as the controller saw it when it chose the round: what lookup cost it in plain rounds.
        price = (self.lookup_rates[round.match].estimated_cost(round.proposed) if round.lookup is not None
                 else 0.0)
        rounds.append((kind, round.proposed, committed.shape[0] - 1, price))
        if self.sizes is not None and self.sizes not in controllers:
            controllers.append(self.sizes)
    return real_verification(self, committed)


def traced_shadow_cost(self, seconds, drafter_seconds, typical=True):
    real_shadow_cost(self, seconds, drafter_seconds, typical)
    shadow_costs.append(drafter_seconds / self.step_seconds)


def traced_cost(self, proposed, seconds):
    if proposed == 0:
        unit_samples.append(seconds)
    return real_cost(self, proposed, seconds)


Rounds.record_verification, Sizes.record_shadow_cost, Sizes.record_cost = (
    traced_verification, traced_shadow_cost, traced_cost)


def timed(**kwargs):
    start = time.process_time()
    with torch.inference_mode():
        output = target.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **kwargs)
    return time.process_time() - start, output


name, record = dataset_records([spec], index + 1)[index]
inputs = encode_chat(tokenizer, record["turns"])
timed(assistant_model=drafter)  # warm-up: the head's matmul forms, the first round costs
for call in range(calls):
    plain_seconds, plain = timed()
    for log in (rounds, shadow_costs, unit_samples, controllers):
        log.clear()
    dflash_seconds, output = timed(assistant_model=drafter)
    kinds = collections.defaultdict(lambda: [0, 0, 0])
    for kind, proposed, accepted, _ in rounds:
        kinds[kind][0] += 1
        kinds[kind][1] += proposed
        kinds[kind][2] += accepted
    lookup_tokens = sum(count + accepted for kind, (count, _, accepted) in kinds.items() if kind.startswith("lookup"))
    lookup_price = sum(price for *_, price in rounds)  # 0 for every round but a lookup's
    sizes = controllers[0]
    print(f"{record['id']} call {call}: plain {plain_seconds:.2f} s, DFlash {dflash_seconds:.2f} s "
          f"({plain_seconds / dflash_seconds:.3f}x), tau {drafter.last_stats.mean_acceptance_length:.2f}, "
          f"identical {torch.equal(plain, output)}")
    print("  rounds (count, proposed, accepted):", {kind: tuple(v) for kind, v in sorted(kinds.items())})
    print(f"  lookup rounds committed {lookup_tokens} tokens for {lookup_price:.1f} plain rounds (their estimated "
          f"cost when chosen; plain decoding commits 1 per round)")
    print(f"  shadow drafter forwards {[round(c, 2) for c in shadow_costs]} plain rounds; exploration spent "
          f"{sizes.explored:.2f} of {sizes.allowance + sizes.explore_share * sizes.rounds:.2f}")
    print(f"  unit: first {unit_samples[0] * 1e3:.1f} ms, median {statistics.median(unit_samples) * 1e3:.1f} ms, "
          f"end {sizes.step_seconds * 1e3:.1f} ms", flush=True)
