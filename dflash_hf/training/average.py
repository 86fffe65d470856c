"""``dflash-hf average``: one drafter whose weights are the mean of several trained ones (a "model soup").

Training runs that continue one another (each warm-started from the one before) end close together in weight space,
and each trades one kind of prompt for another by a few hundredths of τ; the mean of their weights keeps what they
share (docs/training.md, "Results: averaged drafters"). It is meant for drafters of one lineage: the same shape,
fine-tuned from a common ancestor. The mean of unrelated drafters is not a drafter.
"""

from pathlib import Path

import torch

from ..errors import DFlashUserError
from ..modeling_dflash import DFlashDraftModel
from .trainer import save_final


def _load(folder: Path) -> DFlashDraftModel:
    if not (folder / "config.json").is_file():
        raise DFlashUserError(f"{folder} has no config.json: pass DFlash drafter folders (e.g. RUN/final)")
    return DFlashDraftModel.from_pretrained(folder, dtype=torch.float32)


def average_drafters(sources: list, out, dtype: str = "bfloat16") -> Path:
    """The mean of the weights of the drafters in ``sources`` (folders; summed in float32), saved to ``out`` in
    ``dtype`` (atomically, with the remote code) under the first drafter's config, its draft vocabulary included."""
    sources = [Path(s) for s in sources]
    if len(sources) < 2:
        raise DFlashUserError("average needs at least two drafter folders")
    first = _load(sources[0])
    total = {name: tensor.detach().clone() for name, tensor in first.state_dict().items()}
    for source in sources[1:]:
        weights = _load(source).state_dict()
        if weights.keys() != total.keys() or any(weights[n].shape != t.shape for n, t in total.items()):
            raise DFlashUserError(f"{source} is not shaped like {sources[0]}: average drafters of one lineage (the "
                                  "same layers and sizes, trained from a common drafter)")
        for name, tensor in weights.items():
            total[name] += tensor
    first.load_state_dict({name: tensor / len(sources) for name, tensor in total.items()})
    return save_final(first, out, dtype)


__all__ = ["average_drafters"]
