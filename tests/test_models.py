import json
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from tailreplay_eval.models import BUILD_MARKER, PRESETS, build_model
from tailreplay_eval.reference import load_hf_model

TINY_PRESETS = ["tiny-qwen35", "tiny-qwen3next"]
PATTERN = ["linear_attention"] * 3 + ["full_attention"]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {name: build_model(name, root / name) for name in TINY_PRESETS}


def _config(model_dir):
    return json.loads((model_dir / "config.json").read_text())


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_tiny_presets_stay_under_a_million_parameters(built, preset):
    marker = json.loads((built[preset] / BUILD_MARKER).read_text())
    assert marker["num_parameters"] < 1_000_000
    assert marker["num_parameters"] == sum(t.numel() for t in load_file(built[preset] / "model.safetensors").values())


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_config_declares_the_hybrid_layer_pattern_for_hf_and_sglang(built, preset):
    config = _config(built[preset])
    assert config["full_attention_interval"] == 4
    assert config["layer_types"] == PATTERN * 2
    assert config["num_hidden_layers"] == PRESETS[preset].num_hidden_layers == 8
    # SGLang's Qwen3-Next attention reads the top-level rope_theta; it must agree with HF's rope_parameters.
    assert config["rope_theta"] == config["rope_parameters"]["rope_theta"]
    assert config["dtype"] == "float32"


def test_sglang_config_classes_see_full_attention_at_layers_3_and_7(built):
    from sglang.srt.utils.hf_transformers.config import get_config

    for preset, architecture in [("tiny-qwen35", "Qwen3_5ForCausalLM"), ("tiny-qwen3next", "Qwen3NextForCausalLM")]:
        config = get_config(str(built[preset]), trust_remote_code=False)
        assert config.architectures == [architecture]
        assert config.full_attention_layer_ids == [3, 7]
        assert config.rope_theta == _config(built[preset])["rope_parameters"]["rope_theta"]


def test_tokenizer_round_trips_and_applies_chatml(built):
    tokenizer = AutoTokenizer.from_pretrained(built["tiny-qwen35"])
    assert len(tokenizer) == PRESETS["tiny-qwen35"].vocab_size
    text = "The old sailor  repaired 3 windows, naïvely — didn't he?\n\tYes: 42%."
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.bos_token is None and tokenizer.eos_token == "<|im_end|>"
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt == "<|im_start|>user\nHello<|im_end|>\n<|im_start|>assistant\n"
    generation = json.loads((built["tiny-qwen35"] / "generation_config.json").read_text())
    assert tokenizer.eos_token_id in generation["eos_token_id"]


@torch.no_grad()
def _greedy(model, input_ids, max_new_tokens=8):
    ids = torch.tensor([input_ids])
    # generation_config.json supplies eos (a list: <|im_end|>, <|endoftext|>) and pad.
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(input_ids):].tolist()


@pytest.mark.parametrize("preset", TINY_PRESETS)
def test_hf_loads_and_generates_deterministically(built, preset):
    model = load_hf_model(built[preset])  # float32, torch GDN path on CPU
    tokenizer = AutoTokenizer.from_pretrained(built[preset])
    prompt = tokenizer("The gardener quietly opened the garden fence")["input_ids"]
    first = _greedy(model, prompt)
    assert 0 < len(first) <= 8
    assert _greedy(model, prompt) == first


def test_same_seed_same_weights_other_seed_other_weights(built, tmp_path):
    original = load_file(built["tiny-qwen35"] / "model.safetensors")
    again = load_file(build_model("tiny-qwen35", tmp_path / "again") / "model.safetensors")
    assert all(torch.equal(original[name], again[name]) for name in original)
    reseeded = load_file(build_model("tiny-qwen35", tmp_path / "reseeded", seed=1) / "model.safetensors")
    assert not torch.equal(original["lm_head.weight"], reseeded["lm_head.weight"])


def test_matching_build_is_skipped_unless_forced(tmp_path):
    out = build_model("tiny-qwen35", tmp_path / "m")
    weights = out / "model.safetensors"
    before = weights.stat().st_mtime_ns
    assert build_model("tiny-qwen35", out) == out
    assert weights.stat().st_mtime_ns == before
    build_model("tiny-qwen35", out, force=True)
    assert weights.stat().st_mtime_ns != before
    build_model("tiny-qwen35", out, dtype="bfloat16")  # a different build replaces it
    assert _config(out)["dtype"] == "bfloat16"


def test_refuses_to_overwrite_a_directory_that_is_not_a_build(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_model("tiny-qwen35", out)
    assert (out / "notes.txt").read_text() == "keep me"
    assert [p.name for p in tmp_path.iterdir()] == ["mine"]  # no staging directory left behind


def test_sglang_reads_olmo_hybrid_through_our_config_class(tmp_path):
    """After the plugin's registration SGLang's `get_config` returns our subclass of transformers' config, with the
    layer ids and mamba cache shapes SGLang's hybrid code asks for, and the linear-attention registry finds it."""
    from sglang.srt.configs.linear_attn_model_registry import get_linear_attn_config
    from sglang.srt.utils.hf_transformers.config import get_config

    from tailreplay_sglang import models
    from tailreplay_sglang.models.olmo_hybrid_config import OlmoHybridSGLangConfig

    models.register_config()  # what the plugin's `hooks.ALWAYS` rows run in every SGLang process
    models.register_linear_attention()
    config = get_config(str(build_model("tiny-olmo-hybrid", tmp_path / "olmo")), trust_remote_code=False)
    assert isinstance(config, OlmoHybridSGLangConfig) and config.architectures == ["OlmoHybridForCausalLM"]
    assert config.full_attention_layer_ids == [3, 7] and config.linear_layer_ids == [0, 1, 2, 4, 5, 6]
    assert config.linear_allow_neg_eigval
    spec, _ = get_linear_attn_config(config)
    assert spec.backend_class_name.endswith("OlmoHybridGDNAttnBackend")


def test_olmo_hybrid_checkpoint_names_map_onto_our_parameters():
    """OLMo-core names (as saved) -> ours: renamed norms, merged projections, the three conv parts."""
    from tailreplay_sglang.models.olmo_hybrid import _RENAMES, _stacked_target

    def ours(name):
        for old, new in _RENAMES:
            name = name.replace(old, new)
        return _stacked_target(name) or name

    layer = "model.layers.0."
    assert ours(layer + "attention_layer_norm.weight") == layer + "input_layernorm.weight"
    assert ours(layer + "feedforward_layer_norm.weight") == layer + "post_attention_layernorm.weight"
    assert ours(layer + "post_feedforward_layernorm.weight") == layer + "post_feedforward_layernorm.weight"
    assert ours(layer + "linear_attn.b_proj.weight") == (layer + "linear_attn.ab_proj.weight", 1)
    assert ours(layer + "linear_attn.v_conv1d.weight") == (layer + "linear_attn.conv1d.weight", 2)
    assert ours(layer + "self_attn.k_proj.weight") == (layer + "self_attn.qkv_proj.weight", "k")
    assert ours(layer + "linear_attn.k_proj.weight") == (layer + "linear_attn.qkv_proj.weight", 1)
    assert ours(layer + "linear_attn.g_proj.weight") == layer + "linear_attn.g_proj.weight"
    assert ours(layer + "mlp.up_proj.weight") == (layer + "mlp.gate_up_proj.weight", 1)


@pytest.fixture(scope="module")
def jet(tmp_path_factory):
    return build_model("tiny-jet-nemotron", tmp_path_factory.mktemp("models") / "tiny-jet-nemotron")


def test_sglang_reads_the_jet_nemotron_build_as_nvlabs_config(jet):
    """SGLang's own config class reads the hand-written config.json (JetBlockConfig takes exactly its eight fields),
    with JetBlocks at 0, 1, 3, 4 and the conv / SSM state shapes its pool allots; the build stays tiny."""
    from sglang.srt.configs.jet_nemotron import JetBlockConfig, JetNemotronConfig
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.hf_transformers.config import get_config

    config = get_config(str(jet), trust_remote_code=False)
    assert type(config) is JetNemotronConfig and config.architectures == ["JetNemotronForCausalLM"]
    assert config.linear_layer_ids == [0, 1, 3, 4] and config.full_attention_layer_ids == [2, 5]
    JetBlockConfig(**config.efficient_attention_config["jet"])
    with get_parallel().override(attn_tp_size=1):
        shape = config.mamba2_cache_params.shape
    assert shape.temporal == (4, 32, 16) and shape.conv == [(128 + 2 * 64, 3)]  # [HV, V, K]; JetBlock uses 128
    marker = json.loads((jet / BUILD_MARKER).read_text())
    assert marker["num_parameters"] == sum(t.numel() for t in load_file(jet / "model.safetensors").values())
    assert marker["num_parameters"] < 1_000_000
    assert json.loads((jet / "generation_config.json").read_text())["eos_token_id"] == [2, 0]


def test_jet_nemotron_heads_remember_tens_to_hundreds_of_tokens(jet):
    """Each JetBlock's heads forget over 1 / (exp(A_log) softplus(dt_bias)) tokens, log-spaced over the GDN presets'
    memories, with A itself away from 1 (a reader that drops A_log is wrong)."""
    from tailreplay_eval.models import GDN_MEMORY_TOKENS

    weights = load_file(jet / "model.safetensors")
    for layer in (0, 1, 3, 4):
        a = f"model.layers.{layer}.self_attn."
        memory = 1 / (weights[a + "A_log"].exp() * torch.nn.functional.softplus(weights[a + "dt_bias"]))
        assert torch.allclose(memory, torch.logspace(*(math.log10(t) for t in GDN_MEMORY_TOKENS), 4), rtol=1e-3)
        assert (weights[a + "A_log"].exp() > 1).all()


def test_jet_nemotron_reference_decodes_as_it_scores_and_feels_a_dropped_state(jet, monkeypatch):
    """The reference (`jet_nemotron.load_reference`, strict over the checkpoint): its greedy tokens are the argmax of
    its own whole-sequence logits, and restarting every JetBlock from zero 64 tokens before the end (conv window and
    delta-rule state; attention unchanged) moves those tokens' log-probs by more than 0.05 nats: a replay that drops
    or misplaces a state shows."""
    from tailreplay_eval import jet_nemotron
    from tailreplay_eval.reference import greedy_generate, load_reference, prompt_logprobs

    model = load_reference(jet)
    ids = torch.randint(3, 512, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    tokens = greedy_generate(model, ids[:40], 6)
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:40] + tokens])).logits[0, 39:-1]
    assert logits.argmax(-1).tolist() == tokens
    whole = prompt_logprobs(model, ids)
    forward, cut = jet_nemotron.TorchJetBlock.forward, 236

    def restarted(self, hidden_states, **unused):
        head, _ = forward(self, hidden_states[:, :cut])
        tail, _ = forward(self, hidden_states[:, cut:])
        return torch.cat([head, tail], dim=1), None

    monkeypatch.setattr(jet_nemotron.TorchJetBlock, "forward", restarted)
    dropped = prompt_logprobs(model, ids)
    assert whole[:cut - 1] == pytest.approx(dropped[:cut - 1], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(whole[cut - 1:], dropped[cut - 1:])) > 0.05
