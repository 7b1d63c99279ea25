"""A Kimi K3 processor for the tiny vision checkpoint (`tailreplay_eval.kimi_k3_vl`), copied into it as
`processing_kimi_k3.py` and loaded by SGLang through `auto_map` (`--trust-remote-code`), as Moonshot's checkpoints
ship theirs.

transformers has no Kimi K3 processor, and SGLang's (`multimodal/processors/kimi_k3.py`) wraps the checkpoint's. On a
machine without CUDA it takes the checkpoint processor's path (`KimiK3GPUProcessorWrapper._cpu_call`), which reads:
- `media_processor.media_proc_cfg`: the NaViT limits and the normalization;
- `media_processor.media_tokens_calculator({"type": "image", "image": image})`: an image's feature count;
- `processor(text=[...], medias=[...])`: `pixel_values` (patches, (N, 3, p, p), row-major over the padded grid) and
  `grid_thws` ((1, h, w) per image); SGLang writes the prompt's token ids itself;
- `tokenizer`, and `image_processor` (None here: SGLang then skips its fast-image-processor path).

The resize follows SGLang's GPU path (`navit_resize_config`, PIL bicubic, zero padding to the merge grid), so a CPU
and a GPU server give the tower the same patches for the images the tests send (sizes on the merge grid need no
resize). Self-contained: it runs inside the checkpoint, importing neither SGLang nor this repository.
"""

import json
import math
import os

import numpy as np
import torch
from PIL import Image
from transformers import AutoTokenizer, BatchFeature


class KimiK3MediaProcessor:
    def __init__(self, media_proc_cfg: dict):
        self.media_proc_cfg = media_proc_cfg

    def resize_config(self, width: int, height: int) -> dict:
        cfg = self.media_proc_cfg
        patch, limit, side = cfg["patch_size"], cfg["in_patch_limit"], cfg["patch_limit_on_one_side"]
        scale = min(1.0, math.sqrt(limit / (max(1.0, width // patch) * max(1.0, height // patch))),
                    side * patch / width, side * patch / height)
        new_w = min(max(1, int(width * scale)), side * patch)
        new_h = min(max(1, int(height * scale)), side * patch)
        factor = cfg["merge_kernel_size"] * patch
        pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
        tokens = ((new_h + pad_h) // factor) * ((new_w + pad_w) // factor)
        return {"num_tokens": tokens, "new_width": new_w, "new_height": new_h, "pad_width": pad_w,
                "pad_height": pad_h}

    def media_tokens_calculator(self, media: dict) -> int:
        width, height = media["image"].size
        return self.resize_config(width, height)["num_tokens"]

    def patches(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, int, int]]:
        cfg = self.media_proc_cfg
        resize = self.resize_config(*image.size)
        image = image.convert("RGB")
        if image.size != (resize["new_width"], resize["new_height"]):
            image = image.resize((resize["new_width"], resize["new_height"]), Image.BICUBIC)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)
        mean = torch.tensor(cfg["image_mean"]).view(3, 1, 1)
        std = torch.tensor(cfg["image_std"]).view(3, 1, 1)
        pixels = torch.nn.functional.pad((pixels - mean) / std, (0, resize["pad_width"], 0, resize["pad_height"]))
        p = cfg["patch_size"]
        gh, gw = pixels.shape[1] // p, pixels.shape[2] // p
        patches = pixels.reshape(3, gh, p, gw, p).permute(1, 3, 0, 2, 4).reshape(gh * gw, 3, p, p)
        return patches, (1, gh, gw)


class KimiK3Processor:
    def __init__(self, tokenizer, media_processor: KimiK3MediaProcessor):
        self.tokenizer = tokenizer
        self.media_processor = media_processor
        self.image_processor = None

    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        pass  # AutoProcessor registers a remote class before loading it; nothing to record here

    @classmethod
    def from_pretrained(cls, path, **kwargs):
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            media_proc_cfg = json.load(f)["media_proc_cfg"]
        return cls(AutoTokenizer.from_pretrained(path), KimiK3MediaProcessor(media_proc_cfg))

    def __call__(self, text=None, medias=None, **kwargs) -> BatchFeature:
        texts = [text] if isinstance(text, str) else list(text or [])
        data = {"input_ids": torch.tensor([self.tokenizer.encode(t) for t in texts])} if texts else {}
        if medias:
            patches, grids = zip(*(self.media_processor.patches(m["image"]) for m in medias))
            data.update(pixel_values=torch.cat(patches), grid_thws=torch.tensor(grids, dtype=torch.int64))
        return BatchFeature(data)

    def apply_chat_template(self, *args, **kwargs):
        return self.tokenizer.apply_chat_template(*args, **kwargs)

    def decode(self, *args, **kwargs):
        return self.tokenizer.decode(*args, **kwargs)
