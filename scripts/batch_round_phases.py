"""Per-round phase costs of the batched DFlash loop at a fixed number of drafts k (process CPU ms, medians over the
rounds of a 32-token call after one warm call), against a plain batched greedy step, on held-out GSM8K.

    taskset -c 0 .venv/bin/python scripts/batch_round_phases.py 4,8 0,1,3 [DTYPE]  # batch sizes, k values, float32
"""
import sys, time, statistics, collections, torch
from batch_setup import held_out_batch, load_models
import dflash_hf.batch_generation_dflash as bg
target, tok, drafter = load_models(sys.argv[3] if len(sys.argv) > 3 else "float32")
NEW = 32
cur = collections.defaultdict(float)
def wrap(obj, name, key, cls=True):
    orig = getattr(obj, name)
    def f(*a, **k):
        c = time.process_time()
        try: return orig(*a, **k)
        finally: cur[key] += time.process_time() - c
    setattr(obj, name, f)
for n in ["_take_context", "_draft", "_verify", "_accept", "_commit", "_after_round", "_close_holes", "_drop_finished"]:
    wrap(bg.BatchedDFlashLoop, n, n)
wrap(drafter, "propose", "propose")
rounds = []
orig_round = bg.BatchedDFlashLoop._round
def rnd(self):
    cur.clear(); c = time.process_time()
    orig_round(self)
    d = dict(cur); d["round"] = time.process_time() - c; d["b"] = self.batch
    rounds.append(d)
bg.BatchedDFlashLoop._round = rnd
# greedy step: time model forward calls during plain generate
for B in [int(x) for x in sys.argv[1].split(",")]:
    ids, mask = held_out_batch(tok, B)
    opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
    with torch.no_grad():
        # plain greedy per-step CPU: total minus prefill estimated from the 1-token generate
        g = []
        for rep in range(3):
            c = time.process_time(); target.generate(ids, attention_mask=mask, **opts); t_all = time.process_time() - c
            c = time.process_time(); target.generate(ids, attention_mask=mask, **dict(opts, max_new_tokens=1)); t_1 = time.process_time() - c
            g.append((t_all - t_1) / (NEW - 1))
        step = statistics.median(g)
        print(f"b={B} greedy step {step*1e3:.0f} ms CPU", flush=True)
        for k in [int(x) for x in sys.argv[2].split(",")]:
            for rep in range(2):
                rounds.clear()
                target.generate(ids, attention_mask=mask, assistant_model=drafter, num_assistant_tokens=k,
                                num_assistant_tokens_schedule="constant", **opts)
            rs = [r for r in rounds[1:] if r["b"] == B]
            med = {key: statistics.median(r.get(key, 0.0) for r in rs) * 1e3 for key in
                   ["round", "_take_context", "_draft", "propose", "_verify", "_accept", "_commit", "_after_round", "_close_holes"]}
            print(f"b={B} k={k} tau {drafter.last_stats.mean_acceptance_length:.2f} rounds {len(rs)} round/step {med['round']/1e3/step:.2f}",
                  " ".join(f"{n}:{v:.0f}" for n, v in med.items()), flush=True)
