"""``dflash-hf train``: train a DFlash drafter against a frozen target, from distilled shards.

One optimizer step, per sequence batch (see `blocks` for the block layout):

1. features: the shard's stored ``hidden_states[l + 1]`` of the target, or one no-grad target forward when the
   shards have none (online);
2. random anchors in the response, all blocks side by side, one boolean mask (context ``< anchor``, bidirectional
   inside a block, nothing across blocks), the target's frozen embedding for ``[anchor, mask x (B-1)]``;
3. one drafter forward; the target's frozen ``lm_head`` on the label positions only (rows with weight > 0);
4. weighted CE ``sum(w * CE) / sum(w)``, ``w_k = exp(-(k-1)/gamma)``; with ``--sample-positions`` each label
   position is kept with probability ``w_k`` at unit weight instead (same expected loss, fewer ``lm_head`` rows);
5. AdamW, cosine schedule with warm-up, gradient clipping (``fc`` clipped on its own: massive target activations
   give it huge early gradients).

Checkpoints (``OUT/checkpoints/step-XXXXXXX``, written to a tmp dir then renamed; ``OUT/latest`` names the newest)
hold the drafter in the z-lab layout (``save_pretrained``), ``trainer_state.pt`` (optimizer, scheduler, step),
``rng-rank{r}.pt`` per process, and ``training_args.json``: enough to ``--resume`` on another machine.
``OUT/log.jsonl`` has one line per logged step; ``OUT/curves.png`` plots it. Multi-process: ``torchrun`` (gloo on
CPU, nccl on CUDA), DDP gradient all-reduce, data sharded by rank.
"""

import copy
import json
import logging
import math
import os
import random
import shutil
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..configuration_dflash import DFlashConfig
from ..generation_dflash import extract_context_feature
from ..modeling_dflash import DFlashDraftModel
from .blocks import (
    block_labels_and_weights,
    build_block_inputs,
    build_block_mask,
    build_flex_block_mask,
    default_gamma,
    sample_anchors,
)
from .data import ShardDataset, collate

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# ----------------------------------------------------------------------------------------------------- the loss
class VocabSubsetHead(nn.Module):
    """The frozen ``lm_head`` restricted to the token ids ``ids [N]``: logits ``[..., N]`` over those tokens only.

    The head is most of a CPU training step (``V x H`` per label row); the few thousand tokens that make up almost
    all of the distilled responses cost ``N / V`` of it. Labels outside the subset carry no loss (`block_loss`).
    At inference the drafter still uses the full ``lm_head``.
    """

    def __init__(self, lm_head: nn.Linear, ids: torch.LongTensor):
        super().__init__()
        weight = lm_head.weight.detach()
        self.register_buffer("weight", weight[ids.to(weight.device)].clone(), persistent=False)
        lookup = torch.full((weight.shape[0],), -1, dtype=torch.long, device=weight.device)
        lookup[ids.to(weight.device)] = torch.arange(len(ids), device=weight.device)
        self.register_buffer("lookup", lookup, persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)

    def rows(self, labels: torch.LongTensor) -> torch.LongTensor:
        """Each label's row in the subset, -1 outside it."""
        return self.lookup[labels]


def block_loss(draft, embed_tokens, lm_head, batch: dict, features: torch.Tensor, *, block_size: int,
               num_anchors: int, mask_token_id: int, gamma: float | None, generator: torch.Generator,
               sample_positions: bool = False, autocast=nullcontext) -> tuple[torch.Tensor, dict]:
    """The DFlash training loss of one batch, and its metrics (``correct``/``count`` per block position).

    ``features [b, S, F*H]`` are the target's concatenated hidden states for ``batch["input_ids"] [b, S]``.
    ``lm_head`` is the target's head or a `VocabSubsetHead` (then accuracy is measured within the subset).
    """
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    device = input_ids.device
    seq_len = input_ids.shape[1]
    anchors, keep = sample_anchors(loss_mask, block_size, num_anchors, generator)
    stats = {"correct": torch.zeros(block_size), "count": torch.zeros(block_size), "blocks": int(keep.sum())}
    if anchors.shape[1] == 0:  # no response position can anchor a block: a zero loss that still touches every param
        return sum(p.sum() * 0.0 for p in draft.parameters()), stats
    noise_ids, position_ids = build_block_inputs(input_ids, anchors, block_size, mask_token_id, keep)
    if draft_attention(draft) == "flex_attention":  # block-sparse: the kernel skips fully masked tiles
        mask = build_flex_block_mask(anchors.to(device), keep.to(device), seq_len, block_size)
    else:
        mask = build_block_mask(anchors, keep, seq_len, block_size).to(device)
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, block_size, gamma)
    if isinstance(lm_head, VocabSubsetHead):
        labels = lm_head.rows(labels)
        weights = weights * (labels >= 0)
        labels = labels.clamp(min=0)
    active = weights > 0
    if sample_positions:
        draw = torch.rand(weights.shape, generator=generator).to(device)
        chosen = active & (draw < weights)
        row_weights = chosen.float()
    else:
        chosen, row_weights = active, weights
    with autocast():
        noise = embed_tokens(noise_ids)
        hidden = draft(noise_embedding=noise, target_hidden=features, position_ids=position_ids,
                       attention_mask=mask).last_hidden_state
        logits = lm_head(hidden[chosen])
    ce = F.cross_entropy(logits.float(), labels[chosen], reduction="none")
    loss = (ce * row_weights[chosen]).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        block_pos = (torch.arange(weights.shape[1], device=device) % block_size).expand_as(weights)[chosen]
        hits = (logits.argmax(-1) == labels[chosen]).float()
        stats["correct"] = torch.zeros(block_size, device=device).index_add_(0, block_pos, hits).cpu()
        stats["count"] = torch.zeros(block_size, device=device).index_add_(0, block_pos, torch.ones_like(hits)).cpu()
    return loss, stats


def draft_attention(draft) -> str:
    """The drafter's attention implementation (through a DDP wrapper)."""
    return getattr(draft, "module", draft).config._attn_implementation


def resolve_attention(choice: str, device: torch.device) -> str:
    """``auto``: FlexAttention on CUDA (a block mask computed per tile), SDPA with the dense mask elsewhere
    (FlexAttention has no backward on CPU)."""
    if choice == "auto":
        return "flex_attention" if device.type == "cuda" else "sdpa"
    if choice == "flex_attention" and device.type == "cpu":
        raise ValueError("--attn-implementation flex_attention needs a GPU: PyTorch's FlexAttention has no backward "
                         "on CPU; use sdpa (or auto).")
    return choice


@torch.no_grad()
def target_features(target, batch: dict, layer_ids: list[int]) -> torch.Tensor:
    """Online features: one no-grad target forward over the right-padded batch."""
    out = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                 output_hidden_states=[i + 1 for i in layer_ids], logits_to_keep=1)
    return extract_context_feature(out.hidden_states, layer_ids)


# ------------------------------------------------------------------------------------------------- model setup
def build_draft(target, args, layer_ids: list[int] | None) -> DFlashDraftModel:
    overrides = {}
    if args.intermediate_size:
        overrides["intermediate_size"] = args.intermediate_size
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=args.mask_token_id, num_hidden_layers=args.num_draft_layers,
        block_size=args.block_size, target_layer_ids=layer_ids, **overrides,
    )
    config._attn_implementation = args.attn_implementation
    return DFlashDraftModel(config)


def warm_start_from_target(draft: DFlashDraftModel, target) -> list[str]:
    """Copy the target's top decoder layers into the drafter where names and shapes match.

    Drafter layer ``i`` of ``n`` takes target layer ``L - n + i`` (attention ``q/k/v/o_proj``, ``q_norm``/``k_norm``
    when the target has them, otherwise they stay ones; MLP ``gate/up/down_proj``; both layer norms). ``norm`` takes
    the target's final norm; ``fc`` starts as a selector of the last feature layer. Returns the copied names.
    """
    copied = []
    target_layers = target.get_decoder().layers
    n, total = len(draft.layers), len(target_layers)
    with torch.no_grad():
        for i, layer in enumerate(draft.layers):
            source = target_layers[max(total - n + i, 0)].state_dict()
            for name, param in layer.state_dict().items():
                if name in source and source[name].shape == param.shape:
                    param.copy_(source[name].to(param.dtype))
                    copied.append(f"layers.{i}.{name}")
        final_norm = getattr(target.get_decoder(), "norm", None)
        if final_norm is not None and final_norm.weight.shape == draft.norm.weight.shape:
            draft.norm.weight.copy_(final_norm.weight.to(draft.norm.weight.dtype))
            copied.append("norm.weight")
        hidden = draft.config.hidden_size
        draft.fc.weight.zero_()
        draft.fc.weight[:, -hidden:] = torch.eye(hidden, dtype=draft.fc.weight.dtype)
        copied.append("fc.weight (selects the last feature layer)")
    return copied


def cosine_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / max(1, warmup_steps)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return factor


# -------------------------------------------------------------------------------------------------- checkpoints
def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def save_checkpoint(out_dir: Path, name: str, draft, optimizer, scheduler, state: dict, args, generator,
                    rank: int, world: int, keep: int | None = None) -> Path:
    """Atomic: everything goes to ``.tmp-NAME``, renamed to ``checkpoints/NAME``, then ``latest`` is replaced."""
    root = out_dir / "checkpoints"
    final, tmp = root / name, root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _barrier(world)
    torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "anchors": generator.get_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
               tmp / f"rng-rank{rank}.pt")
    _barrier(world)
    if rank == 0:
        _unwrap(draft).save_pretrained(tmp)
        torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), **state,
                    "world_size": world}, tmp / "trainer_state.pt")
        (tmp / "training_args.json").write_text(json.dumps(vars(args), indent=2, default=str))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = out_dir / ".latest.tmp"
        pointer.write_text(f"checkpoints/{name}\n")
        os.replace(pointer, out_dir / "latest")
        if keep:
            old = sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]
            for path in old:
                shutil.rmtree(path, ignore_errors=True)
    _barrier(world)
    return final


def resolve_resume(resume: str, out_dir: Path) -> Path | None:
    """``auto``: ``OUT/latest`` if present, else None (fresh start); otherwise a checkpoint folder or a run folder."""
    path = out_dir if resume == "auto" else Path(resume)
    if (path / "latest").exists():
        path = path / (path / "latest").read_text().strip()
    elif resume == "auto":
        return None
    if not (path / "trainer_state.pt").exists():
        raise FileNotFoundError(f"--resume {resume}: no trainer_state.pt in {path}")
    return path


# ----------------------------------------------------------------------------------------------- distributed
def setup_distributed(device_arg: str | None):
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = device_arg or ("cuda" if torch.cuda.is_available() else "cpu")
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device.startswith("cuda") else "gloo"
        torch.distributed.init_process_group(backend)
    if device == "cuda":
        device = f"cuda:{local}"
        torch.cuda.set_device(device)
    return rank, world, torch.device(device)


def _barrier(world: int):
    if world > 1:
        torch.distributed.barrier()


def _any(flag: bool, world: int, device) -> bool:
    if world == 1:
        return flag
    tensor = torch.tensor([1.0 if flag else 0.0], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return bool(tensor.item())


def epoch_order(num: int, epoch: int, seed: int, rank: int, world: int) -> list[int]:
    """This rank's sample order for ``epoch``: one shared shuffle, truncated to a multiple of ``world``, strided."""
    generator = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    order = torch.randperm(num, generator=generator).tolist()
    order = order[: len(order) // world * world]
    return order[rank::world]


# ---------------------------------------------------------------------------------------------------- logging
def plot_curves(log_path: Path, png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    if not rows:
        return
    steps = [r["step"] for r in rows]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(steps, [r["loss"] for r in rows])
    ax_loss.set(xlabel="step", ylabel="loss", title="weighted CE", yscale="log")
    ax_acc.plot(steps, [r["acc"] for r in rows], label="all positions")
    per_pos = [r.get("acc_per_position") for r in rows]
    if per_pos[-1]:
        for k in sorted({1, len(per_pos[-1]) // 2, len(per_pos[-1])}):
            ax_acc.plot(steps, [p[k - 1] if p else float("nan") for p in per_pos], label=f"position {k}", alpha=0.7)
    ax_acc.set(xlabel="step", ylabel="accuracy", title="draft accuracy", ylim=(0, 1))
    ax_acc.legend()
    fig.tight_layout()
    tmp = png_path.with_name(f".{png_path.name}.tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    os.replace(tmp, png_path)


# ------------------------------------------------------------------------------------------------------- train
def train(args) -> dict:
    """Run training as configured by ``args`` (see `add_train_parser`); returns a summary dict."""
    from ..loading import load_target

    rank, world, device = setup_distributed(args.device)
    args.attn_implementation = resolve_attention(args.attn_implementation, device)
    out_dir = Path(args.output_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(args.seed + rank)
    torch.manual_seed(args.seed)
    generator = torch.Generator().manual_seed(args.seed * 7919 + rank)

    target, tokenizer = load_target(args.target, dtype=args.target_dtype, device=str(device))
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    dataset = ShardDataset(args.data, max_length=args.max_length, load_features=not args.online_features)
    layer_ids = args.target_layer_ids or dataset.target_layer_ids
    if dataset.has_features and args.target_layer_ids and dataset.target_layer_ids not in (None, args.target_layer_ids):
        raise ValueError(f"--target-layer-ids {args.target_layer_ids} differ from the shards' features "
                         f"({dataset.target_layer_ids}); redistill or pass --online-features.")
    if args.train_vocab:
        ids, coverage = dataset.frequent_response_tokens(args.train_vocab)
        lm_head = VocabSubsetHead(lm_head, ids)
        if rank == 0:
            logger.info("loss over the %d most frequent response tokens: %.2f%% of the labels", len(ids),
                        100 * coverage)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gamma = args.gamma if args.gamma is not None else default_gamma(args.block_size)

    resume_dir = resolve_resume(args.resume, out_dir) if args.resume else None
    if resume_dir is not None:
        draft = DFlashDraftModel.from_pretrained(resume_dir, dtype=torch.float32)
        draft.config._attn_implementation = args.attn_implementation
    elif args.init_from:  # continue from a trained drafter (its shape and layer ids), with a fresh optimizer
        draft = DFlashDraftModel.from_pretrained(args.init_from, dtype=torch.float32)
        draft.config._attn_implementation = args.attn_implementation
        if dataset.has_features and dataset.target_layer_ids not in (None, list(draft.config.target_layer_ids)):
            raise ValueError(f"--init-from {args.init_from} reads layers {draft.config.target_layer_ids} but the "
                             f"shards' features are of layers {dataset.target_layer_ids}; pass --online-features.")
    else:
        torch.manual_seed(args.seed)
        draft = build_draft(target, args, layer_ids)
        if args.warm_start:
            copied = warm_start_from_target(draft, target)
            if rank == 0:
                logger.info("warm start copied %d tensors from the target", len(copied))
    layer_ids = list(draft.config.target_layer_ids)
    draft.to(device).train()
    model = draft
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            draft, device_ids=[device.index] if device.type == "cuda" else None)

    fc_params = list(draft.fc.parameters())
    other_params = [p for n, p in draft.named_parameters() if not n.startswith("fc.")]
    no_decay = [p for n, p in draft.named_parameters() if p.ndim < 2]
    decay = [p for n, p in draft.named_parameters() if p.ndim >= 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_eps,
    )
    per_rank = len(dataset) // world
    if per_rank == 0:
        raise ValueError(f"{len(dataset)} sequences cannot feed {world} processes.")
    micro_per_epoch = math.ceil(per_rank / args.batch_size)
    steps_per_epoch = max(1, micro_per_epoch // args.grad_accum)
    total_steps = args.max_steps or args.epochs * steps_per_epoch
    warmup = args.warmup_steps if args.warmup_steps is not None else int(args.warmup_ratio * total_steps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_lambda(total_steps, warmup, args.min_lr_ratio))

    step = 0
    if resume_dir is not None:
        state = torch.load(resume_dir / "trainer_state.pt", map_location="cpu", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        scheduler.load_state_dict(state["scheduler"])
        step = state["step"]
        rng_path = resume_dir / f"rng-rank{rank}.pt"
        if rng_path.exists() and state.get("world_size", 1) == world:
            rng = torch.load(rng_path, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            generator.set_state(rng["anchors"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        else:
            logger.warning("resuming with a different process count: anchor RNG reseeded")
            generator.manual_seed(args.seed * 7919 + rank + step)
        if rank == 0:
            logger.info("resumed from %s at step %d", resume_dir, step)

    use_autocast = args.bf16
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if use_autocast else nullcontext
    log_path, png_path = out_dir / "log.jsonl", out_dir / "curves.png"
    if rank == 0 and resume_dir is None and log_path.exists():
        log_path.unlink()

    start = time.monotonic()
    window = {"loss": 0.0, "n": 0, "correct": torch.zeros(args.block_size), "count": torch.zeros(args.block_size),
              "blocks": 0, "t": time.monotonic()}
    total_blocks = 0
    stopped_by_budget = False
    bar = tqdm(total=total_steps, initial=step, desc="train", unit="step", disable=rank != 0 or args.quiet)
    order_cache: dict[int, list[int]] = {}
    last_saved = step
    while step < total_steps:
        epoch, in_epoch = divmod(step, steps_per_epoch)
        if epoch not in order_cache:
            order_cache = {epoch: epoch_order(len(dataset), epoch, args.seed, rank, world)}
        order = order_cache[epoch]
        optimizer.zero_grad(set_to_none=True)
        step_loss = 0.0
        for micro in range(args.grad_accum):
            first = (in_epoch * args.grad_accum + micro) * args.batch_size
            indices = [order[(first + j) % len(order)] for j in range(args.batch_size)]
            batch = {k: v.to(device) for k, v in collate([dataset[i] for i in indices], pad_id).items()}
            features = batch.pop("features", None)
            if features is None:
                features = target_features(target, batch, layer_ids)
            sync = nullcontext() if (world == 1 or micro == args.grad_accum - 1) else model.no_sync()
            with sync:
                loss, stats = block_loss(
                    model, embed_tokens, lm_head, batch, features, block_size=args.block_size,
                    num_anchors=args.num_anchors, mask_token_id=draft.config.mask_token_id, gamma=gamma,
                    generator=generator, sample_positions=args.sample_positions, autocast=autocast,
                )
                (loss / args.grad_accum).backward()
            step_loss += loss.item() / args.grad_accum
            window["correct"] += stats["correct"]
            window["count"] += stats["count"]
            window["blocks"] += stats["blocks"]
            total_blocks += stats["blocks"]
        if args.fc_max_grad_norm:
            torch.nn.utils.clip_grad_norm_(fc_params, args.fc_max_grad_norm)
        if args.max_grad_norm:
            torch.nn.utils.clip_grad_norm_(other_params, args.max_grad_norm)
        optimizer.step()
        scheduler.step()
        step += 1
        window["loss"] += step_loss
        window["n"] += 1
        bar.update(1)

        if rank == 0 and (step % args.log_every == 0 or step == total_steps):
            elapsed = time.monotonic() - window["t"]
            per_pos = (window["correct"] / window["count"].clamp(min=1)).tolist()[1:]
            row = {
                "step": step, "epoch": epoch, "loss": window["loss"] / window["n"],
                "acc": float(window["correct"].sum() / window["count"].sum().clamp(min=1)),
                "acc_per_position": per_pos, "lr": scheduler.get_last_lr()[0],
                "blocks_per_s": window["blocks"] * world / max(elapsed, 1e-9),
                "tokens_per_s": window["blocks"] * world * args.block_size / max(elapsed, 1e-9),
                "elapsed_s": time.monotonic() - start,
            }
            with log_path.open("a") as handle:
                handle.write(json.dumps(row) + "\n")
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            window.update(loss=0.0, n=0, correct=torch.zeros(args.block_size), count=torch.zeros(args.block_size),
                          blocks=0, t=time.monotonic())

        out_of_time = bool(args.time_budget) and time.monotonic() - start > args.time_budget
        out_of_time = _any(out_of_time, world, device) or bool(args.stop_after and step >= args.stop_after)
        if step < total_steps and (out_of_time or (args.save_every and step % args.save_every == 0)):
            save_checkpoint(out_dir, f"step-{step:07d}", model, optimizer, scheduler, {"step": step}, args,
                            generator, rank, world, keep=args.keep_checkpoints)
            last_saved = step
        if out_of_time:
            stopped_by_budget = True
            if rank == 0:
                logger.info("stopping at step %d (--time-budget %s / --stop-after %s)", step, args.time_budget,
                            args.stop_after)
            break
    bar.close()

    if step != last_saved or step == total_steps:
        save_checkpoint(out_dir, f"step-{step:07d}", model, optimizer, scheduler, {"step": step}, args,
                        generator, rank, world, keep=args.keep_checkpoints)
    final_dir = out_dir / "final"
    if rank == 0:
        if log_path.exists():
            plot_curves(log_path, png_path)
        save_final(draft, final_dir, dtype=args.final_dtype, max_shard_size=args.final_max_shard_size)
    _barrier(world)
    seconds = time.monotonic() - start
    summary = {"step": step, "total_steps": total_steps, "stopped_by_budget": stopped_by_budget,
               "blocks": total_blocks * world, "seconds": seconds, "blocks_per_s": total_blocks * world / seconds,
               "final": str(final_dir)}
    if rank == 0:
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if world > 1:
        torch.distributed.destroy_process_group()
    return summary


def save_final(draft: DFlashDraftModel, path: Path, dtype: str = "bfloat16", max_shard_size: str | None = None):
    """The drafter alone, in the z-lab layout, in ``dtype``; atomically (tmp dir + rename)."""
    path = Path(path)
    tmp = path.with_name(f".tmp-{path.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model = copy.deepcopy(_unwrap(draft)).to(DTYPES[dtype])  # a copy: casting back would round the live weights
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(tmp, **options)
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)
    return path


__all__ = ["VocabSubsetHead", "block_loss", "build_draft", "save_checkpoint", "save_final", "train", "warm_start_from_target"]
