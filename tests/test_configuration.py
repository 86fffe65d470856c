"""DFlashConfig: the layer-id formula, both block_size placements, validation of its own fields."""

import pytest
from conftest import tiny_target

from dflash_hf import DFlashConfig, build_target_layer_ids


@pytest.mark.parametrize(
    ("num_target_layers", "num_draft_layers", "expected"),
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (32, 4, [1, 10, 20, 29]),  # the code's answer; one seed article's prose claims [2, 12, 22, 30]
        (32, 5, [1, 8, 15, 22, 29]),
        (30, 5, [1, 8, 14, 20, 27]),  # round-half-even: 7.5 -> 8, 20.5 -> 20
        (30, 1, [15]),
    ],
)
def test_build_target_layer_ids_matches_reference(num_target_layers, num_draft_layers, expected):
    assert build_target_layer_ids(num_target_layers, num_draft_layers) == expected


def test_ids_default_from_num_target_layers():
    config = DFlashConfig(hidden_size=64, num_hidden_layers=5, vocab_size=100, num_target_layers=36)
    assert config.target_layer_ids == [1, 9, 17, 25, 33]
    assert config.dflash_config["target_layer_ids"] == [1, 9, 17, 25, 33]


def test_from_target_config_copies_shapes_and_rope():
    target = tiny_target("llama", rope_theta=12345.0)
    config = DFlashConfig.from_target_config(target.config, mask_token_id=3, num_hidden_layers=2, block_size=8)
    assert (config.hidden_size, config.vocab_size, config.head_dim) == (64, 96, 16)
    assert config.rope_parameters["rope_theta"] == 12345.0
    assert config.num_target_layers == 6 and config.block_size == 8 and config.mask_token_id == 3
    assert config.to_dict()["rope_theta"] == 12345.0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(mask_token_id=500), "outside the vocabulary"),
        (dict(target_layer_ids=[1, 40], num_target_layers=36), "reach past"),
        (dict(block_size=0), "block_size"),
    ],
)
def test_invalid_fields_raise_with_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DFlashConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, **kwargs)


def test_sliding_window_survives_for_sliding_layers():
    config = DFlashConfig.from_dict(
        {
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "vocab_size": 100,
            "layer_types": ["sliding_attention", "full_attention"],
            "sliding_window": 32,
            "use_sliding_window": False,
            "dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 2]},
        }
    )
    assert config.sliding_window == 32


def test_draft_vocab_round_trips_inside_dflash_config_on_one_line(tmp_path):
    """``draft_vocab`` is read from ``dflash_config``, written back there (one JSON line, not one line per id) and
    absent from configs that have none, so published layouts save unchanged."""
    import json

    config = DFlashConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, mask_token_id=3,
                          dflash_config={"draft_vocab": [2, 5, 7, 50]})
    assert config.draft_vocab == [2, 5, 7, 50]
    config.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert '"draft_vocab": [2, 5, 7, 50]' in text
    saved = json.loads(text)
    assert saved["dflash_config"]["draft_vocab"] == [2, 5, 7, 50] and "draft_vocab" not in saved
    assert DFlashConfig.from_pretrained(tmp_path).draft_vocab == [2, 5, 7, 50]
    config.draft_vocab = None
    assert "draft_vocab" not in config.to_dict()["dflash_config"]
    plain = DFlashConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, mask_token_id=3)
    assert "draft_vocab" not in plain.to_dict()["dflash_config"] and "draft_vocab" not in plain.to_json_string()


@pytest.mark.parametrize("ids", [[], [5, 2], [2, 2, 5], [-1, 4], [4, 100]])
def test_invalid_draft_vocab_raises_with_the_fix(ids):
    with pytest.raises(ValueError, match="draft_vocab must be a non-empty sorted list"):
        DFlashConfig(hidden_size=64, num_hidden_layers=2, vocab_size=100, dflash_config={"draft_vocab": ids})
