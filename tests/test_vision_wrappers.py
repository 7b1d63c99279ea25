"""Hybrids served under another family's vision wrapper: MiniCPM-V 4.6 and 4.7 (`MiniCPMV4_6ForConditionalGeneration`,
`MiniCPMV4_7ForConditionalGeneration`: a Qwen3.5 language model under MiniCPM-V's SigLIP tower, GDN; 4.7 with canvas
M-RoPE positions, `tailreplay_eval.minicpmv`), LFM2-VL (`Lfm2VlForConditionalGeneration`: LFM2 under
a SigLIP2 NaFlex tower, gated short conv) and Nemotron-H Omni (`NemotronH_Omni_Reasoning_V3`: Nemotron-H under a
RADIO tower, Mamba2, `tailreplay_eval.nemotron_omni`) with NVIDIA's two earlier releases of its SGLang class,
Nano VL V2 and Nano Omni V3 (the Omni's weights under their own config.json, judged against the Omni's reference).

SGLang feeds the first layer the tower's features in an image's rows, so a replay over an image starts from the
stored group-0 input (as on Qwen3.5's vision-language checkpoints, tests/test_vision_language.py), and each wrapper
holds its decoder where `architectures.decoder_stack` finds it (MiniCPM-V: `llm`; LFM2-VL: `language_model.model`).
- MiniCPM-V: SGLang's processor port expands an image to `<image_id>i</image_id><image>` + 64 rows (448 px) +
  `</image>`, and `<slice>` rows for a wide image's slices. Its HF checks use 448-px images, which neither processor
  resizes (`tailreplay_eval.minicpmv`). 4.6 on two servers: anchored (CHUNK-token prefill chunks, every span
  replayed: a fork's replay starts at an anchor inside the image's rows) and paper (the whole prefix from a cleared
  state); 4.7 on one, as anchored.
- LFM2-VL: transformers' processor (SGLang calls it) makes a 256-px image one tile of 64 rows between
  `<|image_start|>` and `<|image_end|>`, a larger one 512-px tiles behind `<|img_row_r_col_c|>` and a thumbnail.
  Every hit replays its last WINDOW tokens from a cleared slot (`families.short_conv`), so a hit that ends right after
  an image replays the image's last rows. Conv states in float32, as tests/test_lfm2.py explains.
- Nemotron-H Omni: SGLang's own processor (dynamic resolution) keeps a 256-px image at its 16 x 16 patches, 64 rows
  after the 2 x 2 pixel shuffle between `<img>` and `</img>`, as transformers' does; a 256 x 512 one is 128 rows. It
  hands the tower bfloat16 pixels, so the HF reference gets its pixels rounded the same way. Interval anchors every
  64 tokens (Mamba2's chunk), so a fork after an image replays from an anchor inside its rows.
Checked against HF transformers (requests with no hit) and against each server's own no-cache prefill.
"""

import json
from dataclasses import dataclass, replace

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from helpers import (EXACT_FLAGS, MODELS_DIR, Spec, exact_errors, generate, image, no_cache, scored, start_servers,
                     with_images)
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TOL = 2e-3  # mean nats per token of a hit against no cache
WORST = 0.02  # any one token (EXACT_TOL)
CHUNK = 32  # MiniCPM-V's anchored server's prefill chunk: chunk-end anchors fall inside an image's 64 rows
WINDOW = 6  # tiny-lfm2's state window: (conv_L_cache - 1) x its largest group's 3 conv layers
NEW = 8
QUESTION = " Describe it."
FOLLOW_UP = " Then say which colour covers most of it, and why that might be."


@dataclass(frozen=True)
class Wrapper:
    preset: str
    placeholder: str  # what a prompt says where an image goes
    side: int  # an image of 64 rows that the HF and SGLang processors prepare alike
    wide: tuple[int, int]  # an image the processor splits (MiniCPM-V: slices; LFM2-VL: tiles and a thumbnail)
    hf_tol: float = 2e-3  # nats, any output token against HF (measured: MiniCPM-V 4e-4, LFM2-VL 1e-6)
    # the pixels' dtype the server's processor hands the tower, where it is not the model's (the HF reference's
    # pixels are rounded through it)
    pixel_dtype: torch.dtype | None = None
    # SGLang 0.5.23's Nemotron-H processor expands all of a prompt's images at its first placeholder
    # (`prompt.replace(IMG_CONTEXT_TOKEN, ..., 1)`) and leaves the later ones as text; transformers expands each in
    # place, so only one-image prompts are the same prompt to both
    one_image_per_prompt: bool = False
    # the preset whose checkpoint the HF reference loads, where transformers cannot load this one (None: this one)
    reference: str | None = None


MINICPMV = Wrapper("tiny-minicpmv4.6", "<|image_pad|>", 448, (448, 896))
MINICPMV47 = Wrapper("tiny-minicpmv4.7", "<|image_pad|>", 448, (448, 896))
LFM2VL = Wrapper("tiny-lfm2-vl", "<image>", 256, (512, 1024))
# Mamba2 through the grouped gated norm: up to 0.0023 nats from HF in float32 (tests/test_hybrid_families.py)
OMNI = Wrapper("tiny-nemotron-h-omni", "<image>", 256, (256, 512), hf_tol=5e-3, pixel_dtype=torch.bfloat16,
               one_image_per_prompt=True)
OMNI_ANCHORS = 64  # the Nemotron-H Omni server's interval anchors: Mamba2's chunk
# NVIDIA's earlier releases under the same SGLang class: the Omni's weights, their own config.json (transformers has
# neither model_type, so their reference is the Omni build: test_a_nano_release_differs_from_the_omni_in_its_config)
NANO_VL = replace(OMNI, preset="tiny-nemotron-h-nano-vl", reference=OMNI.preset)
NANO_OMNI = replace(OMNI, preset="tiny-nemotron-h-nano-omni", reference=OMNI.preset)
OMNI_FLAGS = ("--enable-tail-replay", "--enable-cache-report", "--dtype", "float32", "--tail-replay-fold-tokens", "0",
              "--tail-replay-anchor-interval", str(OMNI_ANCHORS))
# server name -> (wrapper, flags, env)
SERVERS = {
    "minicpmv-anchored": (MINICPMV, ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size",
                                     str(CHUNK), "--tail-replay-fold-tokens", "0"), {}),
    "minicpmv-paper": (MINICPMV, EXACT_FLAGS, {}),
    "minicpmv47": (MINICPMV47, ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
                                "--tail-replay-fold-tokens", "0"), {}),
    "lfm2vl": (LFM2VL, ("--enable-tail-replay", "--enable-cache-report", "--dtype", "float32"),
               {"SGLANG_MAMBA_CONV_DTYPE": "float32"}),
    "nemotron-omni": (OMNI, OMNI_FLAGS, {}),
    "nemotron-nano-vl": (NANO_VL, OMNI_FLAGS, {}),
    "nemotron-nano-omni": (NANO_OMNI, OMNI_FLAGS, {}),
}
HF_SERVERS = ("minicpmv-anchored", "minicpmv47", "lfm2vl", "nemotron-omni", "nemotron-nano-vl",
              "nemotron-nano-omni")  # one per model
# server -> the grid its replays start on: an interval anchor inside an image's rows
ANCHOR_GRID = {"minicpmv-anchored": CHUNK, "minicpmv47": CHUNK, "nemotron-omni": OMNI_ANCHORS,
               "nemotron-nano-vl": OMNI_ANCHORS, "nemotron-nano-omni": OMNI_ANCHORS}


def prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    specs = {name: Spec(build_model(w.preset, MODELS_DIR / w.preset), flags, env)
             for name, (w, flags, env) in SERVERS.items()}
    yield from start_servers(tmp_path_factory, specs)


@pytest.fixture(scope="module")
def hf():
    """The HF model and processor of each wrapper, loaded once."""
    loaded = {}

    def get(wrapper: Wrapper):
        preset = wrapper.reference or wrapper.preset
        if preset not in loaded:
            path = build_model(preset, MODELS_DIR / preset)
            loaded[preset] = load_hf_model(path), AutoProcessor.from_pretrained(path)
        return loaded[preset]
    return get


@pytest.mark.parametrize("wrapper", [NANO_VL, NANO_OMNI], ids=lambda w: w.preset)
def test_a_nano_release_differs_from_the_omni_in_its_config_alone(wrapper):
    """The reference of a checkpoint transformers cannot load is the Omni build: the same weights, byte for byte, and
    a config.json that names another architecture and model_type (SGLang serves all three with one class)."""
    release, omni = (build_model(p, MODELS_DIR / p) for p in (wrapper.preset, wrapper.reference))
    assert (release / "model.safetensors").read_bytes() == (omni / "model.safetensors").read_bytes()
    config, omni_config = (json.loads((p / "config.json").read_text()) for p in (release, omni))
    (architecture,) = config.pop("architectures")
    assert architecture == config.pop("model_type") != omni_config.pop("model_type")
    assert omni_config.pop("architectures") == ["NemotronH_Omni_Reasoning_V3"] and config == omni_config


def image_rows(processor, text: str, images) -> list[int]:
    """The positions of the prompt's image rows, as the processor expands it."""
    ids = processor(text=text, images=images or None, return_tensors="pt")["input_ids"][0].tolist()
    return [i for i, t in enumerate(ids) if t == processor.image_token_id]


@torch.no_grad()
def hf_greedy(model, processor, text, images, pixel_dtype=None) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for the prompt, and their log-probs from one teacher-forced forward."""
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    if images and pixel_dtype is not None:
        inputs["pixel_values"] = inputs["pixel_values"].to(pixel_dtype).to(torch.float32)
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    full = dict(inputs, input_ids=out, attention_mask=torch.ones_like(out))
    if "mm_token_type_ids" in inputs:  # which tokens are image rows (MiniCPM-V 4.7's canvas): none generated
        types = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, out.shape[1] - n)], dim=1)
    logits = model(**full).logits[0, n - 1:-1]
    return out[0, n:].tolist(), logits.float().log_softmax(-1).gather(-1, out[0, n:, None])[:, 0].tolist()


def assert_as_no_cache(hit: dict, ref: dict) -> None:
    worst, mean = exact_errors(hit, ref)
    assert worst < WORST and mean < TOL, f"max {worst:.4g}, mean {mean:.4g} nats per token"


@pytest.mark.parametrize("images", [0, 1, 2], ids=["text", "one-image", "two-images"])
@pytest.mark.parametrize("name", HF_SERVERS)
def test_text_and_images_are_served_as_hf_does(servers, hf, name, images):
    """A prompt the server has not seen (MiniCPM-V: in CHUNK-token chunks through the images)."""
    wrapper, server = SERVERS[name][0], servers[name]
    if images > 1 and wrapper.one_image_per_prompt:
        pytest.skip("SGLang's processor expands a prompt's images at its first placeholder (Wrapper)")
    model, processor = hf(wrapper)
    flush_cache(server.base_url)
    pictures = [image(i, wrapper.side) for i in range(images)]
    text = prompt("".join(wrapper.placeholder + f" picture {i}." for i in range(images)) + " What do these show?")
    tokens, lps = hf_greedy(model, processor, text, pictures, wrapper.pixel_dtype)
    out = generate(server, text, NEW, return_logprob=True, logprob_start_len=-1, **with_images(*pictures))
    assert out["meta_info"]["cached_tokens"] == 0
    assert len(image_rows(processor, text, pictures)) == 64 * images
    assert out["output_ids"] == tokens
    served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert np.abs(np.array(served) - np.array(lps)).max() < wrapper.hf_tol


def assert_replayed(name: str, meta: dict, rows: list[int]) -> None:
    """Where each server's replay of a hit that ends after an image's last row starts: in the image's rows."""
    assert meta["tail_replay_exact"] is True
    if name in ANCHOR_GRID:
        anchor = meta["tail_replay_anchor"]
        assert anchor is not None and anchor % ANCHOR_GRID[name] == 0 and rows[0] < anchor < rows[-1]
    elif name == "minicpmv-paper":
        assert meta["tail_replay_tokens"] == meta["cached_tokens"]  # the whole prefix, from a cleared state
    else:
        assert meta["tail_replay_tokens"] == WINDOW and meta["cached_tokens"] - WINDOW <= rows[-1]


@pytest.mark.parametrize("name", SERVERS)
def test_a_hit_through_a_split_image_equals_no_cache(servers, hf, name):
    """A fork right after an image the processor splits: the second request matches through the image and its
    replay covers the image's last rows."""
    wrapper, server = SERVERS[name][0], servers[name]
    picture = image(7, wrapper.wide)
    first, second = prompt(wrapper.placeholder + QUESTION), prompt(wrapper.placeholder + FOLLOW_UP)
    rows = image_rows(hf(wrapper)[1], first, [picture])
    assert len(rows) > 64  # the slices or tiles are there
    start = rows[-1] + 1
    ref = no_cache(server, second, start, NEW, **with_images(picture))
    flush_cache(server.base_url)  # else the first request hits the reference and leaves an anchor at its match end
    generate(server, first, 1, **with_images(picture))
    hit = scored(server, second, start, NEW, **with_images(picture))
    assert rows[-1] < hit["meta"]["cached_tokens"] < rows[-1] + 8
    assert_replayed(name, hit["meta"], rows)
    assert_as_no_cache(hit, ref)


@pytest.mark.parametrize("name", HF_SERVERS)
def test_different_images_with_the_same_text_never_share_past_the_image(servers, hf, name):
    wrapper, server = SERVERS[name][0], servers[name]
    flush_cache(server.base_url)
    text = prompt(wrapper.placeholder + QUESTION)
    generate(server, text, 1, **with_images(image(0, wrapper.side)))
    other = scored(server, text, 0, NEW, **with_images(image(1, wrapper.side)))
    assert other["meta"]["cached_tokens"] <= image_rows(hf(wrapper)[1], text, [image(1, wrapper.side)])[0]
    assert_as_no_cache(other, no_cache(server, text, 0, NEW, **with_images(image(1, wrapper.side))))


@pytest.mark.parametrize("name", HF_SERVERS)
def test_a_second_turn_after_an_image_answers_as_no_cache(servers, name):
    """Turn two repeats turn one (its image, its answer) and asks again: it hits all of turn one and answers as the
    flushed server does."""
    wrapper, server = SERVERS[name][0], servers[name]
    flush_cache(server.base_url)
    picture = image(3, wrapper.side)
    turn1 = prompt(wrapper.placeholder + QUESTION)
    answer = generate(server, turn1, NEW, **with_images(picture))["text"]
    turn2 = f"{turn1}{answer}<|im_end|>\n" + prompt(FOLLOW_UP)
    start = len(generate(server, turn2, 1, return_logprob=True, logprob_start_len=0, **with_images(picture))
                ["meta_info"]["input_token_logprobs"]) - 6
    ref = no_cache(server, turn2, start, NEW, **with_images(picture))
    flush_cache(server.base_url)
    generate(server, turn1, NEW, **with_images(picture))
    hit = scored(server, turn2, start, NEW, **with_images(picture))
    assert hit["meta"]["cached_tokens"] > 64 + 8 and hit["meta"]["tail_replay_exact"] is True
    assert_as_no_cache(hit, ref)
