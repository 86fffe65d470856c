"""How much of a corpus is on the target's greedy path, and how many rows per block training keeps from it.

    python scripts/greedy_path_share.py FEATURE_DIR [BLOCK_SIZE]

``FEATURE_DIR`` holds shards written by ``dflash-hf features`` or ``distill`` (with ``next_ids``). Prints the share of
response tokens that are the target's greedy prediction after the token before them, and the mean number of rows a
block keeps (`block_labels_and_weights`, every response position an anchor): ``B - 1`` when the answers are the
target's own greedy ones in the features' dtype, fewer on sampled answers (each departure ends a block's rows), and
the share of the training weight (the paper's decay) those rows keep.
"""

import sys

import torch

from dflash_hf.training.blocks import block_labels_and_weights, default_gamma, sample_anchors
from dflash_hf.training.data import ShardDataset, collate


def main(directory: str, block_size: int = 16) -> None:
    dataset = ShardDataset(directory, load_features=False)
    on_path = responses = rows = blocks = 0
    weight = all_weight = 0.0
    gamma = default_gamma(block_size)
    for i in range(len(dataset)):
        batch = collate([dataset[i]])
        ids, nxt, mask = batch["input_ids"][0], batch["next_ids"][0], batch["loss_mask"][0].bool()
        follows = ids[1:] == nxt[:-1]
        on_path += int(follows[mask[1:]].sum())
        responses += int(mask[1:].sum())
        anchors, keep = sample_anchors(batch["loss_mask"], block_size, len(ids))
        _, weights = block_labels_and_weights(batch["input_ids"], batch["loss_mask"], anchors, keep, block_size,
                                              gamma, batch["next_ids"])
        _, every_row = block_labels_and_weights(batch["input_ids"], batch["loss_mask"], anchors, keep, block_size,
                                                gamma)
        rows += int((weights > 0).sum())
        blocks += int(keep.sum())
        weight, all_weight = weight + float(weights.sum()), all_weight + float(every_row.sum())
    print(f"{directory}: {responses} response tokens, {on_path / max(responses, 1):.3f} on the greedy path; "
          f"{rows / max(blocks, 1):.2f} rows kept per block of {block_size} ({blocks} blocks), "
          f"{weight / max(all_weight, 1e-9):.3f} of the decayed weight")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python scripts/greedy_path_share.py FEATURE_DIR [BLOCK_SIZE]")
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
