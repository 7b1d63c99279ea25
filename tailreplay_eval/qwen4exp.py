"""Qwen3.8-Flash-Next (`Qwen4ExpForConditionalGeneration`, model_type `qwen4_exp`): tiny checkpoints.

tiny-qwen35-moe-vl's build (a Qwen3.5-style text stack under a Qwen3.5 vision tower, with its processor) as
transformers' Qwen4ExpConfig, plus what Qwen4-Exp adds to the text stack:
- 4 hyper-connection streams (`hc_count`): the residual stream is 4 hidden vectors per token, read by each mixer
  and MLP through a low-rank gated mix (`hc_lowrank`) and written back with per-stream injection weights;
- QSA sparse attention in the full-attention layers (`indexed_attention`): an indexer scores blocks of
  `indexer_compress_ratio` keys and keeps the best `indexer_budget` tokens (SGLang allows budget / ratio of 512 or
  2048 only, so prompts under 1024 tokens see every token, as dense attention);
- per-layer embeddings (PLE) where the preset names its layers (`Preset.ple_layers`; tiny-qwen3.8-flash-next-ple:
  layers 0 and 5): a PLE layer adds hashed n-gram embeddings of the token ids, gated by each stream and passed
  through a dilated depthwise conv, so it holds two more per-request states (the conv's last (kernel - 1) x
  ngram_size inputs, the last ngram_size - 1 token ids; `families/ple.py` rebuilds them). Its n-gram tables are
  small (`PLE_FIELDS`) and its conv taps nonzero (`init_ple_convs`).

SGLang 0.5.23 builds the hyper-connection weights and the n-gram tables in bfloat16 whatever the checkpoint's dtype
(`models/qwen4_exp.py`), so the checkpoint is bfloat16, sub-configs included (SGLang reads the text config's dtype
and would serve a float32 one in float16), and its QSA forces a 64-token page, which only the extra_buffer
strategy allows: the servers run SGLang's GPU-default scheduling.
"""

from __future__ import annotations

import json
from pathlib import Path

# Fields of Qwen4ExpTextConfig on top of the preset's text stack.
TEXT_FIELDS = dict(
    hc_count=4,
    hc_lowrank=16,
    indexer_n_heads=2,
    indexer_kv_heads=1,
    indexer_head_dim=16,
    indexer_budget=1024,
    indexer_compress_ratio=2,
    ple_layer_ids=[],
    output_gate_type="sigmoid",
)


# Per-layer embeddings, where a preset has them (`Preset.ple_layers`): n-gram tables of about 16 x 1,000 rows a layer
# instead of the published 16 x 20 million.
PLE_FIELDS = dict(ngram_vocab_size_base=1000)
PLE_CONV_STD = 0.3  # the dilated conv's taps: HF and SGLang start them at zero, which would leave its state unread


def text_config(config, ple_layers: tuple[int, ...] = ()):
    """The preset's Qwen3.5-style text config (`models.model_config`) with Qwen4-Exp's fields, its full-attention
    layers named as Qwen4-Exp names them (QSA: `indexed_attention`), and PLE on `ple_layers` (1-indexed)."""
    for key, value in dict(TEXT_FIELDS, **(dict(PLE_FIELDS, ple_layer_ids=list(ple_layers)) if ple_layers else {})
                           ).items():
        setattr(config, key, value)
    config.layer_types = ["indexed_attention" if t == "full_attention" else t for t in config.layer_types]
    return config


def init_ple_convs(model, seed: int) -> None:
    """Nonzero taps for every PLE layer's dilated conv (drawn from `seed`), so its state carries across tokens."""
    import torch

    generator = torch.Generator().manual_seed(seed + 7)
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.endswith(".ple.conv1d"):
                module.weight.copy_(PLE_CONV_STD * torch.randn(module.weight.shape, generator=generator))


def serving_dtypes(config_file: Path) -> None:
    """Write the checkpoint's dtype into its sub-configs too: SGLang takes the text config's (float32 as transformers
    leaves it) and would serve the model in float16."""
    config = json.loads(config_file.read_text())
    for sub in ("text_config", "vision_config"):
        config[sub]["dtype"] = config["dtype"]
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def write_mtp_head(checkpoint: Path, seed: int) -> None:
    """Add a multi-token-prediction head under `mtp.*`, as Qwen ships it inside the checkpoint, and declare it
    (`mtp_num_hidden_layers`). SGLang serves it as the NEXTN draft (`models/qwen4_exp_mtp.py`): the target's 4 streams
    at token i and the embedding of token i + 1, each normed and projected (`fc_hidden` per stream, `fc_embedding`
    added to every stream), pass one hyper-connected attention layer and the final mixer. The layer starts as a copy
    of the target's last QSA layer and the projections are drawn from `seed`; no reference model exists to distil it
    from (transformers' qwen4_exp has no MTP module), so its drafts are rarely accepted: speculative decoding must give
    the target's tokens whatever the draft says."""
    import torch
    from safetensors.torch import load_file, save_file

    config_file, weights = checkpoint / "config.json", checkpoint / "model.safetensors"
    config = json.loads(config_file.read_text())
    text = config["text_config"]
    last_qsa = max(i for i, kind in enumerate(text["layer_types"]) if kind == "indexed_attention")
    tensors = load_file(weights)
    stack, layer = "model.language_model.", f"model.language_model.layers.{last_qsa}."
    for name, tensor in list(tensors.items()):
        if name.startswith(layer):
            tensors["mtp.layers.0." + name.removeprefix(layer)] = tensor.clone()
        elif name.startswith(stack + "hyper_connection_mixer."):
            tensors["mtp." + name.removeprefix(stack)] = tensor.clone()
    hidden, dtype = text["hidden_size"], tensors[stack + "embed_tokens.weight"].dtype
    generator = torch.Generator().manual_seed(seed)
    for name in ("fc_embedding", "fc_hidden"):
        tensors[f"mtp.{name}.weight"] = (torch.randn(hidden, hidden, generator=generator) / hidden ** 0.5).to(dtype)
    # Gemma-style norms (1 + weight): zero is the unit gain
    tensors["mtp.pre_fc_norm_embedding.weight"] = torch.zeros(hidden, dtype=dtype)
    tensors["mtp.pre_fc_norm_hidden.weight"] = torch.zeros(text["hc_count"] * hidden, dtype=dtype)
    save_file(tensors, weights, metadata={"format": "pt"})
    text["mtp_num_hidden_layers"] = 1
    config_file.write_text(json.dumps(config, indent=2) + "\n")
