"""Jet-Nemotron (`JetNemotronForCausalLM`, model_type `jet_nemotron`): tiny checkpoints, and their torch reference.

Jet-Nemotron is Qwen2.5 (q/k/v biases, NeoX RoPE, SwiGLU MLPs) with most attention layers replaced by JetBlocks: a
gated delta rule whose values pass through a dynamic short conv (kernels generated per token from the layer's input).
SGLang 0.5.23 serves it (`models/jet_nemotron.py`); transformers 5.19 has no jet_nemotron and NVlabs' remote code
needs fla's and its own Triton kernels, so neither of the usual routes applies:
- the build draws the weights itself, under the names NVlabs ships (q/k/v/a/b/g_proj, which SGLang stacks into
  `qkvabz_proj`), and writes config.json in the format of NVlabs' `jetlm_2B.json`, which SGLang's
  `JetNemotronConfig` reads: `layer_types` of "jet" / "attn", `efficient_attention_config["jet"]` with exactly the
  eight `JetBlockConfig` fields (a dataclass without defaults: a missing or extra key fails the load);
- the reference (`load_reference`) is transformers' Qwen2ForCausalLM, which is exactly Jet's non-Jet part under the
  same weight names, with each jet layer's `self_attn` a `TorchJetBlock` written from NVlabs' naive paths.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM
from transformers.modeling_outputs import CausalLMOutputWithPast

# `preset` below: a `tailreplay_eval.models.Preset` with a `jet` (not imported: models imports this module)

ARCHITECTURE = "JetNemotronForCausalLM"
LAYER_TYPES = {"J": "jet", "*": "attn"}  # the preset's pattern letters; NVlabs' "swa" layers are not built
NORM_SPREAD = 0.1  # norm weights drawn around 1, so that a norm applied in another's place shows
GATE_INPUT_STD = 0.5  # a_proj's gain: the input term modulates each head's decay by about exp(+-1)
CONV_BIAS_STD = 0.3  # the dynamic conv's static kernel part (w2's bias), beside its generated part (~0.2)


def jet_block_config(preset) -> dict:
    """`efficient_attention_config["jet"]`: every JetBlockConfig field, as NVlabs writes them."""
    jet = preset.jet
    return {
        "mode": "chunk",  # read by NVlabs' HF code only; SGLang always runs the fused recurrent kernel
        "expand_v": jet.expand_v,
        "num_heads": jet.num_heads,
        "head_dim": jet.head_dim,
        "norm_eps": "1e-5",  # a string in NVlabs' config; SGLang applies float()
        "conv_size": jet.conv_size,
        "dconv_generator_reduction": jet.generator_reduction,
        "dconv_implementation": "triton",  # read by NVlabs' HF code only
    }


def jet_config(preset, eos_token_id: int, pad_token_id: int, dtype: str) -> dict:
    """config.json for `preset`. No `head_dim`: SGLang's attention uses hidden / heads, so the preset must agree."""
    if preset.head_dim * preset.num_attention_heads != preset.hidden_size:
        raise ValueError("Jet-Nemotron derives the attention head_dim as hidden_size / num_attention_heads")
    if len(preset.jet.pattern) != preset.num_hidden_layers:
        raise ValueError(f"pattern {preset.jet.pattern!r} has {len(preset.jet.pattern)} layers, not "
                         f"{preset.num_hidden_layers}")
    return {
        "architectures": [ARCHITECTURE], "model_type": "jet_nemotron", "dtype": dtype,
        "layer_types": [LAYER_TYPES[c] for c in preset.jet.pattern],
        "efficient_attention_config": {"jet": jet_block_config(preset)},
        "hidden_act": "silu", "hidden_size": preset.hidden_size, "intermediate_size": preset.intermediate_size,
        "num_hidden_layers": preset.num_hidden_layers, "num_attention_heads": preset.num_attention_heads,
        "num_key_value_heads": preset.num_key_value_heads, "rms_norm_eps": 1e-6, "attention_dropout": 0.0,
        "rope_theta": preset.rope_theta, "rope_scaling": None, "initializer_range": 0.02,
        "max_position_embeddings": preset.max_position_embeddings, "vocab_size": preset.vocab_size,
        "tie_word_embeddings": False, "use_cache": True, "bos_token_id": None, "eos_token_id": eos_token_id,
        "pad_token_id": pad_token_id,
    }


def jet_weights(preset, seed: int, memory_tokens: tuple[float, float]) -> dict[str, torch.Tensor]:
    """Every parameter SGLang's model owns, in float32, drawn from `seed`: projections of unit gain (std
    fan_in^-1/2; outputs half that), norm weights around 1, the lm head untied. Each JetBlock's decays as NVlabs
    parametrises them (A_log, dt_bias) with A in NVlabs' range U(1, 16), and dt = 1 / (A tau) so that head h forgets
    over tau_h tokens, log-spaced over `memory_tokens` (the GDN presets' memories, `models._init_gdn_gates`): with
    NVlabs' random dt most heads forget within a few tokens, and a dropped state would hardly show. The dynamic conv
    gets a static bias (CONV_BIAS_STD) so that its 3-row window carries signal."""
    generator = torch.Generator().manual_seed(seed)

    def normal(*shape, std, mean=0.0):
        return torch.randn(*shape, generator=generator) * std + mean

    def unit(rows, cols, gain=1.0):
        return normal(rows, cols, std=gain * cols ** -0.5)

    hidden, inner, jet = preset.hidden_size, preset.intermediate_size, preset.jet
    heads, key_dim = jet.num_heads, jet.head_dim
    total_k, total_v = heads * key_dim, heads * int(key_dim * jet.expand_v)
    attention, kv = preset.num_attention_heads * preset.head_dim, preset.num_key_value_heads * preset.head_dim
    low, high = (math.log10(tokens) for tokens in memory_tokens)
    w = {"model.embed_tokens.weight": normal(preset.vocab_size, hidden, std=1.0),
         "model.norm.weight": normal(hidden, std=NORM_SPREAD, mean=1.0),
         "lm_head.weight": unit(preset.vocab_size, hidden)}
    for i, kind in enumerate(jet.pattern):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = normal(hidden, std=NORM_SPREAD, mean=1.0)
        w[p + "post_attention_layernorm.weight"] = normal(hidden, std=NORM_SPREAD, mean=1.0)
        w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"] = unit(inner, hidden), unit(inner, hidden)
        w[p + "mlp.down_proj.weight"] = unit(hidden, inner, 0.5)
        a = p + "self_attn."
        if LAYER_TYPES[kind] == "attn":
            for name, rows in (("q_proj", attention), ("k_proj", kv), ("v_proj", kv)):
                w[a + name + ".weight"], w[a + name + ".bias"] = unit(rows, hidden), normal(rows, std=0.1)
            w[a + "o_proj.weight"] = unit(hidden, attention, 0.5)
            continue
        for name, rows in (("q_proj", total_k), ("k_proj", total_k), ("v_proj", total_v), ("b_proj", heads),
                           ("g_proj", total_v)):
            w[a + name + ".weight"] = unit(rows, hidden)
        w[a + "a_proj.weight"] = unit(heads, hidden, GATE_INPUT_STD)
        w[a + "o_proj.weight"] = unit(hidden, total_v, 0.5)
        A = 1 + 15 * torch.rand(heads, generator=generator)
        dt = 1 / (A * torch.logspace(low, high, heads))
        w[a + "A_log"], w[a + "dt_bias"] = A.log(), dt + torch.log(-torch.expm1(-dt))  # inverse softplus
        c = a + "dynamic_conv1d.kernel_generator."
        w[c + "w1.weight"] = unit(total_v // jet.generator_reduction, hidden)
        w[c + "w2.weight"] = normal(total_v * jet.conv_size, total_v // jet.generator_reduction, std=0.1)
        w[c + "w2.bias"] = normal(total_v * jet.conv_size, std=CONV_BIAS_STD)
        w[a + "o_norm.weight"] = normal(total_v // heads, std=NORM_SPREAD, mean=1.0)
    return w


def write_checkpoint(out: Path, preset, eos_token_id: int, pad_token_id: int, seed: int, dtype: str,
                     memory_tokens: tuple[float, float]) -> int:
    """config.json and model.safetensors of `preset` in `out` (the tokenizer is the build's); returns the number of
    parameters. A_log stays float32 whatever `dtype`, as SGLang's parameter is."""
    weights = {name: t if name.endswith("A_log") else t.to(getattr(torch, dtype))
               for name, t in jet_weights(preset, seed, memory_tokens).items()}
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    config = jet_config(preset, eos_token_id, pad_token_id, dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return sum(t.numel() for t in weights.values())


# --- reference ----------------------------------------------------------------------------------------------------


def _delta_rule():
    """transformers' own torch gated delta rule (token by token, l2-normed q and k as fla's), not fla's kernel."""
    from transformers.models.qwen3_5 import modeling_qwen3_5

    rule = modeling_qwen3_5.torch_recurrent_gated_delta_rule
    while hasattr(rule, "__wrapped__"):
        rule = rule.__wrapped__
    return rule


class TorchJetBlock(nn.Module):
    """NVlabs' JetBlock forward (jet_block.py, dynamic_conv.py's naive path), one sequence from a zero state:
    q, k = silu(proj); v = silu(sum over the window of v_proj(x) times kernels w2(silu(w1(x))) + b2, "(d w)" layout);
    g = -exp(A_log) softplus(a + dt_bias); beta = sigmoid(b); the gated delta rule with l2-normed q and k; a per-head
    RMSNorm times silu(g_proj(x)); o_proj. Keeps the state after the last token in SGLang's pool layout
    (`last_state`: conv [total_v, conv_size - 1] raw v rows, temporal [heads, head_v, head_k])."""

    def __init__(self, hidden: int, jet: dict):
        super().__init__()
        self.heads, self.key_dim = jet["num_heads"], jet["head_dim"]
        self.value_dim = int(self.key_dim * jet["expand_v"])
        self.width, self.eps = jet["conv_size"], float(jet["norm_eps"])
        total_k, total_v = self.heads * self.key_dim, self.heads * self.value_dim
        for name, rows in (("q_proj", total_k), ("k_proj", total_k), ("v_proj", total_v), ("a_proj", self.heads),
                           ("b_proj", self.heads), ("g_proj", total_v)):
            setattr(self, name, nn.Linear(hidden, rows, bias=False))
        self.o_proj = nn.Linear(total_v, hidden, bias=False)
        self.A_log, self.dt_bias = nn.Parameter(torch.zeros(self.heads)), nn.Parameter(torch.zeros(self.heads))
        generator_hidden = total_v // jet["dconv_generator_reduction"]
        self.dynamic_conv1d = nn.Module()
        self.dynamic_conv1d.kernel_generator = nn.Sequential()
        self.dynamic_conv1d.kernel_generator.add_module("w1", nn.Linear(hidden, generator_hidden, bias=False))
        self.dynamic_conv1d.kernel_generator.add_module("act", nn.SiLU())
        self.dynamic_conv1d.kernel_generator.add_module("w2", nn.Linear(generator_hidden, total_v * self.width))
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.ones(self.value_dim))
        self.last_state: dict[str, torch.Tensor] | None = None

    def forward(self, hidden_states, **unused):
        x = hidden_states  # [1, T, hidden]: the layer's normed input
        batch, length, _ = x.shape
        q, k, v_raw = F.silu(self.q_proj(x)), F.silu(self.k_proj(x)), self.v_proj(x)
        kernels = self.dynamic_conv1d.kernel_generator(x).view(batch, length, -1, self.width)  # [B, T, D, W]
        windows = F.pad(v_raw.transpose(1, 2), (self.width - 1, 0)).unfold(2, self.width, 1).transpose(1, 2)
        v = F.silu((windows * kernels).sum(-1))
        g = -self.A_log.float().exp() * F.softplus(self.a_proj(x).float() + self.dt_bias)
        o, state = _delta_rule()(q.view(batch, length, self.heads, self.key_dim),
                                 k.view(batch, length, self.heads, self.key_dim),
                                 v.view(batch, length, self.heads, self.value_dim), g, self.b_proj(x).sigmoid(),
                                 output_final_state=True, use_qk_l2norm_in_kernel=True)
        self.last_state = {"temporal": state[0].transpose(-1, -2).float(),  # [HV, K, V] -> SGLang's [HV, V, K]
                           "conv": F.pad(v_raw[0].T, (self.width - 1, 0))[:, -(self.width - 1):].float()}
        o = o.float()
        normed = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps) * self.o_norm.weight
        gate = F.silu(self.g_proj(x).view(batch, length, self.heads, self.value_dim).float())
        return self.o_proj((normed * gate).to(x.dtype).reshape(batch, length, -1)), None


class JetNemotronReference(Qwen2ForCausalLM):
    """Qwen2ForCausalLM with TorchJetBlocks in the jet layers. Each call runs the whole sequence from the start: the
    "cache" it hands back (`past_key_values`) is the token ids so far, so `reference.greedy_generate` recomputes the
    prefix at every step (cheap at the tiny sizes) and no incremental state of the reference can be wrong."""

    def __init__(self, config: Qwen2Config, layer_types: list[str], jet: dict):
        super().__init__(config)
        for layer, kind in zip(self.model.layers, layer_types, strict=True):
            if kind == "jet":
                layer.self_attn = TorchJetBlock(config.hidden_size, jet)

    def forward(self, input_ids, past_key_values=None, use_cache=False):
        ids = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], dim=1)
        logits = super().forward(input_ids=ids, use_cache=False).logits[:, -input_ids.shape[1]:]
        return CausalLMOutputWithPast(logits=logits, past_key_values=ids if use_cache else None)


@torch.no_grad()
def load_reference(checkpoint: Path, dtype=torch.float32) -> JetNemotronReference:
    """A Jet-Nemotron checkpoint as `JetNemotronReference`, in eval mode. Every checkpoint weight is loaded and
    every parameter comes from the checkpoint (strict, apart from the rotary buffers)."""
    c = json.loads((Path(checkpoint) / "config.json").read_text())
    if set(c["layer_types"]) - {"jet", "attn"}:
        raise NotImplementedError(f"layer types {sorted(set(c['layer_types']))}: swa layers need Qwen2's sliding "
                                  "attention, not built here")
    config = Qwen2Config(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], rms_norm_eps=c["rms_norm_eps"], hidden_act=c["hidden_act"],
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=c["tie_word_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]}, use_sliding_window=False,
        layer_types=["full_attention"] * c["num_hidden_layers"])
    config._attn_implementation = "eager"
    model = JetNemotronReference(config, c["layer_types"], c["efficient_attention_config"]["jet"])
    missing, unexpected = model.load_state_dict(load_file(Path(checkpoint) / "model.safetensors"), strict=False)
    if unexpected or [name for name in missing if "rotary" not in name]:
        raise ValueError(f"checkpoint and reference disagree: missing {missing}, unexpected {unexpected}")
    return model.to(dtype).eval()


@torch.no_grad()
def layer_states(model: JetNemotronReference, input_ids: list[int]) -> dict[str, dict[int, torch.Tensor]]:
    """Each jet layer's state after the prompt in SGLang's pool layout and float32, as `reference.layer_states`
    gives HF's: {"temporal": {layer: [HV, V, K]}, "conv": {layer: [total_v, conv_size - 1]}} (the conv pool's last
    total_v channels, the only ones JetBlock uses)."""
    model(input_ids=torch.tensor([input_ids]))
    blocks = {i: layer.self_attn for i, layer in enumerate(model.model.layers)
              if isinstance(layer.self_attn, TorchJetBlock)}
    return {part: {i: block.last_state[part] for i, block in blocks.items()} for part in ("temporal", "conv")}
