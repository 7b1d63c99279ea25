"""Tail-Replay on SGLang's HiCache (issue 42): the host tier (L2) and the `file` storage backend (L3), as stock runs
them in test_hicache.py, with `--enable-tail-replay` (`tailreplay_sglang/cache/hierarchy.py`): the hidden store
travels with the KV pages, anchors go to HiCache's host mamba pool with their nodes, and a hit at any token boundary
of host or storage pages is rebuilt, exactly where a state is within the budget and labelled approximate otherwise.

Three servers: tr with the CPU flags and the host tier alone; tr_gpu_a and tr_gpu_b with SGLang's GPU scheduling
(extra_buffer + overlap) and one L3 folder, tr_gpu_b writing back (host copies only at eviction) instead of through;
tr_pure (the paper's pure mode, its own L3 folder) started by its test.
Every hit labelled exact is checked against the same server's no-cache prefill (`no_cache`, with an `extra_key` of
its own so no tier can serve it), whose agreement with HF test_hicache.py checks on these weights.
"""

import concurrent.futures
import time
from pathlib import Path

import pytest
import requests

from helpers import (CONTEXT, QUESTION, assert_anchored_hit, assert_exact, generate, hicache_spec, launch, no_cache,
                     random_ids, scored, start_servers, stop_all, wait_for_pages)
from soak import pool_leaks, pools, wait_idle
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TR = ("--enable-tail-replay",)
SERVERS = ["tr", "tr_gpu_a", "tr_gpu_b"]


@pytest.fixture(scope="module")
def shared_l3(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("l3-tr-shared")


@pytest.fixture(scope="module")
def servers(tiny_qwen35, tmp_path_factory, shared_l3):
    yield from start_servers(tmp_path_factory, {
        "tr": hicache_spec(tiny_qwen35, None, False, *TR),
        "tr_gpu_a": hicache_spec(tiny_qwen35, shared_l3, True, *TR),
        "tr_gpu_b": hicache_spec(tiny_qwen35, shared_l3, True, *TR, "--hicache-write-policy", "write_back")})


def push_out(srv, seed: int) -> None:
    """2,100 tokens through the 1,200-token device pool: what was there before is on the host tier now."""
    for i in range(3):
        generate(srv, random_ids(CONTEXT, seed=seed + i), 1)


def assert_hit(hit: dict, cached: int, tier: str, exact: bool) -> None:
    meta = hit["meta"]
    assert meta["cached_tokens"] == cached and meta["cached_tokens_details"][tier] == cached, \
        meta["cached_tokens_details"]
    assert meta["tail_replay_exact"] is exact, meta


@pytest.mark.parametrize("name", SERVERS)
def test_host_hits_are_exact_at_any_token_boundary(servers, name):
    """One context pushed out to the host tier, then hit there at four boundaries, each pushed out again first:
    555 (43 tokens past an interval anchor at 512 on the host: the match stops there and the extend computes them),
    650 (replayed from an anchor on the host over hidden rows loaded from the host), 700 (the request's own end
    state) and 333 (replayed from the root). Each is exact and equals the server's no-cache prefill; the hits
    started from states in HiCache's host mamba pool."""
    srv = servers[name]
    flush_cache(srv.base_url)
    backups = pools(srv.base_url)["hicache_anchor_backups"]
    context = random_ids(CONTEXT, seed=71 + SERVERS.index(name))  # its own: tr_gpu_a and b share their L3
    generate(srv, context, 1)
    hits = []
    for cut in (555, 650, CONTEXT, 333):
        push_out(srv, seed=1000 + cut)
        prompt = context[:cut] + random_ids(QUESTION, seed=72 + cut)
        hit = scored(srv, prompt, cut)
        assert_anchored_hit(hit["meta"], cut)  # a hit within 64 tokens of its anchor stops there (the fold)
        assert hit["meta"]["cached_tokens_details"]["host"] == hit["meta"]["cached_tokens"] > 0
        hits.append((cut, prompt, hit))
    assert pools(srv.base_url)["hicache_anchor_hits"] > 0
    # The 555 hit starts from the interval anchor at 512. Under write-through SGLang backs up no state for a node
    # whose write-through was still in flight: on tr (no storage) the anchor reaches the host only through the
    # plugin's copy at eviction (`_backup_state_to_hicache`); with storage (tr_gpu_a) the plugin backs it up at a
    # later step, bound for storage (`TailReplayRadixCache.back_up_state`). Under write_back SGLang copies node and
    # state to the host when it evicts.
    assert hits[0][2]["meta"]["tail_replay_anchor"] == 512
    backed_up = pools(srv.base_url)["hicache_anchor_backups"] - backups
    if name != "tr_gpu_a":
        assert backed_up > 0 if name == "tr" else backed_up == 0, backed_up
    for cut, prompt, hit in hits:  # references last: a flush empties the host tier too
        assert_exact(hit, no_cache(srv, prompt, cut, extra_key=f"no-cache {name} {cut}"))


def test_second_server_hits_the_file_tier_off_grid(servers, shared_l3):
    """tr_gpu_a computes two contexts; tr_gpu_b, which never saw them, hits them in the shared L3 folder at 450 and
    600 tokens, off its 64-token track grid (stock lands on the grid, `test_a_second_server_hits...`): 450 is within
    the exact budget (512), replayed from the root over hidden rows read from storage; 600 is past it, so the hit
    reads the deepest state tr_gpu_a stored within the budget, its interval anchor at 512, and replays the 88
    tokens after it (`cache/storage_anchors.py`). Both are exact and equal no cache."""
    a, b = servers["tr_gpu_a"], servers["tr_gpu_b"]
    contexts = [random_ids(CONTEXT, seed=s) for s in (81, 83)]
    before = len(list(shared_l3.iterdir()))
    for context in contexts:
        generate(a, context, 1)
    wait_for_pages(shared_l3, before, 2 * 2 * CONTEXT)  # a KV page and a hidden page per token, each context
    time.sleep(1)  # the anchors' states follow their nodes' pages by a scheduler step or two
    flush_cache(b.base_url)
    checks = []
    for context, cut, anchor in ((0, 450, 0), (1, 600, 512)):
        prompt = contexts[context][:cut] + random_ids(QUESTION, seed=82 + cut)
        hit = scored(b, prompt, cut)
        assert_hit(hit, cut, "storage", exact=True)
        assert hit["meta"]["tail_replay_anchor"] == anchor and hit["meta"]["tail_replay_tokens"] == cut - anchor
        checks.append((cut, prompt, hit))
    for cut, prompt, hit in checks:
        assert_exact(hit, no_cache(b, prompt, cut, extra_key=f"no-cache tr_gpu_b {cut}"))


def test_never_writes_approximate_kv_to_storage(tiny_qwen35, tmp_path_factory):
    """KV computed from an approximate state is tainted on its tree node, which storage cannot carry, so it is not
    written there. On a server in the paper's pure mode (`--tail-replay-exact-budget 0`: no state kept, every hit
    past the tail approximate), after a flush, L3 serves the 600 exact tokens of an approximate hit's prefix, not
    the 24 it computed past them (a control context written after them shows the writes had time to land)."""
    folder, other = tmp_path_factory.mktemp("l3-tr-pure"), {}
    try:
        launch(tmp_path_factory, {"tr_pure": hicache_spec(tiny_qwen35, folder, False, *TR,
                                                          "--tail-replay-exact-budget", "0")}, other)
        srv = other["tr_pure"]
        context = random_ids(CONTEXT, seed=91)
        before = len(list(folder.iterdir()))
        generate(srv, context, 1)
        wait_for_pages(folder, before, 2 * CONTEXT)
        flush_cache(srv.base_url)
        prompt = context[:600] + random_ids(QUESTION, seed=92)
        assert_hit(scored(srv, prompt, 600), 600, "storage", exact=False)
        before = len(list(folder.iterdir()))
        generate(srv, random_ids(300, seed=93), 1)  # control: written through after the approximate request's KV
        wait_for_pages(folder, before, 2 * 300)
        flush_cache(srv.base_url)
        # log-probs from the end: SGLang caps a match at the request's logprob start, which would hide those pages
        again = scored(srv, prompt + random_ids(8, seed=94), len(prompt))
        assert again["meta"]["cached_tokens_details"]["storage"] == 600, again["meta"]["cached_tokens_details"]
    finally:
        stop_all(other)


def test_concurrent_host_hits_and_an_abort_leave_exact_hits_and_no_leak(servers):
    """Four hits on host pages at once, one more aborted mid-decode, then the pools are whole and each hit equals
    its no-cache prefill."""
    srv = servers["tr"]
    flush_cache(srv.base_url)
    context = random_ids(CONTEXT, seed=101)
    generate(srv, context, 1)
    push_out(srv, seed=2000)
    cuts = (300, 450, 555, CONTEXT)
    prompts = [context[:cut] + random_ids(QUESTION, seed=102 + cut) for cut in cuts]
    with concurrent.futures.ThreadPoolExecutor(len(cuts) + 1) as pool:
        aborted = pool.submit(generate, srv, context[:400] + [3, 4], 400, rid="hicache-abort")
        hits = list(pool.map(lambda args: scored(srv, *args), zip(prompts, cuts)))
        while not aborted.done():
            requests.post(f"{srv.base_url}/abort_request", json={"rid": "hicache-abort"}, timeout=30)
            time.sleep(0.05)
    assert aborted.result()["meta_info"]["finish_reason"]["type"] == "abort"
    assert pool_leaks(wait_idle(srv.base_url)) == []
    for cut, hit in zip(cuts, hits):
        assert_anchored_hit(hit["meta"], cut)
    for cut, prompt, hit in zip(cuts, prompts, hits):
        assert_exact(hit, no_cache(srv, prompt, cut, extra_key=f"no-cache concurrent {cut}"))
