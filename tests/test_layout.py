"""One source for the remote code: the repository root's model files are what the package imports, what a built wheel
installs, and what every saved checkpoint carries, always as real files."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import tiny_drafter, tiny_target

import dflash_hf
from dflash_hf.assets import default_draft_path
from dflash_hf.hub import REMOTE_CODE_FILES

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(dflash_hf.__file__).parent


@pytest.mark.parametrize("name", REMOTE_CODE_FILES)
def test_package_imports_the_root_files(name):
    assert (REPO_ROOT / name).is_file() and not (REPO_ROOT / name).is_symlink()
    assert (PACKAGE / name).resolve() == (REPO_ROOT / name).resolve(), f"dflash_hf/{name} must link to ../{name}"


def test_shipped_drafter_folder_holds_config_weights_and_card_only():
    folder = default_draft_path()
    assert folder is not None, "the SmolLM2 drafter ships with the package"
    assert sorted(p.name for p in folder.iterdir()) == ["README.md", "config.json", "model.safetensors"]


def test_saved_checkpoint_carries_real_copies_of_the_root_files(tmp_path):
    tiny_drafter(tiny_target()).save_pretrained(tmp_path)
    for name in REMOTE_CODE_FILES:
        assert not (tmp_path / name).is_symlink()
        assert (tmp_path / name).read_bytes() == (REPO_ROOT / name).read_bytes()


def test_built_wheel_holds_real_copies_of_the_root_files(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(tmp_path), str(REPO_ROOT)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("dflash_hf-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        for name in REMOTE_CODE_FILES:
            info = archive.getinfo(f"dflash_hf/{name}")
            assert (info.external_attr >> 16) & 0o170000 == 0o100000, f"{name} is not a regular file in the wheel"
            assert archive.read(info) == (REPO_ROOT / name).read_bytes()
        assert not [n for n in archive.namelist() if n.startswith("dflash_hf/drafters/") and n.endswith(".py")]
