"""Qwen3.5 as Qwen publishes it: vision-language checkpoints (`Qwen3_5ForConditionalGeneration`,
`Qwen3_5MoeForConditionalGeneration`, tiny presets with a vision tower and a processor), images in prompts and chats;
and InternS2-Preview (`InternS2PreviewForConditionalGeneration`), which SGLang serves with the MoE class unchanged:
the MoE build under InternS2-Preview's config, checked against HF's Qwen3.5-MoE (transformers has no
intern_s2_preview).

SGLang keys an image's tokens in the radix tree by a hash of the image and feeds the first layer the vision tower's
features in their rows, so a replay over an image must start from what the first layer got, not from re-embedded
ids (`layout.py`: vision-language checkpoints store group 0's input). Checked here against HF transformers (a request
with no hit) and against each server's own no-cache prefill (the cache flushed, the same request again), by the
log-probs of the prompt tokens after the hit and of the outputs (teacher-forced, so a near-tie cannot hide an
error) and the first greedy token. Measured on this model: a replay that re-embeds the ids misses by 0.020 nats per
token on average (0.071 at most) and changes the greedy outputs; from the stored input, 1.7e-4 (7.5e-4 at most).
"""

import numpy as np
import pytest
import requests
import torch
from transformers import AutoProcessor

from helpers import (EXACT_FLAGS, EXACT_TOL, MODELS_DIR, Spec, data_uri, exact_errors, generate, image, no_cache,
                     scored, start_servers, with_images)
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TOL = 2e-3  # mean nats per token: 10x below what re-embedded ids miss by (module docstring)
HF_TOL = 2e-3  # nats, any output token against HF's teacher-forced forward (measured at most 1.0e-3, MoE)
IMAGE_PX = 128  # 16 x 16 patches of 8 px: 64 tokens after the 2 x 2 merge
IMAGE_TOKENS = (IMAGE_PX // 16) ** 2
CHUNK = 32  # the anchored server's prefill chunk: chunk-end anchors fall inside an image
VISION = "<|vision_start|><|image_pad|><|vision_end|>"
NEW = 8


def user_turn(content: str) -> str:
    return f"<|im_start|>user\n{content}"


def prompt(content: str) -> str:
    return f"{user_turn(content)}<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tiny_interns2_preview():
    return build_model("tiny-interns2-preview", MODELS_DIR / "tiny-interns2-preview")


@pytest.fixture(scope="module")
def servers(tiny_qwen35_vl, tiny_qwen35_moe_vl, tiny_interns2_preview, tmp_path_factory):
    """Started together:
    - anchored: Tail-Replay's defaults, prefill chunks of CHUNK tokens so that anchors sit inside images, and every
      span replayed (--tail-replay-fold-tokens 0), since the replay through an image is what is checked;
    - paper_moe: the MoE checkpoint in the paper's mode, replaying the whole prefix from a cleared state;
    - interns2: the same checkpoint as InternS2-Preview, in the same mode.
    The HF comparisons run on them with the cache flushed: a request with no hit is SGLang's own forward of the
    checkpoint (the plugin only reads it)."""
    yield from start_servers(tmp_path_factory, {
        "anchored": Spec(tiny_qwen35_vl, ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size",
                                          str(CHUNK), "--tail-replay-fold-tokens", "0")),
        "paper_moe": Spec(tiny_qwen35_moe_vl, EXACT_FLAGS),
        "interns2": Spec(tiny_interns2_preview, EXACT_FLAGS),
    })


def assert_as_no_cache(hit: dict, ref: dict) -> None:
    """Every token within the suite's exact bound (one bad position cannot hide in the mean), the mean within TOL."""
    worst, mean = exact_errors(hit, ref)
    assert worst < EXACT_TOL and mean < TOL, f"max {worst:.4g}, mean {mean:.4g} nats per token"


# ---- SGLang serves the checkpoints as HF does (a request with no hit) ----

@pytest.fixture(scope="module")
def hf_vl(tiny_qwen35_vl):
    return load_hf_model(tiny_qwen35_vl), AutoProcessor.from_pretrained(tiny_qwen35_vl)


@torch.no_grad()
def hf_greedy(hf, text, images, max_new=NEW) -> tuple[list[int], list[float]]:
    """HF's greedy tokens for the prompt, and their log-probs from one teacher-forced forward."""
    model, processor = hf
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    out = model.generate(**inputs, max_new_tokens=max_new, do_sample=False, eos_token_id=None)
    tokens = out[0, n:].tolist()
    full = dict(inputs, input_ids=out, attention_mask=torch.ones_like(out))
    if "mm_token_type_ids" in inputs:  # which tokens are image tokens: none of the generated ones
        types = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, out.shape[1] - n)], dim=1)
    logits = model(**full).logits[0, n - 1:-1].float()
    return tokens, logits.log_softmax(-1).gather(-1, out[0, n:, None])[:, 0].tolist()


def assert_serves_as_hf(server, hf, text, images) -> dict:
    """The server's greedy tokens are HF's, their log-probs within HF_TOL of HF's teacher-forced ones."""
    tokens, lps = hf_greedy(hf, text, images)
    out = generate(server, text, NEW, return_logprob=True, logprob_start_len=-1, **with_images(*images))
    assert out["output_ids"] == tokens
    served = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert np.abs(np.array(served) - np.array(lps)).max() < HF_TOL
    return out


@pytest.mark.parametrize("images", [0, 1, 2], ids=["text", "one-image", "two-images"])
def test_text_and_images_are_served_as_hf_does(servers, hf_vl, images):
    """The anchored server's prefill (in CHUNK-token chunks, through the images) of a prompt it has not seen."""
    flush_cache(servers["anchored"].base_url)
    content = "".join(VISION + f" picture {i}." for i in range(images)) + " What do these show?"
    out = assert_serves_as_hf(servers["anchored"], hf_vl, prompt(content), [image(i) for i in range(images)])
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["meta_info"].get("image_tokens", 0) == images * IMAGE_TOKENS


@pytest.mark.parametrize("name", ["paper_moe", "interns2"])
def test_the_moe_checkpoint_serves_an_image_as_hf_does(servers, tiny_qwen35_moe_vl, name):
    """Qwen3_5MoeForConditionalGeneration, and the same weights as InternS2-Preview: a request with no hit (cache
    flushed) is the model's plain forward, HF's Qwen3.5-MoE's."""
    hf = load_hf_model(tiny_qwen35_moe_vl), AutoProcessor.from_pretrained(tiny_qwen35_moe_vl)
    flush_cache(servers[name].base_url)
    assert_serves_as_hf(servers[name], hf, prompt(VISION + QUESTION), [image(4)])


def test_interns2_preview_differs_from_the_moe_build_in_its_config_alone(tiny_qwen35_moe_vl, tiny_interns2_preview):
    """What makes HF's Qwen3.5-MoE its reference: the same weight bytes and processor, a config.json that differs in
    its architecture and model_type only."""
    import json

    for name in ("model.safetensors", "processor_config.json", "tokenizer.json"):
        assert (tiny_interns2_preview / name).read_bytes() == (tiny_qwen35_moe_vl / name).read_bytes(), name
    release, moe = (json.loads((path / "config.json").read_text()) for path in (tiny_interns2_preview,
                                                                                 tiny_qwen35_moe_vl))
    assert {k for k in release.keys() | moe.keys() if release.get(k) != moe.get(k)} == {"architectures", "model_type"}
    assert release["architectures"] == ["InternS2PreviewForConditionalGeneration"]
    assert release["model_type"] == "intern_s2_preview"


# ---- Tail-Replay: every hit that covers an image answers as no cache does ----

QUESTION = " Describe it."
IMAGE_START = 5  # "<|im_start|>user\n<|vision_start|>" is 5 tokens: the image's tokens are [5, 69)
FOLLOW_UP = " Then say which colour covers most of it, and why that might be."


@pytest.mark.parametrize("name", ["anchored", "paper_moe", "interns2"])
def test_a_hit_through_an_image_equals_no_cache(servers, name):
    """A fork after an image: the second request matches through the image, and (anchored, chunks of CHUNK tokens)
    its replay starts at a chunk-end anchor inside the image."""
    server = servers[name]
    first, second = prompt(VISION + QUESTION), prompt(VISION + QUESTION + FOLLOW_UP)
    start = generate(server, first, 1, **with_images(image(0)))["meta_info"]["prompt_tokens"] - 4
    ref = no_cache(server, second, start, NEW, **with_images(image(0)))
    flush_cache(server.base_url)  # else the first request hits the reference and leaves an anchor at its match end
    generate(server, first, 1, **with_images(image(0)))
    hit = scored(server, second, start, NEW, **with_images(image(0)))
    meta = hit["meta"]
    assert meta["cached_tokens"] > IMAGE_TOKENS + 2 and meta["tail_replay_exact"] is True
    if name == "anchored":
        anchor = meta["tail_replay_anchor"]
        assert anchor is not None and anchor % CHUNK == 0 and IMAGE_START < anchor < IMAGE_START + IMAGE_TOKENS
    else:
        assert meta["tail_replay_tokens"] == meta["cached_tokens"]  # the whole prefix, from a cleared state
    assert_as_no_cache(hit, ref)


def test_different_images_with_the_same_text_never_share_past_the_image(servers):
    server = servers["anchored"]
    flush_cache(server.base_url)
    text = prompt(VISION + QUESTION)
    generate(server, text, 1, **with_images(image(0)))
    other = scored(server, text, 0, NEW, **with_images(image(1)))
    assert other["meta"]["cached_tokens"] <= IMAGE_START  # the text before the image at most
    ref = no_cache(server, text, 0, NEW, **with_images(image(1)))
    assert_as_no_cache(other, ref)


def test_an_image_later_in_the_prompt_is_replayed_exactly(servers):
    """Text, an image, text: the hit covers the image from the middle of the prompt; the anchor at the shared
    text's chunk end lies before it."""
    server = servers["anchored"]
    lead = " A long shared instruction that comes before the picture arrives." * 2
    first = prompt(lead + VISION + QUESTION)
    second = prompt(lead + VISION + QUESTION + FOLLOW_UP)
    start = generate(server, first, 1, **with_images(image(2)))["meta_info"]["prompt_tokens"] - 4
    ref = no_cache(server, second, start, NEW, **with_images(image(2)))
    flush_cache(server.base_url)
    generate(server, first, 1, **with_images(image(2)))
    hit = scored(server, second, start, NEW, **with_images(image(2)))
    assert hit["meta"]["cached_tokens"] > IMAGE_TOKENS + 30 and hit["meta"]["tail_replay_exact"] is True
    assert_as_no_cache(hit, ref)


def chat(server, messages, max_tokens=NEW) -> dict:
    r = requests.post(f"{server.base_url}/v1/chat/completions", json={
        "model": "m", "messages": messages, "max_tokens": max_tokens, "temperature": 0, "logprobs": True},
        timeout=120)
    r.raise_for_status()
    return r.json()


def chat_logprobs(response) -> np.ndarray:
    return np.array([t["logprob"] for t in response["choices"][0]["logprobs"]["content"]])


@pytest.mark.parametrize("name", ["anchored", "paper_moe", "interns2"])
def test_a_chat_with_an_image_in_its_first_turn_answers_as_no_cache(servers, name):
    """Through the OpenAI-compatible endpoint, the image as a data URI: turn two hits turn one (image, answer and
    all) and answers as the same server does with the cache flushed. Anchored, the replay starts at turn one's end
    state; in the paper's mode it covers the image."""
    server = servers[name]
    flush_cache(server.base_url)
    turn1 = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_uri(image(3))}},
                                          {"type": "text", "text": QUESTION}]}]
    answer = chat(server, turn1)["choices"][0]["message"]["content"]
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
    hit = chat(server, turn2)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > IMAGE_TOKENS + 8
    flush_cache(server.base_url)
    ref = chat(server, turn2)
    assert ref["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert hit["choices"][0]["message"]["content"] == ref["choices"][0]["message"]["content"]
    assert np.abs(chat_logprobs(hit) - chat_logprobs(ref)).mean() < TOL


def test_input_embeds_requests_are_refused_and_the_server_keeps_serving(servers):
    """A request with its own `input_embeds` carries placeholder ids (SGLang makes them all 1), so its tokens must
    never be matched or inserted: SGLang refuses such requests unless the radix cache is off, which Tail-Replay
    refuses at start-up. The refusal is an HTTP error and the server serves on."""
    server = servers["anchored"]
    r = requests.post(f"{server.base_url}/generate", timeout=60, json={
        "input_embeds": [[0.0] * 64] * 4, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400 and "disable-radix-cache" in r.text
    assert len(generate(server, prompt(QUESTION), 2)["output_ids"]) == 2
