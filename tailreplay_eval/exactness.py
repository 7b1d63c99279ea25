"""Is a hit exact? Its log-probs against a reference run of the same prompt (the same server with its cache flushed),
per token, with the bound stock SGLang's own hits set. Shared by the tests (`tests/helpers.py` re-exports these) and
the GPU check (`tailreplay_eval/gpu_check.py`).

A server here is anything with a `base_url` (`server.ServerProcess`)."""

import requests

from tailreplay_eval.server import flush_cache


def generate_response(server, input_ids, max_new_tokens, **extra) -> requests.Response:
    """Greedy /generate of exactly max_new_tokens tokens; returns the HTTP response as it came (errors included).
    A str prompt is sent as `text`."""
    prompt = {"text": input_ids} if isinstance(input_ids, str) else {"input_ids": input_ids}
    body = {**prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
            **extra}
    return requests.post(f"{server.base_url}/generate", json=body, timeout=120)


def generate(server, input_ids, max_new_tokens, **extra) -> dict:
    """Greedy /generate of exactly max_new_tokens tokens; returns the response JSON (raises on an HTTP error)."""
    r = generate_response(server, input_ids, max_new_tokens, **extra)
    r.raise_for_status()
    return r.json()


def scored(server, prompt, start, max_new=4, **extra) -> dict:
    """The request with log-probs of every prompt token from `start` on and of its outputs (teacher-forced, so a
    near-tie in the greedy outputs cannot hide an error). SGLang matches a prefix only up to `start`."""
    return scored_from(generate(server, prompt, max_new, return_logprob=True, logprob_start_len=start,
                                top_logprobs_num=2, **extra))


def scored_from(out: dict) -> dict:
    """A `/generate` (or `Engine.generate`) answer asked for log-probs with top_logprobs_num=2, in `scored`'s form."""
    meta = out["meta_info"]
    lps = [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None]
    prompt_len = len(lps)
    lps += [lp for lp, _, _ in meta["output_token_logprobs"]]
    top2 = [[(lp, tid) for lp, tid, _ in top[:2]] for top in meta["output_top_logprobs"]]
    return {"meta": meta, "output_ids": out["output_ids"], "logprobs": lps, "prompt_len": prompt_len, "top2": top2}


def no_cache(server, prompt, start, max_new=4, **extra) -> dict:
    """`scored` with the server's cache flushed first: the reference a hit must equal."""
    flush_cache(server.base_url)
    out = scored(server, prompt, start, max_new, **extra)
    assert out["meta"]["cached_tokens"] == 0
    return out


# Nats per token: how far stock SGLang's own exact-state hit lies from its own no-cache prefill on long-memory random
# float32 models (max 0.005-0.016, mean 0.0016-0.0039 over prompts of 684-2007 tokens), the bound of an exact hit.
EXACT_TOL = 0.02
EXACT_MEAN_TOL = 0.005


def exact_errors(hit: dict, reference: dict) -> tuple[float, float]:
    """(max, mean) log-prob difference between two `scored` results of one prompt, over every prompt token and every
    output token before the greedy outputs part; they may part only at a near-tie of the reference (its top two within
    EXACT_TOL, the hit's token one of them), past which the log-probs are of different tokens."""
    hit_ids, ref_ids = hit["output_ids"], reference["output_ids"]
    same = next((i for i, (a, b) in enumerate(zip(hit_ids, ref_ids)) if a != b), min(len(hit_ids), len(ref_ids)))
    if same < min(len(hit_ids), len(ref_ids)):
        (first, first_id), (second, second_id) = reference["top2"][same]
        assert first - second < EXACT_TOL and hit_ids[same] in (first_id, second_id), \
            f"greedy outputs part at output {same} without a near-tie: {hit_ids} against {ref_ids}"
    assert hit["prompt_len"] == reference["prompt_len"]
    n = reference["prompt_len"] + same
    assert n > 0, "nothing to compare"
    diffs = [abs(x - y) for x, y in zip(hit["logprobs"][:n], reference["logprobs"][:n])]
    return max(diffs), sum(diffs) / len(diffs)


def assert_exact(hit: dict, reference: dict) -> None:
    """A hit equals the reference (`no_cache`) as closely as stock's own hit does: the greedy outputs up to a
    near-tie, every log-prob within EXACT_TOL and their mean within EXACT_MEAN_TOL."""
    worst, mean = exact_errors(hit, reference)
    assert worst < EXACT_TOL and mean < EXACT_MEAN_TOL, f"max {worst:.4g}, mean {mean:.4g} nats per token"
