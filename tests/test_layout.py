from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout


def layout(pattern: str) -> HybridLayout:
    return HybridLayout(tuple(LINEAR if c == "G" else FULL for c in pattern), hidden_size=8)


def test_qwen35_pattern_groups():
    lay = layout("GGGA" * 3)
    assert [g.gdn_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6), (8, 9, 10)]
    assert [g.index for g in lay.stored_groups] == [1, 2]
    assert lay.bytes_per_token(2) == 2 * 8 * 2


def test_leading_full_attention_layer_makes_every_group_stored():
    lay = layout("AGGAGG")
    assert [g.gdn_layers for g in lay.groups] == [(1, 2), (4, 5)]
    assert len(lay.stored_groups) == 2


def test_adjacent_full_attention_layers_and_trailing_gdn():
    lay = layout("GAAGG")
    assert [g.gdn_layers for g in lay.groups] == [(0,), (3, 4)]
    assert [g.first_layer for g in lay.stored_groups] == [3]


def test_from_built_checkpoint(tmp_path):
    from tailreplay_eval.models import build_model

    lay = HybridLayout.from_model_path(str(build_model("tiny-qwen35", tmp_path / "m")))
    assert [g.gdn_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6)]
    assert lay.hidden_size == 64


def test_plain_transformer_is_refused():
    import pytest

    with pytest.raises(ValueError, match="linear-attention"):
        layout("AAAA").require_hybrid("some/llama")
