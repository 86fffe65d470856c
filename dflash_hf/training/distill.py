"""``dflash-hf distill``: the target answers the prompts; its answers (and optionally its features) become shards.

Per shard of ``--shard-size`` prompts: chat template -> batched generation (left padding, greedy or temperature
sampling, ``max_new_tokens``) -> **one teacher-forced target forward** over each ``prompt + response`` (right
padding, batched) that captures ``hidden_states[l + 1]`` for the drafter's ``target_layer_ids``. The extra forward
is cheap next to generation and gives exactly the features the target produces at verify time (capturing them during
generation matches to cosine 0.99994, see cpu-training-notes), without threading hooks through ``generate``; it also
records the target's greedy prediction after every token (``next_ids``), the labels of sampled answers.

Resumable: a shard file exists only once complete (tmp file + rename), so a rerun skips finished shards and a crash
loses at most the shard in progress. ``manifest.json`` lists the finished shards. Multi-process: with ``RANK`` and
``WORLD_SIZE`` set (torchrun), process ``r`` writes shards ``r, r + W, ...``.
"""

import json
import logging
import os
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..assets import encode_chat
from ..atomic import atomic_path
from ..configuration_dflash import build_target_layer_ids
from ..errors import DFlashUserError
from ..generation_dflash import extract_context_feature, sampling_options
from ..loading import load_target, resolve_device
from .config import DistillConfig, FeaturesConfig
from .data import Prompt, read_prompts, shard_path, write_shard

logger = logging.getLogger(__name__)


def default_layer_ids(target_config, num_features: int) -> list[int]:
    return build_target_layer_ids(target_config.get_text_config().num_hidden_layers, num_features)


def eos_ids(model, tokenizer) -> list[int]:
    eos = model.generation_config.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos:
        eos.append(tokenizer.eos_token_id)
    return eos


def encode_prompt(tokenizer, text: str, chat_template_kwargs: dict | None = None) -> list[int]:
    """`encode_chat` as a list of ids: the target's chat template around one user turn, with the generation prompt;
    plain text for a tokenizer without a template."""
    chat = bool(tokenizer.chat_template)
    return encode_chat(tokenizer, text, chat=chat, chat_template_kwargs=chat_template_kwargs)["input_ids"][0].tolist()


@torch.no_grad()
def generate_responses(model, tokenizer, prompt_ids: list[list[int]], max_new_tokens: int, temperature: float,
                       eos: list[int], pad_id: int, drafter=None) -> list[list[int]]:
    """Batched generation with left padding; each response is cut after its first EOS (inclusive). With a DFlash
    ``drafter``, the batch decodes with batched DFlash (``generate(..., assistant_model=drafter)``): lossless, so the
    same responses as plain greedy generation, or the same distribution when sampling."""
    device = model.device
    width = max(len(p) for p in prompt_ids)
    input_ids = torch.full((len(prompt_ids), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(prompt_ids):
        input_ids[i, width - len(ids):] = torch.tensor(ids)
        attention_mask[i, width - len(ids):] = 1
    options = dict(max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos or None)
    options |= sampling_options(temperature)
    if drafter is not None:
        options["assistant_model"] = drafter
    out = model.generate(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **options)
    responses = []
    for row in out[:, width:].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        responses.append(row[:cut])
    return responses


# Logits of this many tokens x vocabulary entries at a time (268 MB in fp32): the argmax at every token of a batch
# without holding the batch's whole [b, T, V] logits (1.5 GB for 8 sequences of 1,000 tokens of a 49k vocabulary).
ARGMAX_CHUNK = 2**26


@torch.no_grad()
def target_pass(model, input_ids: torch.LongTensor, attention_mask: torch.Tensor, layer_ids: list[int]):
    """One teacher-forced forward of the target over a right-padded batch ``[b, T]``.

    Returns ``features [b, T, F*H]`` (``hidden_states[l + 1]`` of ``layer_ids``, concatenated), ``next_ids
    [b, T]``: the target's greedy prediction after each token (``next_ids[:, t]`` is the argmax of its logits at
    ``t``, the token greedy decoding would put at ``t + 1``), and ``last_hidden [b, T, H]``: the final (normed)
    states its head turns into those logits, for a loss against the target's whole distribution. On the target's
    own greedy answers ``next_ids[:, t] == input_ids[:, t + 1]`` wherever the dtype's rounding agrees; on sampled
    answers they are the labels that keep training on greedy continuations.
    """
    out = model.get_decoder()(input_ids=input_ids, attention_mask=attention_mask,
                              output_hidden_states=[i + 1 for i in layer_ids])
    features = extract_context_feature(out.hidden_states, layer_ids)
    head, real = model.get_output_embeddings(), attention_mask.bool()
    rows = out.last_hidden_state[real]  # [n, H] contiguous: the head runs ~8x slower on strided [b, t, H] slices
    step = max(1, ARGMAX_CHUNK // head.weight.shape[0])
    next_ids = torch.zeros_like(input_ids)  # padding keeps 0
    # a monotone logit transform after the head (soft-capping, scaling) leaves the argmax where it is
    next_ids[real] = torch.cat([head(part).argmax(-1) for part in rows.split(step)])
    return features, next_ids, out.last_hidden_state


def teacher_forced_features(model, sequences: list[list[int]], layer_ids: list[int], pad_id: int
                            ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`target_pass` over ``sequences`` (batched with right padding) -> per sequence ``(features [T, F*H] bf16,
    next_ids [T])``."""
    width = max(len(s) for s in sequences)
    input_ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for i, ids in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        attention_mask[i, : len(ids)] = 1
    features, next_ids, _ = target_pass(model, input_ids.to(model.device), attention_mask.to(model.device), layer_ids)
    features, next_ids = features.to(torch.bfloat16).cpu(), next_ids.cpu()
    return [(features[i, : len(ids)], next_ids[i, : len(ids)]) for i, ids in enumerate(sequences)]


# What one run of `distill` decides about the answers it writes (the seed only when it samples); a resumed corpus
# keeps its first run's values and lists each later run's under ``resumes``.
RUN_FIELDS = ("target", "dtype", "draft", "max_new_tokens", "temperature", "seed")


def _manifest_lock(out_dir: Path):
    """A lock for ``out_dir``'s manifest, kept in the system's temporary folder (named by the folder's resolved path)
    so that the corpus folder holds shards and manifest only. It serializes the processes of one machine, which is
    how ``RANK``/``WORLD_SIZE`` runs are launched here; a lock file itself would be left behind in the folder."""
    import hashlib
    import tempfile

    from filelock import FileLock  # huggingface_hub's dependency: always installed

    key = hashlib.sha256(str(out_dir.resolve()).encode()).hexdigest()[:16]
    return FileLock(Path(tempfile.gettempdir()) / f"dflash-hf-manifest-{key}.lock")


def _write_manifest(out_dir: Path, info: dict, resumed_shards: list[str] | None = None) -> None:
    """Write ``manifest.json``: ``info``, the finished shards and their response tokens. Keys that a person added to
    an existing manifest (how the corpus was made, notes) are kept, so that resuming a committed corpus with the
    command its manifest names does not erase that record. A resume (``resumed_shards``: the shards this run wrote
    into a corpus that had a manifest) keeps the manifest's `RUN_FIELDS` too, and records its own values with its
    shards under ``resumes``, so that a corpus grown over several runs and machines says which run wrote which
    shard (resuming used to overwrite the target folder and dtype of the whole corpus with its own).

    Every process of a several-process run (``RANK``/``WORLD_SIZE``) calls this after each of its shards, under a lock
    (`_manifest_lock`): the manifest then lists every finished shard whichever process finished last, and no
    process's read-modify-write drops another's ``resumes`` entry."""
    from safetensors import safe_open

    path = out_dir / "manifest.json"
    with _manifest_lock(out_dir):
        kept = json.loads(path.read_text()) if path.exists() else {}
        done = sorted(out_dir.glob("shard-*.safetensors"))
        tokens = 0
        for shard in done:
            with safe_open(shard, "pt") as f:
                tokens += int(f.get_tensor("loss_mask").sum())
        fresh = {k: v for k, v in info.items() if not (resumed_shards is not None and k in RUN_FIELDS and k in kept)}
        manifest = {**kept, **fresh, "finished_shards": [p.name for p in done], "response_tokens": tokens}
        if resumed_shards:  # this run's entry, rewritten after each of its shards
            entry = {"shards": resumed_shards, **{k: info[k] for k in RUN_FIELDS}}
            earlier = [r for r in kept.get("resumes", []) if r.get("shards", [None])[0] != resumed_shards[0]]
            manifest["resumes"] = earlier + [entry]
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps(manifest, indent=2))


def distill(config: DistillConfig) -> dict:
    """Run distillation as ``config`` says (see `DistillConfig`, ``dflash-hf distill``); returns a summary dict."""
    torch.manual_seed(config.seed)
    prompts, problems = read_prompts(config.prompts, limit=config.limit)
    if not prompts:  # before loading the target: nothing to distill is an input error, not an empty success
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        sources = config.prompts if isinstance(config.prompts, (list, tuple)) else [config.prompts]
        raise DFlashUserError(f"no usable prompt in {', '.join(map(str, sources))}: {shown or 'no lines'}")
    out_dir = Path(config.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    resuming = (out_dir / "manifest.json").exists()
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    device = resolve_device(config.device)
    if device == "cuda" and world > 1:
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', rank))}"

    for problem in problems:
        logger.warning("skipped prompt line %s", problem)
    model, tokenizer = load_target(config.target, dtype=config.dtype, device=device)
    layer_ids = config.target_layer_ids or default_layer_ids(model.config, config.num_features)
    drafter = None
    if config.draft:
        from ..loading import load_drafter

        drafter = load_drafter(config.draft, model, config.dtype, tokenizer)
        if drafter is None:
            raise DFlashUserError(f"--draft {config.draft}: no drafter is shipped for this target; pass a folder")
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else 0)

    encoded: list[tuple[Prompt, list[int]]] = []
    for prompt in prompts:
        ids = encode_prompt(tokenizer, prompt.text, config.chat_template_kwargs)
        if config.max_prompt_length and len(ids) > config.max_prompt_length:
            limit = config.max_prompt_length
            problems.append(f"prompt {prompt.id}: {len(ids)} tokens > --max-prompt-length {limit}")
            logger.warning("skipped prompt %s: too long (%d tokens)", prompt.id, len(ids))
            continue
        encoded.append((prompt, ids))

    num_shards = (len(encoded) + config.shard_size - 1) // config.shard_size
    mine = [s for s in range(num_shards) if s % world == rank]
    todo = [s for s in mine if not shard_path(out_dir, s).exists()]
    info = dict(target=str(config.target), target_layer_ids=layer_ids, num_prompts=len(encoded),
                num_shards=num_shards, max_new_tokens=config.max_new_tokens, temperature=config.temperature,
                dtype=config.dtype, features=not config.no_features, skipped=problems, draft=config.draft,
                seed=config.seed if config.temperature > 0 else None)
    logger.info("%d prompts, %d shards (%d already done), layer ids %s", len(encoded), num_shards,
                len(mine) - len(todo), layer_ids)
    start, written, tokens = time.monotonic(), [], 0
    resumed = [] if resuming else None  # the shard names this run adds to a corpus that had a manifest
    bar = tqdm(total=sum(min(config.shard_size, len(encoded) - s * config.shard_size) for s in todo), unit="prompt",
               desc="distill", disable=rank != 0 or config.quiet)
    for shard in todo:
        if config.time_budget and time.monotonic() - start > config.time_budget:
            logger.info("time budget reached; %d shards left for a rerun", len(todo) - len(written))
            break
        chunk = encoded[shard * config.shard_size : (shard + 1) * config.shard_size]
        sequences = []
        for b in range(0, len(chunk), config.batch_size):
            batch = chunk[b : b + config.batch_size]
            prompt_ids = [ids for _, ids in batch]
            responses = generate_responses(model, tokenizer, prompt_ids, config.max_new_tokens, config.temperature,
                                           eos, pad_id, drafter)
            full = [p + r for p, r in zip(prompt_ids, responses)]
            passes = None if config.no_features else teacher_forced_features(model, full, layer_ids, pad_id)
            for i, (p, r) in enumerate(zip(prompt_ids, responses)):
                features, next_ids = (None, None) if passes is None else passes[i]
                sequences.append({
                    "input_ids": torch.tensor(full[i]),
                    "loss_mask": torch.tensor([0] * len(p) + [1] * len(r)),
                    "features": features,
                    "next_ids": next_ids,
                })
                tokens += len(r)
            bar.update(len(batch))
            bar.set_postfix(tok_s=f"{tokens / max(time.monotonic() - start, 1e-9):.0f}")
        write_shard(shard_path(out_dir, shard), sequences, [p.id for p, _ in chunk], layer_ids)
        written.append(shard)
        if resumed is not None:
            resumed.append(shard_path(out_dir, shard).name)
        _write_manifest(out_dir, info, resumed)
    bar.close()
    if not written:  # a process with nothing to do still leaves a manifest (each written shard already updated it)
        _write_manifest(out_dir, info, resumed)
    return dict(written=written, skipped_shards=len(mine) - len(todo), problems=problems, new_tokens=tokens,
                seconds=time.monotonic() - start)


def add_features(config: FeaturesConfig) -> dict:
    """Token-only shards (``distill --no-features``) -> the same shards with the target's features stored.

    Each shard of ``config.data`` is read, its sequences go through `teacher_forced_features` in batches of
    ``config.batch_size`` (sorted by length, so padding stays small), and the shard is rewritten under ``config.out``
    with ``features`` and ``next_ids`` (the target's greedy prediction after each token) added. Resumable like
    `distill` (an existing output shard is complete); with ``RANK``/``WORLD_SIZE`` process ``r`` takes shards
    ``r, r + W, ...``. Training from the result runs no target forward at all.
    """
    from safetensors import safe_open

    src, out_dir = Path(config.data), Path(config.out)
    shards = sorted(src.glob("shard-*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"No shard-*.safetensors under {src}: run `dflash-hf distill --no-features` first.")
    if src.resolve() == out_dir.resolve():
        raise ValueError("--out must differ from --data: the token-only shards stay as they are.")
    out_dir.mkdir(parents=True, exist_ok=True)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    model, tokenizer = load_target(config.target, dtype=config.dtype, device=resolve_device(config.device))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    start, tokens, written = time.monotonic(), 0, []
    todo = [p for i, p in enumerate(shards) if i % world == rank and not (out_dir / p.name).exists()]
    for path in tqdm(todo, unit="shard", desc="features", disable=rank != 0 or config.quiet):
        with safe_open(str(path), framework="pt") as handle:
            meta = handle.metadata() or {}
            input_ids, loss_mask = handle.get_tensor("input_ids"), handle.get_tensor("loss_mask")
            offsets = handle.get_tensor("offsets").tolist()
        layer_ids = config.target_layer_ids or json.loads(meta.get("target_layer_ids") or "null") or \
            default_layer_ids(model.config, config.num_features)
        sequences = [input_ids[a:b].long().tolist() for a, b in zip(offsets, offsets[1:])]
        passes: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(sequences)
        order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]))
        for b in range(0, len(order), config.batch_size):
            chunk = order[b : b + config.batch_size]
            for i, result in zip(chunk, teacher_forced_features(model, [sequences[i] for i in chunk], layer_ids,
                                                                pad_id)):
                passes[i] = result
        rows = [{"input_ids": input_ids[a:b], "loss_mask": loss_mask[a:b], "features": f, "next_ids": n}
                for (a, b), (f, n) in zip(zip(offsets, offsets[1:]), passes)]
        write_shard(out_dir / path.name, rows, json.loads(meta.get("ids") or "[]"), layer_ids)
        tokens += len(input_ids)
        written.append(path.name)
    return dict(written=written, tokens=tokens, seconds=time.monotonic() - start)


__all__ = ["add_features", "distill", "encode_prompt", "generate_responses", "target_pass", "teacher_forced_features"]
