"""Build small random-weight Qwen3.5 / Qwen3-Next / OLMo-Hybrid / Nemotron-H checkpoints that HF transformers 5.19 and
SGLang 0.5.23 both load.

    python -m tailreplay_eval.models --preset tiny-qwen35 --out /tmp/models/tiny-qwen35

Everything is made locally: a byte-level BPE tokenizer trained on a generated English corpus, a config written
for both libraries, and weights drawn by the HF model class from a fixed seed (Jet-Nemotron, which transformers
lacks and SGLang serves: drawn directly, `tailreplay_eval.jet_nemotron`). A directory that already holds the same
build (preset, seed, dtype, builder version; see `tailreplay_build.json`) is left as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, GenerationConfig,
                          PretrainedConfig, PreTrainedModel)

from tailreplay_eval import (glm5, jet_nemotron, kimi_k3, kimi_k3_vl, lfm2vl, minicpmv, nemotron_omni,
                             nemotron_puzzle, qwen4exp, zaya)
from tailreplay_eval.corpus import training_corpus
from tailreplay_eval.tasks import vocabulary_texts

# Bump whenever a change here alters what a preset builds, so cached builds are redone.
BUILDER_VERSION = 6
BUILD_MARKER = "tailreplay_build.json"
DTYPES = ("float32", "bfloat16", "float16")

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (ENDOFTEXT, IM_START, IM_END)
# Qwen's vision special tokens, which the vision-language presets' tokenizers add after the ChatML ones.
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen's chat template reduced to ChatML with images: a message's content is a string or a list of parts, and each
# image part becomes the vision span that the processor expands to one <|image_pad|> per merged patch.
VL_CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- else %}{%- for part in message['content'] %}"
    "{%- if part['type'] == 'image' or part['type'] == 'image_url' or 'image' in part %}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

# Every 4th layer is full attention, the rest Gated DeltaNet: [GDN, GDN, GDN, FA] repeated.
FULL_ATTENTION_INTERVAL = 4
# Qwen3.5's RoPE settings. SGLang's Qwen3-Next / Qwen3.5 attention reads the top-level `rope_theta` and
# `partial_rotary_factor`, while transformers 5 reads `rope_parameters`, so both places get the same values.
ROPE_THETA = 10_000_000.0
PARTIAL_ROTARY_FACTOR = 0.25
# Range of memory lengths, in tokens, that the GDN heads start with (see `_init_gdn_gates`).
GDN_MEMORY_TOKENS = (16.0, 512.0)


@dataclass(frozen=True)
class MoE:
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int


@dataclass(frozen=True)
class Vision:
    """A Qwen3.5 vision tower (transformers' Qwen3_5VisionConfig) and its image processor's patching."""

    depth: int
    hidden_size: int
    num_heads: int
    intermediate_size: int
    patch_size: int
    num_position_embeddings: int  # a square grid of learnt positions, interpolated to each image's patch grid
    spatial_merge_size: int = 2  # 2 x 2 patches merge into one language-model token
    temporal_patch_size: int = 2
    min_pixels: int = 32 * 32
    max_pixels: int = 128 * 128


@dataclass(frozen=True)
class Mamba2:
    """Nemotron-H's Mamba2 mixers and layer pattern (M Mamba2, * attention, - MLP), as NVIDIA's configs spell them."""

    pattern: str
    num_heads: int
    head_dim: int
    n_groups: int
    state_size: int
    chunk_size: int = 64  # SGLang's extra_buffer needs its track interval (256) to be a multiple


@dataclass(frozen=True)
class ShortConv:
    """LFM2's gated short-conv layers and layer pattern (C conv, * attention); `kernel` is conv_L_cache."""

    pattern: str
    kernel: int = 3


@dataclass(frozen=True)
class Kda:
    """Kimi Linear's mixers: KDA layers (K) and MLA attention layers (*) in `pattern`, as Moonshot's
    `linear_attn_config` lists them (1-indexed `kda_layers` / `full_attn_layers`). The MLA layers are NoPE (Kimi's
    `mla_use_nope`): the rope part of each key is still projected, and shared, but never rotated."""

    pattern: str
    num_heads: int
    head_dim: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Jet:
    """Jet-Nemotron's JetBlocks and layer pattern (J JetBlock, * attention); `head_dim` is the key head's, each value
    head `expand_v` times wider, and the dynamic conv's kernel generator `generator_reduction` times narrower than
    the values (`tailreplay_eval.jet_nemotron`)."""

    pattern: str
    num_heads: int
    head_dim: int
    expand_v: float = 2.0
    conv_size: int = 4
    generator_reduction: int = 8


@dataclass(frozen=True)
class Preset:
    model_type: str  # transformers model_type; its causal LM class is the checkpoint's architecture
    num_hidden_layers: int
    hidden_size: int
    # Multiples of 32 throughout: SGLang's CPU path pads unaligned MLP/MoE sizes to 32.
    intermediate_size: int
    vocab_size: int  # the tokenizer is trained to exactly this size
    linear_num_key_heads: int
    linear_num_value_heads: int  # grouped value heads: a multiple of the key heads
    linear_head_dim: int  # GDN key and value head dim
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    dtype: str
    moe: MoE | None = None
    # Train the tokenizer on the task suites' words too (`tasks.vocabulary_texts`), so needle keys, names and
    # template words are whole tokens: a retrieval model then matches one token per key, not a run of fragments.
    task_words: bool = False
    # Qwen3.5 rotates a quarter of each head at theta 1e7. The quality model rotates all of it at 1e4: a hybrid
    # with Qwen3.5's RoPE stayed at chance on a copy drill where this one learnt to copy within 200 steps
    # (docs/quality.md, recipe 4): its full-attention layers need fast frequencies for a previous-token head.
    rope_theta: float = ROPE_THETA
    partial_rotary_factor: float = PARTIAL_ROTARY_FACTOR
    # A vision-language checkpoint (Qwen3_5ForConditionalGeneration, as Qwen publishes Qwen3.5) with this tower.
    vision: Vision | None = None
    # Multimodal RoPE: the rotated pairs split over (time, height, width) positions, interleaved as Qwen3.5's.
    mrope_section: tuple[int, ...] | None = None
    # Nemotron-H (model_type nemotron_h): its Mamba2 layers and pattern; num_hidden_layers is the pattern's length.
    mamba2: Mamba2 | None = None
    # Kimi Linear (model_type kimi_linear): its KDA and MLA layers; num_hidden_layers is the pattern's length.
    kda: Kda | None = None
    # Ling-2.5 (bailing_hybrid without a short conv): the `kda` pattern's linear layers are lightning attention
    # (`tailreplay_eval.ling25`).
    lightning: bool = False
    # Kimi K3 (KimiLinearForCausalLM's config and layers under attention residuals, `tailreplay_eval.kimi_k3`): the
    # bank's block size (attn_res_block_size); None: Kimi Linear.
    attn_res_block: int | None = None
    # Kimi K3 with its vision tower (KimiK3ForConditionalGeneration, `tailreplay_eval.kimi_k3_vl`): the K3 build under
    # a tiny MoonViT3d tower, with K3's media tokens and processor.
    kimi_vision: bool = False
    # Qwen3.8-Flash-Next's per-layer embeddings (`tailreplay_eval.qwen4exp`): the PLE layers, 1-indexed as
    # `ple_layer_ids`; () none.
    ple_layers: tuple[int, ...] = ()
    # LFM2 (model_type lfm2): its short-conv and attention layers; num_hidden_layers is the pattern's length.
    short_conv: ShortConv | None = None
    # Nemotron-H Puzzle (`tailreplay_eval.nemotron_puzzle`): the `mamba2` pattern's MoE layers with their own sizes,
    # written as NemotronHPuzzleForCausalLM with per-layer `block_configs`.
    puzzle: bool = False
    # Jet-Nemotron (model_type jet_nemotron): its JetBlock and attention layers; num_hidden_layers is the pattern's
    # length. Built without transformers (`tailreplay_eval.jet_nemotron`).
    jet: Jet | None = None
    # The build written as another release of the same SGLang class: Nemotron-H Omni's as one of NVIDIA's earlier
    # releases (`nemotron_omni.NANO_RELEASES`: NemotronH_Nano_VL_V2, NemotronH_Nano_Omni_Reasoning_V3), Qwen3.5-MoE's
    # vision-language one as InternS2-Preview (`QWEN_RELEASES`); None: the model itself.
    released_as: str | None = None
    # Multi-token-prediction layers as each vendor ships them inside the checkpoint, which SGLang serves as the NEXTN
    # speculative draft: Qwen3.5's (`tailreplay_eval.mtp`, distilled) and Qwen3.8-Flash-Next's
    # (`qwen4exp.write_mtp_head`) under `mtp.*`, Ling-3.0's (`ling.write_mtp_head`) as its layer num_hidden_layers.
    mtp_layers: int = 0


# model_type -> the module that builds a vision wrapper's config, processor and marker tokens
VISION_WRAPPERS = {"minicpmv4_6": minicpmv, "minicpmv4_7": minicpmv, "lfm2_vl": lfm2vl,
                   "nemotron_h_omni": nemotron_omni, "glm5_next": glm5}

# Architectures SGLang serves with a Qwen3.5 vision-language class unchanged -> the model_type their config.json names
QWEN_RELEASES = {"InternS2PreviewForConditionalGeneration": "intern_s2_preview"}

# The test models' sizes (under a million parameters), shared by every family's tiny preset.
TINY = dict(num_hidden_layers=8, hidden_size=64, intermediate_size=128, vocab_size=512, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_head_dim=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=32768, dtype="float32")

# 8-pixel patches: a 64 x 64 image is 8 x 8 patches, 16 language-model tokens after the 2 x 2 merge.
TINY_VISION = Vision(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=8,
                     num_position_embeddings=256)

# Nemotron-H Omni (nemotron_h_omni, `tailreplay_eval.nemotron_omni`): tiny-nemotron-h's text stack under the
# smallest RADIO tower SGLang builds (ViT-S/16, 12 layers) and NVIDIA's projector; no audio tower.
OMNI_PRESET = Preset(
    model_type="nemotron_h_omni", **dict(TINY, num_hidden_layers=11),
    mamba2=Mamba2(pattern="M-M*-MEM*M-", num_heads=8, head_dim=16, n_groups=2, state_size=16),
    moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
)
PRESETS: dict[str, Preset] = {
    "tiny-qwen35": Preset(
        model_type="qwen3_5_text", **TINY,
    ),
    # tiny-qwen35's weights (same seed, same build) plus an MTP head: the NEXTN draft of the speculative tests.
    "tiny-qwen35-mtp": Preset(
        model_type="qwen3_5_text", **TINY, mtp_layers=1,
    ),
    "tiny-qwen3next": Preset(
        model_type="qwen3_next", **TINY,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "tiny-qwen35-moe": Preset(
        model_type="qwen3_5_moe_text", **TINY,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    # Vision-language checkpoints as Qwen publishes Qwen3.5: the tiny text stack under a tiny vision tower, with a
    # processor. Half of each head rotates, so the multimodal RoPE has 4 pairs to split (Qwen3.5: [11, 11, 10]).
    "tiny-qwen35-vl": Preset(
        model_type="qwen3_5", **TINY, vision=TINY_VISION, partial_rotary_factor=0.5, mrope_section=(2, 1, 1),
    ),
    "tiny-qwen35-moe-vl": Preset(
        model_type="qwen3_5_moe", **TINY, vision=TINY_VISION, partial_rotary_factor=0.5, mrope_section=(2, 1, 1),
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    # The quality-evaluation model (`tailreplay_eval.training`): trained on RULER-style tasks, ~2M parameters.
    "quality-qwen35": Preset(
        model_type="qwen3_5_text", num_hidden_layers=8, hidden_size=128, intermediate_size=256, vocab_size=1408,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_head_dim=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=32768, dtype="float32", task_words=True, rope_theta=10_000.0,
        partial_rotary_factor=1.0,
    ),
    # OLMo-Hybrid (transformers' olmo_hybrid; served by tailreplay_sglang.models): same sizes as tiny-qwen35.
    "tiny-olmo-hybrid": Preset(
        model_type="olmo_hybrid", **TINY,
    ),
    # Nemotron-H (Mamba2): the tiny sizes, a pattern with an MLP between two Mamba2 layers (group 0), a group that
    # starts with an MLP and has a MoE between its Mamba2 layers (group 1: Nemotron-3's MoE, sigmoid router with a
    # score-correction bias, routed scale 2.5, a shared expert) and MLPs after a group's last Mamba2 layer. HF's
    # Mamba2 init (A = 1..heads,
    # dt in [0.001, 0.1]) gives per-token decays from 0.45 to 0.999: the heads' memories span 1 to 1000 tokens.
    "tiny-nemotron-h": Preset(
        model_type="nemotron_h", **dict(TINY, num_hidden_layers=11),
        mamba2=Mamba2(pattern="M-M*-MEM*M-", num_heads=8, head_dim=16, n_groups=2, state_size=16),
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    # Nemotron-H Puzzle: tiny-nemotron-h's sizes with MoE layers at 3, 6 and 10, each with its own expert width and
    # top-k (nemotron_puzzle.OVERRIDES).
    "tiny-nemotron-h-puzzle": Preset(
        model_type="nemotron_h", **dict(TINY, num_hidden_layers=11), puzzle=True,
        mamba2=Mamba2(pattern="M-ME*-EM*ME", num_heads=8, head_dim=16, n_groups=2, state_size=16),
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    "tiny-nemotron-h-omni": OMNI_PRESET,
    # NVIDIA's earlier releases of the Omni's SGLang class: tiny-nemotron-h-omni's weights (the same preset and seed),
    # config.json naming that release's architecture and model_type (`nemotron_omni.NANO_RELEASES`)
    **{name: replace(OMNI_PRESET, released_as=release) for name, release in (
        ("tiny-nemotron-h-nano-vl", "NemotronH_Nano_VL_V2"),
        ("tiny-nemotron-h-nano-omni", "NemotronH_Nano_Omni_Reasoning_V3"))},
    # Granite-4.0-H (granitemoehybrid, Mamba2): Mamba2 and attention mixers each with a MoE and a shared MLP in the
    # same layer, and Granite 4's multipliers (embedding 12, residual 0.22, attention 1/128).
    "tiny-granite-4.0-h": Preset(
        model_type="granitemoehybrid", **TINY,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
        mamba2=Mamba2(pattern="MMM*MMM*", num_heads=8, head_dim=16, n_groups=1, state_size=16),
    ),
    # Falcon-H1 (falcon_h1): attention and Mamba2 side by side in every layer. Served by stock SGLang here (the
    # Mamba2 CPU ops); Tail-Replay refuses it at start-up with the store-to-KV ratio
    # (layout._refuse_unsupported_mixers).
    "tiny-falcon-h1": Preset(
        model_type="falcon_h1", **dict(TINY, num_hidden_layers=4),
        mamba2=Mamba2(pattern="", num_heads=8, head_dim=16, n_groups=1, state_size=16),
    ),
    # Kimi Linear (kimi_linear, KDA + MLA): layer 1 a dense MLP and the rest Kimi's MoE (sigmoid router with a
    # score-correction bias, one shared expert), as Moonshot's first_k_dense_replace = 1.
    "tiny-kimi-linear": Preset(
        model_type="kimi_linear", **TINY,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        kda=Kda(pattern="KKK*KKK*", num_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    ),
    # Ling-3.0 (bailing_hybrid, BailingMoeV3ForCausalLM: KDA + gated MLA with RoPE, served by SGLang, not by
    # transformers): tiny-kimi-linear's structure under Bailing's names, every 4th layer MLA (`tailreplay_eval.ling`).
    "tiny-ling-3.0": Preset(
        model_type="bailing_hybrid", **TINY, rope_theta=10_000.0,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        kda=Kda(pattern="KKK*KKK*", num_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    ),
    # Ling-2.5 (BailingMoeV2_5ForCausalLM: lightning attention + ungated MLA with RoPE, served by SGLang, not by
    # transformers): tiny-ling-3.0's layout with lightning mixers in its linear layers (`tailreplay_eval.ling25`).
    "tiny-ling-2.5": Preset(
        model_type="bailing_hybrid", **TINY, rope_theta=10_000.0, lightning=True,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        kda=Kda(pattern="KKK*KKK*", num_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    ),
    # Kimi K3 (KimiK3LinearForCausalLM, served by SGLang, not by transformers; `tailreplay_eval.kimi_k3`):
    # tiny-kimi-linear's layers in 12 (three groups of three KDA layers, each closed by a gated NoPE MLA layer) under
    # attention residuals banked every 8 layers: group 1 starts mid-block (its input is the running residual) and
    # group 2 on a banking layer (its input is the row banked there).
    "tiny-kimi-k3": Preset(
        model_type="kimi_linear", **dict(TINY, num_hidden_layers=12), attn_res_block=8,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        kda=Kda(pattern="KKK*KKK*KKK*", num_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    ),
    # Kimi K3 with its vision tower (KimiK3ForConditionalGeneration; `tailreplay_eval.kimi_k3_vl`): tiny-kimi-k3's
    # language model (its own tokenizer, with K3's media tokens) under a two-block MoonViT3d tower.
    "tiny-kimi-k3-vl": Preset(
        model_type="kimi_linear", **dict(TINY, num_hidden_layers=12), attn_res_block=8, kimi_vision=True,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
        kda=Kda(pattern="KKK*KKK*KKK*", num_heads=4, head_dim=16, kv_lora_rank=32, qk_nope_head_dim=16,
                qk_rope_head_dim=8, v_head_dim=16),
    ),
    # Jet-Nemotron (jet_nemotron, `tailreplay_eval.jet_nemotron`): the tiny sizes in 6 layers, two groups of two
    # JetBlocks (4 heads of 16 key and 32 value channels, a 4-tap dynamic conv) each closed by Qwen2 attention.
    "tiny-jet-nemotron": Preset(
        model_type="jet_nemotron", **dict(TINY, num_hidden_layers=6), rope_theta=1_000_000.0,
        jet=Jet(pattern="JJ*JJ*", num_heads=4, head_dim=16),
    ),
    # Qwen3.8-Flash-Next (qwen4_exp, `tailreplay_eval.qwen4exp`): tiny-qwen35-moe-vl's build with 4 hyper-connection
    # streams and QSA sparse attention in its full-attention layers, without per-layer embeddings, in bfloat16, with
    # an undistilled MTP head (`qwen4exp.write_mtp_head`).
    "tiny-qwen3.8-flash-next": Preset(
        model_type="qwen4_exp", **dict(TINY, dtype="bfloat16"), vision=TINY_VISION, partial_rotary_factor=0.5,
        mrope_section=(2, 1, 1), mtp_layers=1,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    # Qwen3.8-Flash-Next with per-layer embeddings: the same build (no MTP head) with PLE on layers 1 and 6
    # (1-indexed): the first layer of GDN group 0 and a GDN layer inside group 1 (transformers allows PLE on
    # linear-attention layers only).
    "tiny-qwen3.8-flash-next-ple": Preset(
        model_type="qwen4_exp", **dict(TINY, dtype="bfloat16"), vision=TINY_VISION, partial_rotary_factor=0.5,
        mrope_section=(2, 1, 1), ple_layers=(1, 6),
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=64),
    ),
    # GLM-5.3-Flash (glm5_next, `tailreplay_eval.glm5`): KDA and DSA-indexed MLA layers (every fourth) under 4 mHC
    # streams, a dense first layer then MoE, under a vision tower, with an undistilled MTP layer
    # (`glm5.write_mtp_head`).
    "tiny-glm-5.3-flash": Preset(
        model_type="glm5_next", **TINY, vision=TINY_VISION, mtp_layers=1,
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32),
    ),
    # MiniCPM-V 4.6 (minicpmv4_6, `tailreplay_eval.minicpmv`): tiny-qwen35's text stack under a two-layer SigLIP tower
    # of 14-px patches at 448 px (1024 patches, 64 language-model tokens per image after the 16x downsampling).
    "tiny-minicpmv4.6": Preset(
        model_type="minicpmv4_6", **TINY,
        vision=Vision(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14,
                      num_position_embeddings=(448 // 14) ** 2),
    ),
    # MiniCPM-V 4.7 (minicpmv4_7): 4.6's build with canvas M-RoPE, half of each head rotated so that the (t, h, w)
    # sections have 4 pairs to split (as tiny-qwen35-vl).
    "tiny-minicpmv4.7": Preset(
        model_type="minicpmv4_7", **TINY, partial_rotary_factor=0.5, mrope_section=(2, 1, 1),
        vision=Vision(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=14,
                      num_position_embeddings=(448 // 14) ** 2),
    ),
    # LFM2-VL (lfm2_vl, `tailreplay_eval.lfm2vl`): tiny-lfm2's text stack under a two-layer SigLIP2 tower of 16-px
    # patches (a 256-px image: 256 patches, 64 rows after the 2 x 2 unshuffle).
    "tiny-lfm2-vl": Preset(
        model_type="lfm2_vl", **TINY, short_conv=ShortConv(pattern="CC*CCC*C"),
        vision=Vision(depth=2, hidden_size=32, num_heads=2, intermediate_size=64, patch_size=16,
                      num_position_embeddings=256),
    ),
    # LFM2 (lfm2: gated short conv + GQA, each layer with a SwiGLU MLP): groups of 2, 3 and 1 conv layers between the
    # attention layers, so a zero-init tail of (3 - 1) x 3 = 6 tokens rebuilds every group's state exactly.
    "tiny-lfm2": Preset(
        model_type="lfm2", **TINY, short_conv=ShortConv(pattern="CC*CCC*C"),
    ),
    # LFM2-MoE (lfm2_moe): tiny-lfm2's pattern, layers 0-1 dense, the rest Liquid's MoE.
    "tiny-lfm2-moe": Preset(
        model_type="lfm2_moe", **TINY, short_conv=ShortConv(pattern="CC*CCC*C"),
        moe=MoE(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=0),
    ),
    # ZAYA1 (zaya, `tailreplay_eval.zaya`): 4 of transformers' layers (SGLang's 8: CCA attention, then MoE), 4 heads
    # over 2 KV heads of 16, half of each rotated at theta 1e4, 4 experts (one per token) routed through a 32-wide MLP.
    "tiny-zaya": Preset(
        model_type="zaya", **dict(TINY, num_hidden_layers=4), rope_theta=10_000.0, partial_rotary_factor=0.5,
        moe=MoE(num_experts=4, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=0),
    ),
    "small": Preset(
        model_type="qwen3_5_text", num_hidden_layers=12, hidden_size=512, intermediate_size=1536, vocab_size=1024,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=65536, dtype="bfloat16",
    ),
    # Benchmark-size OLMo-Hybrid, the sizes of "small" (head_dim is hidden / heads there, as OLMo-Hybrid derives it).
    "small-olmo-hybrid": Preset(
        model_type="olmo_hybrid", num_hidden_layers=12, hidden_size=512, intermediate_size=1536, vocab_size=1024,
        linear_num_key_heads=4, linear_num_value_heads=8, linear_head_dim=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=128,
        max_position_embeddings=65536, dtype="bfloat16",
    ),
}

# InternS2-Preview (intern_s2_preview): SGLang serves it with Qwen3.5-MoE's vision-language class unchanged
# (`models/interns2preview.py` subclasses it, its config Qwen3.5-MoE's), so tiny-qwen35-moe-vl's build (the same preset
# and seed: the same weights) with a config.json naming InternS2-Preview (`QWEN_RELEASES`).
# tiny-ling-3.0's weights (same seed, same build) plus an undistilled NEXTN layer (`ling.write_mtp_head`): Ling-3.0's
# MTP draft in the speculative tests.
PRESETS["tiny-ling-3.0-mtp"] = replace(PRESETS["tiny-ling-3.0"], mtp_layers=1)
PRESETS["tiny-interns2-preview"] = replace(PRESETS["tiny-qwen35-moe-vl"],
                                           released_as="InternS2PreviewForConditionalGeneration")

# Benchmark-size Mamba2 hybrids, the sizes of "small" (hidden 512, 12 layers, 2 attention layers of 4 x 128 heads):
# Mamba2 mixers of 16 heads x 64 (expand 2), 4 groups of state 64, 128-token chunks.
SMALL_MAMBA2 = dict(num_heads=16, head_dim=64, n_groups=4, state_size=64, chunk_size=128)
PRESETS["small-nemotron-h"] = replace(PRESETS["small"], model_type="nemotron_h",
                                      mamba2=Mamba2(pattern="M-M-M*M-M-M*", **SMALL_MAMBA2))
PRESETS["small-granite-4.0-h"] = replace(
    PRESETS["small"], model_type="granitemoehybrid", mamba2=Mamba2(pattern="MMMMM*MMMMM*", **SMALL_MAMBA2),
    moe=MoE(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=512))

# Benchmark-size Kimi Linear, the sizes of "small" (hidden 512, 12 layers, 2 of them MLA): KDA mixers of 8 heads x 64,
# NoPE MLA of 4 heads over a 128 + 32 latent, a MoE of 8 experts (top 2) and a shared one after a dense first layer.
PRESETS["small-kimi-linear"] = replace(
    PRESETS["small"], model_type="kimi_linear",
    moe=MoE(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, shared_expert_intermediate_size=256),
    kda=Kda(pattern="KKKKK*KKKKK*", num_heads=8, head_dim=64, kv_lora_rank=128, qk_nope_head_dim=64,
            qk_rope_head_dim=32, v_head_dim=64))

# Benchmark-size vision-language checkpoint: "small" under a 4-block vision tower with Qwen3.5's 16-pixel patches
# (a 512 x 384 screenshot is 192 tokens); Qwen3.5's quarter-head rotation gives 16 pairs for the multimodal RoPE.
PRESETS["small-qwen35-vl"] = replace(
    PRESETS["small"], model_type="qwen3_5", mrope_section=(6, 5, 5),
    vision=Vision(depth=4, hidden_size=128, num_heads=4, intermediate_size=256, patch_size=16,
                  num_position_embeddings=576, min_pixels=64 * 64, max_pixels=1024 * 1024))


# --- tokenizer ---------------------------------------------------------------------------------------------------

def train_tokenizer(vocab_size: int, extra_texts: tuple[str, ...] = (),
                    special_tokens: tuple[str, ...] = SPECIAL_TOKENS) -> Tokenizer:
    """Byte-level BPE (so any text round-trips) with the special tokens first (the ChatML ones at ids 0, 1, 2),
    trained on `training_corpus()` plus `extra_texts`."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_corpus() + list(extra_texts), trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        # The model's vocab must equal the tokenizer's, or sampled ids could not be decoded.
        raise ValueError(f"corpus only supports {tokenizer.get_vocab_size()} tokens, preset wants {vocab_size}")
    return tokenizer


def preset_tokenizer(preset: Preset) -> Tokenizer:
    """The tokenizer a preset's build gets."""
    wrapper = VISION_WRAPPERS.get(preset.model_type)
    special = SPECIAL_TOKENS + (wrapper.SPECIAL_TOKENS if wrapper else VISION_TOKENS if preset.vision else ())
    if preset.kimi_vision:
        special += kimi_k3_vl.SPECIAL_TOKENS
    return train_tokenizer(preset.vocab_size, vocabulary_texts() if preset.task_words else (), special)


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int,
                   chat_template: str = CHAT_TEMPLATE) -> None:
    """tokenizer.json plus a hand-written tokenizer_config.json.

    transformers 5's own writer puts the chat template in a separate chat_template.jinja and names its v5-only
    backend class; writing the config ourselves keeps the template inline and the class name that every reader
    (older transformers, SGLang's tokenizer manager) understands.
    """
    tokenizer.save(str(out_dir / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "chat_template": chat_template,
        "model_max_length": model_max_length,
        # Byte-level BPE decodes exactly; the default clean-up would rewrite spaces before punctuation.
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2) + "\n")


# --- model -------------------------------------------------------------------------------------------------------


def load_tokenizer(model_path):
    """A checkpoint's tokenizer, as its tokenizer files describe it. Given an empty config, transformers does not read
    config.json, which it cannot for a model type it lacks (Jet-Nemotron's `jet_nemotron`, which SGLang serves)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path, config=PretrainedConfig())


def mark_tokens(out_dir: Path, markers: dict[str, str]) -> None:
    """A vision wrapper's processor finds its marker tokens as tokenizer attributes (`tokenizer.image_token`), which
    transformers reads from tokenizer_config.json's `extra_special_tokens`; `save_tokenizer` writes none."""
    path = out_dir / "tokenizer_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), extra_special_tokens=markers), indent=2) + "\n")


def layer_types(num_hidden_layers: int) -> list[str]:
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_hidden_layers)
    ]


def _common_fields(preset: Preset, tokenizer: Tokenizer) -> dict:
    """What every preset's config spells the same way, whatever its model type."""
    return dict(
        vocab_size=preset.vocab_size,
        hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers,
        layer_types=layer_types(preset.num_hidden_layers),
        num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_key_value_heads,
        linear_num_key_heads=preset.linear_num_key_heads,
        linear_num_value_heads=preset.linear_num_value_heads,
        linear_key_head_dim=preset.linear_head_dim,
        linear_value_head_dim=preset.linear_head_dim,
        linear_conv_kernel_dim=4,
        max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def olmo_hybrid_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' OlmoHybridConfig, which has no head_dim (it is hidden / heads) and rotates whole heads."""
    if preset.head_dim * preset.num_attention_heads != preset.hidden_size:
        raise ValueError("OLMo-Hybrid derives head_dim as hidden_size / num_attention_heads")
    return AutoConfig.for_model(
        preset.model_type,
        **_common_fields(preset, tokenizer),
        linear_allow_neg_eigval=True,  # beta in (0, 2): transformers' default, and the path that differs from Qwen
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
    )


def vision_language_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' Qwen3_5Config / Qwen3_5MoeConfig: the text config of `preset` (with multimodal RoPE) under a
    vision tower, and the vision special tokens' ids."""
    vision = preset.vision
    text = model_config(replace(preset, model_type=f"{preset.model_type}_text", vision=None), tokenizer)
    text.rope_parameters["mrope_section"] = list(preset.mrope_section)
    text.rope_parameters["mrope_interleaved"] = True  # transformers' Qwen3.5 always interleaves
    text_fields = dict(text.to_dict(), rope_theta=preset.rope_theta)  # to_dict drops the top-level copy SGLang reads
    config = AutoConfig.for_model(
        preset.model_type,
        text_config=text_fields,
        vision_config=dict(
            depth=vision.depth, hidden_size=vision.hidden_size, num_heads=vision.num_heads,
            intermediate_size=vision.intermediate_size, patch_size=vision.patch_size,
            spatial_merge_size=vision.spatial_merge_size, temporal_patch_size=vision.temporal_patch_size,
            out_hidden_size=preset.hidden_size, num_position_embeddings=vision.num_position_embeddings,
        ),
        image_token_id=tokenizer.token_to_id(IMAGE_PAD), video_token_id=tokenizer.token_to_id(VIDEO_PAD),
        vision_start_token_id=tokenizer.token_to_id(VISION_START),
        vision_end_token_id=tokenizer.token_to_id(VISION_END),
        tie_word_embeddings=False,
    )
    # Qwen3.5 has no deepstack features; SGLang's vision config defaults to Qwen3-VL's [8, 16, 24] unless told.
    config.vision_config.deepstack_visual_indexes = []
    return config


def save_processor(preset: Preset, tokenizer: Tokenizer, out_dir: Path) -> None:
    """The processor Qwen3.5 checkpoints ship (Qwen3VLProcessor: image and video processors over the tokenizer).
    It writes tokenizer files of its own: `save_tokenizer` runs after it."""
    from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    vision = preset.vision
    patching = dict(patch_size=vision.patch_size, merge_size=vision.spatial_merge_size,
                    temporal_patch_size=vision.temporal_patch_size,
                    size={"shortest_edge": vision.min_pixels, "longest_edge": vision.max_pixels},
                    image_mean=[0.5, 0.5, 0.5], image_std=[0.5, 0.5, 0.5])
    processor = Qwen3VLProcessor(image_processor=Qwen2VLImageProcessor(**patching),
                                 tokenizer=PreTrainedTokenizerFast(tokenizer_object=tokenizer),
                                 video_processor=Qwen3VLVideoProcessor(**patching), chat_template=VL_CHAT_TEMPLATE)
    processor.save_pretrained(out_dir)


def nemotron_h_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' NemotronHConfig for `preset.mamba2`; `nvidia_config_fields` respells it as NVIDIA ships it."""
    m = preset.mamba2
    if len(m.pattern) != preset.num_hidden_layers:
        raise ValueError(f"pattern {m.pattern!r} has {len(m.pattern)} layers, not {preset.num_hidden_layers}")
    return AutoConfig.for_model(
        "nemotron_h", vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, hybrid_override_pattern=m.pattern,
        num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim, intermediate_size=preset.intermediate_size, ssm_state_size=m.state_size,
        mamba_num_heads=m.num_heads, mamba_head_dim=m.head_dim, n_groups=m.n_groups, conv_kernel=4,
        expand=m.num_heads * m.head_dim // preset.hidden_size, chunk_size=m.chunk_size,
        max_position_embeddings=preset.max_position_embeddings, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END), pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        **({} if preset.moe is None else dict(
            n_routed_experts=preset.moe.num_experts, num_experts_per_tok=preset.moe.num_experts_per_tok,
            moe_intermediate_size=preset.moe.moe_intermediate_size, n_shared_experts=1,
            moe_shared_expert_intermediate_size=preset.moe.shared_expert_intermediate_size,
            routed_scaling_factor=2.5, n_group=1, topk_group=1, norm_topk_prob=True)),
    )


def granite_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' GraniteMoeHybridConfig as Granite-4.0-H ships it: layer_types mamba / attention, no position
    embeddings, Granite 4's embedding, residual and attention multipliers (a replay that drops one is wrong). The
    logits are not scaled down (the replay never reaches the head, and a divisor would shrink every log-prob error
    the tests measure by as much)."""
    m, moe = preset.mamba2, preset.moe
    return AutoConfig.for_model(
        "granitemoehybrid", vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=moe.moe_intermediate_size, shared_intermediate_size=moe.shared_expert_intermediate_size,
        num_local_experts=moe.num_experts, num_experts_per_tok=moe.num_experts_per_tok,
        num_hidden_layers=len(m.pattern), layer_types=["mamba" if c == "M" else "attention" for c in m.pattern],
        num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
        position_embedding_type="nope", mamba_n_heads=m.num_heads, mamba_d_head=m.head_dim,
        mamba_n_groups=m.n_groups, mamba_d_state=m.state_size, mamba_d_conv=4,
        mamba_expand=m.num_heads * m.head_dim // preset.hidden_size, mamba_chunk_size=m.chunk_size,
        embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=1 / 128,
        logits_scaling=1.0, max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def falcon_h1_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    m = preset.mamba2
    return AutoConfig.for_model(
        "falcon_h1", vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim, mamba_d_ssm=m.num_heads * m.head_dim, mamba_n_heads=m.num_heads,
        mamba_d_head=m.head_dim, mamba_n_groups=m.n_groups, mamba_d_state=m.state_size, mamba_d_conv=4,
        mamba_chunk_size=m.chunk_size, max_position_embeddings=preset.max_position_embeddings,
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def lfm2_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' Lfm2Config (the feed-forward width as given, no auto-adjust) or Lfm2MoeConfig (its first two
    layers dense, then Liquid's MoE: sigmoid router with an expert bias, routed scale 2.5); head_dim hidden / heads."""
    pattern = preset.short_conv.pattern
    if preset.head_dim * preset.num_attention_heads != preset.hidden_size:
        raise ValueError("LFM2 derives head_dim as hidden_size / num_attention_heads")
    if preset.moe is None:
        kind = dict(block_auto_adjust_ff_dim=False)
    else:
        kind = dict(num_experts=preset.moe.num_experts, num_experts_per_tok=preset.moe.num_experts_per_tok,
                    moe_intermediate_size=preset.moe.moe_intermediate_size, num_dense_layers=2, use_expert_bias=True,
                    routed_scaling_factor=2.5, norm_topk_prob=True)
    return AutoConfig.for_model(
        preset.model_type, vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        intermediate_size=preset.intermediate_size, num_hidden_layers=len(pattern), **kind,
        num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
        conv_L_cache=preset.short_conv.kernel, conv_bias=False,
        full_attn_idxs=[i for i, c in enumerate(pattern) if c == "*"],
        layer_types=["full_attention" if c == "*" else "conv" for c in pattern],
        max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": preset.rope_theta},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def kimi_linear_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' KimiLinearConfig from the fields Moonshot's config.json has (`moonshot_config_fields`)."""
    return AutoConfig.for_model("kimi_linear", **moonshot_config_fields(preset, tokenizer))


def moonshot_config_fields(preset: Preset, tokenizer: Tokenizer) -> dict:
    """Kimi-Linear-48B-A3B's config.json keys at `preset`'s sizes: the layer pattern as 1-indexed
    `linear_attn_config` lists, the MoE as `num_experts` / `num_experts_per_token` / `num_shared_experts` with a
    sigmoid router, NoPE MLA without a query low-rank. Both transformers and SGLang read these."""
    k, moe = preset.kda, preset.moe
    if len(k.pattern) != preset.num_hidden_layers:
        raise ValueError(f"pattern {k.pattern!r} has {len(k.pattern)} layers, not {preset.num_hidden_layers}")
    return dict(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size, intermediate_size=preset.intermediate_size,
        num_hidden_layers=preset.num_hidden_layers, num_attention_heads=preset.num_attention_heads,
        num_key_value_heads=preset.num_attention_heads, head_dim=k.qk_rope_head_dim,
        q_lora_rank=None, kv_lora_rank=k.kv_lora_rank, qk_nope_head_dim=k.qk_nope_head_dim,
        qk_rope_head_dim=k.qk_rope_head_dim, v_head_dim=k.v_head_dim, mla_use_nope=True,
        linear_attn_config={
            "kda_layers": [i + 1 for i, c in enumerate(k.pattern) if c == "K"],
            "full_attn_layers": [i + 1 for i, c in enumerate(k.pattern) if c == "*"],
            "head_dim": k.head_dim, "num_heads": k.num_heads, "short_conv_kernel_size": 4,
        },
        num_experts=moe.num_experts, num_experts_per_token=moe.num_experts_per_tok,
        moe_intermediate_size=moe.moe_intermediate_size,
        num_shared_experts=moe.shared_expert_intermediate_size // moe.moe_intermediate_size,
        first_k_dense_replace=1, moe_layer_freq=1, moe_renormalize=True, moe_router_activation_func="sigmoid",
        routed_scaling_factor=2.446, use_grouped_topk=True, num_expert_group=1, topk_group=1,
        rms_norm_eps=1e-5, hidden_act="silu", max_position_embeddings=preset.max_position_embeddings,
        model_max_length=preset.max_position_embeddings, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=tokenizer.token_to_id(IM_END), pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def nvidia_config_fields(config: dict) -> dict:
    """config.json as NVIDIA writes Nemotron-H's: the layer pattern as `hybrid_override_pattern` (transformers 5
    writes `layers_block_type`), and the Mamba2 sizes under both of the names SGLang's and transformers' configs
    read (SGLang's reads `mamba_n_groups`, defaulting to 8, where transformers writes `n_groups`)."""
    config = dict(config)
    letters = {"linear_attention": "M", "mlp": "-", "full_attention": "*", "moe": "E"}
    config["hybrid_override_pattern"] = "".join(letters[t] for t in config.pop("layers_block_type"))
    config["num_hidden_layers"] = len(config["hybrid_override_pattern"])
    config.pop("mtp_layers_block_type", None)
    config.update(mamba_n_groups=config["n_groups"], mamba_d_conv=config["conv_kernel"],
                  mamba_expand=config["expand"], mamba_chunk_size=config["chunk_size"],
                  time_step_limit=[0.0, float("inf")])
    return config


def zaya_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' ZayaConfig: `num_hidden_layers` of its layers (each CCA attention and a MoE), every one a full
    causal one (`hybrid`), the router's MLP half the hidden size."""
    from transformers.models.zaya import ZayaConfig  # not AutoConfig: SGLang registers its own ZayaConfig over it

    return ZayaConfig(
        vocab_size=preset.vocab_size, hidden_size=preset.hidden_size,
        num_hidden_layers=preset.num_hidden_layers,
        num_attention_heads=preset.num_attention_heads, num_key_value_heads=preset.num_key_value_heads,
        head_dim=preset.head_dim, num_experts=preset.moe.num_experts,
        num_experts_per_tok=preset.moe.num_experts_per_tok, moe_intermediate_size=preset.moe.moe_intermediate_size,
        router_hidden_size=preset.hidden_size // 2, max_position_embeddings=preset.max_position_embeddings,
        rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": preset.rope_theta,
                                    "partial_rotary_factor": preset.partial_rotary_factor}},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=tokenizer.token_to_id(IM_END),
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
    )


def model_config(preset: Preset, tokenizer: Tokenizer) -> PretrainedConfig:
    if preset.model_type == "zaya":
        return zaya_config(preset, tokenizer)
    if preset.model_type == "glm5_next":
        return glm5.glm5_config(preset, tokenizer)
    if preset.model_type == "nemotron_h":
        return nemotron_h_config(preset, tokenizer)
    if preset.model_type == "granitemoehybrid":
        return granite_config(preset, tokenizer)
    if preset.model_type == "falcon_h1":
        return falcon_h1_config(preset, tokenizer)
    if preset.model_type == "olmo_hybrid":
        return olmo_hybrid_config(preset, tokenizer)
    if preset.model_type in ("lfm2", "lfm2_moe"):
        return lfm2_config(preset, tokenizer)
    if preset.model_type == "lfm2_vl":
        text = lfm2_config(replace(preset, model_type="lfm2", vision=None), tokenizer)
        return lfm2vl.lfm2vl_config(text, preset.vision, tokenizer)
    if preset.model_type in ("kimi_linear", "bailing_hybrid"):  # Ling is built as Kimi Linear, then renamed
        return kimi_linear_config(preset, tokenizer)
    if preset.model_type == "nemotron_h_omni":
        return nemotron_omni.omni_config(nemotron_h_config(replace(preset, model_type="nemotron_h"), tokenizer),
                                         tokenizer)
    if preset.model_type in ("minicpmv4_6", "minicpmv4_7"):
        text = model_config(replace(preset, model_type="qwen3_5_text", vision=None, mrope_section=None), tokenizer)
        if preset.mrope_section:
            text.rope_parameters.update(mrope_section=list(preset.mrope_section), mrope_interleaved=True)
        return minicpmv.minicpmv_config(preset.model_type, text, preset.vision, tokenizer, preset.rope_theta)
    if preset.vision is not None:
        return vision_language_config(preset, tokenizer)
    moe_fields = {}
    if preset.moe is not None:
        # decoder_sparse_step=1 and no mlp_only_layers: every layer is MoE, which is all SGLang's Qwen3-Next supports.
        moe_fields = dict(asdict(preset.moe), decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True)
    config = AutoConfig.for_model(
        preset.model_type,
        **_common_fields(preset, tokenizer),
        head_dim=preset.head_dim,
        # No mrope_section: text-only checkpoints then get plain 1-D RoPE in SGLang, which is what HF's
        # (always interleaved-mrope) rotary embedding reduces to when all three position rows are equal.
        rope_parameters={
            "rope_type": "default", "rope_theta": preset.rope_theta,
            "partial_rotary_factor": preset.partial_rotary_factor,
        },
        **moe_fields,
    )
    # Keys transformers 5 no longer writes but SGLang's configs read. SGLang derives its layer pattern from
    # full_attention_interval (not layer_types) and defaults attn_output_gate to True, which HF's Qwen3.5 /
    # Qwen3-Next attention always applies; spelling it out keeps the two from drifting apart silently.
    config.full_attention_interval = FULL_ATTENTION_INTERVAL
    config.rope_theta = preset.rope_theta
    config.partial_rotary_factor = preset.partial_rotary_factor  # HF's Qwen3.5 config writes 0.25 here regardless
    config.attn_output_gate = True
    return qwen4exp.text_config(config, preset.ple_layers) if preset.model_type == "qwen4_exp_text" else config


@torch.no_grad()
def _init_gdn_gates(model: PreTrainedModel) -> None:
    """Give every GDN head a memory of tens to hundreds of tokens.

    The per-token state decay is exp(-exp(A_log) * softplus(a_t + dt_bias)). HF's init (A ~ U(0.01, 16),
    dt_bias = 1) leaves most heads with a decay below 0.01, so the recurrent state is forgotten within a token
    or two and replaying a prefix state would be indistinguishable from dropping it. We set A = 1 and
    softplus(dt_bias) = 1 / tau with tau log-spaced over GDN_MEMORY_TOKENS across each layer's value heads:
    decay exp(-1/tau), i.e. a memory of about tau tokens. The input term a_t (std ~0.02 * sqrt(hidden)) still
    modulates it per token, by a factor of about exp(a_t).
    """
    low, high = (math.log10(tokens) for tokens in GDN_MEMORY_TOKENS)
    for module in model.modules():
        if type(module).__name__.endswith("GatedDeltaNet"):
            rate = 1.0 / torch.logspace(low, high, module.num_v_heads)
            module.dt_bias.copy_(torch.log(torch.expm1(rate)))  # inverse softplus
            module.A_log.zero_()


@torch.no_grad()
def _init_mamba2_gates(model: PreTrainedModel, unit_output: bool = False) -> None:
    """Nemotron-H's Mamba2 heads get the GDN presets' memories: per-token decay exp(dt A) with A = -1 and
    softplus(dt_bias) = 1 / tau, tau log-spaced over GDN_MEMORY_TOKENS across each layer's heads; input projection
    and conv taps of unit gain (std fan_in^-1/2), so x, B, C and the state's read-out S C are O(1) next to the skip
    term D x. With HF's init (in_proj and conv std 0.02, A = 1..H, dt in [0.001, 0.1]) the mixers added nothing
    measurable to the residual stream and a 64-token zero-init tail came within 3e-4 nats of the exact state: a
    test could not tell a dropped state from a replayed one. (With D = 0 as well, the gated norm divided near-zero
    early outputs, and float32 rounding grew to 0.015 nats between SGLang and HF.) `unit_output`: the output
    projection too, for Granite-4.0-H, whose multipliers (embeddings x 12, mixer outputs x 0.22) otherwise left a
    zero-init tail within 0.002 nats of the exact state."""
    low, high = (math.log10(tokens) for tokens in GDN_MEMORY_TOKENS)
    for module in model.modules():
        if hasattr(module, "A_log") and hasattr(module, "dt_bias") and hasattr(module, "conv1d"):
            rate = 1.0 / torch.logspace(low, high, module.A_log.numel())
            module.dt_bias.copy_(torch.log(torch.expm1(rate)))
            module.A_log.zero_()
            module.in_proj.weight.normal_(0.0, module.in_proj.weight.shape[1] ** -0.5)
            module.conv1d.weight.normal_(0.0, module.conv1d.weight.shape[-1] ** -0.5)
            if unit_output:
                module.out_proj.weight.normal_(0.0, module.out_proj.weight.shape[1] ** -0.5)


@torch.no_grad()
def _init_kda_gates(model: PreTrainedModel) -> None:
    """Kimi Linear's KDA channels get the GDN presets' memories: A = 1 and softplus(dt_bias) = 1 / tau per key
    channel, tau log-spaced over GDN_MEMORY_TOKENS across each layer's heads x channels (the forget-gate projection,
    std 0.02, modulates it per token)."""
    low, high = (math.log10(tokens) for tokens in GDN_MEMORY_TOKENS)
    for module in model.modules():
        if type(module).__name__ == "KimiLinearForgetGate":
            rate = 1.0 / torch.logspace(low, high, module.dt_bias.numel())
            module.dt_bias.copy_(torch.log(torch.expm1(rate)))
            module.A_log.zero_()


@torch.no_grad()
def _init_short_conv(model: PreTrainedModel) -> None:
    """Make the short conv matter. With HF's init (std 0.02 throughout) a layer's gated conv output is about 2 % of
    the residual stream, so a conv state lost or taken from the wrong tokens would hardly move a log-prob. The gates
    and input (in_proj, std 0.1) and the taps (std 0.5) put it at several times the stream."""
    for module in model.modules():
        if type(module).__name__ in ("Lfm2ShortConv", "Lfm2MoeShortConv"):
            module.in_proj.weight.normal_(0.0, 0.1)
            module.conv.weight.normal_(0.0, 0.5)
        if type(module).__name__ == "Lfm2MoeSparseMoeBlock" and module.expert_bias is not None:
            module.expert_bias.normal_(0.0, 0.5)  # the bias chooses experts: make it choose differently


@torch.no_grad()
def _vary_norm_weights(model: PreTrainedModel) -> None:
    """Norm weights drawn around 1 instead of all ones, so that an implementation applying one norm in another's
    place (OLMo-Hybrid has four kinds per layer pair: pre, post-attention, post-feedforward, q/k, gated) gives
    different outputs instead of the same ones."""
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.normal_(1.0, 0.2)


def init_model(config: PretrainedConfig, seed: int, dtype: str) -> PreTrainedModel:
    """HF's own init (normal std 0.02) drawn in float32 from `seed`, so every dtype rounds the same weights."""
    torch.manual_seed(seed)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_config(config, dtype=torch.float32)
    _init_gdn_gates(model)
    if config.model_type in ("nemotron_h", "nemotron_h_omni", "granitemoehybrid"):
        _init_mamba2_gates(model, unit_output=config.model_type == "granitemoehybrid")
    if config.model_type == "olmo_hybrid":
        _vary_norm_weights(model)
    if config.model_type == "kimi_linear":
        _init_kda_gates(model)
    if config.model_type in ("lfm2", "lfm2_moe", "lfm2_vl"):
        _init_short_conv(model)
    if config.model_type == "zaya":
        zaya.init_tiny(model)
    if config.model_type == "glm5_next":
        glm5.init_gates(model, GDN_MEMORY_TOKENS)
    if config.model_type == "qwen4_exp":
        qwen4exp.init_ple_convs(model, seed)
    return model.to(getattr(torch, dtype))  # save_pretrained records this dtype in config.json


def generation_config(tokenizer: Tokenizer) -> GenerationConfig:
    # Stop at the end of an assistant turn as well as at the end of a document.
    return GenerationConfig(
        eos_token_id=[tokenizer.token_to_id(IM_END), tokenizer.token_to_id(ENDOFTEXT)],
        pad_token_id=tokenizer.token_to_id(ENDOFTEXT),
        bos_token_id=None,
    )


# --- build -------------------------------------------------------------------------------------------------------


def _build_record(preset_name: str, seed: int, dtype: str) -> dict:
    return {"preset": preset_name, "seed": seed, "dtype": dtype, "builder_version": BUILDER_VERSION}


def _read_marker(out_dir: Path) -> dict | None:
    marker = out_dir / BUILD_MARKER
    return json.loads(marker.read_text()) if marker.is_file() else None


def _holds_build(out_dir: Path, record: dict) -> bool:
    marker = _read_marker(out_dir)
    return marker is not None and all(marker.get(key) == value for key, value in record.items())


def _write_build(preset: Preset, record: dict, staging: Path) -> None:
    tokenizer = preset_tokenizer(preset)
    wrapper = VISION_WRAPPERS.get(preset.model_type)
    if wrapper:
        wrapper.save_processor(preset.model_type, tokenizer, staging)
    elif preset.vision is not None:
        save_processor(preset, tokenizer, staging)
    template = VL_CHAT_TEMPLATE if preset.vision is not None and not wrapper else CHAT_TEMPLATE
    save_tokenizer(tokenizer, staging, preset.max_position_embeddings, template)  # after (over) the processor's
    if wrapper:
        mark_tokens(staging, wrapper.MARKERS)
    if preset.jet is not None:  # transformers has no jet_nemotron: no model class to draw the weights
        num_parameters = jet_nemotron.write_checkpoint(staging, preset, tokenizer.token_to_id(IM_END),
                                                       tokenizer.token_to_id(ENDOFTEXT), record["seed"],
                                                       record["dtype"], GDN_MEMORY_TOKENS)
        generation_config(tokenizer).save_pretrained(staging)
        _write_marker(staging, record, num_parameters)
        return
    model = init_model(model_config(preset, tokenizer), record["seed"], record["dtype"])
    if preset.puzzle:
        nemotron_puzzle.with_block_configs(model, nemotron_puzzle.block_configs(preset.mamba2.pattern))
    model.generation_config = generation_config(tokenizer)
    model.save_pretrained(staging)  # transformers 5 always writes safetensors
    config_file = staging / "config.json"
    if preset.model_type == "nemotron_h":
        config_file.write_text(json.dumps(nvidia_config_fields(json.loads(config_file.read_text())), indent=2) + "\n")
        if preset.puzzle:
            nemotron_puzzle.as_puzzle(config_file, preset.mamba2.pattern)
    elif preset.model_type == "granitemoehybrid":  # as IBM ships Granite-4.0-H (transformers 5 writes HF's names)
        config = json.loads(config_file.read_text())
        config["layer_types"] = ["mamba" if t == "linear_attention" else "attention" for t in config["layer_types"]]
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    elif preset.model_type in ("kimi_linear", "bailing_hybrid"):  # as Moonshot ships Kimi Linear (transformers 5
        written = json.loads(config_file.read_text())  # writes HF's names)
        config = {key: written[key] for key in ("architectures", "model_type", "dtype", "transformers_version")}
        config_file.write_text(json.dumps(dict(config, **moonshot_config_fields(preset, tokenizer)), indent=2) + "\n")
        _moonshot_dense_mlp_names(staging / "model.safetensors")
        if preset.lightning:
            from tailreplay_eval.ling25 import convert_to_ling25

            convert_to_ling25(staging, preset.rope_theta, record["seed"])
        elif preset.model_type == "bailing_hybrid":
            from tailreplay_eval.ling import convert_to_ling

            convert_to_ling(staging, preset.rope_theta, record["seed"])
        elif preset.attn_res_block is not None:
            kimi_k3.convert_to_k3(staging, record["seed"], preset.attn_res_block)
            if preset.kimi_vision:
                kimi_k3_vl.wrap_with_vision(staging, record["seed"], tokenizer)
    elif preset.model_type == "lfm2_vl":
        lfm2vl.liquid_names(staging / "model.safetensors")
    elif preset.model_type == "nemotron_h_omni":
        text = dict(model.config.text_config.to_dict(), architectures=["NemotronHForCausalLM"])
        nemotron_omni.released_config(config_file, nvidia_config_fields(text), preset.released_as)
        nemotron_omni.name_unk_token(staging)
    elif preset.model_type == "qwen4_exp":
        qwen4exp.serving_dtypes(config_file)
    elif preset.model_type == "glm5_next":
        glm5.serving_config(config_file)
    elif preset.model_type == "zaya":  # as Zyphra ships ZAYA1, which SGLang loads (transformers writes its own names)
        zaya.to_zyphra(staging)
    elif preset.released_as in QWEN_RELEASES:  # the Qwen build as another release of its SGLang class: config only
        config = json.loads(config_file.read_text())
        config.update(architectures=[preset.released_as], model_type=QWEN_RELEASES[preset.released_as])
        config_file.write_text(json.dumps(config, indent=2) + "\n")
    if preset.mtp_layers and preset.model_type == "qwen4_exp":
        qwen4exp.write_mtp_head(staging, record["seed"])
    elif preset.mtp_layers and preset.model_type == "glm5_next":
        glm5.write_mtp_head(staging, record["seed"])
    elif preset.mtp_layers and preset.model_type == "bailing_hybrid":
        from tailreplay_eval.ling import write_mtp_head

        write_mtp_head(staging, record["seed"])
    elif preset.mtp_layers:
        _add_mtp_head(model, staging, record["seed"], record["dtype"])
    _write_marker(staging, record, model.num_parameters())


def _write_marker(staging: Path, record: dict, num_parameters: int) -> None:
    # Written last: a directory without it is never mistaken for a finished build.
    marker = dict(record, num_parameters=num_parameters)
    (staging / BUILD_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _add_mtp_head(model: PreTrainedModel, staging: Path, seed: int, dtype: str) -> None:
    """Append an MTP head (`mtp.*`) to the checkpoint and declare it in config.json. Drawn after the target's
    weights from its own seed (the target is the same as the preset without MTP), then distilled from the target
    (`tailreplay_eval.mtp.distill_head`, ~10 s) so that its drafts are accepted often enough to measure."""
    from tailreplay_eval.mtp import distilled_head, write_head

    head, _ = distilled_head(model.float(), seed)
    write_head(staging, head, getattr(torch, dtype))


def _moonshot_dense_mlp_names(weights: Path) -> None:
    """transformers 5 saves Kimi Linear's dense MLP (the first_k_dense_replace layers) under `block_sparse_moe.`, the
    MoE's name in Moonshot's checkpoints; Moonshot's dense layers are `mlp.`, which is what SGLang loads."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(weights)
    dense = {name for name in tensors if ".block_sparse_moe." in name
             and name.rsplit(".", 2)[-2] in ("gate_proj", "up_proj", "down_proj") and ".shared_experts." not in name}
    renamed = {name.replace(".block_sparse_moe.", ".mlp.") if name in dense else name: t for name, t in tensors.items()}
    save_file(renamed, weights, metadata={"format": "pt"})


def _publish(staging: Path, out_dir: Path, record: dict) -> None:
    """Move a finished build into place, replacing only an earlier build of ours (or an empty directory)."""
    if out_dir.exists():
        if _read_marker(out_dir) is None and any(out_dir.iterdir()):
            raise FileExistsError(f"{out_dir} is not empty and holds no {BUILD_MARKER}; not overwriting it")
        shutil.rmtree(out_dir)
    try:
        staging.rename(out_dir)
    except OSError:
        # A concurrent builder got there first; its build is as good as ours if it matches.
        if not _holds_build(out_dir, record):
            raise


def build_model(
    preset: str, out_dir: str | Path, seed: int = 0, dtype: str | None = None, force: bool = False
) -> Path:
    """Build `preset` into `out_dir` (unless it already holds this exact build) and return `out_dir`."""
    spec = PRESETS[preset]
    dtype = dtype or spec.dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_dir = Path(out_dir)
    record = _build_record(preset, seed, dtype)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out_dir):
        if not force and _holds_build(out_dir, record):
            return out_dir
        # Built beside the target and renamed into place, so readers never see a half-written checkpoint.
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
        staging.chmod(0o755)  # mkdtemp's 0700 would hide the published checkpoint from other users
        try:
            _write_build(spec, record, staging)
            _publish(staging, out_dir, record)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return out_dir


@contextlib.contextmanager
def _build_lock(out_dir: Path):
    """One builder at a time in a folder, across processes (parallel test workers share models/): the second
    waits, then finds the build done instead of replacing it under the first one's readers. The lock is the
    folder's own (flock on its descriptor), so no lock file is left beside the checkpoints."""
    fd = os.open(out_dir.parent, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", required=True, choices=sorted(PRESETS))
    parser.add_argument("--out", required=True, type=Path, help="checkpoint directory to create")
    parser.add_argument("--seed", type=int, default=0, help="weight init seed (default 0)")
    parser.add_argument("--dtype", choices=DTYPES, help="override the preset's dtype")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT already holds this build")
    args = parser.parse_args(argv)
    out_dir = build_model(args.preset, args.out, seed=args.seed, dtype=args.dtype, force=args.force)
    print(json.dumps({"path": str(out_dir), **json.loads((out_dir / BUILD_MARKER).read_text())}))


if __name__ == "__main__":
    main()
