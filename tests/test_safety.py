"""Nothing runs that should not: no unpickling, remote code only when asked for, the Hub token never shown."""

import ast
from pathlib import Path

import pytest

from dflash_hf import hub
from dflash_hf.cli import main as cli_main

REPO = Path(__file__).resolve().parents[1]
UNSAFE_MODULES = {"pickle", "cPickle", "dill", "cloudpickle", "joblib", "marshal", "shelve"}


def package_sources() -> list[Path]:
    """Everything that runs as the package or ships as remote code (the root files dflash_hf/ links to)."""
    files = {path.resolve() for path in (REPO / "dflash_hf").rglob("*.py")}
    files |= {path.resolve() for path in REPO.glob("*.py")}
    files |= {path.resolve() for path in (REPO / "hub_assets").rglob("*.py")}
    return sorted(files)


def unsafe_calls(source: str) -> list[str]:
    """``torch.load`` without ``weights_only=True``, pickle-like imports, ``trust_remote_code=True`` in a call."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            name = ast.unparse(node.func)
            keywords = {k.arg: k.value for k in node.keywords}
            weights_only = keywords.get("weights_only")
            if name.endswith("torch.load") or name == "load" and "weights_only" in keywords:
                if not (isinstance(weights_only, ast.Constant) and weights_only.value is True):
                    found.append(f"line {node.lineno}: {ast.unparse(node)}")
            remote = keywords.get("trust_remote_code")
            if remote is not None and not (isinstance(remote, ast.Constant) and remote.value is False):
                found.append(f"line {node.lineno}: trust_remote_code in {ast.unparse(node)}")
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"line {node.lineno}: import {m}" for m in modules if m.split(".")[0] in UNSAFE_MODULES]
    return found


def test_the_scan_finds_what_it_looks_for():
    bad = (
        "import pickle\nfrom joblib import load\nimport torch\n"
        "torch.load('a')\ntorch.load('a', weights_only=False)\ntorch.load('a', map_location='cpu')\n"
        "AutoModel.from_pretrained('x', trust_remote_code=True)\n"
    )
    assert len(unsafe_calls(bad)) == 6
    assert unsafe_calls("import torch\ntorch.load('a', weights_only=True)\n") == []


@pytest.mark.parametrize("path", package_sources(), ids=lambda p: str(p.relative_to(REPO)))
def test_package_never_unpickles_nor_trusts_remote_code_on_its_own(path):
    assert unsafe_calls(path.read_text()) == []


def test_push_takes_the_token_from_the_standard_places_and_never_prints_it(saved_drafter, monkeypatch, capsys):
    """The CLI has no token flag: ``HfApi(token=None)`` reads HF_TOKEN or the stored login (huggingface_hub's own
    lookup); nothing the command prints contains the token."""
    secret = "hf_NotARealTokenButSecret123"
    monkeypatch.setenv("HF_TOKEN", secret)
    seen = {}

    class FakeApi:
        def __init__(self, token=None):
            seen["token"] = token

        def create_repo(self, *args, **kwargs):
            pass

        def create_commit(self, *args, **kwargs):
            seen["committed"] = True

    monkeypatch.setattr(hub, "HfApi", FakeApi)
    assert cli_main(["push", str(saved_drafter), "me/draft"]) == 0
    output = capsys.readouterr()
    assert seen == {"token": None, "committed": True}
    assert secret not in output.out + output.err
    with pytest.raises(SystemExit):
        cli_main(["push", str(saved_drafter), "me/draft", "--token", secret])


@pytest.fixture
def saved_drafter(tmp_path):
    from conftest import tiny_drafter, tiny_target

    tiny_drafter(tiny_target(), block_size=4).save_pretrained(tmp_path / "draft")
    hub.write_model_card(tmp_path / "draft", target_name="me/target")
    return tmp_path / "draft"
