"""Argument parsers for ``dflash-hf distill | features | train | eval | train-all``; each sets ``func`` to its runner,
which builds the stage's typed config from the flags and calls the library function.

`dflash_hf.cli` registers them as subcommands of ``dflash-hf``.
"""

import argparse
import json
import logging

from ..arguments import COUNT, FRACTION, NON_NEGATIVE, NON_NEGATIVE_INT
from ..loading import DTYPES
from .config import (
    DistillConfig,
    EvalConfig,
    FeaturesConfig,
    GenerationOptions,
    TrainAllConfig,
    TrainConfig,
    TrainOptions,
    from_args,
    json_object,
)


def _int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace(",", " ").split()]


def _add_common(p, *, target_help="local folder of the target model (config, weights, tokenizer)"):
    p.add_argument("--target", required=True, help=target_help)
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    p.add_argument("--seed", type=int, default=0, help="random seed (sampling, init, data order, anchors)")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--threads", type=COUNT, default=None, help="torch.set_num_threads (CPU)")


def _add_distill_options(p, prefix: str = ""):
    """Options of the generation stage; ``prefix`` namespaces them inside ``train-all``."""
    p.add_argument(f"--{prefix}batch-size", type=COUNT, default=16, dest=f"{prefix.replace('-', '_')}batch_size",
                   help="prompts generated together (left padding)")
    p.add_argument("--max-new-tokens", type=COUNT, default=512, help="longest response the target writes")
    p.add_argument("--temperature", type=NON_NEGATIVE, default=0.0, help="0 = greedy; > 0 samples the target's answers")
    p.add_argument("--max-prompt-length", type=COUNT, default=2048, help="skip (and report) longer templated prompts")
    p.add_argument("--shard-size", type=COUNT, default=256, help="prompts per shard (the unit of resumption)")
    p.add_argument("--no-features", action="store_true",
                   help="store tokens only; training then runs the target online for features")
    p.add_argument("--num-features", type=COUNT, default=5,
                   help="feature layers when --target-layer-ids is not given (build_target_layer_ids)")
    p.add_argument("--chat-template-kwargs", default=None,
                   help='JSON passed to apply_chat_template, e.g. \'{"enable_thinking": false}\'')


def add_distill_parser(subparsers):
    p = subparsers.add_parser("distill", help="the target answers prompts -> training shards (self-distillation)",
                              description="Self-distillation: chat template -> target answers (batched) -> "
                              "resumable shards of token ids, response mask and target features. See docs/training.md.")
    _add_common(p)
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL/JSON prompt files (turns/ShareGPT/prompt)")
    p.add_argument("--out", required=True, help="output folder of shard-*.safetensors + manifest.json")
    p.add_argument("--limit", type=COUNT, default=None, help="use at most this many prompts")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="target dtype")
    p.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="feature layers, e.g. '1,8,14,20,27' (default: build_target_layer_ids)")
    p.add_argument("--time-budget", type=NON_NEGATIVE, default=None, help="seconds; no new shard starts after this")
    p.add_argument("--draft", default=None,
                   help="a DFlash drafter for the target ('default': the shipped one): the batches decode with batched "
                   "DFlash, the same tokens as plain generation (greedy) or the same distribution (sampling)")
    _add_distill_options(p)
    p.set_defaults(func=run_distill)
    return p


def add_features_parser(subparsers):
    p = subparsers.add_parser("features", help="store the target's features in token-only shards",
                              description="Token-only shards (distill --no-features) -> the same shards with the "
                              "target's hidden states stored, so that training runs no target forward. Resumable.")
    _add_common(p)
    p.add_argument("--data", required=True, help="folder of token-only shard-*.safetensors")
    p.add_argument("--out", required=True, help="output folder for the shards with features")
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="target dtype")
    p.add_argument("--batch-size", type=COUNT, default=8, help="sequences per teacher-forced forward")
    p.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="feature layers (default: the shards' ids, else build_target_layer_ids)")
    p.add_argument("--num-features", type=COUNT, default=5, help="feature layers when no ids are known")
    p.set_defaults(func=run_features)
    return p


def _add_train_options(p):
    g = p.add_argument_group("drafter")
    g.add_argument("--mask-token-id", type=NON_NEGATIVE_INT, required=True,
                   help="an unused row of the target's vocabulary for masked block slots (SmolLM2: 16)")
    g.add_argument("--num-draft-layers", type=COUNT, default=5, help="drafter decoder layers")
    g.add_argument("--block-size", type=COUNT, default=16, help="tokens per block (anchor + B-1 drafts)")
    g.add_argument("--target-layer-ids", type=_int_list, default=None,
                   help="feature layers (default: the shards' ids, else build_target_layer_ids)")
    g.add_argument("--intermediate-size", type=COUNT, default=None, help="drafter MLP width (default: the target's)")
    g.add_argument("--init-from", default=None,
                   help="start from this trained drafter folder (its shape; fresh optimizer and schedule), e.g. the "
                   "shipped one: training accumulates across runs")
    g.add_argument("--add-draft-layers", type=NON_NEGATIVE_INT, default=0,
                   help="with --init-from: append this many decoder layers, starting as the identity (zero output "
                   "projections), to train a deeper drafter from a trained one")
    g.add_argument("--new-layers-lr-scale", type=NON_NEGATIVE, default=1.0,
                   help="the learning rate of the layers --add-draft-layers appends, as a multiple of --lr")
    g.add_argument("--warm-start", action="store_true",
                   help="copy the target's top layers and final norm into the drafter; fc selects the last feature")
    g.add_argument("--attn-implementation", default="auto",
                   choices=["auto", "block_sparse", "flex_attention", "sdpa", "eager"],
                   help="drafter attention in training: block_sparse computes only the scores a block sees (plain "
                   "matmuls); flex_attention computes the block mask per tile (GPU only); sdpa/eager take a dense "
                   "boolean mask; auto = flex_attention on CUDA, block_sparse elsewhere")
    g = p.add_argument_group("blocks and loss")
    g.add_argument("--num-anchors", type=COUNT, default=512, help="blocks (random anchors) per sequence per step")
    g.add_argument("--gamma", type=float, default=None,
                   help="loss decay exp(-(k-1)/gamma); default 7/5/4 for B=16/10/8; <= 0 for uniform")
    g.add_argument("--sample-positions", action="store_true",
                   help="keep label position k with probability w_k at unit weight (cuts lm_head cost ~2x)")
    g.add_argument("--train-vocab", type=NON_NEGATIVE_INT, default=0,
                   help="loss over the N most frequent response tokens only (0 = the full vocabulary): the lm_head "
                   "is most of a CPU step; the drafter keeps them as its draft vocabulary (config draft_vocab) and "
                   "drafts from those rows of the lm_head only")
    g.add_argument("--kd-weight", type=FRACTION, default=0.0,
                   help="share of each label's loss that is the KL divergence to the target's distribution over the "
                   "(train) vocabulary, the rest cross-entropy to its greedy token: the target's runner-up tokens "
                   "teach more per answer than its argmax alone (needs --online-features; 0 = hard labels only)")
    g.add_argument("--max-length", type=COUNT, default=3072, help="truncate sequences to this many tokens")
    g.add_argument("--online-features", action="store_true",
                   help="run the target for features even when the shards store them")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=NON_NEGATIVE, default=6e-4, help="peak AdamW learning rate")
    g.add_argument("--min-lr-ratio", type=NON_NEGATIVE, default=0.0, help="cosine floor as a fraction of --lr")
    g.add_argument("--warmup-ratio", type=NON_NEGATIVE, default=0.04, help="warm-up steps as a fraction of all steps")
    g.add_argument("--warmup-steps", type=NON_NEGATIVE_INT, default=None, help="overrides --warmup-ratio")
    g.add_argument("--weight-decay", type=NON_NEGATIVE, default=0.0, help="AdamW weight decay (matrices only)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.95)
    g.add_argument("--adam-eps", type=NON_NEGATIVE, default=1e-8)
    g.add_argument("--max-grad-norm", type=NON_NEGATIVE, default=1.0, help="clip for all parameters but fc (0 = off)")
    g.add_argument("--fc-max-grad-norm", type=NON_NEGATIVE, default=1.0, help="separate clip for fc (0 = off)")
    g.add_argument("--batch-size", type=COUNT, default=1, help="sequences per micro-batch per process")
    g.add_argument("--grad-accum", type=COUNT, default=1, help="micro-batches per optimizer step")
    g.add_argument("--epochs", type=COUNT, default=6, help="passes over the data (ignored with --max-steps)")
    g.add_argument("--max-steps", type=COUNT, default=None, help="optimizer steps; sets the schedule length")
    g.add_argument("--schedule", default="steps", choices=["steps", "time"],
                   help="steps: warm-up and cosine over the steps (--max-steps / --epochs); time: over --time-budget "
                   "seconds too, whichever runs out first (a run of fixed wall-clock length on unknown hardware)")
    g.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast for the drafter and lm_head (default: on where the device computes bf16 "
                   "natively -- CUDA, a CPU with AMX or AVX-512 BF16 -- off elsewhere)")
    g.add_argument("--target-dtype", default="float32", choices=list(DTYPES),
                   help="dtype the frozen target is loaded in")
    g = p.add_argument_group("run control")
    g.add_argument("--time-budget", type=NON_NEGATIVE, default=None,
                   help="seconds of training; stops cleanly with a checkpoint and a final drafter")
    g.add_argument("--stop-after", type=COUNT, default=None,
                   help="stop (with a checkpoint) after this step without changing the schedule")
    g.add_argument("--log-every", type=COUNT, default=10, help="steps per log.jsonl line / progress update")
    g.add_argument("--save-every", type=NON_NEGATIVE_INT, default=1000,
                   help="steps between checkpoints (0 = only at the end)")
    g.add_argument("--keep-checkpoints", type=NON_NEGATIVE_INT, default=3, help="newest checkpoints kept (0 = all)")
    g.add_argument("--final-dtype", default="bfloat16", choices=list(DTYPES),
                   help="dtype of OUT/final (published drafters are bf16)")
    g.add_argument("--final-max-shard-size", default=None, help="e.g. 15MB: split OUT/final into shards")
    g.add_argument("--export-dir", default=None,
                   help="every --export-every seconds and at the end, also write the drafter (as OUT/final, without "
                   "its code files) to EXPORT/drafter and the log to EXPORT/log.jsonl: a killed run leaves its last "
                   "drafter there")
    g.add_argument("--export-every", type=NON_NEGATIVE, default=60.0, help="seconds between exports")


def add_train_parser(subparsers):
    p = subparsers.add_parser("train", help="train a drafter on distilled shards", description="Train a DFlash drafter (random anchors, "
                              "block mask, decayed CE) against a frozen target. See docs/training.md.")
    _add_common(p)
    p.add_argument("--data", required=True, nargs="+",
                   help="folders of shard-*.safetensors from `dflash-hf distill` (or `features`), trained on as one "
                   "shuffled mix; a folder named twice counts twice")
    p.add_argument("--output-dir", required=True, help="run folder: checkpoints/, latest, final/, log.jsonl")
    p.add_argument("--resume", default=None,
                   help="'auto' (OUT/latest if any), a run folder or a checkpoint folder")
    _add_train_options(p)
    p.set_defaults(func=run_train)
    return p


def add_eval_parser(subparsers):
    p = subparsers.add_parser("eval", help="acceptance length tau of a drafter per block size",
                              description="Greedy DFlash generation on held-out prompts: tau "
                              "(tokens committed per round, bonus included) and its histogram per block size.")
    _add_common(p)
    p.add_argument("--draft", required=True,
                   help="drafter folder (OUT/final or a checkpoint), or 'default': the one shipped for the default target")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompts", nargs="+", help="held-out JSONL/JSON prompt files (tau by generating)")
    source.add_argument("--data", help="held-out distilled shards: tau teacher-forced on the target's own answers "
                        "(the round-by-round acceptance of a greedy run that followed those answers; minutes faster)")
    p.add_argument("--limit", type=COUNT, default=None,
                   help="evaluate at most this many prompts (or distilled sequences); default: all of them")
    p.add_argument("--block-sizes", type=_int_list, default=[4, 8, 16], help="e.g. '4,8,16'")
    p.add_argument("--max-new-tokens", type=COUNT, default=128)
    p.add_argument("--dtype", default="float32", choices=list(DTYPES), help="target dtype")
    p.add_argument("--draft-dtype", default="float32", choices=list(DTYPES))
    p.add_argument("--chat-template-kwargs", default=None, help="JSON passed to apply_chat_template")
    p.add_argument("--output", default=None, help="write the results as JSON here")
    p.set_defaults(func=run_eval)
    return p


def add_draft_vocab_parser(subparsers):
    p = subparsers.add_parser(
        "draft-vocab", help="give a drafter its draft vocabulary (the tokens it drafts from)",
        description="Write the N most frequent response tokens of distilled shards into a drafter's config.json "
                    "(dflash_config.draft_vocab): the drafter then drafts from those rows of the target's lm_head "
                    "only, a fraction of the head's cost per round. Use the data (and N) the drafter was trained on "
                    "with --train-vocab N; output stays exact either way. No weight is changed.")
    p.add_argument("draft", help="drafter folder (config.json is rewritten in place)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", nargs="+",
                        help="folders of shard-*.safetensors; a folder named twice counts twice (as a training mix "
                        "that lists shards twice)")
    source.add_argument("--clear", action="store_true", help="remove the draft vocabulary (draft over all tokens)")
    p.add_argument("--size", type=COUNT, default=8192, help="tokens kept (the training run's --train-vocab)")
    p.set_defaults(func=run_draft_vocab)
    return p


def add_average_parser(subparsers):
    p = subparsers.add_parser(
        "average", help="one drafter from the mean of several trained drafters' weights",
        description="Average the weights of drafters of one lineage (the same shape, each run warm-started from the "
                    "one before): the mean often drafts better than any of them. The first drafter's config (and draft "
                    "vocabulary) is kept. Judge the result on held-out prompts (dflash-hf eval) before shipping it.")
    p.add_argument("drafts", nargs="+", help="drafter folders, e.g. runs/run27/final runs/run28/final")
    p.add_argument("--out", required=True, help="folder to write the averaged drafter to (replaced atomically)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16", help="weights' dtype (default: %(default)s)")
    p.set_defaults(func=run_average)
    return p


def add_train_all_parser(subparsers):
    p = subparsers.add_parser(
        "train-all", help="distill + train within one wall-clock budget (GPU-ready)",
        description="Distill (up to --distill-fraction of --budget), then train for the rest, then write OUT/final "
                    "(bf16, split into --final-max-shard-size shards). Rerunning resumes both stages.")
    _add_common(p)
    p.add_argument("--prompts", nargs="+", required=True, help="JSONL/JSON prompt files")
    p.add_argument("--out", required=True, help="run folder: data/ (shards) and train/ (checkpoints, final/)")
    p.add_argument("--budget", type=NON_NEGATIVE, required=True, help="total wall-clock seconds for both stages")
    p.add_argument("--distill-fraction", type=NON_NEGATIVE, default=0.3, help="share of --budget for distillation")
    p.add_argument("--limit", type=COUNT, default=None, help="use at most this many prompts")
    p.add_argument("--eval-prompts", nargs="*", default=None, help="if given, run eval on OUT/train/final after")
    _add_distill_options(p, prefix="distill-")
    _add_train_options(p)
    p.set_defaults(func=run_train_all, final_max_shard_size="15MB")
    return p


# ------------------------------------------------------------------------------------------------------ runners
# Each runner turns the parsed flags into the stage's typed config (`dflash_hf.training.config`) and calls the library.
def _prepare(args):
    import torch

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)


def run_distill(args):
    from .distill import distill

    _prepare(args)
    config = from_args(DistillConfig, args, chat_template_kwargs=json_object(args.chat_template_kwargs))
    summary = distill(config)
    print(json.dumps({k: v for k, v in summary.items() if k != "problems"} | {"skipped_lines": summary["problems"]}))
    return summary


def run_features(args):
    from .distill import add_features

    _prepare(args)
    summary = add_features(from_args(FeaturesConfig, args))
    print(json.dumps(summary))
    return summary


def run_train(args):
    from .trainer import train

    _prepare(args)
    summary = train(from_args(TrainConfig, args))
    print(json.dumps(summary))
    return summary


def run_eval(args):
    from .evaluate import evaluate

    _prepare(args)
    return evaluate(from_args(EvalConfig, args, chat_template_kwargs=json_object(args.chat_template_kwargs)))


def run_draft_vocab(args):
    from ..hub import set_draft_vocab
    from .data import ShardDataset, most_frequent

    if args.clear:
        print(f"{set_draft_vocab(args.draft, None)}: no draft vocabulary (drafts over the full vocabulary)")
        return None
    total = ShardDataset(args.data, load_features=False).response_token_counts()
    ids, coverage = most_frequent(total, args.size)
    path = set_draft_vocab(args.draft, ids.tolist())
    print(f"{path}: draft vocabulary of {len(ids)} tokens, {100 * coverage:.2f}% of the {int(total.sum()):,} "
          "response tokens")
    return ids


def run_average(args):
    from .average import average_drafters

    path = average_drafters(args.drafts, args.out, args.dtype)
    print(f"{path}: the mean of {len(args.drafts)} drafters ({args.dtype})")
    return path


def run_train_all(args):
    from .pipeline import train_all

    _prepare(args)
    generation = from_args(GenerationOptions, args, batch_size=args.distill_batch_size,
                           chat_template_kwargs=json_object(args.chat_template_kwargs))
    summary = train_all(from_args(TrainAllConfig, args, generation=generation,
                                  training=from_args(TrainOptions, args)))
    print(json.dumps(summary))
    return summary


__all__ = [
    "add_distill_parser",
    "add_draft_vocab_parser",
    "add_eval_parser",
    "add_features_parser",
    "add_train_all_parser",
    "add_train_parser",
]
