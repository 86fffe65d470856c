"""Prompts in, distilled shards out, and the training dataset that reads them back.

Prompt files (JSONL, one object per line, ``.gz`` too, read by `dflash_hf.assets.json_lines`; malformed lines are
reported as ``file:line`` and skipped):

* ``{"id": ..., "turns": ["user turn 1", ...]}`` (MT-Bench style),
* ShareGPT-like ``{"id": ..., "conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}`` (also
  ``"messages"`` with ``role``/``content``),
* ``{"prompt": "..."}`` or ``{"question": "..."}``.

Only the **first user turn** is used: the target regenerates the answer (self-distillation), and later turns would
need the target's own earlier answers. A ``.json`` file holding a list of such objects is read too.

Shard layout (``shard-00000.safetensors``, written atomically, so an existing file is a finished shard)::

    input_ids  uint16 [T]       all sequences of the shard concatenated (prompt + response); int32 when an id
                                is >= 65,536
    loss_mask  uint8 [T]        1 on response tokens the target generated (incl. its EOS), 0 on the prompt
    offsets    int64 [n + 1]    sequence i is [offsets[i], offsets[i + 1])
    features   bf16  [T, F*H]   optional: concatenated target hidden states hidden_states[l + 1], l in layer_ids
    next_ids   uint16 [T]       optional, written with features: the target's argmax after each token (its greedy
                                prediction of the next one); int32 like input_ids

Metadata (safetensors string map): ``ids`` (JSON list of prompt ids), ``target_layer_ids`` (JSON), ``format``.
"""

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..assets import json_lines
from ..atomic import atomic_path

logger = logging.getLogger(__name__)

SHARD_FORMAT = "dflash-hf-distill-v1"


@dataclass
class Prompt:
    id: str
    text: str


def _first_user_turn(record: dict) -> str | None:
    if isinstance(record.get("turns"), list) and record["turns"]:
        turn = record["turns"][0]
        return turn if isinstance(turn, str) else None
    for key in ("conversations", "messages", "conversation"):
        turns = record.get(key)
        if isinstance(turns, list):
            for turn in turns:
                if not isinstance(turn, dict):
                    return None
                role = turn.get("from", turn.get("role"))
                if role in ("human", "user"):
                    text = turn.get("value", turn.get("content"))
                    return text if isinstance(text, str) else None
            return None
    for key in ("prompt", "question", "instruction", "text"):
        if isinstance(record.get(key), str):
            return record[key]
    return None


def read_prompts(paths, limit: int | None = None) -> tuple[list[Prompt], list[str]]:
    """All usable prompts of ``paths`` in order, and a ``file:line: reason`` entry per skipped line."""
    prompts, problems = [], []
    for path in [paths] if isinstance(paths, (str, Path)) else paths:
        path = Path(path)
        if path.suffix == ".json":
            with path.open(encoding="utf-8") as handle:
                records = [(i + 1, r) for i, r in enumerate(json.load(handle))]
        else:
            records = []
            for number, record, error in json_lines(path):
                if error is None:
                    records.append((number, record))
                else:
                    problems.append(f"{path}:{number}: not JSON ({error})")
        for number, record in records:
            text = _first_user_turn(record) if isinstance(record, dict) else None
            if not text or not text.strip():
                problems.append(f"{path}:{number}: no user turn found")
                continue
            prompt_id = record.get("id", record.get("question_id", f"{path.stem}:{number}"))
            prompts.append(Prompt(id=str(prompt_id), text=text))
            if limit is not None and len(prompts) >= limit:
                return prompts, problems
    return prompts, problems


def shard_path(directory, index: int) -> Path:
    return Path(directory) / f"shard-{index:05d}.safetensors"


def write_shard(path, sequences: list[dict], ids: list[str], target_layer_ids: list[int] | None) -> None:
    """Write one shard atomically (tmp file + rename). ``sequences``: dicts of ``input_ids``, ``loss_mask``,
    optionally ``features`` and ``next_ids`` (1D/2D tensors of equal length)."""
    path = Path(path)
    lengths = [len(s["input_ids"]) for s in sequences]
    offsets = torch.zeros(len(sequences) + 1, dtype=torch.int64)
    offsets[1:] = torch.tensor(lengths, dtype=torch.int64).cumsum(0)
    input_ids = torch.cat([s["input_ids"].to(torch.int32) for s in sequences])
    next_ids = None
    if sequences and sequences[0].get("next_ids") is not None:
        next_ids = torch.cat([s["next_ids"].to(torch.int32) for s in sequences])
    # uint16 halves a token-only shard whenever the vocabulary allows (SmolLM2's 49,152 ids do)
    compact = all(len(t) == 0 or int(t.max()) < 2**16 for t in (input_ids, next_ids) if t is not None)
    id_dtype = torch.uint16 if compact else torch.int32
    tensors = {
        "input_ids": input_ids.to(id_dtype),
        "loss_mask": torch.cat([s["loss_mask"].to(torch.uint8) for s in sequences]),
        "offsets": offsets,
    }
    if sequences and sequences[0].get("features") is not None:
        tensors["features"] = torch.cat([s["features"].to(torch.bfloat16) for s in sequences]).contiguous()
    if next_ids is not None:
        tensors["next_ids"] = next_ids.to(id_dtype)
    metadata = {"format": SHARD_FORMAT, "ids": json.dumps(ids), "target_layer_ids": json.dumps(target_layer_ids)}
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


class ShardDataset(torch.utils.data.Dataset):
    """Sequences of every ``shard-*.safetensors`` under ``directory`` (a folder, or several: each folder's shards in
    turn, and a folder named twice counts twice, as a mix that lists its shards twice), read lazily (features sliced
    per sequence). Shards whose features come from different target layers are refused: one drafter reads one set.

    ``item -> {"input_ids": long [T], "loss_mask": float [T], "next_ids": long [T], "features": bf16 [T, F*H] or
    absent}``, truncated to ``max_length``. ``next_ids`` are the shard's stored target predictions; a shard without
    them holds the target's own greedy answers, whose next token *is* the prediction: ``input_ids`` shifted left
    (the last entry, which no label reads, is 0).
    """

    def __init__(self, directory, max_length: int | None = None, load_features: bool = True):
        folders = [directory] if isinstance(directory, (str, Path)) else list(directory)
        self.paths = []
        for folder in folders:
            shards = sorted(Path(folder).glob("shard-*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"No shard-*.safetensors under {folder}: run `dflash-hf distill` first.")
            self.paths += shards
        self.max_length = max_length
        self.index: list[tuple[int, int, int]] = []  # (shard, start, end)
        self.has_features = load_features
        self.target_layer_ids = None
        self._tokens: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        feature_layers = None  # the layers of the feature shards read so far
        for shard, path in enumerate(self.paths):
            with safe_open(str(path), framework="pt") as handle:
                offsets = handle.get_tensor("offsets").tolist()
                stored = handle.get_tensor("next_ids") if "next_ids" in handle.keys() else None
                self._tokens[shard] = (handle.get_tensor("input_ids"), handle.get_tensor("loss_mask"), stored)
                self.has_features = self.has_features and "features" in handle.keys()
                meta = handle.metadata() or {}
                ids = json.loads(meta.get("target_layer_ids") or "null")
                if load_features and "features" in handle.keys():
                    if feature_layers not in (None, ids):
                        raise ValueError(f"{path} holds features of target layers {ids}, the shards before it of "
                                         f"{feature_layers}: train on one set of layers (rerun `dflash-hf features "
                                         "--target-layer-ids` on one folder) or pass --online-features.")
                    feature_layers = ids
                self.target_layer_ids = ids or self.target_layer_ids
            self.index.extend((shard, offsets[i], offsets[i + 1]) for i in range(len(offsets) - 1))

    def __len__(self) -> int:
        return len(self.index)

    def response_token_counts(self) -> torch.LongTensor:
        """How often each token id is a label of a response position (``loss_mask`` 1), ``[max id + 1]``: the
        response token itself, or on a shard with ``next_ids`` the target's prediction there (what training learns
        from a sampled answer)."""
        counts = torch.zeros(0, dtype=torch.long)
        for input_ids, loss_mask, next_ids in self._tokens.values():
            response = loss_mask.bool()
            # a response never starts a sequence (its prompt does), so the prediction before it is its own sequence's
            ids = (input_ids[response] if next_ids is None else next_ids[:-1][response[1:]]).long()
            shard_counts = torch.bincount(ids, minlength=len(counts))
            counts = torch.nn.functional.pad(counts, (0, len(shard_counts) - len(counts))) + shard_counts
        return counts

    def frequent_response_tokens(self, count: int) -> tuple[torch.LongTensor, float]:
        """The ``count`` most frequent labels of response positions (`response_token_counts`), sorted, and the share
        of response positions they cover (`most_frequent`)."""
        return most_frequent(self.response_token_counts(), count)

    def __getitem__(self, item: int) -> dict:
        shard, start, end = self.index[item]
        if self.max_length is not None:
            end = min(end, start + self.max_length)
        input_ids, loss_mask, next_ids = self._tokens[shard]
        sample = {"input_ids": input_ids[start:end].long(), "loss_mask": loss_mask[start:end].float()}
        if next_ids is not None:
            sample["next_ids"] = next_ids[start:end].long()
        else:
            sample["next_ids"] = torch.cat([sample["input_ids"][1:], sample["input_ids"].new_zeros(1)])
        if self.has_features:
            with safe_open(str(self.paths[shard]), framework="pt") as handle:
                sample["features"] = handle.get_slice("features")[start:end]
        return sample


def most_frequent(counts: torch.LongTensor, count: int) -> tuple[torch.LongTensor, float]:
    """The ``count`` ids with the highest ``counts`` (sorted ids) and the share of all counts they hold."""
    top = counts.topk(min(count, len(counts)))
    return top.indices.sort().values, float(top.values.sum() / counts.sum().clamp(min=1))


def collate(samples: list[dict], pad_token_id: int = 0) -> dict:
    """Right-pad a list of samples: ``input_ids``/``loss_mask``/``attention_mask`` ``[b, S]``, ``next_ids`` ``[b, S]``
    and ``features`` ``[b, S, F*H]`` when present. Right padding keeps positions ``0..len-1`` for every real token."""
    seq_len = max(len(s["input_ids"]) for s in samples)
    batch = len(samples)
    input_ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
    loss_mask = torch.zeros(batch, seq_len)
    attention_mask = torch.zeros(batch, seq_len, dtype=torch.long)
    next_ids = torch.zeros(batch, seq_len, dtype=torch.long) if "next_ids" in samples[0] else None
    features = None
    if "features" in samples[0]:
        width = samples[0]["features"].shape[-1]
        features = torch.zeros(batch, seq_len, width, dtype=samples[0]["features"].dtype)
    for i, sample in enumerate(samples):
        n = len(sample["input_ids"])
        input_ids[i, :n] = sample["input_ids"]
        loss_mask[i, :n] = sample["loss_mask"]
        attention_mask[i, :n] = 1
        if next_ids is not None:
            next_ids[i, :n] = sample["next_ids"]
        if features is not None:
            features[i, :n] = sample["features"]
    out = {"input_ids": input_ids, "loss_mask": loss_mask, "attention_mask": attention_mask}
    if next_ids is not None:
        out["next_ids"] = next_ids
    if features is not None:
        out["features"] = features
    return out


__all__ = ["Prompt", "ShardDataset", "collate", "most_frequent", "read_prompts", "shard_path", "write_shard"]
