"""Is a plain round of the batched DFlash loop as cheap as a plain batched greedy step? Interleaved, on held-out GSM8K
(gsm8k@1000): plain batched greedy vs batched DFlash (adaptive) vs the batched loop forced plain (the controller
answers 0 drafts, no shadow rounds). Process CPU and wall seconds per run, medians; DFlash phase totals (CPU s).

    taskset -c 0 .venv/bin/python scripts/batch_plain_parity.py BATCH NEW_TOKENS REPEATS [DTYPE]  # 8 64 3 bfloat16
"""
import statistics, sys, time, collections
import torch
from batch_setup import held_out_batch, load_models
import dflash_hf.batch_generation_dflash as bg
B, NEW, REPS = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
target, tok, drafter = load_models(sys.argv[4] if len(sys.argv) > 4 else "float32")
ids, mask = held_out_batch(tok, B)
phase = collections.defaultdict(float)
def wrap(name):
    orig = getattr(bg.BatchedDFlashLoop, name)
    def f(self, *a, **k):
        c = time.process_time()
        try: return orig(self, *a, **k)
        finally: phase[name] += time.process_time() - c
    setattr(bg.BatchedDFlashLoop, name, f)
for n in ["_prefill", "_calibrate_head", "_draft", "_verify", "_round"]:
    wrap(n)
real_choose = bg.BatchDraftLengthController.choose
FORCE = [False]
def choose(self):
    if FORCE[0]:
        self.shadow = False; return 0
    return real_choose(self)
bg.BatchDraftLengthController.choose = choose
opts = dict(max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)
def run(kind):
    FORCE[0] = kind == "plain-loop"
    kw = {} if kind == "greedy" else dict(assistant_model=drafter)
    with torch.no_grad():
        return target.generate(ids, attention_mask=mask, **opts, **kw)
with torch.no_grad():
    for k in ("greedy", "dflash"):
        target.generate(ids, attention_mask=mask, **dict(opts, max_new_tokens=4), **({} if k == "greedy" else dict(assistant_model=drafter)))
kinds = ["greedy", "dflash", "plain-loop"]
res = {k: [] for k in kinds}
ref = None
for rep in range(REPS):
    order = kinds[rep % 3:] + kinds[:rep % 3]
    for k in order:
        phase.clear()
        w, c = time.perf_counter(), time.process_time()
        out = run(k)
        res[k].append((time.perf_counter() - w, time.process_time() - c))
        ref = out if k == "greedy" and ref is None else ref
        extra = ""
        if k != "greedy":
            st = drafter.last_stats
            extra = f"tau {st.mean_acceptance_length:.2f} rounds {st.num_batch_rounds} " + " ".join(f"{n}:{v:.2f}" for n, v in phase.items())
        print(f"rep {rep} {k}: wall {res[k][-1][0]:.2f} cpu {res[k][-1][1]:.2f} {extra}", flush=True)
g = statistics.median(c for _, c in res["greedy"]); gw = statistics.median(w for w, _ in res["greedy"])
for k, v in res.items():
    c = statistics.median(x[1] for x in v); w = statistics.median(x[0] for x in v)
    print(f"{k}: median cpu {c:.2f} wall {w:.2f}  -> greedy/this cpu {g / c:.2f}x wall {gw / w:.2f}x")
