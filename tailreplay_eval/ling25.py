"""Ling-2.5 (`BailingMoeV2_5ForCausalLM`, model_type `bailing_hybrid` without a short conv): tiny checkpoints, and
what their reference (`reference.load_ling25_reference`) is made of.

Ling-2.5 is Ling-3.0's layout (`tailreplay_eval.ling`: every `layer_group_size`-th layer MLA, Kimi Linear's MoE under
Bailing's names) with two differences in SGLang 0.5.23's `models/bailing_moe_linear.py`:
- the linear layers are lightning attention (`BailingMoELinearAttention`): q | k | v from one projection, q and k
  RMS-normed per head and rotated (NeoX halves, `rope_theta`), the linear-attention recurrence with a fixed decay per
  head and layer (`LightningAttentionBackend._build_slope_tensor`: ALiBi slopes times 1 - layer / (layers - 1)),
  then a groupwise RMSNorm times sigmoid(g_proj(x)) and the `dense` projection;
- the MLA output is not gated (`DsV3MLA` is DeepSeek's); its rope parts are rotated as Ling-3.0's.

So a tiny Ling-2.5 is a tiny Ling-3.0 (a tiny Kimi Linear's weights under Bailing's names) whose KDA weights are
replaced by lightning weights, with no MLA gate, and its reference is transformers' Kimi Linear over the shared
weights with each linear layer replaced by `reference.LightningAttention` and each MLA layer by an ungated
`reference.GatedRopeMLA`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tailreplay_eval import ling

ARCHITECTURE = "BailingMoeV2_5ForCausalLM"
GROUP_NORM_SIZE = 2  # the output norm's groups (2 heads each at the tiny sizes): a norm over the whole width differs
NORM_SPREAD = 0.2  # q/k and output norm weights drawn around 1, so that a norm applied in another's place shows
DENSE_STD = 0.05  # the output projection: the mixers' share of the residual stream, so that their states show


def ling25_config(kimi: dict, rope_theta: float) -> dict:
    """Bailing's config.json for the Kimi Linear config `kimi` as a lightning Ling-2.5 (no short_conv_kernel_size:
    SGLang then builds lightning attention, `configs/hybrid_arch.py`)."""
    config = ling.ling_config(kimi, rope_theta)
    for key in ("short_conv_kernel_size", "gated_attention_proj_granularity_type", "use_mla_nope", "rope_parameters"):
        del config[key]
    return dict(config, architectures=[ARCHITECTURE], rope_theta=rope_theta, rope_scaling=None, use_qk_norm=True,
                group_norm_size=GROUP_NORM_SIZE, linear_silu=False, linear_backend="seg_la")


def linear_layers(config: dict) -> list[int]:
    period = config["layer_group_size"]
    return [i for i in range(config["num_hidden_layers"]) if (i + 1) % period]


def slopes(config: dict, layer: int) -> torch.Tensor:
    """[heads] the decay rate of each head of `layer`, as SGLang builds it (ALiBi slopes, layerwise factor)."""
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if not math.log2(heads).is_integer():
        raise ValueError("the tiny Ling-2.5 uses a power-of-two head count")
    start = 2 ** (-(2 ** -(math.log2(heads) - 3)))
    rates = torch.tensor([start ** (h + 1) for h in range(heads)], dtype=torch.float64)
    return rates * (1 - layer / (layers - 1) + 1e-5)


@torch.no_grad()
def convert_to_ling25(checkpoint: Path, rope_theta: float, seed: int) -> None:
    """Rewrite the Kimi Linear checkpoint in `checkpoint` as Ling-2.5 in place: `ling.convert_to_ling`'s names and
    rope gain without its MLA gates, each KDA layer's mixer replaced by lightning weights (projections of unit gain,
    norm weights around 1, `dense` at DENSE_STD)."""
    kimi = json.loads((checkpoint / "config.json").read_text())
    ling.convert_to_ling(checkpoint, rope_theta, seed)
    config = ling25_config(kimi, rope_theta)
    tensors = load_file(checkpoint / "model.safetensors")
    linear = linear_layers(config)
    dtype = tensors["lm_head.weight"].dtype
    tensors = {name: t for name, t in tensors.items()
               if not name.endswith(".attention.g_proj.weight") and not _is_linear_mixer(name, linear)}
    generator = torch.Generator().manual_seed(seed + 1)
    hidden, inner = config["hidden_size"], config["num_attention_heads"] * config["head_dim"]

    def normal(shape, mean, std):
        return (torch.randn(shape, generator=generator) * std + mean).to(dtype)

    for layer in linear:
        prefix = f"model.layers.{layer}.attention."
        tensors[prefix + "query_key_value.weight"] = normal((3 * inner, hidden), 0.0, hidden ** -0.5)
        tensors[prefix + "query_layernorm.weight"] = normal((config["head_dim"],), 1.0, NORM_SPREAD)
        tensors[prefix + "key_layernorm.weight"] = normal((config["head_dim"],), 1.0, NORM_SPREAD)
        tensors[prefix + "g_proj.weight"] = normal((inner, hidden), 0.0, hidden ** -0.5)
        tensors[prefix + "g_norm.weight"] = normal((inner,), 1.0, NORM_SPREAD)
        tensors[prefix + "dense.weight"] = normal((hidden, inner), 0.0, DENSE_STD)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _is_linear_mixer(name: str, linear: list[int]) -> bool:
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) in linear and parts[3] == "attention"


def lightning_weights(checkpoint: Path) -> dict[int, dict[str, torch.Tensor]]:
    """{layer: {name after `attention.`: tensor}} of every lightning layer in the checkpoint."""
    config = json.loads((checkpoint / "config.json").read_text())
    linear = linear_layers(config)
    layers: dict[int, dict[str, torch.Tensor]] = {layer: {} for layer in linear}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        if _is_linear_mixer(name, linear):
            layers[int(name.split(".")[2])][name.split(".attention.", 1)[1]] = tensor
    return layers


def write_as_kimi(checkpoint: Path, folder: Path) -> None:
    """The checkpoint's shared weights (embeddings, norms, MoE, MLA) as the Kimi Linear checkpoint they came from,
    in `folder`; the lightning layers are left out (transformers initialises KDA there, which the reference
    replaces)."""
    config = json.loads((checkpoint / "config.json").read_text())
    linear = linear_layers(config)
    tensors = {name: t for name, t in load_file(checkpoint / "model.safetensors").items()
               if not _is_linear_mixer(name, linear)}
    ling.write_kimi(dict(config, short_conv_kernel_size=4), tensors, folder)
