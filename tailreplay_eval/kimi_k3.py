"""Kimi K3's language model (`KimiK3LinearForCausalLM`, model_type `kimi_linear`): tiny checkpoints, and what their
reference (`reference.load_kimi_k3_reference`) is made of.

transformers has no Kimi K3 class. SGLang 0.5.23 (`models/kimi_k3.py`) builds it on Kimi Linear's config with the
same KDA mixer, NoPE MLA and DeepSeek-V3 router. What differs from Kimi Linear, in the parts a tiny build uses:
- **attention residuals** (`attn_res_block_size` B; `layers/attn_residual.py`, `layer_boundary/residual/attn_bank.py`):
  every layer's attention and feed-forward input is a softmax mixture, per token over depth, of a bank of frozen
  rows and the running residual, scored by a per-layer `*_res_norm` + `*_res_proj` (hidden -> 1) and then normed by
  the layer's own norm. Layer l % B == 0 snapshots its running residual into the bank and restarts it; the model's
  output is the same mixture with `output_attn_res_*`, then `model.norm`;
- **the MLA output gate** (`mla_use_output_gate`): `o_proj(attention * sigmoid(g_proj(x)))`, x the layer's normed
  input, per element;
- the MoE under the decoder layer's `mlp.` (Moonshot's Kimi Linear ships it as `block_sparse_moe.`).
Not built here: the latent MoE (`routed_expert_hidden_size`), the SiTU activation and the vision tower.

So a tiny K3 is a tiny Kimi Linear's weights (`models.init_model`) under K3's names, plus the residual scorers and
the gates, and its reference is transformers' Kimi Linear over the same weights with its decoder loop replaced by
the attention-residual mixture (`reference.AttnResidualKimi`) and the gate on each MLA layer.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

K3_ARCHITECTURE = "KimiK3LinearForCausalLM"
# Score projections at std 0.3 over unit-RMS rows: scores spread over about +-2, so the mixture is neither uniform
# nor one-hot and a row dropped or misplaced in the bank moves every later layer.
SCORE_STD = 0.3
GATE_STD = 0.3  # gates spread over about 0.3-0.7, as tiny-ling-3.0's


def k3_config(kimi: dict, block_size: int) -> dict:
    """Kimi Linear's config `kimi` (Moonshot's fields) as Kimi K3's: attention residuals every `block_size` layers
    and the MLA output gate."""
    return dict(kimi, architectures=[K3_ARCHITECTURE], attn_res_block_size=block_size, mla_use_output_gate=True)


def _score_rows(hidden: int, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A residual scorer: its RMSNorm weight (near 1) and its projection to one score."""
    norm = 1.0 + 0.1 * torch.randn(hidden, generator=generator)
    return {"norm.weight": norm.to(dtype), "proj.weight": (SCORE_STD * torch.randn(1, hidden, generator=generator)
                                                           ).to(dtype)}


@torch.no_grad()
def convert_to_k3(checkpoint: Path, seed: int, block_size: int) -> None:
    """Rewrite the Kimi Linear checkpoint in `checkpoint` (Moonshot's names and config) as Kimi K3's in place."""
    weights = checkpoint / "model.safetensors"
    kimi = json.loads((checkpoint / "config.json").read_text())
    generator = torch.Generator().manual_seed(seed + 3)
    tensors = {name.replace(".block_sparse_moe.", ".mlp."): t for name, t in load_file(weights).items()}
    dtype, hidden = tensors["lm_head.weight"].dtype, kimi["hidden_size"]
    for layer in range(kimi["num_hidden_layers"]):
        for side in ("self_attention_res", "mlp_res"):
            for name, t in _score_rows(hidden, generator, dtype).items():
                tensors[f"model.layers.{layer}.{side}_{name}"] = t
    for name, t in _score_rows(hidden, generator, dtype).items():
        tensors[f"model.output_attn_res_{name}"] = t
    width = kimi["num_attention_heads"] * kimi["v_head_dim"]
    for layer in kimi["linear_attn_config"]["full_attn_layers"]:  # 1-indexed
        gate = GATE_STD * torch.randn(width, hidden, generator=generator)
        tensors[f"model.layers.{layer - 1}.self_attn.g_proj.weight"] = gate.to(dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    (checkpoint / "config.json").write_text(json.dumps(k3_config(kimi, block_size), indent=2) + "\n")


def write_as_kimi(checkpoint: Path, folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """Write the K3 checkpoint as the Kimi Linear checkpoint transformers loads into `folder`; returns K3's config
    and the weights Kimi Linear has no place for (the residual scorers and the gates)."""
    k3 = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    extra = {n: t for n, t in tensors.items() if "_res_" in n or n.endswith(".self_attn.g_proj.weight")}
    kimi = {}
    for name, tensor in tensors.items():
        if name in extra:
            continue
        if ".mlp.experts." in name or ".mlp.gate." in name or ".mlp.shared_experts." in name:
            name = name.replace(".mlp.", ".block_sparse_moe.")
        kimi[name] = tensor
    config = {k: v for k, v in k3.items() if k not in ("attn_res_block_size", "mla_use_output_gate")}
    (folder / "config.json").write_text(json.dumps(dict(config, architectures=["KimiLinearForCausalLM"])))
    save_file(kimi, folder / "model.safetensors", metadata={"format": "pt"})
    return k3, extra
