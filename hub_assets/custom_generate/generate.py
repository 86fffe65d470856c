"""DFlash decoding as a ``custom_generate`` repo: ``target.generate(**inputs, custom_generate=REPO,
trust_remote_code=True, assistant_model=draft)``.

This file holds no decoding logic of its own. A dflash-hf drafter (``_is_dflash_drafter``) brings its round with it:
its modeling module installs the ``generate`` dispatch that picks its candidate generator. A drafter following
transformers' built-in contract (``MuseGlimmerAssistantModel``: top-level ``block_size``, ``target_layer_ids``,
``mask_token_id``) is routed to transformers' own DFlash generator with ``speculation_type="dflash"``.
Streamers, stopping criteria and every other ``generate`` argument pass through unchanged.
"""

import sys


def _is_builtin_dflash_drafter(model) -> bool:
    config = getattr(model, "config", None)
    return all(getattr(config, key, None) is not None for key in ("block_size", "target_layer_ids", "mask_token_id"))


def generate(model, inputs=None, input_ids=None, generation_config=None, assistant_model=None, **kwargs):
    """``model.generate`` with ``assistant_model`` as the DFlash drafter; a positional prompt arrives as ``inputs``."""
    if assistant_model is None:
        raise ValueError(
            "This custom_generate runs DFlash speculative decoding and needs the drafter: pass "
            "`assistant_model=AutoModel.from_pretrained(DRAFT, trust_remote_code=True)`."
        )
    if getattr(assistant_model, "_is_dflash_drafter", False):
        install = getattr(sys.modules.get(type(assistant_model).__module__), "install_dflash_dispatch", None)
        if install is not None:
            install()
    elif _is_builtin_dflash_drafter(assistant_model):
        kwargs["speculation_type"] = "dflash"
    else:
        raise ValueError(
            f"assistant_model is a {type(assistant_model).__name__}, not a DFlash drafter. A DFlash checkpoint loaded "
            "without `trust_remote_code=True` becomes a plain Qwen3 model: reload it with trust_remote_code=True."
        )
    prompt = inputs if inputs is not None else input_ids
    # The class's generate, not `model.generate`: a model repo that makes this file its default generate replaces the
    # instance attribute with this very function, and calling it would recurse.
    return type(model).generate(
        model, prompt, generation_config=generation_config, assistant_model=assistant_model, **kwargs
    )
