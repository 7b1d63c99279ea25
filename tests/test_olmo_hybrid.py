"""OLMo-Hybrid (`tailreplay_sglang.models`) served by the real SGLang server on CPU, against HF transformers.

The checkpoint is `tiny-olmo-hybrid`: beta = 2 sigmoid(b) (negative eigenvalues), post-norm attention layers,
pre-norm GDN layers, norm weights drawn around 1 (so a norm applied in the wrong place changes the outputs).
"""

import pytest

from helpers import Spec, assert_anchored_hit, check_concurrent_hits, check_multi_turn, generate, start_servers
from tailreplay_eval.reference import greedy_generate, prompt_logprobs
from tailreplay_eval.server import flush_cache

NEW = 12
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")
LOGPROB_TOL = 1e-3  # what tests/test_server.py asks of Qwen3.5


def max_logprob_error(out, model, ids, start=0) -> float:
    reference = prompt_logprobs(model, ids)  # reference[i] = log p(ids[i + 1] | ids[:i + 1])
    served = [(pos, lp) for pos, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start)
              if lp is not None and pos > 0]
    assert len(served) >= min(5, len(ids) - start - 1)
    return max(abs(lp - reference[pos - 1]) for pos, lp in served)


EXACT_FLAGS = ("--enable-tail-replay", "--tail-replay-exact-budget", "0", "--tail-replay-ratio", "1",
               "--tail-replay-hidden-dtype", "float32", "--chunked-prefill-size", "128")


@pytest.fixture(scope="module")
def servers(tiny_olmo_hybrid, tmp_path_factory):
    """The module's servers, started together: Tail-Replay replaying whole prefixes (exact); the defaults (anchored);
    the paper's zero states and 10 % tail (error ordering). No stock server: a request on a flushed Tail-Replay
    server is SGLang's own forward of the model (the plugin only reads it), and a hit from a kept state, which is
    all a stock hit is, is the anchored server's."""
    paper = ("--enable-tail-replay", "--tail-replay-exact-budget", "0")
    yield from start_servers(tmp_path_factory, {
        "exact": Spec(tiny_olmo_hybrid, EXACT_FLAGS),
        "default": Spec(tiny_olmo_hybrid, ("--enable-tail-replay",)),
        "zero": Spec(tiny_olmo_hybrid, (*paper, "--tail-replay-mode", "zero")),
        "r=0.1": Spec(tiny_olmo_hybrid, (*paper, "--tail-replay-ratio", "0.1", "--tail-replay-min-tokens", "1")),
    })


# ---- the model itself: a cold prefill (cache flushed) and a hit from a kept state, against HF ----

@pytest.fixture(scope="module")
def cold(servers):
    """The exact server, its cache flushed by each test: its requests are then SGLang's no-cache forward."""
    return servers["exact"]


def test_hf_reference_uses_negative_eigenvalues(hf_olmo_hybrid):
    model, _ = hf_olmo_hybrid
    assert model.config.linear_allow_neg_eigval
    assert model.model.layers[0].linear_attn.allow_neg_eigval


@pytest.mark.server
def test_fresh_prompt_matches_hf_greedy(cold, hf_olmo_hybrid):
    model, tok = hf_olmo_hybrid
    flush_cache(cold.base_url)
    ids = tok(SYSTEM + " what happened first?").input_ids
    out = generate(cold, ids, NEW)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == greedy_generate(model, ids, NEW)


@pytest.mark.server
def test_hit_from_a_kept_state_matches_hf_greedy(servers, hf_olmo_hybrid):
    """What a stock (no_buffer) hit is: the state kept where the first request's prefill ended, read back from the
    mamba pool, nothing replayed, and the extend after it; here on the anchored server (its chunk-end anchor)."""
    model, tok = hf_olmo_hybrid
    srv = servers["default"]
    flush_cache(srv.base_url)
    base = tok(SYSTEM).input_ids
    generate(srv, base, max_new_tokens=2)
    extended = base + tok(" who repaired the window?").input_ids
    out = generate(srv, extended, NEW)
    meta = out["meta_info"]
    assert meta["cached_tokens"] >= len(base) - 1 and meta["tail_replay_exact"] is True
    assert meta["tail_replay_anchor"] == meta["cached_tokens"] and meta["tail_replay_tokens"] == 0, meta
    assert out["output_ids"] == greedy_generate(model, extended, NEW)


@pytest.mark.server
def test_prompt_logprobs_match_hf(cold, hf_olmo_hybrid):
    model, tok = hf_olmo_hybrid
    flush_cache(cold.base_url)
    ids = tok(SYSTEM + " runs into the forest").input_ids
    out = generate(cold, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
    assert out["meta_info"]["cached_tokens"] == 0
    assert max_logprob_error(out, model, ids) < LOGPROB_TOL


# ---- Tail-Replay: the paper's mode (no anchors) replaying the whole prefix equals no cache ----

@pytest.fixture(scope="module")
def exact(servers):
    return servers["exact"]


def _hit(server, model, ids, cached):
    """A request that must hit `cached` tokens, replay all of them, and give HF's no-cache greedy tokens."""
    out = generate(server, ids, NEW)
    assert out["meta_info"]["cached_tokens"] == cached
    assert out["meta_info"]["tail_replay_tokens"] == cached
    assert out["output_ids"] == greedy_generate(model, ids, NEW)
    return out


@pytest.mark.server
def test_tail_replay_full_identical_resend_equals_no_cache(exact, hf_olmo_hybrid):
    model, tok = hf_olmo_hybrid
    flush_cache(exact.base_url)
    ids = tok(SYSTEM + " what happened first?").input_ids
    assert generate(exact, ids, NEW)["meta_info"]["cached_tokens"] == 0
    _hit(exact, model, ids, len(ids) - 1)  # SGLang caps a match at input_len - 1


@pytest.mark.server
def test_tail_replay_full_shared_prefix_fork_and_edit_equal_no_cache(exact, hf_olmo_hybrid):
    model, tok = hf_olmo_hybrid
    system = tok(SYSTEM + " and the harbour").input_ids
    generate(exact, system, max_new_tokens=1)
    _hit(exact, model, system + tok(" why did the sailor leave").input_ids, len(system))  # shared system prompt
    _hit(exact, model, system[:13] + tok(" but a different story begins").input_ids, 13)  # fork mid-prefix
    _hit(exact, model, system[:29] + [(system[29] + 1) % 500] + system[30:], 29)  # edit in the middle


@pytest.mark.server
def test_tail_replay_full_multi_turn_through_the_answer(exact, hf_olmo_hybrid):
    """The second turn matches through turn one's generated tokens: decode-time capture of the group inputs."""
    model, tok = hf_olmo_hybrid
    check_multi_turn(exact, model, tok, SYSTEM + " first question for the multi turn chat?", NEW)


@pytest.mark.server
def test_tail_replay_full_long_prompt_through_chunked_prefill(exact, hf_olmo_hybrid):
    """A 600-token prefix (128-token prefill chunks) hit with a 150-token suffix: both prefills are chunked.
    Greedy tokens, as tests/test_tail_replay.py asks of Qwen3.5 here: SGLang keeps conv states in bfloat16 by
    default, and a chunk boundary's rounding reaches ~1e-3 in a logprob after hundreds of tokens."""
    import random

    model, _ = hf_olmo_hybrid
    rng = random.Random(3)
    prefix = [rng.randrange(3, 500) for _ in range(600)]
    generate(exact, prefix, max_new_tokens=1)
    _hit(exact, model, prefix + [rng.randrange(3, 500) for _ in range(150)], len(prefix))


@pytest.mark.server
def test_tail_replay_eight_concurrent_hits_on_one_prefix(exact, hf_olmo_hybrid):
    model, tok = hf_olmo_hybrid
    system = tok(SYSTEM + " eight readers").input_ids
    generate(exact, system, max_new_tokens=1)
    check_concurrent_hits(exact, model, tok, system, NEW)


def _suffix_logprob_error(server, model, ids, start) -> float:
    generate(server, ids[:start], max_new_tokens=1)
    out = generate(server, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=start)
    assert out["meta_info"]["cached_tokens"] == start
    return max_logprob_error(out, model, ids, start)


@pytest.mark.server
def test_tail_replay_error_ordering_zero_above_ratio_above_full(exact, servers, hf_olmo_hybrid):
    """error(zero states) > error(r = 0.1) > error(r = 1) ~ 0 on the suffix after a 560-token hit."""
    import random

    model, _ = hf_olmo_hybrid
    rng = random.Random(0)
    ids, start = [rng.randrange(3, 500) for _ in range(600)], 560
    errors = {"full": _suffix_logprob_error(exact, model, ids, start)}
    for name in ("zero", "r=0.1"):
        errors[name] = _suffix_logprob_error(servers[name], model, ids, start)
    assert errors["zero"] > 2 * errors["r=0.1"] > 2 * errors["full"], errors
    assert errors["full"] < LOGPROB_TOL, errors


@pytest.mark.server
def test_default_anchored_tail_replay_is_exact(servers, hf_olmo_hybrid):
    """`--enable-tail-replay` alone: interval anchors every 512 tokens, cut by the CPU prefill ops. A hit 100
    tokens past the interval anchor at 512 replays [512, 612) from a copy of it (with beta = 2 sigmoid(b)) and is
    exact; a resend replays nothing (the request-end anchor)."""
    import random

    model, _ = hf_olmo_hybrid
    rng = random.Random(5)
    doc = [rng.randrange(3, 500) for _ in range(700)]
    srv = servers["default"]
    generate(srv, doc, max_new_tokens=1)
    fork = doc[:612] + [rng.randrange(3, 500) for _ in range(20)]
    out = generate(srv, fork, NEW)
    assert out["meta_info"]["cached_tokens"] == 612
    assert out["meta_info"]["tail_replay_exact"] and out["meta_info"]["tail_replay_anchor"] == 512
    assert out["meta_info"]["tail_replay_tokens"] == 100
    assert out["output_ids"] == greedy_generate(model, fork, NEW)
    again = generate(srv, fork, NEW)
    assert_anchored_hit(again["meta_info"], len(fork) - 1)  # the fork's end is 19 tokens past its anchor at 612
    assert again["meta_info"]["tail_replay_exact"] and again["output_ids"] == out["output_ids"]
