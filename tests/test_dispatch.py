"""The generate() dispatch: DFlash drafters get our generator, everything else is untouched; bad input is refused."""

import pytest
import torch
from conftest import random_prompt, tiny_drafter, tiny_target
from transformers import GenerationMixin, Qwen3ForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.generation.candidate_generator import (
    AssistedCandidateGenerator,
    DFlashTokenCandidateGenerator,
    PromptLookupCandidateGenerator,
)

import dflash_hf.generation_dflash as generation_dflash
from dflash_hf import DFlashCandidateGenerator, install_dflash_dispatch


def chosen_generator(target, **kwargs):
    """Which candidate generator generate() builds for these arguments."""
    seen = []
    original = GenerationMixin._get_candidate_generator

    def spy(self, *args, **kw):
        generator = original(self, *args, **kw)
        seen.append(type(generator))
        return generator

    GenerationMixin._get_candidate_generator = spy
    try:
        target.generate(random_prompt(0), max_new_tokens=4, do_sample=False, **kwargs)
    finally:
        GenerationMixin._get_candidate_generator = original
    return seen[0]


def test_dispatch_picks_ours_and_leaves_other_paths_alone():
    target = tiny_target()
    drafter = tiny_drafter(target)
    assert issubclass(chosen_generator(target, assistant_model=drafter), DFlashCandidateGenerator)
    assert chosen_generator(target, assistant_model=drafter, speculation_type="dflash") is DFlashTokenCandidateGenerator
    assert chosen_generator(target, prompt_lookup_num_tokens=3) is PromptLookupCandidateGenerator
    small = tiny_target(seed=5, num_hidden_layers=2)
    assert chosen_generator(target, assistant_model=small) is AssistedCandidateGenerator
    assert torch.equal(
        target.generate(random_prompt(1), max_new_tokens=8, do_sample=False, assistant_model=small),
        target.generate(random_prompt(1), max_new_tokens=8, do_sample=False),
    )


def test_install_is_idempotent():
    before = GenerationMixin._get_candidate_generator
    install_dflash_dispatch()
    install_dflash_dispatch()
    assert GenerationMixin._get_candidate_generator is before and before._dflash_dispatch


def test_moved_internals_fail_with_a_clear_message(monkeypatch):
    def renamed(self, config, ids):  # a future transformers with another signature
        raise AssertionError

    monkeypatch.setattr(GenerationMixin, "_get_candidate_generator", renamed)
    with pytest.raises(RuntimeError, match=r"supports transformers >=5\.23"):
        install_dflash_dispatch()


@pytest.mark.parametrize(
    ("make_target", "drafter_kwargs", "message"),
    [
        (lambda: tiny_target(hidden_size=128, head_dim=32), {}, "hidden_size"),
        (lambda: tiny_target(vocab_size=200), {}, "vocab_size"),
        (lambda: tiny_target(num_hidden_layers=3), {}, "reads target layers"),
    ],
)
def test_drafter_that_does_not_fit_the_target_is_refused(make_target, drafter_kwargs, message):
    drafter = tiny_drafter(tiny_target(), **drafter_kwargs)
    with pytest.raises(ValueError, match=message):
        make_target().generate(random_prompt(0), max_new_tokens=4, assistant_model=drafter)


def test_mask_id_outside_target_vocab_is_refused():
    target = tiny_target()
    drafter = tiny_drafter(target)
    drafter.config.mask_token_id = 10_000
    with pytest.raises(ValueError, match="mask_token_id"):
        target.generate(random_prompt(0), max_new_tokens=4, assistant_model=drafter)


class SilentStreamer(BaseStreamer):
    def put(self, value):
        pass

    def end(self):
        pass


def test_unsupported_combinations_are_refused():
    target = tiny_target()
    drafter = tiny_drafter(target)
    with pytest.raises(ValueError, match="stream one prompt at a time"):  # a batch runs the batched loop
        target.generate(torch.cat([random_prompt(0), random_prompt(1)]), max_new_tokens=4, assistant_model=drafter,
                        streamer=SilentStreamer())  # fmt: skip
    with pytest.raises(ValueError, match="beam search"):
        target.generate(random_prompt(0), max_new_tokens=4, num_beams=2, assistant_model=drafter)
    with pytest.raises(ValueError, match="attn_implementation='eager'"):
        target.generate(
            random_prompt(0), max_new_tokens=4, assistant_model=drafter, output_attentions=True,
            return_dict_in_generate=True,
        )  # fmt: skip
    with pytest.raises(ValueError, match="needs a dynamic cache"):
        target.generate(random_prompt(0), max_new_tokens=4, assistant_model=drafter, cache_implementation="static")
    padded = random_prompt(0)
    with pytest.raises(ValueError, match="unpadded"):
        target.generate(
            padded, attention_mask=torch.cat([torch.zeros(1, 2), torch.ones(1, padded.shape[1] - 2)], 1).long(),
            max_new_tokens=4, assistant_model=drafter,
        )  # fmt: skip


def test_output_attentions_work_with_an_eager_target():
    target = tiny_target(attn="eager")
    drafter = tiny_drafter(target)
    out = target.generate(
        random_prompt(0), max_new_tokens=6, do_sample=False, assistant_model=drafter, output_attentions=True,
        return_dict_in_generate=True,
    )  # fmt: skip
    assert len(out.attentions) == 6


def test_other_target_class_with_its_own_generator_hook_still_works():
    """A target class overriding nothing still goes through the wrapper (the patch lives on GenerationMixin)."""
    assert Qwen3ForCausalLM._get_candidate_generator is GenerationMixin._get_candidate_generator
    assert generation_dflash.is_dflash_drafter(tiny_drafter(tiny_target()))


def test_importing_the_package_installs_the_dispatch():
    """So that a drafter loaded without its code (`AutoModel.from_pretrained(path)`, no trust_remote_code) gets the
    message that says so at `generate`, even before any DFlash drafter was built in the process."""
    import subprocess
    import sys

    code = ("import dflash_hf; from transformers import GenerationMixin; "
            "assert getattr(GenerationMixin._get_candidate_generator, '_dflash_dispatch', False)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
