"""Kimi K3 with its vision tower (`KimiK3ForConditionalGeneration`, `tailreplay_eval.kimi_k3_vl`; issue 67): K3's
language model (KDA and gated NoPE MLA under attention residuals) under SGLang's MoonViT3d tower and projector,
served by stock SGLang on the CPU route and with Tail-Replay (`families.attn_res_kda`).

Stock first. The tower runs as SGLang ships it (torch SDPA and RoPE off CUDA); the checkpoint's processor
(`tailreplay_eval/kimi_k3_processing.py`, loaded with --trust-remote-code) feeds SGLang's CPU path. Nothing has K3's
tower to compare with, so on text the server is held to the K3 reference of its language model (transformers' Kimi
Linear under attention residuals, as tiny-kimi-k3 is), and on images to its own no-cache prefill.

Tail-Replay stores group 0's input too (a vision-language checkpoint): on K3 it is the row group 0's first layer
banks, the embeddings with the projector's rows in the image's, which is also the first row of every later layer's
bank. A hit that covers an image replays it from those stored rows: anchored (256-token prefill chunks, so a hit
inside the first chunk has no anchor below it) and paper (the whole prefix from cleared states), both on SGLang's
GPU-default scheduling.
"""

import pytest

import helpers
from helpers import (EXACT_FLAGS, MODELS_DIR, assert_exact, flush_cache, generate, image, no_cache, random_ids,
                     scored, start_gpu_scheduled, with_images)
from tailreplay_eval.models import build_model, load_tokenizer
from tailreplay_eval.reference import load_reference, prompt_logprobs

pytestmark = pytest.mark.server

PRESET = "tiny-kimi-k3-vl"
NEW = 8
CHUNK = 256
LOGPROB_TOL = 5e-3  # the other families' bound on prompt log-probs against the reference (test_hybrid_families)
K3_DECODE_TIE_TOL = 0.05  # K3's decode on the CPU route misses its prefill by up to 0.045 nats (test_hybrid_families)
REMOTE = ("--trust-remote-code", "--dtype", "float32")  # the checkpoint's processor; float32, not auto's float16
ANCHORED = REMOTE + ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
                     "--tail-replay-fold-tokens", "0")
SERVERS = {"anchored": ANCHORED, "paper": REMOTE + EXACT_FLAGS}
PICTURE_PX = 64


@pytest.fixture(scope="module")
def model_path():
    return build_model(PRESET, MODELS_DIR / PRESET)


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    yield from start_gpu_scheduled(tmp_path_factory, model_path, SERVERS)


@pytest.fixture(scope="module")
def reference(model_path):
    return load_reference(model_path)


@pytest.fixture(scope="module")
def tokenizer(model_path):
    return load_tokenizer(model_path)


@pytest.mark.parametrize("n, seed", [(70, 2), (300, 3)])
def test_stock_text_matches_the_k3_reference_of_its_language_model(servers, reference, n, seed):
    """The wrapper loads its language model's weights (under `language_model.`) where the text model has them:
    SGLang's no-cache prompt log-probs and greedy tokens equal the reference's."""
    server, ids = servers["anchored"], random_ids(n, seed)
    flush_cache(server.base_url)
    out = generate(server, ids, NEW, return_logprob=True, logprob_start_len=0)
    assert out["meta_info"]["cached_tokens"] == 0
    helpers.assert_greedy_agrees(reference, ids, out["output_ids"], K3_DECODE_TIE_TOL)
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(served, prompt_logprobs(reference, ids))) < LOGPROB_TOL


def prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


HEAD = "<|media_pad|>" + " word" * 40
FIRST, AGAIN = prompt(HEAD + " word" * 60 + " Describe it."), prompt(HEAD + " colour" * 60 + " What is it?")
ROWS = 16  # a 64x64 picture: 8x8 patches merged 2x2


def served_ids(tokenizer, text: str) -> list[int]:
    """The prompt's ids as SGLang's K3 processor writes them: the text's, with its one placeholder framed by
    "<|media_begin|>image 64x64<|media_content|>" and "<|media_end|>" and repeated once per row."""
    pad = tokenizer.convert_tokens_to_ids("<|media_pad|>")
    ids = tokenizer.encode(text)
    at = ids.index(pad)
    framing = tokenizer.encode(f"<|media_begin|>image {PICTURE_PX}x{PICTURE_PX}<|media_content|>")
    return ids[:at] + framing + [pad] * ROWS + tokenizer.encode("<|media_end|>") + ids[at + 1:]


def test_the_image_reaches_the_language_model(servers, tokenizer):
    """The tower's rows are in the prompt where SGLang's processor puts them, and another picture moves the
    log-probs of the text after it."""
    server = servers["anchored"]
    runs = [no_cache(server, FIRST, 0, 1, **with_images(image(seed=s, px=PICTURE_PX))) for s in (3, 4)]
    assert runs[0]["prompt_len"] == len(served_ids(tokenizer, FIRST)) - 1  # log-probs from the second token on
    after = len(served_ids(tokenizer, prompt(HEAD)))
    moved = max(abs(a - b) for a, b in zip(runs[0]["logprobs"][after:], runs[1]["logprobs"][after:]))
    assert moved > 0.05, moved


@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_hit_through_an_image_replays_its_stored_rows_and_equals_no_cache(servers, tokenizer, name):
    """A second question about the same image, parting from the first inside the anchored server's first chunk:
    both servers replay the whole match, image rows included, from group 0's stored rows (no anchor lies below it),
    and equal their own no-cache prefill."""
    server, picture = servers[name], image(seed=3, px=PICTURE_PX)
    a, b = served_ids(tokenizer, FIRST), served_ids(tokenizer, AGAIN)
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert ROWS < shared < CHUNK
    flush_cache(server.base_url)
    generate(server, FIRST, 2, **with_images(picture))
    hit = scored(server, AGAIN, shared, NEW, **with_images(picture))
    assert hit["meta"]["cached_tokens"] == shared and hit["meta"]["tail_replay_tokens"] == shared
    assert hit["meta"]["tail_replay_exact"] is True
    assert_exact(hit, no_cache(server, AGAIN, shared, NEW, **with_images(picture)))
