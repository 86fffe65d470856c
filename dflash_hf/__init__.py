"""dflash-hf: DFlash block-diffusion drafters for lossless speculative decoding with transformers.

    draft = DFlashDraftModel.from_pretrained(draft_dir)
    out = target.generate(**inputs, assistant_model=draft)      # lossless; draft.last_stats holds tau
"""

from .configuration_dflash import DFlashConfig, build_target_layer_ids
from .generation_dflash import (
    DFlashCandidateGenerator,
    DFlashStats,
    DraftLengthController,
    check_drafter_fits_target,
    extract_context_feature,
    install_dflash_dispatch,
)
from .modeling_dflash import DFlashDraftModel

# Installed at import (not only when a drafter is built) so that a drafter loaded without its code, e.g.
# `AutoModel.from_pretrained(path)` without trust_remote_code, fails at `generate` with a message saying what to do.
install_dflash_dispatch()

# `save_pretrained` then writes `auto_map` and copies the three remote-code files into every checkpoint.
DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")

__version__ = "0.1.0"

__all__ = [
    "DFlashCandidateGenerator",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashStats",
    "DraftLengthController",
    "build_target_layer_ids",
    "check_drafter_fits_target",
    "extract_context_feature",
    "install_dflash_dispatch",
]
