"""``dflash-hf train``: train a DFlash drafter against a frozen target, from distilled shards.

One optimizer step, per sequence batch (see `blocks` for the block layout):

1. features: the shard's stored ``hidden_states[l + 1]`` of the target and its greedy prediction after each token,
   or one no-grad target forward that computes both when the shards have none (online);
2. random anchors in the response, all blocks side by side, one attention picture (context ``< anchor``,
   bidirectional inside a block, nothing across blocks): computed from the anchors alone by ``block_sparse``
   (`attention`, the CPU default), a FlexAttention ``BlockMask`` on CUDA, a dense boolean mask for SDPA/eager; the
   target's frozen embedding for ``[anchor, mask x (B-1)]``; the context cut where the last anchor starts;
3. one drafter forward (its last MLP on the label rows only, `last_mlp_on_rows`); the target's frozen ``lm_head``
   on the label positions only (rows with weight > 0);
4. weighted CE against the greedy continuation of the anchor (`block_labels_and_weights`: on a sampled answer, up
   to its first departure from the target's greedy path) ``sum(w * CE) / sum(w)``, ``w_k = exp(-(k-1)/gamma)``;
   with ``--sample-positions`` each label position is kept with probability ``w_k`` at unit weight instead (same
   expected loss, fewer ``lm_head`` rows);
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
from contextlib import contextmanager, nullcontext
import dataclasses
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from ..atomic import atomic_path, remove, remove_stale_temporaries, removed_on_error, replace, temporary_name
from ..configuration_dflash import DFlashConfig
from ..generation_dflash import DraftVocabHead
from ..loading import DTYPES, resolve_device
from ..modeling_dflash import DFlashDraftModel
from .blocks import (
    block_labels_and_weights,
    build_block_inputs,
    build_block_mask,
    build_flex_block_mask,
    default_gamma,
    sample_anchors,
)
from .attention import BLOCK_SPARSE, BlockLayout
from .config import TrainConfig, TrainOptions
from .data import ShardDataset, collate
from .distill import target_pass

logger = logging.getLogger(__name__)


# ----------------------------------------------------------------------------------------------------- the loss
class VocabSubsetHead(DraftVocabHead):
    """The frozen ``lm_head`` restricted to the token ids ``ids [N]`` (a `DraftVocabHead`): logits ``[..., N]`` over
    those tokens only, and each label's row among them.

    The head is most of a CPU training step (``V x H`` per label row); the few thousand tokens that make up almost
    all of the distilled responses cost ``N / V`` of it. Labels outside the subset carry no loss (`block_loss`).
    The drafter keeps ``ids`` as its draft vocabulary (``config.draft_vocab``) and drafts from those rows only.
    """

    def __init__(self, lm_head: nn.Linear, ids: torch.LongTensor):
        super().__init__(lm_head, ids)
        lookup = torch.full((self.vocab_size,), -1, dtype=torch.long, device=self.weight.device)
        lookup[self.vocab_ids] = torch.arange(len(ids), device=self.weight.device)
        self.register_buffer("lookup", lookup, persistent=False)

    def rows(self, labels: torch.LongTensor) -> torch.LongTensor:
        """Each label's row in the subset, -1 outside it."""
        return self.lookup[labels]


def block_loss(draft, embed_tokens, lm_head, batch: dict, features: torch.Tensor, *, block_size: int,
               num_anchors: int, mask_token_id: int, gamma: float | None, generator: torch.Generator,
               sample_positions: bool = False, autocast=nullcontext, kd_weight: float = 0.0
               ) -> tuple[torch.Tensor, dict]:
    """The DFlash training loss of one batch, and its metrics (``correct``/``count`` per block position).

    ``features [b, S, F*H]`` are the target's concatenated hidden states for ``batch["input_ids"] [b, S]``.
    ``lm_head`` is the target's head or a `VocabSubsetHead` (then accuracy is measured within the subset).
    Each label row's loss is the cross-entropy against the target's greedy token; with ``kd_weight = a > 0`` it is
    ``(1 - a) * CE + a * KL(p || q)``, ``p`` the target's distribution over the same head's rows, read from
    ``batch["teacher_hidden"] [b, S, H]`` (`target_pass`'s ``last_hidden``) at the position before the label.
    """
    input_ids, loss_mask = batch["input_ids"], batch["loss_mask"]
    device = input_ids.device
    seq_len = input_ids.shape[1]
    anchors, keep = sample_anchors(loss_mask, block_size, num_anchors, generator)
    stats = {"correct": torch.zeros(block_size), "count": torch.zeros(block_size), "blocks": int(keep.sum())}
    if anchors.shape[1] == 0:  # no response position can anchor a block: a zero loss that still touches every param
        return sum(p.sum() * 0.0 for p in draft.parameters()), stats
    noise_ids, position_ids = build_block_inputs(input_ids, anchors, block_size, mask_token_id, keep)
    # no block sees the context from the last anchor on (nor the batch's right padding): leave it out
    context_len = max(1, int(anchors.max()))
    features = features[:, :context_len]
    position_ids = torch.cat([position_ids[:, :context_len], position_ids[:, seq_len:]], dim=1)
    mask, layout = None, {}
    if draft_attention(draft) == "flex_attention":  # block-sparse: the kernel skips fully masked tiles
        mask = build_flex_block_mask(anchors.to(device), keep.to(device), context_len, block_size)
    elif draft_attention(draft) == BLOCK_SPARSE:  # only the seen scores, from the anchors (no mask)
        layout = {"block_layout": BlockLayout(anchors.to(device), keep.to(device))}
    else:
        mask = build_block_mask(anchors, keep, context_len, block_size).to(device)
    labels, weights = block_labels_and_weights(input_ids, loss_mask, anchors, keep, block_size, gamma,
                                               batch.get("next_ids"))
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
    with autocast(), last_mlp_on_rows(_unwrap(draft), chosen):
        noise = embed_tokens(noise_ids)
        hidden = draft(noise_embedding=noise, target_hidden=features, position_ids=position_ids,
                       attention_mask=mask, **layout).last_hidden_state
        logits = lm_head(hidden[chosen])
    logits = logits.float()  # for the loss, and for the accuracy's argmax (a bf16 argmax is ~5x slower on a CPU)
    per_row = F.cross_entropy(logits, labels[chosen], reduction="none")
    if kd_weight:
        teacher = teacher_log_probs(lm_head, batch["teacher_hidden"], anchors.to(device), block_size, chosen, autocast)
        kl = F.kl_div(logits.log_softmax(-1), teacher, log_target=True, reduction="none").sum(-1)
        per_row = (1 - kd_weight) * per_row + kd_weight * kl
    loss = (per_row * row_weights[chosen]).sum() / weights.sum().clamp(min=1e-6)
    with torch.no_grad():
        block_pos = (torch.arange(weights.shape[1], device=device) % block_size).expand_as(weights)[chosen]
        hits = (logits.argmax(-1) == labels[chosen]).float()
        stats["correct"] = torch.zeros(block_size, device=device).index_add_(0, block_pos, hits).cpu()
        stats["count"] = torch.zeros(block_size, device=device).index_add_(0, block_pos, torch.ones_like(hits)).cpu()
    return loss, stats


@torch.no_grad()
def teacher_log_probs(lm_head, teacher_hidden: torch.Tensor, anchors: torch.LongTensor, block_size: int,
                      chosen: torch.BoolTensor, autocast=nullcontext) -> torch.Tensor:
    """The target's log-probabilities ``[n, V']`` (over ``lm_head``'s rows) for the ``chosen [b, N*B]`` label rows.

    Row ``k`` of the block at ``anchor`` labels position ``anchor + k``, which the target predicted from its state
    at ``anchor + k - 1``: that is the row of ``teacher_hidden [b, S, H]`` each label row reads.
    """
    seq_len, hidden = teacher_hidden.shape[1:]
    before = anchors[:, :, None] + torch.arange(block_size, device=anchors.device) - 1
    before = before.clamp(0, seq_len - 1).reshape(anchors.shape[0], -1)  # [b, N*B]
    rows = teacher_hidden.gather(1, before[..., None].expand(-1, -1, hidden))[chosen]
    with autocast():
        return lm_head(rows).float().log_softmax(-1)


@contextmanager
def last_mlp_on_rows(draft: DFlashDraftModel, rows: torch.BoolTensor):
    """Within the block, the drafter's last MLP runs on the block rows ``rows [b, N*B]`` only (zeros elsewhere).

    Only the label rows of the last layer reach the loss; every row of the earlier layers does (as the last
    layer's keys and values). With ``--sample-positions`` about a quarter of the rows carry a label, and the last
    MLP is the largest part of the last layer, so this skips ~3/8 of the drafter's MLP work in both passes
    without changing the loss or its gradients. Hooks, so the drafter's modules and weights stay as they are.
    """
    mlp, full_shape = draft.layers[-1].mlp, []

    def take_rows(module, args):
        full_shape.append(args[0].shape)
        return (args[0][rows],)

    def put_back(module, args, output):
        return output.new_zeros(full_shape.pop()).masked_scatter(rows[..., None], output)

    handles = [mlp.register_forward_pre_hook(take_rows), mlp.register_forward_hook(put_back)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def draft_attention(draft) -> str:
    """The drafter's attention implementation (through a DDP wrapper)."""
    return getattr(draft, "module", draft).config._attn_implementation


def resolve_attention(choice: str, device: torch.device) -> str:
    """``auto``: FlexAttention on CUDA (a block mask computed per tile), `block_sparse_attention_forward` elsewhere
    (only the seen scores, in plain matmuls: FlexAttention has no backward on CPU, and SDPA computes the whole
    dense grid)."""
    if choice == "auto":
        return "flex_attention" if device.type == "cuda" else BLOCK_SPARSE
    if choice == "flex_attention" and device.type == "cpu":
        raise ValueError("--attn-implementation flex_attention needs a GPU: PyTorch's FlexAttention has no backward "
                         "on CPU; use sdpa (or auto).")
    return choice


def resolve_autocast(choice: bool | None, device: torch.device) -> tuple[bool, str]:
    """``--bf16`` / ``--no-bf16`` as given; unset (``None``): bf16 autocast where ``device`` computes bf16 natively
    (CUDA, or a CPU with AMX / AVX-512 BF16), where it gives the same loss per step at about twice the blocks per
    second on a CPU (docs/training.md); fp32 elsewhere, where bf16 is emulated and slower. -> (on, why)."""
    from ..loading import native_bf16

    if choice is not None:
        return choice, "asked for"
    native = native_bf16(device.type)
    if native:
        return True, f"auto: {native} computes bf16 natively"
    return False, f"auto: no native bf16 on {device.type} (no AMX / AVX-512 BF16), where float32 is faster"


# ------------------------------------------------------------------------------------------------- model setup
def build_draft(target, options: TrainOptions, layer_ids: list[int] | None) -> DFlashDraftModel:
    """A new drafter for ``target`` shaped as ``options`` say, reading ``layer_ids`` (None: the default ids)."""
    overrides = {}
    if options.intermediate_size:
        overrides["intermediate_size"] = options.intermediate_size
    config = DFlashConfig.from_target_config(
        target.config, mask_token_id=options.mask_token_id, num_hidden_layers=options.num_draft_layers,
        block_size=options.block_size, target_layer_ids=layer_ids, **overrides,
    )
    config._attn_implementation = options.attn_implementation
    return DFlashDraftModel(config)


def grow_draft(draft: DFlashDraftModel, extra_layers: int) -> DFlashDraftModel:
    """``draft`` with ``extra_layers`` decoder layers appended after its own, computing the same function at first.
    A new layer is a copy of the last trained one with its attention and MLP output projections (``o_proj``,
    ``down_proj``) at zero: it adds nothing to the residual stream until training moves them, and what they then add
    is built from trained attention and MLP features rather than random ones. A deeper drafter thus continues from a
    trained shallower one instead of starting over (`build_optimizer` can give the new layers a larger step:
    ``new_layers_lr_scale``)."""
    config = copy.deepcopy(draft.config)
    kinds = list(config.layer_types or ["full_attention"] * config.num_hidden_layers)
    config.layer_types = kinds + [kinds[-1]] * extra_layers
    config.num_hidden_layers += extra_layers
    state = draft.state_dict()
    for i in range(draft.config.num_hidden_layers, config.num_hidden_layers):
        for name, value in draft.layers[-1].state_dict().items():
            zeroed = name in ("self_attn.o_proj.weight", "mlp.down_proj.weight")
            state[f"layers.{i}.{name}"] = torch.zeros_like(value) if zeroed else value
    grown = DFlashDraftModel(config).to(draft.dtype)
    grown.load_state_dict(state)  # strict: every weight of the grown drafter is set here
    return grown


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


class RunClock:
    """Seconds of training: since `restart`, plus ``offset`` (what a resumed ``--schedule time`` run had used)."""

    def __init__(self, offset: float = 0.0):
        self.offset, self.started = offset, time.monotonic()

    def restart(self) -> None:
        self.started = time.monotonic()

    def __call__(self) -> float:
        return self.offset + time.monotonic() - self.started


def budget_cosine_lambda(total_steps: int, budget_s: float, clock: RunClock, warmup_ratio: float, min_ratio: float):
    """`cosine_lambda` over the progress ``max(step / total_steps, clock() / budget_s)``: the warm-up is the first
    ``warmup_ratio`` of it, the cosine the rest, so the schedule ends with whichever of steps and time runs out
    first (``--schedule time``: a run of fixed wall-clock length on hardware of unknown speed)."""
    def factor(step: int) -> float:
        progress = min(1.0, max(step / max(1, total_steps), clock() / budget_s))
        if progress < warmup_ratio:
            return max(progress, 1 / max(1, total_steps)) / warmup_ratio
        rest = (progress - warmup_ratio) / max(1e-9, 1 - warmup_ratio)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * rest))
    return factor


# -------------------------------------------------------------------------------------------------- checkpoints
def _unwrap(model):
    return model.module if hasattr(model, "module") else model


def save_checkpoint(out_dir: Path, name: str, draft, optimizer, scheduler, state: dict, config: TrainConfig,
                    generator, rank: int, world: int, keep: int | None = None) -> Path:
    """Atomic: everything goes to ``.tmp-NAME``, renamed to ``checkpoints/NAME``, then ``latest`` is replaced.

    Every file is plain tensors and Python values (``torch.load(..., weights_only=True)`` reads them). A folder being
    removed (pruned, or replaced by a re-save) is renamed aside first, so a kill never leaves a partial ``step-*``;
    what a killed save left behind is removed by the next save, and a full disk is a clear `OSError`.
    """
    root = out_dir / "checkpoints"
    final, tmp = root / name, root / f".tmp-{name}"
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for stale in root.glob(".tmp-*"):  # ours, from a killed save (processes of one run save one at a time)
            remove(stale)
        remove_stale_temporaries(root)
        tmp.mkdir()
    _barrier(world)
    with removed_on_error(tmp, final):
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "anchors": generator.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / f"rng-rank{rank}.pt")
    _barrier(world)
    if rank == 0:
        with removed_on_error(tmp, final):
            _unwrap(draft).save_pretrained(tmp)
            torch.save({"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), **state,
                        "world_size": world}, tmp / "trainer_state.pt")
            (tmp / "training_args.json").write_text(json.dumps(asdict(config), indent=2, default=str))
        replace(tmp, final)
        with atomic_path(out_dir / "latest") as pointer:
            pointer.write_text(f"checkpoints/{name}\n")
        if keep:
            old = sorted(p for p in root.glob("step-*") if p.is_dir())[:-keep]
            for path in old:
                aside = temporary_name(path, "old")
                os.replace(path, aside)
                remove(aside)
    _barrier(world)
    return final


def _logged_step(line: str) -> int | None:
    """The step of a ``log.jsonl`` line; None for a line a kill cut short (it is dropped on resume)."""
    try:
        return json.loads(line)["step"]
    except (ValueError, KeyError, TypeError):
        return None


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
    device = resolve_device(device_arg)
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


def _any_and_sum(flag: bool, count: int, world: int, device) -> tuple[bool, int]:
    """Whether any rank raised ``flag``, and ``count`` summed over the ranks: one all-reduce a step."""
    if world == 1:
        return flag, count
    tensor = torch.tensor([int(flag), count], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return bool(tensor[0].item()), int(tensor[1].item())


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
@dataclass
class TrainingRun:
    """One training process between steps, as `setup_training` builds it and `train_step` advances it."""

    config: TrainConfig
    rank: int
    world: int
    device: torch.device
    out_dir: Path
    target: nn.Module
    embed_tokens: nn.Module
    lm_head: nn.Module  # the target's head, or a `VocabSubsetHead` with --train-vocab
    dataset: ShardDataset
    pad_id: int
    gamma: float
    layer_ids: list[int]
    draft: DFlashDraftModel
    model: nn.Module  # the drafter, DDP-wrapped with several processes
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    generator: torch.Generator  # anchors (and sampled positions)
    steps_per_epoch: int
    total_steps: int
    autocast: object
    clock: RunClock  # training seconds: the time budget and ``--schedule time`` read it
    resumed_from: Path | None = None
    step: int = 0
    orders: dict[int, list[int]] = field(default_factory=dict)  # this epoch's sample order (one epoch kept)

    @property
    def log_path(self) -> Path:
        return self.out_dir / "log.jsonl"


@dataclass
class MetricsWindow:
    """Loss and draft accuracy per block position over the steps since the last log line."""

    block_size: int
    loss: float = 0.0
    steps: int = 0
    blocks: int = 0  # all ranks' blocks (summed each step), for the throughput
    started: float = field(default_factory=time.monotonic)
    correct: torch.Tensor = field(init=False)  # [B] correct drafts per block position
    count: torch.Tensor = field(init=False)  # [B] label rows per block position

    def __post_init__(self):
        self.correct, self.count = torch.zeros(self.block_size), torch.zeros(self.block_size)

    def add_micro_batch(self, stats: dict) -> None:
        self.correct += stats["correct"]
        self.count += stats["count"]


def train(config: TrainConfig) -> dict:
    """Train a drafter as ``config`` says (see `TrainConfig`, ``dflash-hf train``); returns a summary dict.

    setup (`setup_training`: target, data, drafter, optimizer, schedule, resume) -> steps (`train_step`), each
    evaluated on the running window (`evaluate_window`, a ``log.jsonl`` line every ``log_every`` steps) and
    checkpointed every ``save_every`` steps or when time is up (`checkpoint`) -> the final drafter (`finish_training`).
    """
    run = setup_training(config)
    start = time.monotonic()
    run.clock.restart()
    window, total_blocks, stopped_by_budget, last_saved = MetricsWindow(config.block_size), 0, False, run.step
    last_export = time.monotonic()
    bar = tqdm(total=run.total_steps, initial=run.step, desc="train", unit="step",
               disable=run.rank != 0 or config.quiet)
    while run.step < run.total_steps:
        epoch = run.step // run.steps_per_epoch
        loss, blocks = train_step(run, window)
        out_of_time = bool(config.time_budget) and run.clock() > config.time_budget
        # every rank's blocks, not rank 0's times the world: ranks' draws differ in size
        out_of_time, blocks = _any_and_sum(out_of_time, blocks, run.world, run.device)
        total_blocks += blocks
        window.loss, window.steps, window.blocks = window.loss + loss, window.steps + 1, window.blocks + blocks
        bar.update(1)
        if run.rank == 0 and (run.step % config.log_every == 0 or run.step == run.total_steps):
            row = evaluate_window(run, window, epoch, start)
            bar.set_postfix(loss=f"{row['loss']:.3f}", acc=f"{row['acc']:.3f}", tok_s=f"{row['tokens_per_s']:.0f}")
            window = MetricsWindow(config.block_size)
        out_of_time = out_of_time or bool(config.stop_after and run.step >= config.stop_after)
        if run.step < run.total_steps and (out_of_time or (config.save_every and run.step % config.save_every == 0)):
            last_saved = checkpoint(run)
        if config.export_dir and run.rank == 0 and time.monotonic() - last_export >= config.export_every:
            export(run)
            last_export = time.monotonic()
        if out_of_time:
            stopped_by_budget = True
            if run.rank == 0:
                logger.info("stopping at step %d (--time-budget %s / --stop-after %s)", run.step, config.time_budget,
                            config.stop_after)
            break
    bar.close()
    if run.step != last_saved or run.step == run.total_steps:
        checkpoint(run)
    return finish_training(run, start, stopped_by_budget, total_blocks)


def setup_training(config: TrainConfig) -> TrainingRun:
    """Processes, seeds, the frozen target, the shards, the drafter (new, ``init_from`` or resumed), AdamW and the
    cosine schedule, restored from a checkpoint when resuming; ``log.jsonl`` cut back to the checkpoint's step."""
    from ..loading import load_target

    rank, world, device = setup_distributed(config.device)
    bf16, why = resolve_autocast(config.bf16, device)
    config = dataclasses.replace(config, attn_implementation=resolve_attention(config.attn_implementation, device),
                                 bf16=bf16)
    if rank == 0:
        logger.info("autocast: %s (%s)", "bf16" if bf16 else "off (float32)", why)
    out_dir = Path(config.output_dir)
    if rank == 0:
        out_dir.mkdir(parents=True, exist_ok=True)
    random.seed(config.seed + rank)
    torch.manual_seed(config.seed)
    generator = torch.Generator().manual_seed(config.seed * 7919 + rank)

    target, tokenizer = load_target(config.target, dtype=config.target_dtype, device=str(device))
    embed_tokens, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
    dataset = ShardDataset(config.data, max_length=config.max_length, load_features=not config.online_features)
    asked = config.target_layer_ids
    if dataset.has_features and asked and dataset.target_layer_ids not in (None, asked):
        raise ValueError(f"--target-layer-ids {asked} differ from the shards' features "
                         f"({dataset.target_layer_ids}); redistill or pass --online-features.")
    if config.kd_weight and dataset.has_features:
        raise ValueError("--kd-weight learns the target's distribution, which the stored features do not hold: "
                         "pass --online-features.")
    if config.train_vocab:
        ids, coverage = dataset.frequent_response_tokens(config.train_vocab)
        lm_head = VocabSubsetHead(lm_head, ids)
        if rank == 0:
            logger.info("loss over the %d most frequent response tokens: %.2f%% of the labels", len(ids),
                        100 * coverage)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    gamma = config.gamma if config.gamma is not None else default_gamma(config.block_size)

    resume_dir = resolve_resume(config.resume, out_dir) if config.resume else None
    draft = load_draft(config, target, dataset, resume_dir, rank)
    if config.train_vocab:  # drafted from at inference too (`DraftVocabHead`): saved with every checkpoint
        draft.config.draft_vocab = lm_head.vocab_ids.tolist()
    draft.to(device).train()
    model = draft
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(
            draft, device_ids=[device.index] if device.type == "cuda" else None)
    optimizer = build_optimizer(draft, config)
    per_rank = len(dataset) // world
    if per_rank == 0:
        raise ValueError(f"{len(dataset)} sequences cannot feed {world} processes.")
    steps_per_epoch = max(1, math.ceil(per_rank / config.batch_size) // config.grad_accum)
    total_steps = config.max_steps or config.epochs * steps_per_epoch
    warmup = config.warmup_steps if config.warmup_steps is not None else int(config.warmup_ratio * total_steps)
    clock = RunClock()
    if config.schedule == "time":
        if not config.time_budget:
            raise ValueError("--schedule time runs the schedule over --time-budget seconds: pass --time-budget")
        ratio = warmup / total_steps if config.warmup_steps is not None else config.warmup_ratio
        factor = budget_cosine_lambda(total_steps, config.time_budget, clock, ratio, config.min_lr_ratio)
    else:
        factor = cosine_lambda(total_steps, warmup, config.min_lr_ratio)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if config.bf16 else nullcontext
    run = TrainingRun(
        config=config, rank=rank, world=world, device=device, out_dir=out_dir, target=target,
        embed_tokens=embed_tokens, lm_head=lm_head, dataset=dataset, pad_id=pad_id, gamma=gamma,
        layer_ids=list(draft.config.target_layer_ids), draft=draft, model=model, optimizer=optimizer,
        scheduler=scheduler, generator=generator, steps_per_epoch=steps_per_epoch, total_steps=total_steps,
        autocast=autocast, clock=clock, resumed_from=resume_dir,
    )
    if resume_dir is not None:
        restore_checkpoint(run, resume_dir)
    if rank == 0:
        _trim_log(run)
    return run


def load_draft(config: TrainConfig, target, dataset: ShardDataset, resume_dir: Path | None, rank: int):
    """The drafter to train, in float32: the checkpoint's when resuming, ``init_from``'s (its shape and layer ids;
    ``add_draft_layers`` more layers, `grow_draft`), or a new one (``warm_start``: the target's top layers)."""
    if config.add_draft_layers and not config.init_from:
        raise ValueError("--add-draft-layers grows a trained drafter: pass the drafter to grow with --init-from "
                         "(for a new drafter, set its depth with --num-draft-layers)")
    if resume_dir is not None:
        draft = DFlashDraftModel.from_pretrained(resume_dir, dtype=torch.float32)
        draft.config._attn_implementation = config.attn_implementation
    elif config.init_from:  # continue from a trained drafter (its shape and layer ids), with a fresh optimizer
        draft = DFlashDraftModel.from_pretrained(config.init_from, dtype=torch.float32)
        draft.config._attn_implementation = config.attn_implementation
        if dataset.has_features and dataset.target_layer_ids not in (None, list(draft.config.target_layer_ids)):
            raise ValueError(f"--init-from {config.init_from} reads layers {draft.config.target_layer_ids} but the "
                             f"shards' features are of layers {dataset.target_layer_ids}; pass --online-features.")
        if config.add_draft_layers:
            draft = grow_draft(draft, config.add_draft_layers)
            if rank == 0:
                logger.info("grew the drafter to %d layers (the new ones start as the identity)",
                            draft.config.num_hidden_layers)
    else:
        torch.manual_seed(config.seed)
        draft = build_draft(target, config, config.target_layer_ids or dataset.target_layer_ids)
        if config.warm_start:
            copied = warm_start_from_target(draft, target)
            if rank == 0:
                logger.info("warm start copied %d tensors from the target", len(copied))
    return draft


def build_optimizer(draft: DFlashDraftModel, config: TrainOptions) -> torch.optim.AdamW:
    """AdamW with weight decay on matrices only; layers appended by ``add_draft_layers`` (the last ones) step
    ``new_layers_lr_scale`` times as far: grown from zero output projections, at the trained layers' rate they stayed
    near the identity for a whole CPU run (run 19, docs/training.md)."""
    first_new = draft.config.num_hidden_layers - config.add_draft_layers
    groups = {}  # (decayed, new layer) -> parameters
    for name, param in draft.named_parameters():
        new = name.startswith("layers.") and int(name.split(".")[1]) >= first_new
        groups.setdefault((param.ndim >= 2, new), []).append(param)
    # Decayed group first, as before there were new layers: a resumed checkpoint's optimizer state matches by order.
    order = [(True, False), (False, False), (True, True), (False, True)]
    return torch.optim.AdamW(
        [{"params": groups[key], "weight_decay": config.weight_decay if key[0] else 0.0,
          "lr": config.lr * (config.new_layers_lr_scale if key[1] else 1.0)} for key in order if key in groups],
        lr=config.lr, betas=(config.adam_beta1, config.adam_beta2), eps=config.adam_eps,
    )


def restore_checkpoint(run: TrainingRun, resume_dir: Path) -> None:
    """Optimizer, schedule, step and (with the same process count) every RNG from ``resume_dir``."""
    state = torch.load(resume_dir / "trainer_state.pt", map_location="cpu", weights_only=True)
    run.optimizer.load_state_dict(state["optimizer"])
    run.scheduler.load_state_dict(state["scheduler"])
    run.step = state["step"]
    if run.config.schedule == "time":  # the schedule continues where the time ran out, not from its start
        run.clock.offset = state.get("elapsed_s", 0.0)
    rng_path = resume_dir / f"rng-rank{run.rank}.pt"
    if rng_path.exists() and state.get("world_size", 1) == run.world:
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["torch"])
        random.setstate(rng["python"])
        run.generator.set_state(rng["anchors"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(rng["cuda"])
    else:
        logger.warning("resuming with a different process count: anchor RNG reseeded")
        run.generator.manual_seed(run.config.seed * 7919 + run.rank + run.step)
    if run.rank == 0:
        logger.info("resumed from %s at step %d", resume_dir, run.step)


def _trim_log(run: TrainingRun) -> None:
    """A fresh run starts a new ``log.jsonl``; a resumed one keeps the lines up to its step (later steps run again)."""
    log_path = run.log_path
    if not log_path.exists():
        return
    if run.resumed_from is None:
        log_path.unlink()
        return
    kept = [line for line in log_path.read_text().splitlines()
            if (logged := _logged_step(line)) is not None and logged <= run.step]
    with atomic_path(log_path) as tmp:
        tmp.write_text("".join(line + "\n" for line in kept))


def train_step(run: TrainingRun, window: MetricsWindow) -> tuple[float, int]:
    """One optimizer step over ``grad_accum`` micro-batches of this epoch's order; returns (mean loss, blocks)."""
    config = run.config
    epoch, in_epoch = divmod(run.step, run.steps_per_epoch)
    if epoch not in run.orders:
        run.orders = {epoch: epoch_order(len(run.dataset), epoch, config.seed, run.rank, run.world)}
    order = run.orders[epoch]
    run.optimizer.zero_grad(set_to_none=True)
    step_loss, blocks = 0.0, 0
    for micro in range(config.grad_accum):
        first = (in_epoch * config.grad_accum + micro) * config.batch_size
        indices = [order[(first + j) % len(order)] for j in range(config.batch_size)]
        batch = {k: v.to(run.device) for k, v in collate([run.dataset[i] for i in indices], run.pad_id).items()}
        features = batch.pop("features", None)
        if features is None:  # online: the target's features and its greedy predictions, as `features` stores them
            features, batch["next_ids"], teacher_hidden = target_pass(run.target, batch["input_ids"],
                                                                      batch["attention_mask"], run.layer_ids)
            if config.kd_weight:
                batch["teacher_hidden"] = teacher_hidden
        sync = nullcontext() if (run.world == 1 or micro == config.grad_accum - 1) else run.model.no_sync()
        with sync:
            loss, stats = block_loss(
                run.model, run.embed_tokens, run.lm_head, batch, features, block_size=config.block_size,
                num_anchors=config.num_anchors, mask_token_id=run.draft.config.mask_token_id, gamma=run.gamma,
                generator=run.generator, sample_positions=config.sample_positions, autocast=run.autocast,
                kd_weight=config.kd_weight,
            )
            (loss / config.grad_accum).backward()
        step_loss += loss.item() / config.grad_accum
        window.add_micro_batch(stats)
        blocks += stats["blocks"]
    # fc clipped on its own: massive target activations give it huge early gradients
    if config.fc_max_grad_norm:
        torch.nn.utils.clip_grad_norm_(list(run.draft.fc.parameters()), config.fc_max_grad_norm)
    if config.max_grad_norm:
        others = [p for n, p in run.draft.named_parameters() if not n.startswith("fc.")]
        torch.nn.utils.clip_grad_norm_(others, config.max_grad_norm)
    run.optimizer.step()
    run.scheduler.step()
    run.step += 1
    return step_loss, blocks


def evaluate_window(run: TrainingRun, window: MetricsWindow, epoch: int, start: float) -> dict:
    """The ``log.jsonl`` line of the steps in ``window``: loss, accuracy (all and per block position), learning rate
    and throughput; appended to the log and returned."""
    elapsed = time.monotonic() - window.started
    row = {
        "step": run.step, "epoch": epoch, "loss": window.loss / window.steps,
        "acc": float(window.correct.sum() / window.count.sum().clamp(min=1)),
        "acc_per_position": (window.correct / window.count.clamp(min=1)).tolist()[1:],
        "lr": run.scheduler.get_last_lr()[0],
        "blocks": window.blocks,
        "blocks_per_s": window.blocks / max(elapsed, 1e-9),
        "tokens_per_s": window.blocks * run.config.block_size / max(elapsed, 1e-9),
        "elapsed_s": time.monotonic() - start,
    }
    with run.log_path.open("a") as handle:
        handle.write(json.dumps(row) + "\n")
    return row


def checkpoint(run: TrainingRun) -> int:
    """Save ``checkpoints/step-XXXXXXX`` (see `save_checkpoint`); returns the step saved."""
    save_checkpoint(run.out_dir, f"step-{run.step:07d}", run.model, run.optimizer, run.scheduler,
                    {"step": run.step, "elapsed_s": run.clock()},
                    run.config, run.generator, run.rank, run.world, keep=run.config.keep_checkpoints)
    return run.step


def finish_training(run: TrainingRun, start: float, stopped_by_budget: bool, blocks: int) -> dict:
    """The curves, ``final/`` (the drafter alone, in ``final_dtype``) and ``summary.json``; returns the summary
    (``blocks``: all ranks' together; ``seconds`` since ``start``, the final save included)."""
    final_dir = run.out_dir / "final"
    if run.rank == 0:
        if run.log_path.exists():
            plot_curves(run.log_path, run.out_dir / "curves.png")
        save_final(run.draft, final_dir, dtype=run.config.final_dtype, max_shard_size=run.config.final_max_shard_size)
    _barrier(run.world)
    seconds = time.monotonic() - start
    summary = {"step": run.step, "total_steps": run.total_steps, "stopped_by_budget": stopped_by_budget,
               "blocks": blocks, "seconds": seconds, "blocks_per_s": blocks / seconds, "final": str(final_dir)}
    if run.rank == 0:
        (run.out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
        if run.config.export_dir:
            export(run, extra=(run.out_dir / "curves.png", run.out_dir / "summary.json"))
    if run.world > 1:
        torch.distributed.destroy_process_group()
    return summary


def save_final(draft: DFlashDraftModel, path: Path, dtype: str = "bfloat16", max_shard_size: str | None = None,
               code: bool = True):
    """The drafter alone, in the z-lab layout, in ``dtype``; atomically (tmp dir + rename). ``code=False`` leaves
    out the remote-code files (an export that must stay within a few files; the package has them)."""
    path = Path(path)
    model = copy.deepcopy(_unwrap(draft)).to(DTYPES[dtype])  # a copy: casting back would round the live weights
    options = {"max_shard_size": max_shard_size} if max_shard_size else {}
    with atomic_path(path, directory=True) as tmp:
        model.save_pretrained(tmp, **options)
        if not code:
            for script in Path(tmp).glob("*.py"):
                script.unlink()
    return path


def export(run: TrainingRun, extra: tuple[Path, ...] = ()) -> Path:
    """``--export-dir``: the drafter as it is now (``final_dtype``, ``final_max_shard_size``, no code files) to
    ``EXPORT/drafter``, and ``log.jsonl`` and ``extra`` files beside it, each replaced atomically."""
    root = Path(run.config.export_dir)
    root.mkdir(parents=True, exist_ok=True)
    save_final(run.draft, root / "drafter", dtype=run.config.final_dtype,
               max_shard_size=run.config.final_max_shard_size, code=False)
    for source in (run.log_path, *extra):
        if source.is_file():
            with atomic_path(root / source.name) as tmp:
                shutil.copyfile(source, tmp)
    return root


__all__ = [
    "MetricsWindow",
    "TrainingRun",
    "VocabSubsetHead",
    "block_loss",
    "build_draft",
    "checkpoint",
    "evaluate_window",
    "export",
    "finish_training",
    "save_checkpoint",
    "save_final",
    "setup_training",
    "train",
    "train_step",
    "warm_start_from_target",
]
