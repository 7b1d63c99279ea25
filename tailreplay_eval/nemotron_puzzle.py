"""Nemotron-H Puzzle (`NemotronHPuzzleForCausalLM`, model_type `nemotron_h_puzzle`): tiny checkpoints and their
reference.

NVIDIA's Puzzle models are Nemotron-H stacks compressed by architecture search: each layer's block has its own
sizes, listed per layer in `block_configs` (SGLang's `configs/nemotron_h.py`, NemotronHPuzzleConfig). SGLang builds
every MoE and attention layer from the base config overlaid with its layer's entry
(`get_nemotron_h_config_for_layer`); Mamba2 and MLP layers keep the base sizes (the mamba pool holds one state shape).
transformers has no Puzzle class, so the reference is transformers' Nemotron-H with each overridden layer's mixer
rebuilt from its own config (`with_block_configs`): the same module code, one size per layer.

The tiny one (`tiny-nemotron-h-puzzle`, pattern M-ME*-EM*ME) is tiny-nemotron-h's layout with three MoE layers whose
expert widths and top-k differ (`OVERRIDES`); the one a replay runs (layer 6, between group 1's first stage and its
Mamba2 layer) is neither the base's width nor its top-k.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import load_file

ARCHITECTURE = "NemotronHPuzzleForCausalLM"
MODEL_TYPE = "nemotron_h_puzzle"
BLOCK_TYPES = {"M": "mamba", "-": "mlp", "*": "attention", "E": "moe"}
# MoE layer index -> what its block sets (the base config: 4 experts of width 32, top 2). Every MoE block names its
# expert count, as NVIDIA's do: SGLang sizes its expert tables from the largest (`max_n_routed_experts`).
OVERRIDES = {3: dict(n_routed_experts=4, moe_intermediate_size=64, num_experts_per_tok=1),
             6: dict(n_routed_experts=4, moe_intermediate_size=96, num_experts_per_tok=3),
             10: dict(n_routed_experts=4, moe_intermediate_size=32, num_experts_per_tok=2)}


def block_configs(pattern: str) -> list[dict]:
    return [dict(block_type=BLOCK_TYPES[c], **OVERRIDES.get(i, {})) for i, c in enumerate(pattern)]


def layer_config(config, block: dict):
    """The base config overlaid with one layer's block, as SGLang's get_nemotron_h_config_for_layer does."""
    overlaid = copy.copy(config)
    for key, value in block.items():
        if key != "block_type":
            setattr(overlaid, key, value)
    return overlaid


def with_block_configs(model, blocks: list[dict]):
    """Rebuild the mixer of every layer whose block overrides a size, from its own config, and draw its weights with
    the model's own init."""
    from transformers.models.nemotron_h.modeling_nemotron_h import MIXER_TYPES

    for i, block in enumerate(blocks):
        if set(block) - {"block_type"}:
            layer = model.model.layers[i]
            layer.mixer = MIXER_TYPES[layer.block_type](layer_config(model.config, block), layer_idx=i)
            layer.mixer.apply(model._init_weights)
    return model


def as_puzzle(config_file: Path, pattern: str) -> None:
    """config.json (already in NVIDIA's spelling, `models.nvidia_config_fields`) as a Puzzle checkpoint's."""
    config = json.loads(config_file.read_text())
    config.update(architectures=[ARCHITECTURE], model_type=MODEL_TYPE, block_configs=block_configs(pattern))
    config_file.write_text(json.dumps(config, indent=2) + "\n")


@torch.no_grad()
def load_reference(model_path: Path, dtype=torch.float32):
    """transformers' Nemotron-H over the Puzzle checkpoint's base config (its loader reads NVIDIA's names), with
    each overridden layer's mixer rebuilt per block and its weights read from the checkpoint: NVIDIA's per-expert
    `experts.<e>.up_proj.weight` stacked as transformers' fused `experts.up_proj`."""
    from transformers import AutoConfig, NemotronHForCausalLM

    raw = json.loads((model_path / "config.json").read_text())
    base = {k: v for k, v in raw.items() if k not in ("architectures", "model_type", "block_configs")}
    config = AutoConfig.for_model("nemotron_h", **base)
    model = NemotronHForCausalLM.from_pretrained(model_path, config=config, dtype=torch.float32,
                                                 ignore_mismatched_sizes=True)
    blocks = raw["block_configs"]
    with_block_configs(model, blocks)
    tensors = load_file(model_path / "model.safetensors")
    for i, block in enumerate(blocks):
        if set(block) - {"block_type"}:
            model.model.layers[i].mixer.load_state_dict(_mixer_weights(tensors, f"backbone.layers.{i}.mixer."))
    return model.to(dtype).eval()


def _mixer_weights(tensors: dict, prefix: str) -> dict:
    own = {name[len(prefix):]: t for name, t in tensors.items() if name.startswith(prefix)}
    experts = sorted({int(name.split(".")[1]) for name in own if name.startswith("experts.")})
    weights = {name: t for name, t in own.items() if not name.startswith("experts.")}
    for proj in ("up_proj", "down_proj"):
        weights[f"experts.{proj}"] = torch.stack([own[f"experts.{e}.{proj}.weight"] for e in experts])
    return weights
