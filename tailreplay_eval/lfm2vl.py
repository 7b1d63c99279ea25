"""LFM2-VL (`Lfm2VlForConditionalGeneration`, model_type `lfm2_vl`): tiny checkpoints.

An LFM2 language model (the preset's text stack, as `models.lfm2_config` builds it) under a SigLIP2 NaFlex tower and
Liquid's projector (a 2 x 2 pixel unshuffle, layer norm, two linears), with transformers' Lfm2VlProcessor, which
SGLang's processor calls too: an image of up to 512 x 512 px is one tile of (side / 16 / 2)^2 rows between
`<|image_start|>` and `<|image_end|>`; a larger one is split into 512-px tiles, each behind its
`<|img_row_r_col_c|>` marker, and a thumbnail behind `<|img_thumbnail|>`.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig, PretrainedConfig

IMAGE = "<image>"
MARKERS = dict(image_token=IMAGE, image_start_token="<|image_start|>", image_end_token="<|image_end|>",
               image_thumbnail_token="<|img_thumbnail|>")
MAX_GRID = 4  # tile markers up to row 4, column 4 (the tests' images split into at most 2 x 2 tiles)
SPECIAL_TOKENS = tuple(MARKERS.values()) + tuple(
    f"<|img_row_{r}_col_{c}|>" for r in range(1, MAX_GRID + 1) for c in range(1, MAX_GRID + 1))
PATCH_SIZE = 16


def lfm2vl_config(text: PretrainedConfig, vision, tokenizer: Tokenizer) -> PretrainedConfig:
    """Lfm2VlConfig over the LFM2 text config `text` with a SigLIP2 tower of `vision`'s sizes and a projector as
    wide as the language model."""
    return AutoConfig.for_model(
        "lfm2_vl", text_config=text.to_dict(),
        vision_config=dict(model_type="siglip2_vision_model", hidden_size=vision.hidden_size,
                           intermediate_size=vision.intermediate_size, num_hidden_layers=vision.depth,
                           num_attention_heads=vision.num_heads, patch_size=PATCH_SIZE,
                           num_patches=vision.num_position_embeddings),
        image_token_id=tokenizer.token_to_id(IMAGE), projector_hidden_size=text.hidden_size,
        tie_word_embeddings=False,
    )


def liquid_names(weights: Path) -> None:
    """transformers 5.19 saves the SigLIP2 tower under `model.vision_tower.` (its Siglip2VisionModel drops the
    `vision_model.` level, and adds it back when loading); Liquid's checkpoints keep it, and SGLang's loader expects
    it. Without it SGLang's loader matched no tower weight and left them uninitialized: the tower answered NaN."""
    from safetensors.torch import load_file, save_file

    tower = "model.vision_tower."
    tensors = load_file(weights)
    renamed = {name.replace(tower, tower + "vision_model.", 1) if name.startswith(tower) else name: t
               for name, t in tensors.items()}
    save_file(renamed, weights, metadata={"format": "pt"})


def save_processor(model_type: str, tokenizer: Tokenizer, out_dir: Path) -> None:
    """transformers' Lfm2VlProcessor at its defaults (512-px tiles, 64 to 256 rows per tile, thumbnails), whatever
    `model_type` (the vision builders' common signature). It writes tokenizer files of its own:
    `models.save_tokenizer` runs after it, then the build puts MARKERS back (`models.mark_tokens`)."""
    from transformers import Lfm2VlImageProcessor, Lfm2VlProcessor, PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, extra_special_tokens=MARKERS)
    Lfm2VlProcessor(image_processor=Lfm2VlImageProcessor(), tokenizer=fast).save_pretrained(out_dir)
