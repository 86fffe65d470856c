"""CPU time of training steps with the code in CODE_DIR (a checkout, e.g. `git archive <commit> | tar -x -C old/`),
so that two versions of the trainer can be compared step for step: the shipped drafter warm-started on the shards
in DATA with the run-13 flags (bf16 autocast where the CPU computes it natively), STEPS optimizer steps; prints the
median process CPU time of a step after the first 3 and the mean loss from step 5 on (the same seed draws the same
anchors and positions, so two versions that compute the same thing print the same loss).

    OMP_NUM_THREADS=1 taskset -c 0 python scripts/train_step_time.py CODE_DIR DATA STEPS
"""
import statistics
import sys
import tempfile
import time
from pathlib import Path

code, data, steps = Path(sys.argv[1]).resolve(), sys.argv[2], int(sys.argv[3])
sys.path.insert(0, str(code))
from dflash_hf.cli import build_parser  # noqa: E402
from dflash_hf.training import cli as training_cli  # noqa: E402
from dflash_hf.training.config import TrainConfig  # noqa: E402
from dflash_hf.training.trainer import MetricsWindow, setup_training, train_step  # noqa: E402

target = Path.home() / ".cache/dflash-hf/targets/smollm2-135m-instruct-float32"
with tempfile.TemporaryDirectory() as out:
    args = build_parser().parse_args(
        f"train --target {target} --data {data} --output-dir {out} --mask-token-id 16 "
        f"--init-from {code}/dflash_hf/drafters/smollm2-135m-instruct --block-size 16 --gamma 4 --sample-positions "
        "--train-vocab 8192 --num-anchors 48 --batch-size 2 --lr 3e-4 --warmup-steps 30 --min-lr-ratio 0.1 "
        "--max-steps 30000 --threads 1 --device cpu --quiet --seed 0".split())
    training_cli._prepare(args)
    run = setup_training(training_cli.from_args(TrainConfig, args))
    window, seconds, losses = MetricsWindow(16), [], []
    for _ in range(steps):
        start = time.process_time()
        loss, _ = train_step(run, window)
        seconds.append(time.process_time() - start)
        losses.append(loss)
print(f"{code}: median step {statistics.median(seconds[3:]):.4f} s CPU, mean loss from step 5 "
      f"{statistics.mean(losses[5:]):.4f}")
