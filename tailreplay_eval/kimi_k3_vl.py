"""Kimi K3 with its vision tower (`KimiK3ForConditionalGeneration`, model_type `kimi_k3`): a tiny checkpoint.

SGLang 0.5.23 (`models/kimi_k3.py`, `models/kimi_k3_vl.py`) wraps K3's language model (`tailreplay_eval.kimi_k3`)
under a MoonViT3d tower and a bias-free projector (`KimiK3VisionTower`, `KimiK3MultiModalProjector`): image
placeholders (`<|media_pad|>`, `media_placeholder_token_id`) get the projector's rows as their embeddings. So the
build is tiny-kimi-k3's under `language_model.`, with a two-block tower of random weights, K3's media tokens in the
tokenizer, and a processor (`tailreplay_eval/kimi_k3_processing.py`, shipped in the checkpoint as Moonshot ships
theirs). Neither transformers nor anything else here has K3's tower: its weights are random and the images are not
compared with a reference (the language model is, by `reference.load_kimi_k3_reference`, on text).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ARCHITECTURE = "KimiK3ForConditionalGeneration"
# K3's media framing (SGLang's processor writes "<|media_begin|>image WxH<|media_content|>" + pads + "<|media_end|>")
MEDIA_PAD = "<|media_pad|>"
SPECIAL_TOKENS = ("<|media_begin|>", "<|media_content|>", "<|media_end|>", MEDIA_PAD)
# 8-pixel patches merged 2x2: a 32x32 image is 4 features; at most 64 patches (16 features) per image
VISION = dict(patch_size=8, init_pos_emb_height=16, init_pos_emb_width=16, init_pos_emb_time=4,
              vt_num_attention_heads=2, vt_num_hidden_layers=2, vt_hidden_size=32, vt_intermediate_size=64,
              qkv_hidden_size=32, merge_kernel_size=[2, 2], norm_type="rmsnorm", attn_bias=False,
              patch_embed_proj_bias=False, linear_bias=False, mlp_type="mlp2", _attn_implementation="sdpa")
MEDIA_PROC_CFG = dict(patch_size=8, merge_kernel_size=2, in_patch_limit=256, patch_limit_on_one_side=16,
                      image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])


def _tower_weights(text_hidden: int, generator: torch.Generator, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The tower's and projector's tensors under SGLang's names, scaled so every layer keeps unit-size rows."""
    v, mlp, p = VISION["vt_hidden_size"], VISION["vt_intermediate_size"], VISION["patch_size"]
    merged = v * VISION["merge_kernel_size"][0] * VISION["merge_kernel_size"][1]
    grid = (VISION["init_pos_emb_height"], VISION["init_pos_emb_width"])

    def matrix(rows, cols):
        return torch.randn(rows, cols, generator=generator) / cols ** 0.5

    def norm(width):
        return 1.0 + 0.1 * torch.randn(width, generator=generator)

    patch = torch.randn(v, 3, p, p, generator=generator) / (3 * p * p) ** 0.5
    tensors = {"vision_tower.patch_embed.proj.weight": patch,
               "vision_tower.patch_embed.pos_emb.weight": 0.1 * torch.randn(*grid, v, generator=generator),
               "vision_tower.encoder.final_layernorm.weight": norm(v),
               "mm_projector.proj.0.weight": matrix(merged, merged),
               "mm_projector.proj.2.weight": matrix(text_hidden, merged),
               "mm_projector.post_norm.weight": norm(text_hidden)}
    for block in range(VISION["vt_num_hidden_layers"]):
        prefix = f"vision_tower.encoder.blocks.{block}."
        tensors.update({prefix + "norm0.weight": norm(v), prefix + "norm1.weight": norm(v),
                        prefix + "wqkv.weight": matrix(3 * v, v), prefix + "wo.weight": matrix(v, v),
                        prefix + "mlp.fc0.weight": matrix(mlp, v), prefix + "mlp.fc1.weight": matrix(v, mlp)})
    return {name: t.to(dtype) for name, t in tensors.items()}


@torch.no_grad()
def wrap_with_vision(checkpoint: Path, seed: int, tokenizer) -> None:
    """Rewrite the K3 text checkpoint in `checkpoint` as K3 with its vision tower, in place, with the processor."""
    weights = checkpoint / "model.safetensors"
    text = json.loads((checkpoint / "config.json").read_text())
    tensors = {f"language_model.{name}": t for name, t in load_file(weights).items()}
    dtype = tensors["language_model.lm_head.weight"].dtype
    tensors.update(_tower_weights(text["hidden_size"], torch.Generator().manual_seed(seed + 5), dtype))
    save_file(tensors, weights, metadata={"format": "pt"})
    config = {"architectures": [ARCHITECTURE], "model_type": "kimi_k3", "dtype": text["dtype"],
              "text_config": text, "vision_config": dict(VISION, text_hidden_size=text["hidden_size"]),
              "media_placeholder_token_id": tokenizer.token_to_id(MEDIA_PAD),
              "pad_token_id": text["pad_token_id"], "eos_token_id": text["eos_token_id"]}
    (checkpoint / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copy(Path(__file__).with_name("kimi_k3_processing.py"), checkpoint / "processing_kimi_k3.py")
    auto_map = {"AutoProcessor": "processing_kimi_k3.KimiK3Processor"}
    (checkpoint / "preprocessor_config.json").write_text(json.dumps(
        {"media_proc_cfg": MEDIA_PROC_CFG, "auto_map": auto_map}, indent=2) + "\n")
    (checkpoint / "processor_config.json").write_text(json.dumps({"auto_map": auto_map}, indent=2) + "\n")


def write_language_model(checkpoint: Path, folder: Path) -> Path:
    """The checkpoint's language model as the K3 text checkpoint (`tailreplay_eval.kimi_k3`) it was built from, in
    `folder`: what `reference.load_kimi_k3_reference` reads."""
    config = json.loads((checkpoint / "config.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    tensors = {name.removeprefix("language_model."): t for name, t in tensors.items()
               if name.startswith("language_model.")}
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(config["text_config"]))
    return folder
