"""Pinned proposals for loop tests, in the spirit of transformers' pinned-head candidate-generator tests.

The real drafter still runs every round (its proposals are recorded, so context feeding is exercised), but what is
proposed to the target is the target's own greedy continuation, corrupted at a chosen slot: the round then accepts
exactly that many drafts. This forces rounds with 0, partial and full acceptance.
"""

import types

import torch

from dflash_hf import DFlashCandidateGenerator


def corrupted(continuation: torch.LongTensor, start: int, num: int, cut: int, vocab_size: int) -> torch.LongTensor:
    """``continuation[..., start : start + num]`` with slot ``cut`` changed (none when ``cut`` is past the end): a
    round that proposes it accepts exactly ``cut`` drafts (all of them when none is changed)."""
    pinned = continuation[..., start : start + num].clone()
    if cut < pinned.shape[-1]:
        pinned[..., cut] = (pinned[..., cut] + 1) % vocab_size
    return pinned


class PinnedGenerator(DFlashCandidateGenerator):
    def __init__(self, *args, continuation, cuts, vocab_size, **kwargs):
        super().__init__(*args, **kwargs)
        self.continuation, self.cuts, self.vocab_size = continuation, cuts, vocab_size
        self.real_proposals: list[torch.Tensor] = []

    def draft_block(self, input_ids, round):
        real, _ = super().draft_block(input_ids, round)
        self.real_proposals.append(real)
        start = input_ids.shape[1]
        num = self.continuation[:, start : start + round.num_drafts].shape[1]
        cut = self.cuts(len(self.real_proposals) - 1, num)
        return corrupted(self.continuation, start, num, cut, self.vocab_size), None  # pinned drafts are no samples of the drafter's q: the loop compares samples


def pin(drafter, continuation, cuts=lambda round_index, n: n):
    """Make ``drafter`` propose ``continuation`` (``[1, total]``) corrupted at slot ``cuts(round, n)`` (n = none)."""
    generators = []

    def make_candidate_generator(self, target, generation_config, input_ids, model_kwargs, target_tokenizer=None):
        generator = PinnedGenerator(
            self,
            target,
            generation_config,
            input_ids,
            model_kwargs,
            target_tokenizer,
            continuation=continuation,
            cuts=cuts,
            vocab_size=target.config.vocab_size,
        )
        generators.append(generator)
        return generator

    drafter.make_candidate_generator = types.MethodType(make_candidate_generator, drafter)
    return generators
