"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, model_type `glm5_next`): tiny checkpoints.

transformers' Glm5NextConfig at the preset's sizes, in Zai's checkpoint names (transformers 5.19 writes them): KDA
layers with GLM's safe gate (`linear_lower_bound`), MLA layers with a DSA indexer and no RoPE, 4 mHC streams
(`hc_mult`), a dense first layer then MoE (a shared expert beside routed ones, `swiglu_limit` clamps), a vision
tower with its processor. What SGLang's Glm5NextTextConfig reads with other defaults than transformers writes goes
into config.json after the save (`serving_config`):
- `mhc`: SGLang builds the layers without hyper-connections unless it is set;
- `index_kpool_compress`: SGLang's pooled indexer asserts it;
- `first_k_dense_replace`: SGLang's dense-versus-MoE rule (transformers writes `mlp_layer_types`).

Two sizes follow SGLang's DSA KV pool, not the published model's scale: `index_head_dim` 128 (the pool asserts it)
and `index_kpool` 2, since SGLang's page is 64 x `index_kpool` tokens (a 128-token page here; 1024 at the published
16). `index_topk` is the published 2048, so every prompt the tests send is attended densely by both HF and SGLang
(the CPU port runs no indexer: `sglang_cpu_compat.glm5`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from tailreplay_eval.nextn import nextn_fusion

# The processor's marker tokens (Glm5NextProcessor finds image and video ones by these names)
MARKERS = dict(image_token="<|image|>", video_token="<|video|>")
SPECIAL_TOKENS = ("<|image|>", "<|video|>", "<|begin_of_image|>", "<|end_of_image|>", "<|begin_of_video|>",
                  "<|end_of_video|>")
INDEX_KPOOL = 2
MAX_IMAGE_TOKENS = 64  # rows of one image in the language model, after the 2 x 2 merge
PATCHING = dict(patch_size=8, spatial_merge_size=2, temporal_patch_size=2)  # the tower's, and its processor's
TEXT_FIELDS = dict(
    q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=0, qk_nope_head_dim=16, v_head_dim=16,
    index_topk=2048, index_head_dim=128, index_n_heads=2, index_kpool=INDEX_KPOOL,
    linear_head_dim=16, linear_num_heads=4, linear_conv_kernel_dim=4, hc_mult=4,
)
# What SGLang's Glm5NextTextConfig reads with defaults of its own (module docstring)
SERVING_FIELDS = dict(mhc=True, index_kpool_compress=True, first_k_dense_replace=1)


def glm5_config(preset, tokenizer):
    """Glm5NextConfig: the preset's text sizes (layers, hidden, vocab, heads, MoE) with GLM's fields, every fourth
    layer MLA (as GLM's default pattern), the first layer dense, under a tower of the preset's vision sizes (patching:
    PATCHING)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextConfig

    n, moe, vision = preset.num_hidden_layers, preset.moe, preset.vision
    text = dict(TEXT_FIELDS, vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
                intermediate_size=preset.intermediate_size, num_hidden_layers=n,
                num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_attention_heads,
                n_routed_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
                moe_intermediate_size=moe.moe_intermediate_size, n_shared_experts=1,
                max_position_embeddings=preset.max_position_embeddings,
                layer_types=["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)],
                mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
                pad_token_id=tokenizer.token_to_id("<|endoftext|>"), eos_token_id=tokenizer.token_to_id("<|im_end|>"))
    tower = dict(PATCHING, depth=vision.depth, hidden_size=vision.hidden_size, num_heads=vision.num_heads,
                 intermediate_size=vision.intermediate_size,
                 out_hidden_size=preset.hidden_size, projection_intermediate_size=2 * preset.intermediate_size)
    ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    return Glm5NextConfig(text_config=text, vision_config=tower, image_token_id=ids["<|image|>"],
                          video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                          image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                          video_end_token_id=ids["<|end_of_video|>"], tie_word_embeddings=False)


@torch.no_grad()
def init_gates(model, memory_tokens: tuple[float, float]) -> None:
    """GLM's safe gate decays a KDA channel by lower_bound * sigmoid(exp(A_log) (raw + dt_bias)) per token (lower
    bound -5). With A_log 0 and dt_bias = logit(1 / (5 tau)), channel memories tau lie log-spaced over
    `memory_tokens` across each layer's heads x channels, as the other KDA presets' (the raw gate, std 0.02 through
    two projections, modulates it per token). HF's own init keeps at most about 200 tokens."""
    low, high = (math.log10(tokens) for tokens in memory_tokens)
    for module in model.modules():
        if type(module).__name__ == "Glm5NextTextForgetGate":
            share = 1.0 / (-module.safe_gate_lower_bound * torch.logspace(low, high, module.dt_bias.numel()))
            module.dt_bias.copy_(torch.log(share / (1 - share)))
            module.A_log.zero_()


def save_processor(model_type: str, tokenizer, out_dir: Path) -> None:
    """transformers' Glm5NextProcessor patching as the tower does (PATCHING), at most MAX_IMAGE_TOKENS rows per image
    (the vision builders' common signature). It writes tokenizer files of its own: `models.save_tokenizer` runs after
    it, then the build puts MARKERS back (`models.mark_tokens`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.glm5_next.image_processing_glm5_next import Glm5NextImageProcessor
    from transformers.models.glm5_next.processing_glm5_next import Glm5NextProcessor
    from transformers.models.glm5_next.video_processing_glm5_next import Glm5NextVideoProcessor

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, extra_special_tokens=MARKERS)
    patching = dict(patch_size=PATCHING["patch_size"], merge_size=PATCHING["spatial_merge_size"],
                    temporal_patch_size=PATCHING["temporal_patch_size"])
    Glm5NextProcessor(image_processor=Glm5NextImageProcessor(**patching, max_image_tokens=MAX_IMAGE_TOKENS),
                      video_processor=Glm5NextVideoProcessor(**patching), tokenizer=fast).save_pretrained(out_dir)


def serving_config(config_file: Path) -> None:
    """SERVING_FIELDS into the text config, and the checkpoint's dtype into its sub-configs (SGLang takes the text
    config's)."""
    config = json.loads(config_file.read_text())
    config["text_config"].update(SERVING_FIELDS)
    for sub in ("text_config", "vision_config"):
        config[sub]["dtype"] = config["dtype"]
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def write_mtp_head(checkpoint: Path, seed: int) -> None:
    """Add a NEXTN layer at `model.language_model.layers.<num_hidden_layers>.` and declare it
    (`num_nextn_predict_layers`), as GLM ships its MTP layer; SGLang serves it as the draft
    `Glm5NextForConditionalGenerationNextN`: the embedding of token i + 1 and the target's hidden at token i (its
    streams contracted), each normed (`enorm`, `hnorm`) and projected together (`eh_proj`), pass one indexed MLA + MoE
    layer on a plain residual and `shared_head.norm`. The layer starts as a copy of the target's last MLA layer without
    its mHC weights, and `eh_proj` is drawn from `seed`; transformers' glm5_next has no MTP module to distil it from,
    so its drafts are rarely accepted: the target's tokens must come out whatever the draft says."""
    from safetensors.torch import load_file, save_file

    config_file, weights = checkpoint / "config.json", checkpoint / "model.safetensors"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    hidden, nextn = text["hidden_size"], text["num_hidden_layers"]
    last_mla = max(i for i, kind in enumerate(text["layer_types"]) if kind == "indexed_attention")
    stack = "model.language_model.layers."
    tensors = load_file(weights)
    source, target = f"{stack}{last_mla}.", f"{stack}{nextn}."
    for name, tensor in list(tensors.items()):
        if name.startswith(source) and not name.removeprefix(source).startswith("hc_"):
            tensors[target + name.removeprefix(source)] = tensor.clone()
    tensors.update(nextn_fusion(target, hidden, tensors["lm_head.weight"].dtype, seed,
                                ("enorm", "hnorm", "shared_head.norm")))
    save_file(tensors, weights, metadata={"format": "pt"})
    text["num_nextn_predict_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2) + "\n")
