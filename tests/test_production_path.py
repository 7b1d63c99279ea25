"""SGLang's GPU-default scheduling on our CPUs (issue 28): `--mamba-radix-cache-strategy auto` resolving to
extra_buffer with the overlap scheduler, as every GPU server runs it, for stock SGLang and for Tail-Replay.

Stock keeps recurrent states only at track points (every 64 prefill tokens, every 256 decode tokens) and caps each
insert there, so its hits land on that grid and a short chat turn inserts nothing. Tail-Replay inserts every token's
KV, keeps the tracked states as anchors at their own depth, and replays the rest exactly, or, at most
`--tail-replay-fold-tokens` (64) past the anchor, leaves it to the extend as stock does. "Exact" is measured as in
test_anchored_replay.py: log-probs of the prompt after the hit and of the outputs against the same server's no-cache
prefill, within stock's own hit noise on these long-memory random float32 models (0.02 nats per token).
"""

import concurrent.futures
import random

import pytest
import requests

from helpers import (Spec, assert_anchored_hit, assert_exact, faults_env, generate, no_cache, pool_writes, random_ids,
                     scored, start_servers)
from soak import SoakConfig, check_against_no_cache, pool_leaks, run_soak, wait_idle
from tailreplay_eval.reference import greedy_generate
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TRACK = 64  # SGLang's prefill track grid at page size 1 and 16: lcm(max(64, page), page)
INTERVAL = 128
PAGE = 16
HOST_ANCHORS = 64
LAZY = ("--mamba-radix-cache-strategy", "extra_buffer_lazy")
STRATEGY = {"stock": "extra_buffer", "tail_replay": "extra_buffer", "lazy": "extra_buffer_lazy"}
TAIL_REPLAY_SERVERS = pytest.mark.parametrize("name", ["tail_replay", "lazy"])
SMALL_POOLS = pytest.mark.parametrize("name", ["small_pool", "small_pool_lazy"])
TAIL_REPLAY = ("--enable-tail-replay", "--dtype", "float32", "--enable-cache-report", "--tail-replay-anchor-interval",
               str(INTERVAL), "--chunked-prefill-size", "256")


@pytest.fixture(scope="module")
def watch_dir(tmp_path_factory):
    """Where the small-pool servers log mamba-pool writes made outside a forward (the test plugin's watch)."""
    return tmp_path_factory.mktemp("pool_writes")


@pytest.fixture(scope="module")
def servers(tiny_qwen35, tmp_path_factory, watch_dir):
    """No strategy flag and no --disable-overlap-schedule on any of them (`gpu_scheduling`):
    - stock: also page size 16 (SGLang resolves auto to extra_buffer for paging as well);
    - tail_replay: the defaults, interval anchors every INTERVAL tokens, 256-token prefill chunks;
    - small_pool: the same with 16-token pages and 12 mamba slots for 3 running requests (each holds a live slot
      and two track slots), so anchors are evicted while requests run, and HOST_ANCHORS host-memory anchors that
      take them in. (The device-only pool under pressure: tests/test_reliability.py's 3-slot server and the
      anchored cache property tests.)
    - lazy, small_pool_lazy: tail_replay and small_pool under `--mamba-radix-cache-strategy extra_buffer_lazy`
      (SGLang's strategy for speculative decoding: track slots taken at boundaries, one per request), which the
      Tail-Replay tests run on too.
    The small pools carry the test plugin's watch of mamba-pool writes (`test_no_mamba_slot_is_written_outside_a_
    forward`)."""
    gpu = {"gpu_scheduling": True}
    small = (*TAIL_REPLAY, "--max-mamba-cache-size", "12", "--page-size", str(PAGE), "--tail-replay-host-anchors",
             str(HOST_ANCHORS))
    watch = {name: faults_env(watch_pool_writes=watch_dir / f"{name}.jsonl")
             for name in ("small_pool", "small_pool_lazy")}
    yield from start_servers(tmp_path_factory, {
        "stock": Spec(tiny_qwen35, ("--dtype", "float32", "--enable-cache-report", "--page-size", "16"), kwargs=gpu),
        "tail_replay": Spec(tiny_qwen35, TAIL_REPLAY, kwargs=gpu),
        "lazy": Spec(tiny_qwen35, (*TAIL_REPLAY, *LAZY), kwargs=gpu),
        "small_pool": Spec(tiny_qwen35, small, watch["small_pool"], kwargs={**gpu, "max_running_requests": 3}),
        "small_pool_lazy": Spec(tiny_qwen35, (*small, *LAZY), watch["small_pool_lazy"],
                                kwargs={**gpu, "max_running_requests": 3}),
    })


def cold_equals_hf(srv, hf_model, prompt) -> dict:
    flush_cache(srv.base_url)
    cold = generate(srv, prompt, 6)
    assert cold["output_ids"] == greedy_generate(hf_model[0], prompt, 6)
    return cold


@pytest.mark.parametrize("name", list(STRATEGY))
def test_servers_run_extra_buffer_with_the_overlap_scheduler(servers, name):
    info = requests.get(f"{servers[name].base_url}/server_info", timeout=30).json()
    assert info["mamba_radix_cache_strategy"] == STRATEGY[name]
    assert info["disable_overlap_schedule"] is False


def test_stock_equals_hf_and_hits_on_its_track_grid(servers, hf_qwen35):
    """Stock SGLang on the GPU path (extra_buffer, overlap, 16-token pages) serves as HF computes, and a resend hits
    at the last track point of the prompt, as SGLang does on a GPU."""
    srv, prompt = servers["stock"], random_ids(300, seed=1)
    cold = cold_equals_hf(srv, hf_qwen35, prompt)
    resend = generate(srv, prompt, 6)
    assert resend["meta_info"]["cached_tokens"] == 300 // TRACK * TRACK
    assert resend["output_ids"] == cold["output_ids"]


@TAIL_REPLAY_SERVERS
@pytest.mark.parametrize("answer", [6, 80])
def test_tail_replay_equals_hf_cold_and_a_resend_starts_at_its_track_point(servers, hf_qwen35, answer, name):
    """The request's state was tracked at its last track point, not where it ended. A resend of prompt and answer
    hits there: within --tail-replay-fold-tokens of it (a 6-token answer), the extend computes the rest, as after a
    stock hit; past it (an 80-token answer: decode tracks a state every 256 tokens), the rest is replayed."""
    srv, prompt = servers[name], random_ids(300, seed=1)
    cold = cold_equals_hf(srv, hf_qwen35, prompt)
    if answer != len(cold["output_ids"]):
        cold = generate(srv, prompt, answer)
    ids = prompt + cold["output_ids"] + random_ids(12, seed=9)
    kept = len(prompt) + len(cold["output_ids"]) - 1
    hit = scored(srv, ids, kept)
    meta = hit["meta"]
    assert meta["tail_replay_anchor"] % TRACK == 0
    assert_anchored_hit(meta, kept)
    assert_exact(hit, no_cache(srv, ids, kept))


def test_chat_turns_hit_their_previous_turn_at_least_where_stock_does(servers):
    """Chat turns of 40-90 new tokens after a 100-token prompt. Stock's insert stops at the last track point, so it
    hits on the 64-token grid and recomputes the rest. Tail-Replay inserts every token and matches each turn through
    the previous answer, but the nearest state is the same track point, less than 64 tokens back (prefill tracks
    every 64 tokens, decode every 256): the span is folded into the extend, as stock computes it, exactly."""
    srv, stock = servers["tail_replay"], servers["stock"]
    for s in (srv, stock):
        flush_cache(s.base_url)
    ids, turns, previous = random_ids(100, seed=2), [], []
    for turn in range(4):
        out = scored(srv, ids, len(ids) - 1, 5)
        stock_meta = generate(stock, ids, 5)["meta_info"]
        turns.append((list(ids), out))
        if turn:
            assert out["meta"]["cached_tokens"] >= stock_meta["cached_tokens"] // TRACK * TRACK
            assert_anchored_hit(out["meta"], len(previous) + 5 - 1)
        previous = ids
        ids = ids + out["output_ids"] + random_ids(35 + 25 * turn, seed=10 + turn)
    assert all(t["meta"]["cached_tokens"] and not t["meta"]["tail_replay_tokens"] for _, t in turns[1:])
    for prompt, out in turns[1:]:
        assert_exact(out, no_cache(srv, prompt, len(prompt) - 1, 5))


@TAIL_REPLAY_SERVERS
@pytest.mark.parametrize("seed", [3, 4])
def test_forks_at_random_points_replay_less_than_the_interval_and_equal_no_cache(servers, seed, name):
    """The nearest anchor of a fork is an interval anchor, a chunk's or a track point: fewer than INTERVAL tokens
    back. Stock on the same fork would hit at most to the track grid."""
    srv = servers[name]
    rng = random.Random(seed)
    base = random_ids(1000, seed=seed)
    flush_cache(srv.base_url)
    for cut in sorted(rng.sample(range(INTERVAL + 1, 990), 3)):
        ids = base[:cut] + random_ids(12, seed=cut)
        generate(srv, base, 1)
        hit = scored(srv, ids, cut)
        meta = hit["meta"]
        assert meta["tail_replay_tokens"] < INTERVAL
        assert_anchored_hit(meta, cut)
        assert_exact(hit, no_cache(srv, ids, cut))


@TAIL_REPLAY_SERVERS
def test_eight_concurrent_hits_are_exact(servers, name):
    srv = servers[name]
    flush_cache(srv.base_url)
    prefix = random_ids(700, seed=6)
    generate(srv, prefix, 1)
    prompts = [prefix[:650] + random_ids(5 + i, seed=20 + i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        hits = list(pool.map(lambda ids: scored(srv, ids, 650), prompts))
    for ids, hit in zip(prompts, hits):
        assert_anchored_hit(hit["meta"], 650)
        assert_exact(hit, no_cache(srv, ids, 650))
    assert pool_leaks(wait_idle(srv.base_url)) == []


@SMALL_POOLS
def test_paged_kv_hits_to_the_page_and_equals_no_cache(servers, name):
    """16-token pages: SGLang's tree keys whole pages, so a hit ends on the last page boundary of the match and the
    rest of that page is recomputed by the extend; the replay reaches the page boundary exactly."""
    srv = servers[name]
    flush_cache(srv.base_url)
    base = random_ids(600, seed=11)
    for cut in (200, 333, 517):
        generate(srv, base, 1)  # cached again after each no-cache reference flushed it
        ids = base[:cut] + random_ids(9, seed=cut)
        hit = scored(srv, ids, cut)
        meta = hit["meta"]
        assert meta["tail_replay_anchor"] % PAGE == 0 and meta["tail_replay_tokens"] < INTERVAL
        assert_anchored_hit(meta, cut // PAGE * PAGE)
        assert_exact(hit, no_cache(srv, ids, cut))


@SMALL_POOLS
def test_small_pool_with_host_anchors_keeps_hits_exact(servers, name):
    """12 mamba slots, 3 requests at a time: forks and chat turns on 5 prompts race for slots and evict anchors
    (with device anchors only, 4 of these 16 hits were exact, measured 2026-12-02; docs/results.md, section 2e).
    Evicted anchors
    move to the host pool and hits copy them back: at least 95 % of hits are exact, every one equals the no-cache
    prefill, host hits are counted and nothing leaks."""
    srv = servers[name]
    flush_cache(srv.base_url)
    before = wait_idle(srv.base_url)
    prompts = [random_ids(500, seed=100 + i) for i in range(5)]
    answers = [generate(srv, ids, 8)["output_ids"] for ids in prompts]
    rng = random.Random(7)
    workload = []
    for i in range(16):  # forks at random points of each prompt, and chat turns after each answer
        base = prompts[i % 5]
        if i % 3 == 2:
            workload.append(base + answers[i % 5] + random_ids(rng.randrange(20, 60), seed=200 + i))
        else:
            workload.append(base[:rng.randrange(100, 500)] + random_ids(rng.randrange(5, 40), seed=200 + i))
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        hits = list(pool.map(lambda ids: scored(srv, ids, len(ids) - 4), workload))
    state = wait_idle(srv.base_url)
    assert pool_leaks(state) == [] and state["evicted_anchors"] > before["evicted_anchors"]
    assert state["host_anchor_hits"] > before["host_anchor_hits"] and state["host_anchors_total"] == HOST_ANCHORS
    assert all(hit["meta"]["cached_tokens"] >= 100 // PAGE * PAGE for hit in hits)
    exact = [(ids, hit) for ids, hit in zip(workload, hits) if hit["meta"]["tail_replay_exact"]]
    assert len(exact) >= 0.95 * len(hits), f"{len(exact)} of {len(hits)} hits exact"
    for ids, hit in exact:
        assert_exact(hit, no_cache(srv, ids, len(ids) - 4))


@SMALL_POOLS
def test_soak_on_the_small_paged_pool(servers, name):
    """The reliability soak (tests/soak.py: forks, resends, continuations, aborts by hang-up and by API, bad token
    ids, flushes, 4 clients) on extra_buffer with the overlap scheduler, 16-token pages and 12 mamba slots: no
    error, nothing leaks, and every output served as exact equals the no-cache prefill (its first token always; a
    later greedy token may flip on a float32 near-tie, see check_against_no_cache)."""
    srv = servers[name]
    flush_cache(srv.base_url)
    report = run_soak(srv.base_url, SoakConfig(requests=80, clients=4, seed=1))
    assert report.errors == [] and report.hits > 0 and report.aborted > 0
    assert pool_leaks(wait_idle(srv.base_url)) == []
    exact = [c for c in report.completed if c.exact and c.cached_tokens]
    assert exact, "no exact hit in the soak"
    mismatches = check_against_no_cache(srv.base_url, report.completed, only_exact=True)
    assert [m for m in mismatches if m.endswith("FIRST TOKEN")] == []
    assert len(mismatches) <= max(1, len(exact) // 50), mismatches


@SMALL_POOLS
def test_bursts_of_track_aligned_prompts_leave_every_donation_a_slot(servers, name):
    """S1 (`../shared/notes/gpu-path-review.md`): under the overlap scheduler a batch's chunk-end donations need a
    mamba slot after the next batch has planned its interval anchors, which reserve one slot per request of their own
    batch only. Bursts of 6 concurrent prompts whose lengths are multiples of the track grid (each donated state
    lands on its own locked node, freeing nothing) and one longer prompt, on 12 slots for 3 running requests (just
    above 3 x 3): every request completes (the scheduler would die on "Can not alloc mamba cache"), and the pools
    drain."""
    srv = servers[name]
    flush_cache(srv.base_url)
    for burst in range(8):
        prompts = [random_ids(6 * TRACK, seed=3000 + 10 * burst + i) for i in range(6)]
        prompts.append(random_ids(16 * TRACK, seed=3000 + 10 * burst + 9))
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda ids: generate(srv, ids, 2), prompts))
        assert all(len(out["output_ids"]) == 2 for out in outs)
    assert pool_leaks(wait_idle(srv.base_url)) == []  # every mamba slot free or an anchor, nothing locked


@SMALL_POOLS
def test_no_mamba_slot_is_written_outside_a_forward(servers, watch_dir, name):
    """The stream-order argument device anchors rest on (GPU path review F1): a hit's copy of its anchor runs in the
    forward (SGLang's deferred copy-on-write), after the scheduler released the anchor's lock, so a later step may
    evict the anchor and hand its slot to another request; that is safe because nothing writes a mamba slot
    outside a forward under the overlap scheduler: the new owner's clear or copy is queued on the forwards' stream
    after the copy that reads the slot. Checked after every test above on the small pools (anchors evicted while
    requests run, host anchors, the soak): every `clear_slots` and `copy_from` came from inside a forward."""
    writes = pool_writes(watch_dir / f"{name}.jsonl")
    assert writes["inside_forward"], "the watch saw no mamba-pool write at all"
    assert writes["outside_forward"] == [], writes["outside_forward"][:10]
