"""dflash-hf: DFlash block-diffusion drafters for lossless speculative decoding with transformers.

    draft = DFlashDraftModel.from_pretrained(draft_dir)
    out = target.generate(**inputs, assistant_model=draft)      # lossless; draft.last_stats holds tau

Importing the package installs the ``generate`` dispatch, so a drafter built by z-lab's own remote code
(``AutoModel.from_pretrained("z-lab/...", trust_remote_code=True)``) works as ``assistant_model`` too.
"""

import logging

from .configuration_dflash import DFlashConfig, build_target_layer_ids
from .controller_dflash import DFlashStats, DraftLengthController, RoundController
from .generation_dflash import (
    DFlashCandidateGenerator,
    DFlashDraftHead,
    as_dflash_drafter,
    check_drafter_fits_target,
    extract_context_feature,
    install_dflash_dispatch,
)
from .modeling_dflash import DFlashDraftModel
from .modeling_dflash2 import DFlash2DraftModel

# `save_pretrained` then writes `auto_map` and copies the remote-code files into every checkpoint.
DFlashConfig.register_for_auto_class()
DFlashDraftModel.register_for_auto_class("AutoModel")
DFlash2DraftModel.register_for_auto_class("AutoModel")

# Installed at import (not only when a drafter is built) so that a drafter loaded without its code, e.g.
# `AutoModel.from_pretrained(path)` without trust_remote_code, fails at `generate` with a message saying what to do.
try:
    install_dflash_dispatch()
except RuntimeError as error:  # an unsupported transformers: importing still works, generating with a drafter says why
    logging.getLogger(__name__).warning("%s", error)

__version__ = "0.1.0"

__all__ = [
    "DFlashCandidateGenerator",
    "DFlashDraftHead",
    "DFlash2DraftModel",
    "DFlashConfig",
    "DFlashDraftModel",
    "DFlashStats",
    "DraftLengthController",
    "RoundController",
    "as_dflash_drafter",
    "build_target_layer_ids",
    "check_drafter_fits_target",
    "extract_context_feature",
    "install_dflash_dispatch",
]
