"""MiniCPM-V 4.6 (`MiniCPMV4_6ForConditionalGeneration`): a Qwen3.5 language model under MiniCPM-V's SigLIP tower.

SGLang serves it with its own processor port: each image is `<image_id>i</image_id><image>` + 64 rows of the tower's
features + `</image>` at 448 px, plus `<slice>` rows for a larger image's slices. Its runner holds the version's
module, whose decoder is at `llm` (`architectures.decoder_stack`), and its first layer gets the features in the
image rows, so a replay over an image starts from the stored group-0 input, as on Qwen3.5's vision-language
checkpoints (tests/test_vision_language.py). Checked against HF transformers (requests with no hit, images at 448 px,
which neither processor resizes: `tailreplay_eval.minicpmv`) and against each server's own no-cache prefill.
"""

import numpy as np
import pytest
import torch
from transformers import AutoProcessor

from helpers import (EXACT_FLAGS, Spec, exact_errors, generate, image, no_cache, scored, start_servers,
                     with_images)
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

HF_TOL = 2e-3  # nats, any output token against HF's teacher-forced forward (text and 448-px images: 4e-4 measured)
TOL = 2e-3  # mean nats per token of a hit against no cache
WORST = 0.02  # any one token (EXACT_TOL)
CHUNK = 32  # the anchored server's prefill chunk: chunk-end anchors fall inside an image's 64 rows
SIDE = 448  # the processor's scale resolution: an image of this size is not resized
IMAGE = "<|image_pad|>"
NEW = 8
QUESTION = " Describe it."
FOLLOW_UP = " Then say which colour covers most of it, and why that might be."


def prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def servers(tiny_minicpmv46, tmp_path_factory):
    """anchored: prefill chunks of CHUNK tokens and every span replayed (--tail-replay-fold-tokens 0), so that a hit
    replays from an anchor inside an image; paper: the whole prefix from a cleared state."""
    yield from start_servers(tmp_path_factory, {
        "anchored": Spec(tiny_minicpmv46, ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size",
                                           str(CHUNK), "--tail-replay-fold-tokens", "0")),
        "paper": Spec(tiny_minicpmv46, EXACT_FLAGS),
    })


@pytest.fixture(scope="module")
def hf(tiny_minicpmv46):
    return load_hf_model(tiny_minicpmv46), AutoProcessor.from_pretrained(tiny_minicpmv46)


def image_rows(hf, text: str, images) -> list[int]:
    """The positions of the prompt's image rows, as the processor expands it."""
    _, processor = hf
    ids = processor(text=text, images=images or None, return_tensors="pt")["input_ids"][0].tolist()
    return [i for i, t in enumerate(ids) if t == processor.image_token_id]


@torch.no_grad()
def hf_greedy(hf, text, images) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for the prompt, and their log-probs from one teacher-forced forward."""
    model, processor = hf
    inputs = processor(text=text, images=images or None, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, eos_token_id=None)
    logits = model(**dict(inputs, input_ids=out, attention_mask=torch.ones_like(out))).logits[0, n - 1:-1]
    return out[0, n:].tolist(), logits.float().log_softmax(-1).gather(-1, out[0, n:, None])[:, 0].tolist()


def assert_as_no_cache(hit: dict, ref: dict) -> None:
    worst, mean = exact_errors(hit, ref)
    assert worst < WORST and mean < TOL, f"max {worst:.4g}, mean {mean:.4g} nats per token"


@pytest.mark.parametrize("images", [0, 1, 2], ids=["text", "one-image", "two-images"])
def test_text_and_images_are_served_as_hf_does(servers, hf, images):
    """The anchored server's prefill (CHUNK-token chunks through the images) of a prompt it has not seen."""
    server = servers["anchored"]
    flush_cache(server.base_url)
    pictures = [image(i, SIDE) for i in range(images)]
    text = prompt("".join(IMAGE + f" picture {i}." for i in range(images)) + " What do these show?")
    tokens, lps = hf_greedy(hf, text, pictures)
    out = generate(server, text, NEW, return_logprob=True, logprob_start_len=-1, **with_images(*pictures))
    assert out["meta_info"]["cached_tokens"] == 0
    assert len(image_rows(hf, text, pictures)) == 64 * images
    assert out["output_ids"] == tokens
    served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert np.abs(np.array(served) - np.array(lps)).max() < HF_TOL


# A wide image: the processor adds slices, 64 + 2 x 64 image rows in all (SGLang's port expands it the same way).
WIDE = (SIDE, 2 * SIDE)


@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_hit_through_an_image_equals_no_cache(servers, hf, name):
    """A fork after an image with slices: the second request matches through the image, and (anchored) its replay
    starts at a chunk-end anchor inside the image's rows."""
    server = servers[name]
    picture = image(7, WIDE)
    first, second = prompt(IMAGE + QUESTION), prompt(IMAGE + QUESTION + FOLLOW_UP)
    rows = image_rows(hf, first, [picture])
    assert len(rows) > 64  # the slices are there
    start = generate(server, first, 1, **with_images(picture))["meta_info"]["prompt_tokens"] - 4
    ref = no_cache(server, second, start, NEW, **with_images(picture))
    flush_cache(server.base_url)  # else the first request hits the reference and leaves an anchor at its match end
    generate(server, first, 1, **with_images(picture))
    hit = scored(server, second, start, NEW, **with_images(picture))
    meta = hit["meta"]
    assert meta["cached_tokens"] > rows[-1] and meta["tail_replay_exact"] is True
    if name == "anchored":
        anchor = meta["tail_replay_anchor"]
        assert anchor is not None and anchor % CHUNK == 0 and rows[0] < anchor < rows[-1]
    else:
        assert meta["tail_replay_tokens"] == meta["cached_tokens"]  # the whole prefix, from a cleared state
    assert_as_no_cache(hit, ref)


def test_different_images_with_the_same_text_never_share_past_the_image(servers, hf):
    server = servers["anchored"]
    flush_cache(server.base_url)
    text = prompt(IMAGE + QUESTION)
    generate(server, text, 1, **with_images(image(0, SIDE)))
    other = scored(server, text, 0, NEW, **with_images(image(1, SIDE)))
    assert other["meta"]["cached_tokens"] <= image_rows(hf, text, [image(1, SIDE)])[0]
    assert_as_no_cache(other, no_cache(server, text, 0, NEW, **with_images(image(1, SIDE))))


def test_a_second_turn_after_an_image_answers_as_no_cache(servers):
    """Turn two repeats turn one (its image, its answer) and asks again: it hits all of turn one, replays from the
    anchor turn one left, and answers as the flushed server does."""
    server = servers["anchored"]
    flush_cache(server.base_url)
    picture = image(3, SIDE)
    turn1 = prompt(IMAGE + QUESTION)
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
