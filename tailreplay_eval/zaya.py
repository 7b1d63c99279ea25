"""ZAYA1 (`ZayaForCausalLM`, model_type `zaya`): tiny checkpoints in Zyphra's format, and transformers' view of them.

transformers 5.19 has `zaya`, but names and lays out the model its own way: one decoder layer holds a CCA attention
block and a MoE block (`self_attn.qkv_proj.q_proj`, `mlp.gate`, `mlp.experts.gate_up_proj` [E, 2I, H], ...).
Zyphra's checkpoints, which SGLang 0.5.23 loads (`models/zaya.py`), count the two blocks as two layers (even:
`self_attn.qkv.linear_q`, `conv_qk.0`, ...; odd: `zaya_block.router`, `zaya_block.experts.local_experts.<e>.linear_fc1`)
and carry each residual scaling on the layer it feeds (`res_scale`: layer 0's is the model's input scaling, the last
one is the model's own `res_scale` before the final norm). transformers writes no conversion for zaya, so the build
draws the weights with transformers' class, then renames them into Zyphra's layout (`to_zyphra`), and the reference
loads the inverse (`write_as_hf`). The config is written as Zyphra's (SGLang registers its own ZayaConfig over
transformers').

Where the two implementations differ on paper, the tiny build stays where they agree: one expert per token (the only
routing transformers allows), and the skip expert's balancing bias at -1 as both initialise it, so the router never
picks it (a probability less 1 never beats another expert's); SGLang would add the input times its probability
(MoD) where transformers adds nothing.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ARCHITECTURE = "ZayaForCausalLM"

# transformers' name inside decoder layer i -> (Zyphra layer offset: 0 attention, 1 MoE, 2 the next layer's input;
# Zyphra's name inside that layer)
_LAYER_NAMES = {
    "input_layernorm.weight": (0, "input_norm.weight"),
    "self_attn.qkv_proj.q_proj.weight": (0, "self_attn.qkv.linear_q.weight"),
    "self_attn.qkv_proj.k_proj.weight": (0, "self_attn.qkv.linear_k.weight"),
    "self_attn.qkv_proj.v_proj_current.weight": (0, "self_attn.qkv.val_proj1.weight"),
    "self_attn.qkv_proj.v_proj_delayed.weight": (0, "self_attn.qkv.val_proj2.weight"),
    "self_attn.qkv_proj.conv_qk_depthwise.weight": (0, "self_attn.qkv.conv_qk.0.weight"),
    "self_attn.qkv_proj.conv_qk_depthwise.bias": (0, "self_attn.qkv.conv_qk.0.bias"),
    "self_attn.qkv_proj.conv_qk_grouped.weight": (0, "self_attn.qkv.conv_qk.1.weight"),
    "self_attn.qkv_proj.conv_qk_grouped.bias": (0, "self_attn.qkv.conv_qk.1.bias"),
    "self_attn.qk_norm.temp": (0, "self_attn.qkv.temp"),
    "self_attn.o_proj.weight": (0, "self_attn.o_proj.weight"),
    "post_attention_layernorm.weight": (1, "input_norm.weight"),
    "mlp.gate.down_proj.weight": (1, "zaya_block.router.down_proj.weight"),
    "mlp.gate.down_proj.bias": (1, "zaya_block.router.down_proj.bias"),
    "mlp.gate.router_states_scale": (1, "zaya_block.router.router_states_scale"),
    "mlp.gate.balancing_biases": (1, "zaya_block.router.balancing_biases"),
    "mlp.gate.router_mlp.norm.weight": (1, "zaya_block.router.rmsnorm_eda.weight"),
    "mlp.gate.router_mlp.fc1.weight": (1, "zaya_block.router.router_mlp.0.weight"),
    "mlp.gate.router_mlp.fc1.bias": (1, "zaya_block.router.router_mlp.0.bias"),
    "mlp.gate.router_mlp.fc2.weight": (1, "zaya_block.router.router_mlp.2.weight"),
    "mlp.gate.router_mlp.fc2.bias": (1, "zaya_block.router.router_mlp.2.bias"),
    "mlp.gate.router_mlp.out_proj.weight": (1, "zaya_block.router.router_mlp.4.weight"),
    **{f"post_attention_residual_scale.{p}": (1, f"res_scale.{p}") for p in (
        "hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")},
    **{f"post_mlp_residual_scale.{p}": (2, f"res_scale.{p}") for p in (
        "hidden_states_scale", "hidden_states_bias", "residual_scale", "residual_bias")},
}
_MODEL_NAMES = {
    "model.embed_tokens.weight": "model.embed_tokens.weight",
    "model.norm.weight": "model.final_norm.weight",
    "lm_head.weight": "lm_head.weight",
    "model.input_hidden_states_scale": "model.layers.0.res_scale.hidden_states_scale",
    "model.input_hidden_states_bias": "model.layers.0.res_scale.hidden_states_bias",
}
_EXPERTS = re.compile(r"^model\.layers\.(\d+)\.zaya_block\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$")


def name_map(hf_layers: int) -> dict[str, str]:
    """transformers' weight name -> Zyphra's, for every weight but the experts' (`to_zyphra` splits those)."""
    names = dict(_MODEL_NAMES)
    last = 2 * hf_layers
    for i in range(hf_layers):
        for inner, (offset, zyphra) in _LAYER_NAMES.items():
            layer = 2 * i + offset
            prefix = "model." if layer == last else f"model.layers.{layer}."  # the last scaling: the model's own
            names[f"model.layers.{i}.{inner}"] = prefix + zyphra
    return names


def zyphra_config(hf: dict) -> dict:
    """transformers' ZayaConfig (as written by save_pretrained) as Zyphra's config.json, which SGLang reads."""
    rope = hf["rope_parameters"]["hybrid"]
    return dict(
        architectures=[ARCHITECTURE], model_type="zaya", dtype=hf.get("dtype", "float32"),
        vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"], num_hidden_layers=2 * hf["num_hidden_layers"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        num_key_value_heads=hf["num_key_value_heads"], head_dim=hf["head_dim"], cca=True,
        cca_time0=hf["cca_time0"], cca_time1=hf["cca_time1"], clamp_temp=False,
        ffn_hidden_size=2 * hf["moe_intermediate_size"], num_experts=hf["num_experts"],
        moe_router_topk=hf["num_experts_per_tok"], zaya_mlp_expansion=hf["router_hidden_size"],
        zaya_use_mod=True, zaya_use_eda=True, zaya_high_prec=True, activation_func="swiglu", gated_linear_unit=True,
        scale_residual_merge=True, residual_in_fp32=True, normalization="RMSNorm", norm_epsilon=hf["rms_norm_eps"],
        rope_theta=rope["rope_theta"], partial_rotary_factor=rope["partial_rotary_factor"],
        max_position_embeddings=hf["max_position_embeddings"], attention_bias=hf["attention_bias"],
        lm_head_bias=hf["lm_head_bias"], tie_word_embeddings=hf["tie_word_embeddings"],
        bos_token_id=hf.get("bos_token_id"), eos_token_id=hf["eos_token_id"], pad_token_id=hf["pad_token_id"],
    )


def hf_config(zyphra: dict) -> dict:
    """The inverse of `zyphra_config`: the config transformers' ZayaConfig loads."""
    return dict(
        architectures=[ARCHITECTURE], model_type="zaya", dtype=zyphra["dtype"], vocab_size=zyphra["vocab_size"],
        hidden_size=zyphra["hidden_size"], num_hidden_layers=zyphra["num_hidden_layers"] // 2,
        num_attention_heads=zyphra["num_attention_heads"], num_key_value_heads=zyphra["num_key_value_heads"],
        head_dim=zyphra["head_dim"], cca_time0=zyphra["cca_time0"], cca_time1=zyphra["cca_time1"],
        moe_intermediate_size=zyphra["ffn_hidden_size"] // 2, num_experts=zyphra["num_experts"],
        num_experts_per_tok=zyphra["moe_router_topk"], router_hidden_size=zyphra["zaya_mlp_expansion"],
        rms_norm_eps=zyphra["norm_epsilon"], max_position_embeddings=zyphra["max_position_embeddings"],
        rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": zyphra["rope_theta"],
                                    "partial_rotary_factor": zyphra["partial_rotary_factor"]}},
        attention_bias=zyphra["attention_bias"], lm_head_bias=zyphra["lm_head_bias"],
        tie_word_embeddings=zyphra["tie_word_embeddings"], bos_token_id=zyphra["bos_token_id"],
        eos_token_id=zyphra["eos_token_id"], pad_token_id=zyphra["pad_token_id"],
    )


@torch.no_grad()
def init_tiny(model) -> None:
    """Make CCA's parts count in a tiny build. transformers' init leaves every key at zero (`temp` = 0: uniform
    attention), the conv taps and value/output projections at std 0.02 (a lost conv state or delayed value would
    hardly move a log-prob), the LM head at std 0.02 (logits within about 0.2 of each other: every error shrinks to a
    fifth in the log-probs; a hit replaying a fourth of the window came within 2.3e-3 nats of no cache) and every
    residual scaling at the identity (a scaling applied at the wrong layer would not show). Here: temperatures in
    [0.5, 1.5], conv taps, value and output projections and the LM head of unit gain (std fan_in^-1/2), scalings
    around the identity."""
    for name, param in model.named_parameters():
        if name.endswith("qk_norm.temp"):
            param.uniform_(2.0, 4.0)
        elif ".conv_qk_" in name and name.endswith("weight"):
            param.normal_(0.0, (param.shape[1] * param.shape[2]) ** -0.5)
        elif name.endswith(("v_proj_current.weight", "v_proj_delayed.weight", "o_proj.weight", "lm_head.weight")):
            param.normal_(0.0, param.shape[1] ** -0.5)
        elif name.endswith("_scale") and "router" not in name:
            param.normal_(1.0, 0.1)
        elif name.endswith("_bias") and "balancing" not in name:
            param.normal_(0.0, 0.05)


def to_zyphra(checkpoint: Path) -> None:
    """Rewrite the transformers build in `checkpoint` (weights and config) in Zyphra's layout, in place."""
    hf = json.loads((checkpoint / "config.json").read_text())
    weights = checkpoint / "model.safetensors"
    names = name_map(hf["num_hidden_layers"])
    tensors = {}
    for name, tensor in load_file(weights).items():
        match = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", name)
        if match:
            layer, kind = 2 * int(match[1]) + 1, "linear_fc1" if match[2] == "gate_up_proj" else "linear_fc2"
            for expert, rows in enumerate(tensor):  # gate_up rows: gate then up, as linear_fc1's halves
                tensors[f"model.layers.{layer}.zaya_block.experts.local_experts.{expert}.{kind}.weight"] = rows.clone()
        else:
            tensors[names[name]] = tensor
    save_file(tensors, weights, metadata={"format": "pt"})
    (checkpoint / "config.json").write_text(json.dumps(zyphra_config(hf), indent=2) + "\n")


def write_as_hf(checkpoint: Path, folder: Path) -> None:
    """The Zyphra checkpoint in `checkpoint` as the transformers checkpoint of the same weights, in `folder`."""
    zyphra = json.loads((checkpoint / "config.json").read_text())
    hf = hf_config(zyphra)
    inverse = {z: h for h, z in name_map(hf["num_hidden_layers"]).items()}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    tensors = {}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        match = _EXPERTS.match(name)
        if match:
            kind = "gate_up_proj" if match[3] == "linear_fc1" else "down_proj"
            experts.setdefault(((int(match[1]) - 1) // 2, kind), {})[int(match[2])] = tensor
        else:
            tensors[inverse[name]] = tensor
    for (layer, kind), rows in experts.items():
        tensors[f"model.layers.{layer}.mlp.experts.{kind}"] = torch.stack([rows[e] for e in sorted(rows)])
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")


@torch.no_grad()
def cca_states(model, input_ids: list[int]) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """Each CCA layer's state after the prompt in transformers' model, keyed by SGLang's layer id (2i): the window
    of q || k its conv keeps ([C, W], SGLang's `conv[0]`) and the delayed value of the last token (`v_proj_delayed`
    of it: SGLang keeps the token's input instead, `conv[1]`, and projects it at the next token; `delayed_value`)."""
    cache = model(input_ids=torch.tensor([input_ids]), use_cache=True).past_key_values
    return {2 * i: (layer.conv_states[0][0].float(), layer.recurrent_states[0][0].float())
            for i, layer in enumerate(cache.layers)}


@torch.no_grad()
def delayed_value(model, layer_id: int, prev_hs: torch.Tensor) -> torch.Tensor:
    """SGLang's kept input of CCA layer `layer_id` ([hidden] or [hidden, 1]) as transformers keeps it: projected."""
    return model.model.layers[layer_id // 2].self_attn.qkv_proj.v_proj_delayed(prev_hs.reshape(-1)).float()


def load_reference(checkpoint: Path, dtype=torch.float32):
    """transformers' ZayaForCausalLM over the Zyphra checkpoint's weights. Its classes by name, not through the Auto
    ones: a process that imported SGLang's configs has SGLang's ZayaConfig registered for `zaya` (Zyphra's fields,
    which transformers' model cannot read)."""
    import tempfile

    from transformers.models.zaya import ZayaConfig, ZayaForCausalLM

    with tempfile.TemporaryDirectory() as folder:
        write_as_hf(checkpoint, Path(folder))
        config = ZayaConfig.from_pretrained(folder)
        return ZayaForCausalLM.from_pretrained(folder, config=config, dtype=dtype).eval()
