"""The real SGLang 0.5.23 server (scheduler, hybrid radix cache, HTTP) on CPU, against HF transformers."""

import concurrent.futures

import pytest
import requests

from helpers import generate
from tailreplay_eval.server import flush_cache
from tailreplay_eval.reference import greedy_generate, prompt_logprobs

pytestmark = pytest.mark.server

PROMPT = "the quick brown fox jumps over the lazy dog and then"
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def server(stock_qwen35_server):
    """Stock SGLang on tiny Qwen3.5 (the session's, shared with test_bench.py), from an empty cache."""
    flush_cache(stock_qwen35_server.base_url)
    return stock_qwen35_server


def test_fresh_prompt_matches_hf_greedy(server, hf_qwen35):
    model, tok = hf_qwen35
    ids = tok(PROMPT).input_ids
    out = generate(server, ids, NEW_TOKENS)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == greedy_generate(model, ids, NEW_TOKENS)


def test_prefix_cache_hit_matches_hf_greedy(server, hf_qwen35):
    model, tok = hf_qwen35
    base = tok("a shared system prompt: always answer about foxes and dogs").input_ids
    generate(server, base, max_new_tokens=2)
    extended = base + tok(" what does the fox do").input_ids
    out = generate(server, extended, NEW_TOKENS)
    assert out["meta_info"]["cached_tokens"] >= len(base) - 1  # stock no_buffer hits at the inserted end
    assert out["output_ids"] == greedy_generate(model, extended, NEW_TOKENS)


def test_prompt_logprobs_match_hf(server, hf_qwen35):
    model, tok = hf_qwen35
    ids = tok(PROMPT + " runs into the forest").input_ids
    out = generate(server, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"]][1:]
    reference = prompt_logprobs(model, ids)
    assert len(served) == len(reference)
    assert max(abs(a - b) for a, b in zip(served, reference)) < 1e-3


def test_concurrent_requests_equal_serial(server, hf_qwen35):
    _, tok = hf_qwen35
    prompts = [tok(f"request number {i} asks about the lazy dog").input_ids for i in range(4)]
    serial = [generate(server, p, NEW_TOKENS)["output_ids"] for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        parallel = [f.result()["output_ids"] for f in [pool.submit(generate, server, p, NEW_TOKENS) for p in prompts]]
    assert parallel == serial


def test_openai_chat_uses_the_chat_template(server):
    body = {"model": "default", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4,
            "temperature": 0}
    r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200
    assert r.json()["usage"]["prompt_tokens"] > len("hello there".split())  # role markers were added


@pytest.mark.parametrize("body", [
    {"text": "hi", "sampling_params": {"max_new_tokens": -5}},
    {"text": "hi", "sampling_params": {"temperature": "hot"}},
    {"sampling_params": {"max_new_tokens": 2}},
    "{not json",
    {"input_ids": [1, 100000], "sampling_params": {"max_new_tokens": 2}},
    {"input_ids": [-1, 2], "sampling_params": {"max_new_tokens": 2}},
], ids=["negative-max-new-tokens", "non-numeric-temperature", "no-prompt", "malformed-json", "out-of-vocab-id",
        "negative-id"])
def test_bad_request_gets_http_error_and_server_keeps_serving(server, hf_qwen35, body):
    # Stock SGLang 0.5.23 lets a bad token id kill the scheduler; the plugin's check is on without
    # --enable-tail-replay too (tailreplay_sglang/validation.py).
    payload = {"data": body} if isinstance(body, str) else {"json": body}
    r = requests.post(f"{server.base_url}/generate", timeout=60, **payload)
    assert 400 <= r.status_code < 500, r.text
    _, tok = hf_qwen35
    assert len(generate(server, tok("still alive").input_ids, max_new_tokens=3)["output_ids"]) == 3
