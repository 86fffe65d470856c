"""Publishing a drafter: model card, z-lab <-> transformers built-in layout, pre-upload checks, upload.

A drafter trained here is saved in the z-lab layout (``model_type: qwen3``, ``dflash_config``, un-prefixed weights,
remote code), which is what vLLM, SGLang and z-lab's own code load. transformers also ships its own DFlash drafter
class, ``MuseGlimmerAssistantModel``, with the same math under other weight and config names; `convert_checkpoint`
moves a checkpoint between the two without touching a single weight bit.

Nothing here parses command lines; nothing but `push_to_hub` (without ``dry_run``) touches the network.
"""

import json
import shutil
from pathlib import Path
from string import Template

import torch
from huggingface_hub import CommitOperationAdd, HfApi
from huggingface_hub.utils import HFValidationError, validate_repo_id
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import MuseGlimmerAssistantConfig
from transformers.dynamic_module_utils import get_relative_imports

from .atomic import atomic_path
from .configuration_dflash import DRAFT_VALUE_KEYS, DFlashConfig
from .files import check_safetensors, write_folder
from .modeling_dflash import DFlashDraftModel

MODEL_CARD_TEMPLATE = Path(__file__).parent / "templates" / "model_card.md"

# The remote code every dflash-hf checkpoint carries (``auto_map`` names them); one source, at the repository root.
REMOTE_CODE_FILES = (
    "configuration_dflash.py",
    "modeling_dflash.py",
    "modeling_dflash2.py",
    "controller_dflash.py",
    "generation_dflash.py",
    "batch_generation_dflash.py",
)

# z-lab name prefix -> transformers built-in (MuseGlimmerAssistantModel) name prefix; every other name is shared.
_TO_BUILTIN = {"fc.": "encoder.fc.", "hidden_norm.": "encoder.output_norm_enc."}

# Config keys vLLM (qwen3_dflash.py) and SGLang (dflash_utils.py / models/dflash.py) read from a drafter's config.json.
ENGINE_CONFIG_KEYS = (
    "model_type",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "vocab_size",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "block_size",
    "num_target_layers",
)

# Fields both config classes share, copied one to one by `convert_checkpoint`.
_SHARED_CONFIG_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "max_position_embeddings",
    "layer_types",
    "attention_dropout",
    "hidden_act",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "block_size",
    "mask_token_id",
    "target_layer_ids",
)


def _draft_value(config: dict, name: str, default=None):
    """z-lab's reading order for a DFlash value: ``dflash_config`` first, then the top level."""
    return (config.get("dflash_config") or {}).get(name, config.get(name, default))


def zlab_weight_shapes(config: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor a z-lab drafter checkpoint (DFlash or DFlash2) holds, with its shape, from a ``config.json``
    dict (DFlash2: docs/dflash2-reference.md, bare codebook keys)."""
    hidden, head_dim = config["hidden_size"], config["head_dim"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    ffn = config["intermediate_size"]
    features = len(_draft_value(config, "target_layer_ids"))
    shapes = {"fc.weight": (hidden, features * hidden), "hidden_norm.weight": (hidden,), "norm.weight": (hidden,)}
    dflash2 = "DFlash2DraftModel" in (config.get("architectures") or [])
    if dflash2:
        taps, rank = _draft_value(config, "conv_kernel_size"), _draft_value(config, "selector_rank")
        groups = hidden // _draft_value(config, "conv_group_size")
        shapes.update({
            "candidate_selector.hidden_projection.weight": (rank, hidden),
            "candidate_selector.predecessor_codebook": (config["vocab_size"], rank),
            "candidate_selector.successor_codebook": (config["vocab_size"], rank),
        })  # fmt: skip
    for i in range(config["num_hidden_layers"]):
        prefix = f"layers.{i}."
        shapes.update(
            {
                prefix + "input_layernorm.weight": (hidden,),
                prefix + "post_attention_layernorm.weight": (hidden,),
                prefix + "self_attn.q_proj.weight": (q_dim, hidden),
                prefix + "self_attn.k_proj.weight": (kv_dim, hidden),
                prefix + "self_attn.v_proj.weight": (kv_dim, hidden),
                prefix + "self_attn.o_proj.weight": (hidden, q_dim),
                prefix + "self_attn.q_norm.weight": (head_dim,),
                prefix + "self_attn.k_norm.weight": (head_dim,),
                prefix + "mlp.gate_proj.weight": (ffn, hidden),
                prefix + "mlp.up_proj.weight": (ffn, hidden),
                prefix + "mlp.down_proj.weight": (hidden, ffn),
            }
        )
        if dflash2:
            for conv in ("attention_conv", "mlp_conv"):
                shapes[f"{prefix}{conv}.base_kernel"] = (2, taps, hidden)
                shapes[f"{prefix}{conv}.kernel_projection.weight"] = (2 * taps * groups, hidden)
    return shapes


def _read_config(draft_dir: Path) -> dict:
    return json.loads((draft_dir / "config.json").read_text())


def _dflash_fields(config: dict) -> tuple[int, list[int], int]:
    """``(block_size, target_layer_ids, mask_token_id)``, each read ``dflash_config`` first, then the top level."""
    names = ("block_size", "target_layer_ids", "mask_token_id")
    return tuple(_draft_value(config, name) for name in names)


def _draft_vocab_line(config: dict) -> str:
    vocab = (config.get("dflash_config") or {}).get("draft_vocab")
    if not vocab:
        return "all tokens"
    return (f"{len(vocab):,} tokens (dflash-hf drafts from those rows of the `lm_head` plus the prompt's tokens; "
            "engines that do not read it draft over all tokens)")


def write_model_card(
    draft_dir, target_name: str | None = None, acceptance_table: dict | None = None, draft_name: str | None = None
) -> Path:
    """Write ``README.md`` into a drafter folder from `MODEL_CARD_TEMPLATE`, with copy-paste serving commands.

    ``target_name`` is the target's Hub id (becomes ``base_model``; required: a card without it would publish a
    placeholder), ``acceptance_table`` maps a dataset name to its measured tau (tokens committed per verify round),
    ``draft_name`` is the drafter's Hub id used in the commands (defaults to the folder name). Returns the card's path.
    """
    draft_dir = Path(draft_dir)
    if not target_name:
        raise ValueError("the model card needs the target's Hub id (its base_model): pass --target / target_name")
    _require_drafter_folder(draft_dir)
    config = _read_config(draft_dir)
    block_size, layer_ids, mask_id = _dflash_fields(config)
    acceptance = ""
    if acceptance_table:
        rows = "\n".join(f"| {dataset} | {tau:.2f} |" for dataset, tau in acceptance_table.items())
        acceptance = (
            "\n## Measured acceptance\n\nMean tokens committed per verify round (tau), greedy:\n\n"
            f"| Dataset | tau |\n|---|---|\n{rows}\n"
        )
    card = Template(MODEL_CARD_TEMPLATE.read_text()).substitute(
        base_model_line=f"base_model: {target_name}\n",
        draft_name=draft_name or draft_dir.resolve().name,
        target=target_name,
        block_size=block_size,
        drafts_per_round=block_size - 1,
        num_layers=config["num_hidden_layers"],
        target_layer_ids=layer_ids,
        mask_token_id=mask_id,
        draft_vocab=_draft_vocab_line(config),
        acceptance_section=acceptance,
    )
    path = draft_dir / "README.md"
    path.write_text(card)
    return path


def _require_drafter_folder(folder: Path) -> None:
    """A ``FileNotFoundError`` naming the folder when it is not a local drafter folder (no ``config.json``)."""
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder: pass a local drafter folder (config.json + *.safetensors)")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"{folder} has no config.json: pass a local drafter folder")


def _load_weights(src_dir: Path) -> dict[str, torch.Tensor]:
    files = sorted(src_dir.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"No *.safetensors weights in {src_dir}.")
    check_safetensors(src_dir)
    weights = {}
    for file in files:
        weights.update(load_file(file))
    return weights


def _rename(weights: dict, renames: dict) -> dict:
    def rename(name):
        for old, new in renames.items():
            if name.startswith(old):
                return new + name[len(old) :]
        return name

    return {rename(name): tensor for name, tensor in weights.items()}


def convert_checkpoint(src_dir, dst_dir, to: str = "builtin", overwrite: bool = False, **config_overrides) -> Path:
    """Convert a drafter between the z-lab layout and transformers' built-in ``muse_glimmer_assistant`` layout.

    ``to="builtin"``: z-lab/dflash-hf checkpoint -> folder loadable with ``MuseGlimmerAssistantModel.from_pretrained``
    and usable with ``generate(..., assistant_model=draft, speculation_type="dflash")`` without remote code.
    ``to="zlab"``: the reverse; the output is a full dflash-hf checkpoint (z-lab config, ``auto_map``, remote code).
    Weights keep their dtypes and bits; only two prefixes are renamed. ``config_overrides`` fill fields a foreign
    built-in checkpoint may lack (``vocab_size``, ``num_target_layers``). The model card (``README.md``) is copied.

    ``dst_dir`` is written whole or not at all (see `dflash_hf.files.write_folder`): an existing one is refused
    unless ``overwrite``, and then replaced entirely, so no file of the old checkpoint survives.
    """
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    convert = {"builtin": _to_builtin, "zlab": _to_zlab}.get(to)
    if convert is None:
        raise ValueError(f"to must be 'builtin' or 'zlab', got {to!r}")
    _require_drafter_folder(src_dir)
    if dst_dir.resolve() == src_dir.resolve():
        raise ValueError(f"converting {src_dir} onto itself: choose another destination folder")
    with write_folder(dst_dir, overwrite=overwrite) as tmp:
        convert(src_dir, tmp, config_overrides)
        if (src_dir / "README.md").is_file():
            shutil.copyfile(src_dir / "README.md", tmp / "README.md")
    return dst_dir


def _to_builtin(src_dir: Path, dst_dir: Path, overrides: dict) -> None:
    config = DFlashConfig.from_pretrained(src_dir)
    if config.attention_bias:
        raise ValueError("MuseGlimmerAssistantModel has no attention bias; this drafter uses one and cannot convert.")
    if "DFlash2DraftModel" in (config.architectures or []):
        raise ValueError("transformers has no DFlash2 drafter class: a DFlash2 checkpoint cannot convert to it.")
    unsupported = [n for n in DRAFT_VALUE_KEYS if getattr(config, n) is not None]
    unsupported += [f"causal layer {i}" for i in range(config.num_hidden_layers) if config.layer_is_causal(i)]
    if unsupported:
        raise ValueError(
            f"MuseGlimmerAssistantModel attends bidirectionally and has no {', '.join(unsupported)}: this drafter "
            "cannot convert without changing its drafts (sliding layers are causal unless the config sets "
            "`is_causal: false`)."
        )
    sliding = "sliding_attention" in config.layer_types
    if sliding and config.sliding_window is None:
        raise ValueError("The drafter declares sliding-attention layers without a `sliding_window`; set one first.")
    weights = _load_weights(src_dir)
    fields = {name: getattr(config, name) for name in _SHARED_CONFIG_FIELDS}
    fields.update(
        # MuseGlimmer defaults to rope_theta 500000 and all-sliding layers with window 2048: always set both.
        rope_parameters=dict(config.rope_parameters),
        vocab_size=config.vocab_size,  # extra keys the built-in class keeps, so that `to="zlab"` restores them
        num_target_layers=config.num_target_layers,
        architectures=["MuseGlimmerAssistantModel"],
        dtype=next(iter(weights.values())).dtype,
    )
    if sliding:
        fields["sliding_window"] = config.sliding_window
    fields.update(overrides)
    MuseGlimmerAssistantConfig(**fields).save_pretrained(dst_dir)
    save_file(_rename(weights, _TO_BUILTIN), dst_dir / "model.safetensors", metadata={"format": "pt"})


def _to_zlab(src_dir: Path, dst_dir: Path, overrides: dict) -> None:
    source = MuseGlimmerAssistantConfig.from_pretrained(src_dir).to_dict()
    fields = {name: source[name] for name in _SHARED_CONFIG_FIELDS}
    fields.update(
        rope_parameters=source["rope_parameters"],
        vocab_size=source.get("vocab_size"),
        num_target_layers=source.get("num_target_layers"),
        architectures=["DFlashDraftModel"],
        tie_word_embeddings=False,
    )
    if "sliding_attention" in source["layer_types"]:
        # The built-in drafter's sliding layers are bidirectional; without the key z-lab's rule makes them causal.
        fields.update(sliding_window=source["sliding_window"], use_sliding_window=True, is_causal=False)
    fields.update(overrides)
    if fields["vocab_size"] is None:
        raise ValueError(f"{src_dir}/config.json has no vocab_size; pass vocab_size=<the target's vocabulary size>.")
    config = DFlashConfig(**fields)
    # Build on the meta device and adopt the loaded tensors as they are (`assign=True` keeps their dtypes).
    with torch.device("meta"):
        model = DFlashDraftModel(config)
    model.load_state_dict(_rename(_load_weights(src_dir), {v: k for k, v in _TO_BUILTIN.items()}), assign=True)
    model.save_pretrained(dst_dir)


def set_draft_vocab(draft_dir, ids) -> Path:
    """Write ``ids`` (token ids, any order) as the drafter's draft vocabulary (``dflash_config.draft_vocab``, see
    `DFlashConfig`) into ``draft_dir/config.json``, or remove it with ``ids=None``; no weight is touched. The
    config is rewritten atomically, every other key as it was."""
    draft_dir = Path(draft_dir)
    _require_drafter_folder(draft_dir)
    config = DFlashConfig.from_pretrained(draft_dir)
    config.draft_vocab = None if ids is None else sorted({int(i) for i in ids})
    config._validate_dflash_fields()
    path = draft_dir / "config.json"
    with atomic_path(path) as tmp:
        config.to_json_file(tmp)
    return path


def validate_for_publishing(draft_dir) -> list[str]:
    """Problems that would make the uploaded drafter fail in vLLM, SGLang or transformers; empty means ready."""
    draft_dir = Path(draft_dir)
    if not (draft_dir / "config.json").is_file():
        return [f"{draft_dir}/config.json is missing"]
    config = _read_config(draft_dir)
    problems = []
    if not {"DFlashDraftModel", "DFlash2DraftModel"} & set(config.get("architectures") or []):
        problems.append(f"config.json architectures {config.get('architectures')} lacks DFlashDraftModel")
    elif "DFlash2DraftModel" in config["architectures"]:
        missing = [n for n in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")
                   if _draft_value(config, n) is None]
        problems += [f"config.json lacks `dflash_config.{name}` (DFlash2)" for name in missing]
    missing = [key for key in ENGINE_CONFIG_KEYS if config.get(key) is None]
    problems += [f"config.json lacks `{key}` (read by vLLM/SGLang)" for key in missing]
    _, layer_ids, mask_id = _dflash_fields(config)
    if not layer_ids:
        problems.append("config.json lacks `dflash_config.target_layer_ids`")
    if mask_id is None:
        problems.append("config.json lacks `dflash_config.mask_token_id`")
    elif config.get("vocab_size") is not None and not 0 <= mask_id < config["vocab_size"]:
        problems.append(f"mask_token_id {mask_id} is outside the vocabulary (vocab_size {config['vocab_size']})")
    if layer_ids and config.get("num_target_layers") and max(layer_ids) >= config["num_target_layers"]:
        problems.append(f"target_layer_ids {layer_ids} reach past num_target_layers {config['num_target_layers']}")
    if not problems:
        problems += _weight_problems(draft_dir, zlab_weight_shapes(config))
    problems += _remote_code_problems(draft_dir, config)
    if not (draft_dir / "README.md").is_file():
        problems.append(f"README.md (model card) is missing: write it with `dflash-hf card {draft_dir} --target TARGET_ID`")
    return problems


def _weight_problems(draft_dir: Path, expected: dict) -> list[str]:
    """Names, shapes and dtypes from the safetensors headers, without loading tensors."""
    try:
        check_safetensors(draft_dir)
    except ValueError as err:
        return [str(err)]
    found = {}
    for file in sorted(draft_dir.glob("*.safetensors")):
        with safe_open(file, "pt") as handle:
            for name in handle.keys():
                piece = handle.get_slice(name)
                found[name] = (tuple(piece.get_shape()), piece.get_dtype())
    if not found:
        return ["no *.safetensors weights"]
    problems = [f"weight {name} is missing" for name in expected if name not in found]
    for name, (shape, dtype) in found.items():
        if name not in expected:
            borrowed = "embed" in name or "lm_head" in name
            hint = " (the drafter borrows the target's; engines expect none)" if borrowed else ""
            problems.append(f"unexpected weight {name}{hint}")
        elif shape != expected[name]:
            problems.append(f"weight {name} has shape {list(shape)}, config implies {list(expected[name])}")
        if not dtype.startswith(("F", "BF")):
            problems.append(f"weight {name} has non-floating dtype {dtype}")
    return problems


def _remote_code_problems(draft_dir: Path, config: dict) -> list[str]:
    """``auto_map`` must name an ``AutoModel`` whose file, and every file it imports relatively, is uploaded."""
    auto_map = config.get("auto_map") or {}
    if "AutoModel" not in auto_map:
        return ["config.json auto_map lacks AutoModel: `AutoModel.from_pretrained(..., trust_remote_code=True)` fails"]
    sources = upload_sources(draft_dir)
    problems, checked = [], set()
    for reference in auto_map.values():
        todo = [(_module_file(reference), None)]
        while todo:
            name, importer = todo.pop()
            if name in checked:
                continue
            checked.add(name)
            if name not in sources:
                problems.append(f"{importer} imports {name}, which is missing" if importer
                                else f"auto_map names {reference} but {name} is missing")
                continue
            todo += [(f"{module}.py", name) for module in get_relative_imports(str(sources[name]))]
    return problems


def _module_file(reference: str) -> str:
    """``"repo--module.Class"`` or ``"module.Class"`` -> ``"module.py"``."""
    return reference.split("--")[-1].rsplit(".", 1)[0] + ".py"


def upload_sources(draft_dir) -> dict[str, Path]:
    """What an upload of ``draft_dir`` sends, ``{path in the repository: local file}``: every file of the folder but
    hidden files and ``__pycache__``, plus this package's remote-code files the folder lacks (a drafter folder
    holds config, weights and card; its code is written when it is saved or pushed)."""
    draft_dir = Path(draft_dir)
    sources = {}
    for path in sorted(draft_dir.rglob("*")):
        relative = path.relative_to(draft_dir)
        if path.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in relative.parts):
            sources[relative.as_posix()] = path
    auto_map = (_read_config(draft_dir).get("auto_map") or {}) if (draft_dir / "config.json").is_file() else {}
    if any(_module_file(reference) in REMOTE_CODE_FILES for reference in auto_map.values()):
        package = Path(__file__).parent
        for name in REMOTE_CODE_FILES:
            sources.setdefault(name, (package / name).resolve())
    return dict(sorted(sources.items()))


def publishable_files(draft_dir) -> list[tuple[str, int]]:
    """``(path in the repository, size in bytes)`` of every file an upload sends (see `upload_sources`)."""
    return [(name, path.stat().st_size) for name, path in upload_sources(draft_dir).items()]


def push_to_hub(
    draft_dir, repo_id: str, dry_run: bool = False, token: str | None = None, private: bool = False
) -> list[tuple[str, int]]:
    """Validate, then create ``repo_id`` (if needed) and upload the drafter folder; returns the files sent.

    Refuses with a `ValueError` listing every `validate_for_publishing` problem. ``dry_run=True`` returns the
    files that would be uploaded, with sizes, and contacts nobody.
    """
    try:
        validate_repo_id(repo_id)
    except HFValidationError as err:
        raise ValueError(f"{repo_id!r} is not a Hub repository id (like 'user/name'): {err}") from None
    _require_drafter_folder(Path(draft_dir))
    problems = validate_for_publishing(draft_dir)
    if problems:
        raise ValueError(f"Not pushing {draft_dir} to {repo_id}:\n- " + "\n- ".join(problems))
    files = publishable_files(draft_dir)
    if dry_run:
        return files
    api = HfApi(token=token)
    api.create_repo(repo_id, private=private, exist_ok=True, repo_type="model")
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(path))
                  for name, path in upload_sources(draft_dir).items()]
    api.create_commit(repo_id=repo_id, operations=operations, commit_message="Upload DFlash drafter")
    return files


__all__ = [
    "convert_checkpoint",
    "REMOTE_CODE_FILES",
    "publishable_files",
    "push_to_hub",
    "set_draft_vocab",
    "upload_sources",
    "validate_for_publishing",
    "write_model_card",
    "zlab_weight_shapes",
]
