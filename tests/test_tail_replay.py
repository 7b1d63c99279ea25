"""Tail-Replay inside the real SGLang server: token-level reuse, and exactness at ratio 1 against no cache.

With `--tail-replay-ratio 1` the replay rebuilds every GDN state from the stored group inputs over the whole
matched prefix, so a hit must reproduce the no-cache computation (HF transformers on the same weights) greedily,
and its prompt logprobs within float32 tolerance. That pins capture, layout, replay and the hand-off to the extend.
"""

import math

import pytest
import requests
from transformers import AutoTokenizer

from helpers import (EXACT_FLAGS, Spec, assert_exact, check_concurrent_hits, check_forked_program, check_multi_turn,
                     generate, no_cache, random_ids, run_forked_program, scored, start_servers)
from tailreplay_eval.reference import greedy_generate, load_hf_model, prompt_logprobs
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

NEW = 12
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")


PAPER = ("--enable-tail-replay", "--tail-replay-exact-budget", "0")


@pytest.fixture(scope="module")
def server(exact_tail_replay_server):
    return exact_tail_replay_server


# The paper's ratio tail, clamped: k = clamp(ceil(RATIO * m), MIN_TAIL, MAX_TAIL) for a hit of m tokens.
RATIO, MIN_TAIL, MAX_TAIL = 0.1, 8, 64


def ratio_tail(matched: int) -> int:
    return min(max(math.ceil(RATIO * matched), MIN_TAIL), MAX_TAIL, matched)


@pytest.fixture(scope="module")
def servers(tiny_qwen35, tiny_qwen3next, tmp_path_factory):
    """The module's own servers (beside the session's exact one), started together:
    - host_tier / float8 / int4: the exact flags with the host hidden tier (serialized loads) / float8 / int4
      hiddens;
    - ratio: the paper's 10 % tail clamped to [MIN_TAIL, MAX_TAIL] tokens, 32-token prefill chunks, a 768-token KV
      pool (the clamp, chunked extends, eviction, and the r = 0.1 arm of the error ordering);
    - zero: the paper's zero states (the error ordering);
    - qwen3next: the exact flags on Qwen3-Next."""
    yield from start_servers(tmp_path_factory, {
        "host_tier": Spec(tiny_qwen35, (*EXACT_FLAGS, "--tail-replay-hidden-tier", "host", "--tail-replay-h2d", "ser")),
        "float8": Spec(tiny_qwen35, (*EXACT_FLAGS, "--tail-replay-hidden-dtype", "float8_e4m3fn")),
        "int4": Spec(tiny_qwen35, (*EXACT_FLAGS, "--tail-replay-hidden-dtype", "int4")),
        "ratio": Spec(tiny_qwen35, (*PAPER, "--tail-replay-ratio", str(RATIO), "--tail-replay-min-tokens",
                                    str(MIN_TAIL), "--tail-replay-max-tokens", str(MAX_TAIL),
                                    "--chunked-prefill-size", "32"),
                      kwargs={"max_total_tokens": 768}),
        "zero": Spec(tiny_qwen35, (*PAPER, "--tail-replay-mode", "zero")),
        "qwen3next": Spec(tiny_qwen3next, EXACT_FLAGS),
    })


def flush(server):
    flush_cache(server.base_url)


def test_identical_resend_hits_all_but_the_last_token_and_matches_no_cache(server, hf_qwen35):
    model, tok = hf_qwen35
    flush(server)
    ids = tok(SYSTEM + " what happened first?").input_ids
    first = generate(server, ids, NEW)
    again = generate(server, ids, NEW)
    assert first["meta_info"]["cached_tokens"] == 0
    assert again["meta_info"]["cached_tokens"] == len(ids) - 1  # SGLang's own cap: input_len - 1
    assert first["output_ids"] == again["output_ids"] == greedy_generate(model, ids, NEW)


def test_shared_system_prompt_hits_the_common_prefix(server, hf_qwen35):
    model, tok = hf_qwen35
    flush(server)
    system = tok(SYSTEM).input_ids
    generate(server, system + tok(" who repaired the window?").input_ids, max_new_tokens=2)
    for question in (" why did the sailor leave", " when", " tell me about the boxes and the harbour please"):
        ids = system + tok(question).input_ids
        out = generate(server, ids, NEW)
        assert out["meta_info"]["cached_tokens"] >= len(system)
        assert out["output_ids"] == greedy_generate(model, ids, NEW)


@pytest.mark.parametrize("cut", [1, 7, 23])
def test_fork_mid_prefix_and_edit_in_the_middle(server, hf_qwen35, cut):
    model, tok = hf_qwen35
    flush(server)
    base = tok(SYSTEM).input_ids
    generate(server, base, max_new_tokens=1)
    forked = base[:cut] + tok(" but a different story begins").input_ids
    edited = base[:cut] + [(base[cut] + 1) % 500] + base[cut + 1:]
    for ids in (forked, edited):
        out = generate(server, ids, NEW)
        assert out["meta_info"]["cached_tokens"] == cut
        assert out["output_ids"] == greedy_generate(model, ids, NEW)


def test_multi_turn_follow_up_matches_through_the_previous_answer(server, hf_qwen35):
    """Decode-time capture: the second turn's prompt contains turn one's generated tokens."""
    model, tok = hf_qwen35
    flush(server)
    check_multi_turn(server, model, tok, SYSTEM + " first question?", NEW)


def test_prompt_logprobs_on_a_hit_match_no_cache(server, hf_qwen35):
    model, tok = hf_qwen35
    flush(server)
    ids = tok(SYSTEM + " and then the story ends").input_ids
    start = len(ids) - 6
    generate(server, ids[:start], max_new_tokens=1)
    out = generate(server, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=start)
    assert out["meta_info"]["cached_tokens"] == start  # logprobs from `start` on need only the uncached tail
    served = {pos: lp for pos, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start)
              if lp is not None}
    reference = prompt_logprobs(model, ids)  # reference[i] = log p(ids[i + 1] | ids[:i + 1])
    assert len(served) >= 5
    assert max(abs(lp - reference[pos - 1]) for pos, lp in served.items()) < 1e-3


def test_concurrent_hits_on_one_prefix_are_independent(server, hf_qwen35):
    model, tok = hf_qwen35
    flush(server)
    system = tok(SYSTEM).input_ids
    generate(server, system, max_new_tokens=1)
    check_concurrent_hits(server, model, tok, system, NEW)


def test_server_keeps_serving_after_flush_and_many_hits(server, hf_qwen35):
    _, tok = hf_qwen35
    ids = tok(SYSTEM).input_ids
    for i in range(6):
        generate(server, ids[: 10 + 5 * i] + [i + 3], max_new_tokens=2)
    flush(server)
    assert generate(server, ids, max_new_tokens=2)["meta_info"]["cached_tokens"] == 0


def replayed_total(server) -> float:
    metrics = requests.get(f"{server.base_url}/metrics", timeout=30).text
    replayed = [float(line.split()[-1]) for line in metrics.splitlines()
                if line.startswith("sglang:tail_replay_tokens_total")]
    assert len(replayed) == 1, replayed
    return replayed[0]


def test_meta_info_and_metrics_report_the_replay(server, hf_qwen35):
    """The counter is the session's (the server is shared): its increase over this test's two requests."""
    _, tok = hf_qwen35
    flush(server)
    ids = tok(SYSTEM + " visibility").input_ids
    before = replayed_total(server)
    miss = generate(server, ids, max_new_tokens=2)
    assert miss["meta_info"]["tail_replay_tokens"] == 0 and replayed_total(server) == before
    hit = generate(server, ids, max_new_tokens=2)
    assert hit["meta_info"]["tail_replay_tokens"] == hit["meta_info"]["cached_tokens"] == len(ids) - 1  # ratio 1
    assert hit["meta_info"]["tail_replay_ms"] > 0
    assert replayed_total(server) - before == len(ids) - 1


@pytest.fixture(scope="module")
def host_tier_server(servers):
    return servers["host_tier"]


def _mixed_traffic(server, tok) -> list[dict]:
    """Fresh prompt, resend, fork, multi-turn and more hits on one prefix, each `scored` from its last 4 prompt
    tokens on (SGLang matches up to there): what each answer says about its hit, and its log-probs."""
    flush(server)
    system = tok(SYSTEM).input_ids
    prompts = [system, system + tok(" what happened first?").input_ids, system[:9] + tok(" a fork").input_ids]
    outs = [scored(server, ids, len(ids) - 4, NEW) for ids in prompts]
    prompts.append(prompts[1] + outs[1]["output_ids"] + tok(" and then?").input_ids)
    outs.append(scored(server, prompts[-1], len(prompts[-1]) - 4, NEW))
    # Sequential, so both servers batch alike (concurrent hits: test_concurrent_hits_on_one_prefix_are_independent)
    more = [system + tok(f" {word} happened next?").input_ids for word in ("what", "who", "why", "how")]
    outs += [scored(server, ids, len(ids) - 4, NEW) for ids in more]
    prompts += more
    return [{**o, "ids": ids, "start": len(ids) - 4, "cached": o["meta"]["cached_tokens"],
             "replayed": o["meta"]["tail_replay_tokens"]} for ids, o in zip(prompts, outs)]


def test_host_tier_serves_exactly_what_the_device_tier_serves(server, host_tier_server, tok_qwen35):
    """`--tail-replay-hidden-tier host --tail-replay-h2d ser` (on a CPU: the write-back and tail-load code with
    synchronous copies): the same hits and replays as the default device tier, and every answer as the host-tier
    server's own no-cache prefill."""
    device, host = _mixed_traffic(server, tok_qwen35), _mixed_traffic(host_tier_server, tok_qwen35)
    assert sum(r["replayed"] for r in host) > 0 and sum(r["cached"] for r in host) > 0
    assert [(r["cached"], r["replayed"]) for r in host] == [(r["cached"], r["replayed"]) for r in device]
    for r in host:
        assert_exact(r, no_cache(host_tier_server, r["ids"], r["start"], NEW))
    info = requests.get(f"{host_tier_server.base_url}/server_info", timeout=30).json()
    pools = info["internal_states"][0]["tail_replay_pools"]
    assert pools["hidden_tier"] == "host" and pools["pending_write_backs"] == 0


@pytest.fixture(scope="module")
def float8_server(servers):
    return servers["float8"]


def test_float8_hiddens_hit_alike_and_stay_close_to_float32_hiddens(server, float8_server, tok_qwen35):
    """`--tail-replay-hidden-dtype float8_e4m3fn` (e4m3 + a float32 scale per token): the same hits and replays as
    float32 hiddens; the whole-prefix replay from rounded hiddens moves the hit's logprobs, a little. Measured on this
    model: max |delta logprob| 1.5e-3 over the 9 scored positions (below stock's own hit-vs-prefill noise on long
    random models, 0.005-0.016); the bound leaves ~7x."""
    f32, f8 = _mixed_traffic(server, tok_qwen35), _mixed_traffic(float8_server, tok_qwen35)
    assert [(r["cached"], r["replayed"]) for r in f8] == [(r["cached"], r["replayed"]) for r in f32]
    assert sum(r["replayed"] for r in f8) > 0
    diffs = [abs(a - b) for r8, r32 in zip(f8, f32) for a, b in zip(r8["logprobs"][:r8["prompt_len"]],
                                                                  r32["logprobs"][:r32["prompt_len"]])]
    assert diffs and 0 < max(diffs) < 0.01, max(diffs)
    info = requests.get(f"{float8_server.base_url}/server_info", timeout=30).json()
    assert info["internal_states"][0]["tail_replay_pools"]["hidden_dtype"] == "torch.float8_e4m3fn"


def test_int4_hiddens_hit_alike_and_stay_within_their_measured_error(server, servers, tok_qwen35):
    """`--tail-replay-hidden-dtype int4` (4-bit codes + a bfloat16 scale per 32 values, 0.28x bfloat16's bytes):
    the same hits and replays as float32 hiddens, served from 40-byte rows; the replays from 4-bit hiddens move the
    hit's logprobs by more than float8's do: max |delta logprob| 0.027 over the 24 scored positions on this model
    (float8: 1.5e-3); the bound leaves ~4x, and a wrong decode (a scale or nibble order) misses it by far."""
    f32, i4 = _mixed_traffic(server, tok_qwen35), _mixed_traffic(servers["int4"], tok_qwen35)
    assert [(r["cached"], r["replayed"]) for r in i4] == [(r["cached"], r["replayed"]) for r in f32]
    assert sum(r["replayed"] for r in i4) > 0
    diffs = [abs(a - b) for r4, r32 in zip(i4, f32) for a, b in zip(r4["logprobs"][:r4["prompt_len"]],
                                                                  r32["logprobs"][:r32["prompt_len"]])]
    assert diffs and 0 < max(diffs) < 0.1, max(diffs)
    pools = requests.get(f"{servers['int4'].base_url}/server_info", timeout=30).json()["internal_states"][0][
        "tail_replay_pools"]
    assert pools["hidden_dtype"] == "torch.int4"


@pytest.fixture(scope="module")
def ratio_server(servers):
    return servers["ratio"]


def test_ratio_mode_replays_the_clamped_tail_and_chunked_prefill_continues(ratio_server):
    """k = clamp(ceil(r*m), min, max): at the minimum, in between and at the maximum. With a 32-token prefill chunk
    the extend after the hit spans several chunks and only the first one replays (the others continue the
    request's live state). Deepest cut first: each new branch may evict the least recently used end of the tree."""
    flush(ratio_server)
    base = random_ids(660, seed=7)
    generate(ratio_server, base, max_new_tokens=1)
    for cut, expected in ((650, MAX_TAIL), (305, 31), (20, MIN_TAIL)):
        assert ratio_tail(cut) == expected
        ids = base[:cut] + random_ids(40, seed=cut)  # a new question longer than one prefill chunk
        out = generate(ratio_server, ids, max_new_tokens=3)
        assert out["meta_info"]["cached_tokens"] == cut
        assert out["meta_info"]["tail_replay_tokens"] == expected
        assert len(out["output_ids"]) == 3


def test_long_system_prompt_with_long_suffixes_through_chunked_prefill(server, hf_qwen35):
    """A 1024-token system prompt and suffixes of 40 / 200 / 600 tokens; with 128-token prefill chunks both the
    cold prefill and the extend after each hit are chunked, and every hit is exact."""
    import random

    model, _ = hf_qwen35
    rng = random.Random(1)
    system = [rng.randrange(3, 500) for _ in range(1024)]
    flush(server)
    generate(server, system, max_new_tokens=1)
    for suffix_len in (40, 200, 600):
        ids = system + [rng.randrange(3, 500) for _ in range(suffix_len)]
        out = generate(server, ids, max_new_tokens=6)
        assert out["meta_info"]["cached_tokens"] == len(system)
        assert out["output_ids"] == greedy_generate(model, ids, 6)


def test_openai_multi_turn_chat_reuses_the_conversation(server):
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "what happened first?"}]
    usages = []
    for turn in range(5):
        body = {"model": "default", "messages": messages, "max_tokens": 8, "temperature": 0}
        r = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        reply = r.json()
        usages.append(reply["usage"])
        messages += [{"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
                     {"role": "user", "content": f"and then, part {turn + 2}?"}]
    for previous, usage in zip(usages, usages[1:]):
        # each turn reuses at least the previous turn's whole prompt
        assert usage["prompt_tokens_details"]["cached_tokens"] >= previous["prompt_tokens"]
    # and the last turn, a hit on all the others, answers as the same server does with nothing cached
    flush(server)
    body = {"model": "default", "messages": messages[:-2], "max_tokens": 8, "temperature": 0}  # the last turn
    reference = requests.post(f"{server.base_url}/v1/chat/completions", json=body, timeout=60).json()
    assert (reference["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0
    assert reference["choices"][0]["message"]["content"] == reply["choices"][0]["message"]["content"]


def test_frontend_program_with_fork(server, hf_qwen35):
    """An SGLang frontend program (`sgl.function`) that forks after a shared prefix: every branch hits it and answers
    as the server does with nothing cached."""
    import sglang as sgl

    _, tok = hf_qwen35
    flush(server)
    branches = run_forked_program(sgl.RuntimeEndpoint(server.base_url), SYSTEM, "what happened?")  # stock: 0 cached
    check_forked_program(server, branches, len(tok(SYSTEM + " what happened?").input_ids))


def test_eviction_under_kv_pressure_and_aborted_requests_lose_nothing(ratio_server, hf_qwen35):
    """A 768-token pool: a workload of ~2.5K distinct tokens must evict, and a client that drops a streaming
    request must not leak; the server runs SGLang's strict idle leak check, so a lost slot would crash it."""
    _, tok = hf_qwen35
    prompts = [tok(f"request {i}: " + SYSTEM[i:] + f" number {i}").input_ids for i in range(30)]
    for ids in prompts:
        generate(ratio_server, ids, max_new_tokens=2)
    assert generate(ratio_server, prompts[0], max_new_tokens=1)["meta_info"]["cached_tokens"] < 10  # evicted (LRU)
    body = {"input_ids": tok(SYSTEM).input_ids, "stream": True,
            "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
    with requests.post(f"{ratio_server.base_url}/generate", json=body, stream=True, timeout=60) as r:
        next(line for line in r.iter_lines() if line.startswith(b"data:"))  # first token, then hang up
    ids = tok(SYSTEM + " after the pressure").input_ids
    generate(ratio_server, ids, max_new_tokens=1)
    out = generate(ratio_server, ids, max_new_tokens=2)
    assert out["meta_info"]["cached_tokens"] == len(ids) - 1
    assert out["meta_info"]["tail_replay_tokens"] == ratio_tail(len(ids) - 1)
    assert requests.get(f"{ratio_server.base_url}/health", timeout=30).status_code == 200


def test_qwen3next_hits_match_no_cache(tiny_qwen3next, servers):
    """Qwen3-Next (MoE FFN, its own q/k/v/z layout) through the same replay path, exact at ratio 1. A cold request
    is SGLang's own forward of the model (the plugin only reads it): HF's tokens too. (Not on SYSTEM: HF's third
    token there is a near-tie, 3e-4 nats ahead of the one SGLang's CPU prefill picks, with or without the plugin.)"""
    model = load_hf_model(tiny_qwen3next)
    tok = AutoTokenizer.from_pretrained(tiny_qwen3next)
    srv = servers["qwen3next"]
    flush_cache(srv.base_url)
    fresh = tok("the quick brown fox jumps over the lazy dog and then").input_ids
    cold = generate(srv, fresh, NEW)
    assert cold["meta_info"]["cached_tokens"] == 0 and cold["output_ids"] == greedy_generate(model, fresh, NEW)
    base = tok(SYSTEM).input_ids
    generate(srv, base, max_new_tokens=1)
    for ids, cached in ((base, len(base) - 1), (base[:17] + tok(" another branch").input_ids, 17)):
        out = generate(srv, ids, NEW)
        assert out["meta_info"]["cached_tokens"] == cached
        assert out["output_ids"] == greedy_generate(model, ids, NEW)


def _suffix_logprob_error(server, model, ids, start) -> float:
    generate(server, ids[:start], max_new_tokens=1)
    out = generate(server, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=start)
    assert out["meta_info"]["cached_tokens"] == start
    reference = prompt_logprobs(model, ids)
    served = [(pos, lp) for pos, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start)
              if lp is not None]
    return max(abs(lp - reference[pos - 1]) for pos, lp in served)


def test_error_ordering_zero_above_ratio_above_full(server, servers, hf_qwen35):
    """DESIGN invariant on a model whose GDN heads remember for tens to hundreds of tokens (the builder's gates):
    error(zero states) > error(r = 0.1) > error(r = 1) ~ 0, on the suffix after a 560-token hit (r = 0.1: the ratio
    server, whose clamp leaves this hit's tail alone)."""
    import random

    model, _ = hf_qwen35
    rng = random.Random(0)
    ids, start = [rng.randrange(3, 500) for _ in range(600)], 560
    assert MIN_TAIL < ratio_tail(start) < MAX_TAIL
    errors = {}
    for name, srv in (("zero", servers["zero"]), ("r=0.1", servers["ratio"])):
        flush(srv)
        errors[name] = _suffix_logprob_error(srv, model, ids, start)
    flush(server)
    errors["full"] = _suffix_logprob_error(server, model, ids, start)
    assert errors["zero"] > 2 * errors["r=0.1"] > 2 * errors["full"], errors
    assert errors["full"] < 1e-3, errors
