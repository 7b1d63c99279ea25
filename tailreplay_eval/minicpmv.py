"""MiniCPM-V 4.6 and 4.7 (`MiniCPMV4_6ForConditionalGeneration`, `MiniCPMV4_7ForConditionalGeneration`; model_type
`minicpmv4_6`, `minicpmv4_7`): tiny checkpoints.

A Qwen3.5 language model (the preset's text stack, as `models.model_config` builds it) under MiniCPM-V's SigLIP
tower, its mid-tower window merger and an MLP merger, with the processor transformers 5.19 has for it. SGLang
serves the model with its own port of that processor (`multimodal/processors/minicpmv4_6.py`), which resizes with
torchvision: an image already at the processor's scale resolution (448 px) is not resized by either, so the two
agree token for token; smaller images are resized differently (0.006 nats at most on the tiny model, against 4e-4
at 448 px: measured, tests/test_vision_wrappers.py). 4.7 is 4.6 with canvas M-RoPE: the language model's rotary
positions are (t, h, w), an image's rows placed on the grid of the image they come from, its markers pinned around
it; its config names the marker ids the positions are computed from.
"""

from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoConfig, PretrainedConfig

IMAGE_PAD, VIDEO_PAD = "<|image_pad|>", "<|video_pad|>"
# What the processor names each marker (the tokenizer's `extra_special_tokens`), as the 4.6 checkpoints spell them.
MARKERS = dict(image_token=IMAGE_PAD, video_token=VIDEO_PAD, image_start_token="<image>", image_end_token="</image>",
               slice_start_token="<slice>", slice_end_token="</slice>", image_id_start_token="<image_id>",
               image_id_end_token="</image_id>")
SPECIAL_TOKENS = tuple(MARKERS.values())
SCALE_RESOLUTION = 448  # the processor's base resolution (SGLang's port hard-codes it)
PATCH_SIZE = 14


def minicpmv_config(model_type: str, text: PretrainedConfig, vision, tokenizer: Tokenizer,
                    rope_theta: float) -> PretrainedConfig:
    """MiniCPMV4_6Config or MiniCPMV4_7Config over the text config `text` (a `qwen3_5_text` one; for 4.7 with its
    `mrope_section`) with a SigLIP tower of `vision`'s sizes; the window merger runs after the tower's first layer
    (`insert_layer_id` 0: the tiny tower has two)."""
    text_fields = dict(text.to_dict(), rope_theta=rope_theta)  # to_dict drops the top-level copy SGLang reads
    canvas = {}
    if model_type == "minicpmv4_7":
        canvas = dict(image_start_id=tokenizer.token_to_id("<image>"), image_end_id=tokenizer.token_to_id("</image>"),
                      slice_start_id=tokenizer.token_to_id("<slice>"), slice_end_id=tokenizer.token_to_id("</slice>"),
                      newline_id=tokenizer.encode("\n").ids[0],
                      # What 4.7's checkpoints declare: SGLang lays out canvas positions only where the config says
                      # so, and sequential ones otherwise (transformers always lays out the canvas)
                      mrope_mode="canvas")
    return AutoConfig.for_model(
        model_type, text_config=text_fields, insert_layer_id=0, image_size=SCALE_RESOLUTION, **canvas,
        vision_config=dict(hidden_size=vision.hidden_size, intermediate_size=vision.intermediate_size,
                           num_hidden_layers=vision.depth, num_attention_heads=vision.num_heads,
                           patch_size=PATCH_SIZE, image_size=SCALE_RESOLUTION),
        image_token_id=tokenizer.token_to_id(IMAGE_PAD), video_token_id=tokenizer.token_to_id(VIDEO_PAD),
    )


def save_processor(model_type: str, tokenizer: Tokenizer, out_dir: Path) -> None:
    """transformers' MiniCPMV4_6Processor or MiniCPMV4_7Processor (4.6's image and video processors) at their
    defaults (448 px, up to 9 slices, 16x downsampling). It writes tokenizer files of its own: `models.save_tokenizer`
    runs after it, then the build puts MARKERS back
    (`models.mark_tokens`)."""
    from transformers import PreTrainedTokenizerFast
    from transformers.models.minicpmv4_6 import MiniCPMV4_6ImageProcessor, MiniCPMV4_6Processor
    from transformers.models.minicpmv4_6.video_processing_minicpmv4_6 import MiniCPMV4_6VideoProcessor
    from transformers.models.minicpmv4_7 import MiniCPMV4_7Processor

    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, extra_special_tokens=MARKERS)
    processor = MiniCPMV4_7Processor if model_type == "minicpmv4_7" else MiniCPMV4_6Processor
    processor(image_processor=MiniCPMV4_6ImageProcessor(), video_processor=MiniCPMV4_6VideoProcessor(),
              tokenizer=fast).save_pretrained(out_dir)
