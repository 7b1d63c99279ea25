"""Ling-3.0 (`BailingMoeV3ForCausalLM`, model_type `bailing_hybrid`): tiny checkpoints, and what their reference
(`reference.load_ling_reference`) is made of.

transformers has no Ling class. SGLang 0.5.23 builds Ling-3.0's KDA layers as Kimi Linear's `KimiDeltaAttention`,
its MoE as the DeepSeek-V3 router Kimi Linear has (sigmoid scores, a correction bias, a shared expert, routed scale)
and its MLA as DeepSeek's. Three things differ from Kimi Linear (`models/bailing_moe_v3.py`, `DsV3MLA`):
- the MLA output is gated, `o_proj(attention * sigmoid(g_proj(x)))` with x the layer's normed input, per element
  (`gated_attention_proj_granularity_type` "element_wise");
- the MLA keys' and queries' rope parts are rotated (interleaved pairs, `rope_interleave`); Kimi's MLA is NoPE;
- the KDA layers' gated output norm has eps 1e-6, not rms_norm_eps (on tiny random weights the KDA output's
  variance is near eps, so this one shows).

So a tiny Ling is a tiny Kimi Linear's weights (`models.init_model`, KDA memories included) under Bailing's names,
plus the gate projections, and its reference is transformers' Kimi Linear over the same weights (tested against
SGLang's Kimi Linear in tests/test_hybrid_families.py) with each MLA layer replaced by `reference.GatedRopeMLA`,
a torch implementation of the first two, and the third set on transformers' norms.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailreplay_eval.nextn import nextn_fusion

LING_ARCHITECTURE = "BailingMoeV3ForCausalLM"
KDA_NORM_EPS = 1e-6  # `BailingKDA` builds its output norm at 1e-6 whatever rms_norm_eps says (Kimi: rms_norm_eps)
GATE = "element_wise"
# At HF's init (std 0.02) the rope parts' share of the attention logits is too small for a wrong rotation to show
# (no RoPE at all moved the served log-probs by 0.0017 nats, under the 0.005 the tests allow): x 10 makes it show.
ROPE_GAIN = 10.0

# (Kimi Linear name as Moonshot ships it, Ling-3.0 name) after `model.layers.<i>.`: a prefix pair, then pairs for
# the rest of the name under it. Every pair reads both ways (`to_ling_name`, `to_kimi_name`); the dense MLP's `mlp.`
# names are the same in both.
_RULES = (
    (("self_attn.", "attention."), ()),
    (("block_sparse_moe.gate.", "mlp.gate."), (("e_score_correction_bias", "expert_bias"),)),
    (("block_sparse_moe.shared_experts.", "mlp.shared_experts."), ()),
    (("block_sparse_moe.experts.", "mlp.experts."), ((".w1.", ".gate_proj."), (".w3.", ".up_proj."),
                                                    (".w2.", ".down_proj."))),
)
_EMBEDDINGS = ("model.embed_tokens.weight", "model.word_embeddings.weight")


def _rename(name: str, to_ling: bool) -> str:
    way = (lambda pair: pair) if to_ling else (lambda pair: pair[::-1])
    old, new = way(_EMBEDDINGS)
    if name == old:
        return new
    match = re.match(r"(model\.layers\.\d+\.)(.*)", name)
    if match is None:
        return name
    prefix, rest = match.groups()
    for head, tails in _RULES:
        old, new = way(head)
        if rest.startswith(old):
            rest = new + rest[len(old):]
            for tail in tails:
                rest = rest.replace(*way(tail))
            break
    return prefix + rest


def to_ling_name(name: str) -> str:
    return _rename(name, to_ling=True)


def to_kimi_name(name: str) -> str:
    return _rename(name, to_ling=False)


def ling_config(kimi: dict, rope_theta: float) -> dict:
    """Bailing's config.json (`configs/bailing_hybrid.py`) for the Kimi Linear config `kimi` (Moonshot's fields):
    every `layer_group_size`-th layer MLA, the rest KDA (`short_conv_kernel_size` makes them KDA), the same heads,
    latent and MoE, and the differences above."""
    la = kimi["linear_attn_config"]
    period = la["full_attn_layers"][0]
    if la["full_attn_layers"] != list(range(period, kimi["num_hidden_layers"] + 1, period)):
        raise ValueError(f"Bailing puts MLA at every layer_group_size-th layer, not at {la['full_attn_layers']}")
    if la["head_dim"] != kimi["v_head_dim"]:
        raise ValueError("Bailing's KDA value heads are v_head_dim wide, Kimi's head_dim: they must agree")
    return {
        "architectures": [LING_ARCHITECTURE], "model_type": "bailing_hybrid", "dtype": kimi["dtype"],
        "vocab_size": kimi["vocab_size"], "hidden_size": kimi["hidden_size"],
        "intermediate_size": kimi["intermediate_size"], "num_hidden_layers": kimi["num_hidden_layers"],
        "layer_group_size": period, "num_attention_heads": la["num_heads"], "num_key_value_heads": la["num_heads"],
        "head_dim": la["head_dim"], "short_conv_kernel_size": la["short_conv_kernel_size"],
        "q_lora_rank": None, "kv_lora_rank": kimi["kv_lora_rank"], "qk_nope_head_dim": kimi["qk_nope_head_dim"],
        "qk_rope_head_dim": kimi["qk_rope_head_dim"], "v_head_dim": kimi["v_head_dim"], "rope_interleave": True,
        "use_mla_nope": False, "gated_attention_proj_granularity_type": GATE,
        "rope_parameters": {"rope_type": "default", "rope_theta": rope_theta},
        "num_experts": kimi["num_experts"], "num_experts_per_tok": kimi["num_experts_per_token"],
        "moe_intermediate_size": kimi["moe_intermediate_size"], "num_shared_experts": kimi["num_shared_experts"],
        "first_k_dense_replace": kimi["first_k_dense_replace"], "score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "norm_topk_prob": kimi["moe_renormalize"],
        "n_group": kimi["num_expert_group"], "topk_group": kimi["topk_group"],
        "routed_scaling_factor": kimi["routed_scaling_factor"], "rms_norm_eps": kimi["rms_norm_eps"],
        "hidden_act": "silu", "use_qk_norm": False, "use_bias": False, "use_qkv_bias": False,
        "num_nextn_predict_layers": 0, "max_position_embeddings": kimi["max_position_embeddings"],
        "tie_word_embeddings": False, "eos_token_id": kimi["eos_token_id"], "pad_token_id": kimi["pad_token_id"],
    }


def kimi_config(ling: dict) -> dict:
    """The inverse of `ling_config`: the Kimi Linear config whose transformers model is the reference's body."""
    period, layers = ling["layer_group_size"], ling["num_hidden_layers"]
    return {
        "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear", "dtype": ling["dtype"],
        "vocab_size": ling["vocab_size"], "hidden_size": ling["hidden_size"],
        "intermediate_size": ling["intermediate_size"], "num_hidden_layers": layers,
        "num_attention_heads": ling["num_attention_heads"], "num_key_value_heads": ling["num_attention_heads"],
        "head_dim": ling["qk_rope_head_dim"], "q_lora_rank": None, "kv_lora_rank": ling["kv_lora_rank"],
        "qk_nope_head_dim": ling["qk_nope_head_dim"], "qk_rope_head_dim": ling["qk_rope_head_dim"],
        "v_head_dim": ling["v_head_dim"], "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, layers + 1) if i % period], "head_dim": ling["head_dim"],
            "full_attn_layers": list(range(period, layers + 1, period)), "num_heads": ling["num_attention_heads"],
            "short_conv_kernel_size": ling["short_conv_kernel_size"]},
        "num_experts": ling["num_experts"], "num_experts_per_token": ling["num_experts_per_tok"],
        "moe_intermediate_size": ling["moe_intermediate_size"], "num_shared_experts": ling["num_shared_experts"],
        "first_k_dense_replace": ling["first_k_dense_replace"], "moe_layer_freq": 1,
        "moe_renormalize": ling["norm_topk_prob"], "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": ling["routed_scaling_factor"], "use_grouped_topk": True,
        "num_expert_group": ling["n_group"], "topk_group": ling["topk_group"], "rms_norm_eps": ling["rms_norm_eps"],
        "hidden_act": "silu", "max_position_embeddings": ling["max_position_embeddings"],
        "tie_word_embeddings": False, "bos_token_id": None, "eos_token_id": ling["eos_token_id"],
        "pad_token_id": ling["pad_token_id"],
    }


@torch.no_grad()
def convert_to_ling(checkpoint: Path, rope_theta: float, seed: int) -> None:
    """Rewrite the Kimi Linear checkpoint in `checkpoint` (config.json in Moonshot's fields, weights in Moonshot's
    names) as Ling-3.0 in place: Bailing's names and config, A_log as Ling ships it ([heads]), random correction
    biases (Kimi's start at zero; a bias moves the expert choice, so a router that drops it shows), MLA rope rows
    scaled by ROPE_GAIN, and a gate projection per MLA layer (std 0.3: gates spread over about 0.3-0.7)."""
    weights = checkpoint / "model.safetensors"
    kimi = json.loads((checkpoint / "config.json").read_text())
    ling = ling_config(kimi, rope_theta)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, tensor in load_file(weights).items():
        name = to_ling_name(name)
        if name.endswith(".attention.A_log"):
            tensor = tensor.flatten()
        if name.endswith(".mlp.gate.expert_bias"):
            tensor = torch.randn(tensor.shape, generator=generator).mul_(0.1).to(tensor.dtype)
        tensors[name] = tensor.contiguous()
    heads, width = ling["num_attention_heads"], ling["v_head_dim"]
    nope, rope = ling["qk_nope_head_dim"], ling["qk_rope_head_dim"]
    for name, tensor in tensors.items():  # rope rows x ROPE_GAIN: the rotated part moves the attention weights
        if name.endswith(".attention.q_proj.weight") and tensor.shape[0] == heads * (nope + rope):
            rows = tensor.view(heads, nope + rope, -1).clone()
            rows[:, nope:] *= ROPE_GAIN
            tensors[name] = rows.view_as(tensor)
        elif name.endswith(".attention.kv_a_proj_with_mqa.weight"):
            tensors[name] = torch.cat((tensor[:ling["kv_lora_rank"]], tensor[ling["kv_lora_rank"]:] * ROPE_GAIN))
    for layer in range(ling["layer_group_size"] - 1, ling["num_hidden_layers"], ling["layer_group_size"]):
        gate = torch.randn(heads * width, ling["hidden_size"], generator=generator).mul_(0.3)
        tensors[f"model.layers.{layer}.attention.g_proj.weight"] = gate.to(tensors["lm_head.weight"].dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    (checkpoint / "config.json").write_text(json.dumps(ling, indent=2) + "\n")


def write_as_kimi(checkpoint: Path, folder: Path) -> dict[str, torch.Tensor]:
    """Write the Ling checkpoint as the Kimi Linear checkpoint it was built from (Moonshot's names and config) into
    `folder`; returns the gate projections, which Kimi Linear has no place for."""
    ling = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    gates = {name: t for name, t in tensors.items() if name.endswith(".attention.g_proj.weight")}
    write_kimi(ling, {name: t for name, t in tensors.items() if name not in gates}, folder)
    return gates


def write_kimi(ling: dict, tensors: dict[str, torch.Tensor], folder: Path) -> None:
    """Bailing-named `tensors` under Moonshot's names, with the Kimi Linear config of `ling`, into `folder`."""
    kimi = {}
    for name, tensor in tensors.items():
        kimi_name = to_kimi_name(name)
        if kimi_name.endswith(".self_attn.A_log"):
            tensor = tensor.view(1, 1, -1, 1)
        kimi[kimi_name] = tensor
    (folder / "config.json").write_text(json.dumps(kimi_config(ling)))
    save_file(kimi, folder / "model.safetensors", metadata={"format": "pt"})


def write_mtp_head(checkpoint: Path, seed: int) -> None:
    """Add a NEXTN layer at `model.layers.<num_hidden_layers>.` and declare it (`num_nextn_predict_layers`), as Ling
    ships its MTP layer; SGLang serves it as the draft `BailingMoeForCausalLMNextN`: the embedding of token i + 1 and
    the target's hidden at token i, each normed (`enorm`, `hnorm`) and projected together (`eh_proj`), pass one gated
    MLA + MoE layer and `final_layernorm`. The layer starts as a copy of the target's last MLA layer and `eh_proj` is
    drawn from `seed`; there is no reference to distil it from (transformers has no Ling), so its drafts are rarely
    accepted: the target's tokens must come out whatever the draft says."""
    config_file, weights = checkpoint / "config.json", checkpoint / "model.safetensors"
    config = json.loads(config_file.read_text())
    tensors = load_file(weights)
    nextn, hidden = config["num_hidden_layers"], config["hidden_size"]
    last_mla = max(int(name.split(".")[2]) for name in tensors if ".attention.kv_b_proj." in name)
    source = f"model.layers.{last_mla}."
    for name, tensor in list(tensors.items()):
        if name.startswith(source):
            tensors[f"model.layers.{nextn}." + name.removeprefix(source)] = tensor.clone()
    tensors.update(nextn_fusion(f"model.layers.{nextn}.", hidden, tensors["lm_head.weight"].dtype, seed,
                                ("enorm", "hnorm", "final_layernorm")))
    save_file(tensors, weights, metadata={"format": "pt"})
    config["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2) + "\n")
