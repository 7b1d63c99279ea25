import torch

from tailreplay_sglang.layout import FULL, LINEAR, HybridLayout
from tailreplay_sglang.store.hidden_store import TOKEN_ID_BYTES, bytes_per_token


def layout(pattern: str) -> HybridLayout:
    return HybridLayout(tuple(LINEAR if c == "G" else FULL for c in pattern), hidden_size=8)


def test_qwen35_pattern_groups():
    lay = layout("GGGA" * 3)
    assert [g.recurrent_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6), (8, 9, 10)]
    assert [g.index for g in lay.stored_groups] == [1, 2]
    assert bytes_per_token(lay, torch.bfloat16) == 2 * 8 * 2 + TOKEN_ID_BYTES


def test_leading_full_attention_layer_makes_every_group_stored():
    lay = layout("AGGAGG")
    assert [g.recurrent_layers for g in lay.groups] == [(1, 2), (4, 5)]
    assert len(lay.stored_groups) == 2


def test_adjacent_full_attention_layers_and_trailing_gdn():
    lay = layout("GAAGG")
    assert [g.recurrent_layers for g in lay.groups] == [(0,), (3, 4)]
    assert [g.first_layer for g in lay.stored_groups] == [3]


def test_from_built_checkpoint(tmp_path):
    from tailreplay_eval.models import build_model

    lay = HybridLayout.from_model_path(str(build_model("tiny-qwen35", tmp_path / "m")))
    assert [g.recurrent_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6)]
    assert lay.hidden_size == 64


def test_plain_transformer_is_refused():
    import pytest

    with pytest.raises(ValueError, match="linear-attention"):
        layout("AAAA").require_hybrid("some/llama")


def test_a_vision_language_checkpoint_stores_group_zeros_input_too(tiny_qwen35_vl, tiny_qwen35):
    """The first layer's input is the vision tower's features on image tokens, not an embedding of their ids: it is
    stored like every later group's input (one hidden per token more), from config.json or a loaded config."""
    from transformers import AutoConfig

    for lay in (HybridLayout.from_model_path(str(tiny_qwen35_vl)),
                HybridLayout.from_hf_config(AutoConfig.from_pretrained(tiny_qwen35_vl))):
        assert lay.stores_embeddings
        assert [g.index for g in lay.stored_groups] == [0, 1]
        assert bytes_per_token(lay, torch.float32) == 2 * 64 * 4 + TOKEN_ID_BYTES
    assert not HybridLayout.from_model_path(str(tiny_qwen35)).stores_embeddings


def test_deepstack_visual_features_are_refused(tiny_qwen35_vl, tmp_path):
    """Qwen3-VL-style deepstack adds visual features inside group 0, which the replay does not: refused at start-up
    with what is supported."""
    import json
    import shutil

    import pytest

    path = tmp_path / "deepstack"
    shutil.copytree(tiny_qwen35_vl, path)
    config = json.loads((path / "config.json").read_text())
    config["vision_config"]["deepstack_visual_indexes"] = [0, 1]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"deepstack_visual_indexes=\[0, 1\]\). Supported: Qwen3.5"):
        HybridLayout.from_model_path(str(path))


def test_nemotron_h_pattern_groups_cut_after_their_last_mamba2_layer(tiny_nemotron_h):
    """M-M*-MEM*M- : group 0 replays the MLP between its Mamba2 layers, group 1 starts with an MLP stage and replays
    the MoE stage between its Mamba2 layers, and stages after a group's last Mamba2 layer are not replayed."""
    from tailreplay_sglang.layout import MAMBA2, MOE

    lay = HybridLayout.from_model_path(str(tiny_nemotron_h))
    assert lay.mixer == MAMBA2 and lay.layer_types[6] == MOE
    assert [(g.layers, g.recurrent_layers) for g in lay.groups] == [((0, 1, 2), (0, 2)), ((4, 5, 6, 7), (5, 7)),
                                                                    ((9,), (9,))]
    assert [g.first_layer for g in lay.stored_groups] == [4, 9]
    assert lay.require_hybrid(str(tiny_nemotron_h)) is lay  # MoE stages are replayed, not refused


def test_off_grid_anchor_intervals_are_refused_on_mamba2_models(tiny_nemotron_h):
    """A Mamba2 model's interval anchors come from its scan's chunk grid, so an interval that is not a multiple of
    its chunk is refused, naming the flag and the chunk."""
    import dataclasses

    import pytest

    from tailreplay_sglang import plugin
    from tailreplay_sglang.config import TailReplayConfig, TailReplayConfigError

    lay = HybridLayout.from_model_path(str(tiny_nemotron_h))
    assert lay.chunk_size == 64  # the preset's mamba_chunk_size
    cfg = TailReplayConfig(enabled=True, anchor_interval=128)
    assert plugin._for_mixer(cfg, lay) == cfg
    with pytest.raises(TailReplayConfigError, match="--tail-replay-anchor-interval 128: .* chunks of 256 tokens"):
        plugin._for_mixer(cfg, dataclasses.replace(lay, chunk_size=256))


def test_falcon_h1_is_refused_with_the_reason(tiny_falcon_h1):
    """Falcon-H1: every layer is attention beside Mamba2, so every layer's input would be stored; the refusal gives
    the store-to-KV ratio from the checkpoint's config."""

    import pytest
    from transformers import AutoConfig

    for make in (lambda: HybridLayout.from_model_path(str(tiny_falcon_h1)),
                 lambda: HybridLayout.from_hf_config(AutoConfig.from_pretrained(tiny_falcon_h1))):
        with pytest.raises(ValueError, match=r"Falcon-H1: .* keep 64 values per layer per token beside the KV "
                                             r"cache's 64 \(1.0x the KV cache"):
            make()


def test_kimi_linear_groups_from_its_linear_attn_config(tiny_kimi_linear):
    """Moonshot's 1-indexed kda_layers [1, 2, 3, 5, 6, 7] (full_attn_layers [4, 8]): two KDA groups, the second fed
    by the stored output of MLA layer 3; read the same from config.json and from transformers' config."""
    from transformers import AutoConfig

    from tailreplay_sglang.layout import KDA

    for lay in (HybridLayout.from_model_path(str(tiny_kimi_linear)),
                HybridLayout.from_hf_config(AutoConfig.from_pretrained(tiny_kimi_linear))):
        assert lay.mixer == KDA
        assert [g.recurrent_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6)]
        assert [g.first_layer for g in lay.stored_groups] == [4]


def test_ling_groups_from_its_layer_group_size(tmp_path):
    """Bailing's layer_group_size: an MLA layer at every 4th layer (tiny-ling-3.0's config, as its builder writes
    it), or a per-layer list whose 1s mark the KDA layers; a Bailing config without short_conv_kernel_size (a
    lightning-attention one, Ling-2.5's mixer) is refused with the reason."""
    import json

    import pytest

    from tailreplay_eval.ling import ling_config
    from tailreplay_sglang.layout import KDA

    kimi = {"num_hidden_layers": 8, "dtype": "float32", "vocab_size": 512, "hidden_size": 64,
            "intermediate_size": 128, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "num_experts": 4, "num_experts_per_token": 2, "moe_intermediate_size": 32,
            "num_shared_experts": 1, "first_k_dense_replace": 1, "moe_renormalize": True, "num_expert_group": 1,
            "topk_group": 1, "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "max_position_embeddings": 4096,
            "eos_token_id": 2, "pad_token_id": 0,
            "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7], "full_attn_layers": [4, 8], "head_dim": 16,
                                   "num_heads": 4, "short_conv_kernel_size": 4}}
    config = ling_config(kimi, rope_theta=10_000.0)

    def read(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        return HybridLayout.from_model_path(str(tmp_path))

    for lay in (read(), read(layer_group_size=[1, 1, 1, 0, 1, 1, 1, 0])):
        assert lay.mixer == KDA
        assert [g.recurrent_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6)]
        assert [g.first_layer for g in lay.stored_groups] == [4]
    with pytest.raises(ValueError, match="short_conv_kernel_size.*lightning"):
        read(short_conv_kernel_size=None)


def test_ling25_groups_and_what_is_refused(tmp_path):
    """Ling-2.5 (tiny-ling-2.5's config, as its builder writes it): lightning groups between the MLA layers; refused
    with the reason: the `minimax` linear backend, and a short conv (KDA states for lightning layers)."""
    import json

    import pytest

    from tailreplay_eval.ling25 import ling25_config
    from tailreplay_eval.models import PRESETS, moonshot_config_fields, preset_tokenizer
    from tailreplay_sglang.layout import LIGHTNING

    preset = PRESETS["tiny-ling-2.5"]
    kimi = dict(moonshot_config_fields(preset, preset_tokenizer(preset)), dtype="float32")
    config = ling25_config(kimi, rope_theta=10_000.0)

    def read(**changes):
        (tmp_path / "config.json").write_text(json.dumps({**config, **changes}))
        return HybridLayout.from_model_path(str(tmp_path))

    lay = read()
    assert lay.mixer == LIGHTNING
    assert [g.recurrent_layers for g in lay.groups] == [(0, 1, 2), (4, 5, 6)]
    assert [g.first_layer for g in lay.stored_groups] == [4]
    with pytest.raises(ValueError, match="linear_backend seg_la.*'minimax'"):
        read(linear_backend="minimax")
    with pytest.raises(ValueError, match="short_conv_kernel_size.*KDA"):
        read(short_conv_kernel_size=4)


def test_lfm2_groups_and_its_state_window(tmp_path):
    """LFM2 (tiny-lfm2's config, as transformers writes it: layer_types conv / full_attention, conv_L_cache 3): conv
    groups between the attention layers, and a state window of (3 - 1) x 3 = 6 tokens (the largest group), which
    the launcher turns into every hit's zero-init replay, exact, with no anchors kept."""
    import json

    from tailreplay_eval.models import PRESETS, lfm2_config, preset_tokenizer
    from tailreplay_sglang.config import TailReplayConfig
    from tailreplay_sglang.families import family_for
    from tailreplay_sglang.layout import SHORT_CONV
    from tailreplay_sglang.plugin import _for_mixer

    preset = PRESETS["tiny-lfm2"]
    config = lfm2_config(preset, preset_tokenizer(preset)).to_dict()
    config["architectures"] = ["Lfm2ForCausalLM"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    lay = HybridLayout.from_model_path(str(tmp_path))
    assert lay.mixer == SHORT_CONV and lay.conv_kernel == 3
    assert [g.recurrent_layers for g in lay.groups] == [(0, 1), (3, 4, 5), (7,)]
    assert [g.first_layer for g in lay.stored_groups] == [3, 7]
    assert family_for(lay).state_window(lay) == 6
    cfg = _for_mixer(TailReplayConfig(enabled=True), lay)
    assert (cfg.state_window, cfg.exact_budget, cfg.anchored) == (6, 0, False)
    assert [cfg.tail_len(m) for m in (0, 1, 6, 7, 5000)] == [0, 1, 6, 6, 6]
    assert all(cfg.is_exact_fallback(m) for m in (0, 1, 6, 7, 5000))


def test_nemotron_h_omni_groups_and_its_audio_refusal(tmp_path):
    """Nemotron-H Omni's text config is `llm_config` and SGLang's config class keeps its vision config raw: read from
    config.json and from SGLang's config class alike, tiny-nemotron-h's three Mamba2 groups with group 0's input stored
    (image rows). A checkpoint with an audio tower is refused at start-up, audio rows being untested."""
    import json
    import shutil

    import pytest
    from sglang.srt.configs.nano_nemotron_vl import NemotronH_Omni_Reasoning_V3_Config

    from helpers import MODELS_DIR
    from tailreplay_eval.models import build_model
    from tailreplay_sglang.layout import MAMBA2

    path = build_model("tiny-nemotron-h-omni", MODELS_DIR / "tiny-nemotron-h-omni")
    config = json.loads((path / "config.json").read_text())
    for lay in (HybridLayout.from_model_path(str(path)),
                HybridLayout.from_hf_config(NemotronH_Omni_Reasoning_V3_Config(**config))):
        assert lay.mixer == MAMBA2 and lay.stores_embeddings and lay.hidden_size == 64
        assert [g.recurrent_layers for g in lay.groups] == [(0, 2), (5, 7), (9,)] and lay.chunk_size == 64
    audio = tmp_path / "omni-audio"
    audio.mkdir()
    shutil.copy(path / "config.json", audio / "config.json")
    (audio / "config.json").write_text(json.dumps(dict(config, sound_config={"hidden_size": 32})))
    with pytest.raises(ValueError, match="audio tower"):
        HybridLayout.from_model_path(str(audio))


def test_jet_nemotron_groups_from_its_layer_types_and_its_swa_refusal(tmp_path):
    """Jet-Nemotron as NVlabs writes it: `layer_types` of jet (JetBlock) and attn, so jet jet attn jet jet attn is two
    groups, the second fed by attention layer 2's output. Sliding-window layers (`swa`, as Jet-Nemotron-2B has) are
    refused at start-up."""
    import json

    import pytest

    from tailreplay_sglang.layout import JET

    config = {"architectures": ["JetNemotronForCausalLM"], "hidden_size": 64, "num_hidden_layers": 6,
              "layer_types": ["jet", "jet", "attn", "jet", "jet", "attn"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    lay = HybridLayout.from_model_path(str(tmp_path))
    assert lay.mixer == JET and [g.recurrent_layers for g in lay.groups] == [(0, 1), (3, 4)]
    assert [g.first_layer for g in lay.stored_groups] == [3]
    (tmp_path / "config.json").write_text(json.dumps(dict(config, layer_types=["jet", "swa", "attn"] * 2)))
    with pytest.raises(ValueError, match="sliding-window"):
        HybridLayout.from_model_path(str(tmp_path))


def test_kimi_k3_groups_and_its_banking_layers(tmp_path):
    """Kimi K3's language model as Moonshot writes Kimi Linear (`linear_attn_config`) plus attn_res_block_size:
    groups as Kimi Linear's. Its replay takes the rows banked below a group from earlier groups' replays, so a
    banking layer (every attn_res_block_size-th) that is MLA is refused, as are the latent MoE and the full-rank KDA
    gate (not tested), and a K3 config without attention residuals."""
    import json

    import pytest

    from tailreplay_sglang.layout import KDA_ATTN_RES

    config = {"architectures": ["KimiK3LinearForCausalLM"], "hidden_size": 64, "num_hidden_layers": 12,
              "attn_res_block_size": 8, "linear_attn_config": {"kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11],
                                                               "full_attn_layers": [4, 8, 12]}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    lay = HybridLayout.from_model_path(str(tmp_path))
    assert lay.mixer == KDA_ATTN_RES and [g.first_layer for g in lay.stored_groups] == [4, 8]
    refused = {"MLA": dict(config, attn_res_block_size=3), "latent MoE": dict(config, routed_expert_hidden_size=32),
               "no attn_res_block_size": dict(config, attn_res_block_size=None),
               "use_full_rank_gate": dict(config, linear_attn_config=dict(config["linear_attn_config"],
                                                                          use_full_rank_gate=True))}
    for match, bad in refused.items():
        (tmp_path / "config.json").write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=match):
            HybridLayout.from_model_path(str(tmp_path))
    # The vision checkpoint (KimiK3ForConditionalGeneration): the same groups from its text_config, group 0 stored
    # too (its input carries the tower's rows), and the same refusals.
    vision = {"architectures": ["KimiK3ForConditionalGeneration"], "vision_config": {}}
    (tmp_path / "config.json").write_text(json.dumps(dict(vision, text_config=config)))
    lay = HybridLayout.from_model_path(str(tmp_path))
    assert lay.mixer == KDA_ATTN_RES and lay.stores_embeddings
    assert [g.first_layer for g in lay.stored_groups] == [0, 4, 8]
    (tmp_path / "config.json").write_text(json.dumps(dict(vision, text_config=refused["MLA"])))
    with pytest.raises(ValueError, match="MLA"):
        HybridLayout.from_model_path(str(tmp_path))
