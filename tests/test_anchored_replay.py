"""Anchored Tail-Replay inside the real SGLang server: hits start from the deepest recurrent state the tree kept
(where a request ended, where a prefill chunk ended, every N prefill tokens) and replay the rest exactly.

"Exact" is measured against the server's own no-cache prefill (the cache flushed, the same prompt again), by the
log-probs of the prompt tokens after the hit (teacher-forced), of the outputs, and the first greedy token. Whole
greedy outputs are not compared: this random model's flat logits have near-ties a few tokens in (seen: 1e-4 nats
apart before a different 3rd token). Tolerance: SGLang's own exact-state hit differs from its
no-cache prefill by up to ~0.016 nats per token on long-memory random float32 models (chunk boundaries round
differently); a zero-init tail on this model misses by far more (asserted below, so the check can fail).
"""

import concurrent.futures
import random

import pytest
import requests

from helpers import (EXACT_TOL, TINY_VOCAB, Spec, assert_exact, faults_env, generate, max_error, no_cache, random_ids,
                     scored, start_servers)
from soak import pool_leaks, wait_idle
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

INTERVAL = 128
VOCAB = TINY_VOCAB
# The replay itself is what this module checks, so spans are replayed however short (--tail-replay-fold-tokens 0);
# folding short spans into the extend, the default, is checked on SGLang's GPU path (test_production_path.py).
FLAGS = ("--enable-tail-replay", "--tail-replay-anchor-interval", str(INTERVAL), "--tail-replay-fold-tokens", "0",
         "--enable-metrics", "--enable-cache-report", "--dtype", "float32")


@pytest.fixture(scope="module")
def servers(tiny_qwen35, tmp_path_factory):
    """The module's three servers, started together:
    - anchored: the defaults with interval anchors every INTERVAL tokens, and the test plugin's prefix cut (a
      request with rid `cut<N>-...` extends from at most N tokens; inert for every other request);
    - paper: B = 0, no anchor kept or used, the paper's zero-init tail; same model and prefill chunking;
    - small_pool: a mamba pool of 12 slots, so anchors compete with running requests and SGLang's mamba LRU evicts
      them;
    - three_slots: the defaults on 3 mamba slots for 2 running requests with 1024-token chunks."""
    yield from start_servers(tmp_path_factory, {
        "anchored": Spec(tiny_qwen35, FLAGS, env=faults_env(cut_prefixes=True)),
        "paper": Spec(tiny_qwen35, (*FLAGS, "--tail-replay-exact-budget", "0")),
        "small_pool": Spec(tiny_qwen35, (*[f for f in FLAGS if f != "--enable-metrics"], "--max-mamba-cache-size",
                                         "12"), kwargs={"max_running_requests": 4}),
        "three_slots": Spec(tiny_qwen35, ("--enable-tail-replay", "--enable-cache-report", "--max-mamba-cache-size",
                                          "3", "--chunked-prefill-size", "1024"),
                            kwargs={"max_running_requests": 2, "max_total_tokens": 12288, "context_length": 8192}),
    })


@pytest.fixture(scope="module")
def server(servers):
    return servers["anchored"]


@pytest.fixture(scope="module")
def paper_server(servers):
    return servers["paper"]


@pytest.fixture(scope="module")
def small_pool_server(servers):
    return servers["small_pool"]


@pytest.mark.parametrize("resend_extra", [0, 12])
def test_resend_of_prompt_and_answer_starts_at_the_finish_anchor_and_equals_no_cache(server, resend_extra):
    flush_cache(server.base_url)
    prompt = random_ids(600, seed=1)
    answer = generate(server, prompt, 8)["output_ids"]
    kept = len(prompt) + len(answer) - 1  # the finished request's state was kept here (its last token has no KV)
    ids = prompt + answer + random_ids(resend_extra, seed=9)
    hit = scored(server, ids, kept)
    meta = hit["meta"]
    assert meta["cached_tokens"] == kept == meta["tail_replay_anchor"]
    assert meta["tail_replay_tokens"] == 0 and meta["tail_replay_exact"] is True
    assert meta["tail_replay_state_survival"] is None
    assert_exact(hit, no_cache(server, ids, kept))


def test_five_turn_chat_hits_each_turns_end_state_and_equals_no_cache(server):
    flush_cache(server.base_url)
    ids, turns, start = random_ids(300, seed=2), [], 299
    for turn in range(5):
        out = scored(server, ids, start, 6)
        turns.append((list(ids), start, out))
        start = len(ids) + len(out["output_ids"]) - 1
        ids = ids + out["output_ids"] + random_ids(20, seed=10 + turn)
    for _, start, out in turns[1:]:
        # each turn matches up to the previous turn's last generated token, where that request's state was kept
        meta = out["meta"]
        assert meta["cached_tokens"] == start == meta["tail_replay_anchor"] and meta["tail_replay_tokens"] == 0
        assert meta["tail_replay_exact"] is True
    for prompt, start, out in turns:
        assert_exact(out, no_cache(server, prompt, start, 6))


@pytest.mark.parametrize("seed", [3, 4])
def test_hits_at_random_points_replay_less_than_the_interval_and_equal_no_cache(server, paper_server, seed):
    """Forks, edits and shared prompts end the match where no request or chunk ended: the nearest interval anchor
    (taken inside the 1000-token prefill) is fewer than N tokens back, so the replay is exact and short. The paper's
    zero-init tail on the same hits must be measurably worse, or this test could not tell the two apart."""
    rng = random.Random(seed)
    base = random_ids(1000, seed=seed)
    errors, paper_errors = [], []
    for srv in (server, paper_server):
        flush_cache(srv.base_url)
    for cut in sorted(rng.sample(range(INTERVAL + 1, 990), 3)):
        fork = base[:cut] + random_ids(12, seed=cut)
        edit = base[:cut] + [(base[cut] + 1) % VOCAB] + base[cut + 1:cut + 30]
        for ids in (fork, edit):
            for srv in (server, paper_server):
                generate(srv, base, 1)  # the shared prompt, cached (again) on both servers
            hit, paper = scored(server, ids, cut), scored(paper_server, ids, cut)
            meta = hit["meta"]
            assert meta["cached_tokens"] == cut == paper["meta"]["cached_tokens"]
            assert meta["tail_replay_exact"] is True and 0 <= meta["tail_replay_tokens"] < INTERVAL
            assert meta["tail_replay_anchor"] == cut - meta["tail_replay_tokens"]
            assert paper["meta"]["tail_replay_exact"] is False and paper["meta"]["tail_replay_anchor"] is None
            reference = no_cache(server, ids, cut)
            errors.append(max_error(hit, reference))
            paper_errors.append(max_error(paper, reference))
            assert_exact(hit, reference)
    assert max(errors) < EXACT_TOL, errors
    assert max(paper_errors) > 5 * max(errors), (paper_errors, errors)


def test_budget_zero_keeps_no_state_and_replays_the_papers_tail(paper_server):
    flush_cache(paper_server.base_url)
    base = random_ids(900, seed=5)
    generate(paper_server, base, 4)
    for cut in (100, 500, 899):
        meta = generate(paper_server, base[:cut] + [7, 8, 9], 2)["meta_info"]
        assert meta["cached_tokens"] == cut
        assert meta["tail_replay_tokens"] == min(cut, max(64, -(-cut * 5 // 100)))  # tail_len at the defaults
        assert meta["tail_replay_exact"] is False and meta["tail_replay_anchor"] is None
        assert 0 < meta["tail_replay_state_survival"] <= 1
    state = wait_idle(paper_server.base_url)
    assert state["tree_mamba_slots"] == 0 and pool_leaks(state) == []


def test_eight_concurrent_hits_on_one_anchor(server):
    """The first batch of hits copies the interval anchor at 640 and replays 10 tokens; a hit that replayed keeps
    its rebuilt state at 650, so hits scheduled later start there and replay nothing. Every copy is exact."""
    flush_cache(server.base_url)
    prefix = random_ids(700, seed=6)
    generate(server, prefix, 1)
    prompts = [prefix[:650] + random_ids(5 + i, seed=20 + i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hits = list(pool.map(lambda ids: scored(server, ids, 650), prompts))
    anchors = [h["meta"]["tail_replay_anchor"] for h in hits]
    assert set(anchors) <= {640, 650} and 640 in anchors and all(h["meta"]["tail_replay_exact"] for h in hits)
    assert [h["meta"]["tail_replay_tokens"] for h in hits] == [650 - c for c in anchors]
    for ids, hit in zip(prompts, hits):
        assert_exact(hit, no_cache(server, ids, 650))
    assert pool_leaks(wait_idle(server.base_url)) == []


@pytest.mark.parametrize("planned, cut, anchor, replayed, exact", [
    (700, 680, 640, 40, True),  # the planned anchor (640) lies within the new prefix: replay from it
    (700, 640, 640, 0, True),  # the prefix ends at the anchor: its state, nothing replayed
    (136, 100, 0, 100, True),  # within the budget from the root: the slot, holding the state at 128, is zeroed first
    (700, 300, None, 64, False),  # past the budget from the root: the zero-init tail (64 tokens), approximate
])
def test_a_prefix_cut_after_the_match_retargets_the_hit(server, planned, cut, anchor, replayed, exact):
    """The scheduler can settle on a shorter prefix than the match planned for (the fault plugin cuts it between
    the match and the batch's prepare_for_extend). The hit planned from the deepest interval anchor for `planned`
    tokens is retargeted to the prefix it got (`retarget`): its label and its answer follow the new prefix. The
    log-probs compared start at `planned`: a state error fades over a few hundred tokens of this model, so the
    root case plans close to its cut."""
    base = random_ids(1000, seed=31)
    fork = base[:planned] + random_ids(12, seed=32)
    reference = no_cache(server, fork, planned)
    flush_cache(server.base_url)
    generate(server, base, 1)  # interval anchors every 128 tokens
    hit = scored(server, fork, planned, rid=f"cut{cut}-{planned}")
    meta = hit["meta"]
    assert meta["cached_tokens"] == cut, meta  # the fault happened
    assert (meta["tail_replay_anchor"], meta["tail_replay_tokens"], meta["tail_replay_exact"]) == (
        anchor, replayed, exact), meta
    if exact:
        assert_exact(hit, reference)
    assert pool_leaks(wait_idle(server.base_url)) == []


def test_a_retargeted_hit_on_tainted_kv_is_approximate(server):
    """A match on KV an approximate request computed, cut back to a prefix within the budget from the root: the
    taint is judged on the path the match locked, so the retargeted hit stays labelled approximate."""
    base = random_ids(1000, seed=31)
    fork = base[:700] + random_ids(12, seed=32)
    flush_cache(server.base_url)
    generate(server, base, 1)
    first = scored(server, fork, 700, rid="cut300-taints")  # a zero-init tail: the fork's new KV is tainted
    assert first["meta"]["tail_replay_exact"] is False
    hit = scored(server, fork + [7, 8], 712, rid="cut100-on-taint")
    meta = hit["meta"]
    assert meta["cached_tokens"] == 100 and meta["tail_replay_anchor"] == 0, meta
    assert meta["tail_replay_exact"] is False, meta
    assert pool_leaks(wait_idle(server.base_url)) == []


def replay_counts(server) -> dict[str, float]:
    metrics = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return {line.split()[0]: float(line.split()[-1]) for line in metrics.splitlines()
            if line.startswith("sglang:tail_replay_") and not line.startswith("#")}


def test_metrics_count_exact_and_approximate_hits(server, paper_server):
    """One hit on each server, counted by what it was (the increase over this test: the counters are cumulative)."""
    exact, approximate = "sglang:tail_replay_exact_hits_total", "sglang:tail_replay_approximate_hits_total"
    prompt = random_ids(300, seed=8)
    for srv, kind in ((server, exact), (paper_server, approximate)):
        flush_cache(srv.base_url)
        generate(srv, prompt, 1)
        before = replay_counts(srv)
        assert "sglang:tail_replay_evicted_anchors_total" in before
        hit = generate(srv, prompt[:250] + [5, 6], 1)["meta_info"]
        assert hit["cached_tokens"] == 250 and hit["tail_replay_exact"] is (kind == exact)
        after = replay_counts(srv)
        assert {k: after.get(k, 0) - before.get(k, 0) for k in (exact, approximate)} == {
            exact: float(kind == exact), approximate: float(kind == approximate)}


def test_evicted_anchors_fall_back_to_the_zero_init_tail_without_error_or_leak(small_pool_server):
    """More anchors than the 12-slot mamba pool holds: SGLang's mamba LRU drops the oldest states but their KV
    stays, so a later hit on an early prompt still gets its whole prefix, through the zero-init tail; the strict
    idle check runs in the server and the pools are read back."""
    srv = small_pool_server
    flush_cache(srv.base_url)
    prompts = [random_ids(600, seed=100 + i) for i in range(5)]  # 4 interval anchors + 2 ends each; KV all fits
    for ids in prompts:
        generate(srv, ids, 2)
    state = wait_idle(srv.base_url)
    assert state["evicted_anchors"] > 0 and pool_leaks(state) == []
    early = generate(srv, prompts[0][:550] + [5, 6], 2)["meta_info"]
    assert early["cached_tokens"] == 550
    assert early["tail_replay_exact"] is False and early["tail_replay_anchor"] is None
    late_ids = prompts[-1][:550] + [5, 6]
    late = scored(srv, late_ids, 550, 2)
    assert late["meta"]["cached_tokens"] == 550 and late["meta"]["tail_replay_exact"] is True
    assert late["meta"]["tail_replay_anchor"] is not None
    with concurrent.futures.ThreadPoolExecutor(4) as pool:  # hits and misses racing for slots and KV
        outs = list(pool.map(lambda i: generate(srv, prompts[i % 5][:500] + random_ids(300, seed=i), 3), range(8)))
    assert all(len(o["output_ids"]) == 3 for o in outs)
    assert pool_leaks(wait_idle(srv.base_url)) == []
    assert_exact(late, no_cache(srv, late_ids, 550, 2))  # its anchor survived: exact, as the report says


def test_anchors_never_take_the_slots_running_requests_need(servers):
    """Two 5000-token prompts at once on 3 mamba slots, in 1024-token chunks: after each chunk SGLang copies a
    request's state into a new slot (its chunk-end checkpoint) and asserts it gets one. Interval anchors planned
    before the forward used to take that slot and the scheduler died ("Can not alloc mamba cache"; stock and
    `--tail-replay-anchor-interval 0` served); anchors now give way. Both answer, a hit follows, nothing leaks."""
    srv = servers["three_slots"]
    prompts = [random_ids(5000, seed=300 + i) for i in range(2)]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        outs = list(pool.map(lambda ids: generate(srv, ids, 2), prompts))
    assert all(len(o["output_ids"]) == 2 for o in outs)
    hit = generate(srv, prompts[0][:4000] + [5, 6], 2)["meta_info"]
    assert hit["cached_tokens"] == 4000
    assert pool_leaks(wait_idle(srv.base_url)) == []
