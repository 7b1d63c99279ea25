"""Nemotron-H Omni (`NemotronH_Omni_Reasoning_V3`, model_type `nemotron_h_omni`): tiny checkpoints.

A Nemotron-H language model (the preset's text stack, as `models.nemotron_h_config` builds it) under a RADIO vision
tower and NVIDIA's projector (RMS norm, linear, squared ReLU, linear over 2 x 2 pixel-shuffled patches), with
transformers' NemotronH_Omni_Reasoning_V3Processor: an image becomes its own patch grid (16-px patches, dynamic
resolution) and (h / 32) x (w / 32) rows of `<image>` between `<img>` and `</img>`. No audio tower (`audio_config`
is None: SGLang then builds no Parakeet encoder).

The two readers want different things of one config.json, so it carries both:
- SGLang (`configs/nano_nemotron_vl.py`) reads NVIDIA's released format: `llm_config`, a `vision_config` whose
  `args.model` names a timm ViT (its sizes come from that name: `vit_small_patch16_224` is the smallest, 384 wide and
  12 deep, so the tower here is that one), `register_multiple`, `min_num_patches` / `max_num_patches` (dynamic
  resolution) and `norm_mean` / `norm_std` (its own image preprocessing).
- transformers reads its own names (`hidden_size`, `num_registers`, ...) and maps the released ones across.
SGLang's RADIO has one class token plus `register_multiple - 1` registers; transformers' three class tokens plus
seven registers are the same ten learnt rows ahead of the patches, which both drop before the projector.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig, PretrainedConfig

IMAGE = "<image>"
UNK = "<unk>"  # SGLang's processor splices media through the tokenizer's unk token, and asserts there is one
MARKERS = dict(image_token=IMAGE, image_start_token="<img>", image_end_token="</img>", video_token="<video>")
SPECIAL_TOKENS = tuple(MARKERS.values()) + (UNK,)
TIMM_NAME = "vit_small_patch16_224"  # SGLang's RadioConfig: (384, 12 layers, 6 heads, 1536)
TOWER = dict(hidden_size=384, num_hidden_layers=12, num_attention_heads=6, mlp_ratio=4.0)
PATCH_SIZE = 16
SUMMARY_TOKENS = 10  # transformers: 3 class tokens + 7 registers; SGLang: 1 class token + 9 (register_multiple 10)
MIN_PATCHES, MAX_PATCHES = 64, 1024  # a 128-px to 512-px square keeps its own size
VIDEO_TEMPORAL_PATCH = 2  # transformers requires the tower and the config to agree
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # transformers' processor default; SGLang reads norm_mean
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
# NVIDIA's earlier releases that SGLang serves with the Omni's class (`models/nano_nemotron_vl.py`: the Omni is a
# subclass that adds a name remap and an optional final norm, neither used by these checkpoints), each its
# architecture and model_type. transformers writes the Omni's weights under NVIDIA's released names
# (`vision_model.radio_model.model.*`, `mlp1.*`, `language_model.backbone.*`), which are these releases' names too,
# so a release differs from the Omni build of the same preset and seed in config.json alone.
NANO_RELEASES = ("NemotronH_Nano_VL_V2", "NemotronH_Nano_Omni_Reasoning_V3")


def omni_config(text: PretrainedConfig, tokenizer: Tokenizer) -> PretrainedConfig:
    """transformers' NemotronH_Omni_Reasoning_V3_Config over the Nemotron-H text config `text`, with a RADIO tower of
    TIMM_NAME's sizes and a projector as wide as the language model."""
    return AutoConfig.for_model(
        "nemotron_h_omni", text_config=text.to_dict(),
        vision_config=dict(TOWER, patch_size=PATCH_SIZE, max_img_size=2048, num_cls_tokens=3,
                           num_registers=SUMMARY_TOKENS - 3, video_temporal_patch_size=VIDEO_TEMPORAL_PATCH,
                           norm_mean=CLIP_MEAN, norm_std=CLIP_STD),
        vision_hidden_size=TOWER["hidden_size"], projector_hidden_size=2 * text.hidden_size, downsample_ratio=0.5,
        video_temporal_patch_size=VIDEO_TEMPORAL_PATCH, image_token_id=tokenizer.token_to_id(IMAGE),
        video_token_id=tokenizer.token_to_id(MARKERS["video_token"]), tie_word_embeddings=False,
    )


def released_config(config_file: Path, llm_config: dict, released_as: str | None = None) -> None:
    """Rewrite transformers' config.json with NVIDIA's released field names beside transformers' own, so that
    SGLang's config class and transformers' both read it (module docstring). `llm_config` is the text config as
    NVIDIA writes it (`models.nvidia_config_fields`). `released_as` (one of NANO_RELEASES): the checkpoint is that
    release instead, which transformers cannot load (its reference is the Omni build of the same preset and seed)."""
    written = json.loads(config_file.read_text())
    vision = dict(written["vision_config"], args=dict(model=TIMM_NAME, register_multiple=SUMMARY_TOKENS),
                  preferred_resolution=[256, 256], min_num_patches=MIN_PATCHES, max_num_patches=MAX_PATCHES)
    config = dict(written, llm_config=llm_config, vision_config=vision, vit_hidden_size=written["vision_hidden_size"],
                  img_context_token_id=written["image_token_id"], patch_size=PATCH_SIZE, ps_version="v2",
                  norm_mean=list(CLIP_MEAN), norm_std=list(CLIP_STD), use_thumbnail=False)
    del config["text_config"]
    if released_as is not None:
        assert released_as in NANO_RELEASES, released_as
        config.update(architectures=[released_as], model_type=released_as)
    config_file.write_text(json.dumps(config, indent=2) + "\n")


def name_unk_token(out_dir: Path) -> None:
    """tokenizer_config.json names UNK as the unk token (`models.save_tokenizer` writes none)."""
    path = out_dir / "tokenizer_config.json"
    path.write_text(json.dumps(dict(json.loads(path.read_text()), unk_token=UNK), indent=2) + "\n")


def image_processor():
    """transformers' image processor for these checkpoints: a patch budget that keeps the tests' images at their
    own size, CLIP normalisation as the config's norm_mean / norm_std."""
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3ImageProcessor

    return NemotronH_Omni_Reasoning_V3ImageProcessor(min_num_patches=MIN_PATCHES, max_num_patches=MAX_PATCHES,
                                                     image_mean=CLIP_MEAN, image_std=CLIP_STD)


def save_processor(model_type: str, tokenizer: Tokenizer, out_dir: Path) -> None:
    """transformers' NemotronH_Omni_Reasoning_V3Processor, as NVIDIA ships one, whatever `model_type` (the vision
    builders' common signature). It builds Parakeet's audio feature extractor (librosa) though the checkpoint has no
    audio tower: SGLang loads this processor and uses its tokenizer (its own image preprocessing reads the config).
    It writes tokenizer files of its own: `models.save_tokenizer` runs after it, then the build puts MARKERS back."""
    from transformers import ParakeetFeatureExtractor, PreTrainedTokenizerFast
    from transformers.models.nemotron_h_omni import NemotronH_Omni_Reasoning_V3Processor
    from transformers.models.nemotron_h_omni.video_processing_nemotron_h_omni import (
        NemotronH_Omni_Reasoning_V3VideoProcessor)

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, extra_special_tokens=MARKERS)
    NemotronH_Omni_Reasoning_V3Processor(image_processor=image_processor(),
                                         video_processor=NemotronH_Omni_Reasoning_V3VideoProcessor(),
                                         feature_extractor=ParakeetFeatureExtractor(),
                                         tokenizer=fast).save_pretrained(out_dir)
