"""A request SGLang retracts from decoding and admits again keeps an honest label (review F2, issue 64).

SGLang retracts a decoding request under KV pressure: its KV is freed without entering the tree, the tree is
evicted at once, and the request is queued again with its output so far, to be matched anew
(`schedule_batch.release_req`, `reset_for_retract`). A request whose first output came from an approximate state
(a zero-init tail) must stay `tail_replay_exact: false` whatever its re-admission matches: here that match is a miss,
which by itself is labelled exact (`cache/request.relabel`).

One server, built to retract: `SGLANG_TEST_RETRACT` retracts the least-advanced of two or more decoding requests
every third forward, and `SGLANG_RETRACT_DECODE_STEPS` large makes the eviction that follows a retraction take every
unlocked node, so the retracted request's path is gone when it comes back. Interval anchors are off and the exact
budget is 16 tokens, so a fork 300 tokens into a published prompt is approximate.
"""

import concurrent.futures
import time

import pytest

from helpers import generate, random_ids, start_server
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

FLAGS = ("--enable-tail-replay", "--tail-replay-anchor-interval", "0", "--tail-replay-exact-budget", "16",
         "--tail-replay-fold-tokens", "0", "--enable-cache-report", "--dtype", "float32")
RETRACTING = {"SGLANG_TEST_RETRACT": "1", "SGLANG_RETRACT_DECODE_STEPS": "1000000"}


@pytest.fixture(scope="module")
def server(tiny_qwen35, tmp_path_factory):
    # spawned, not forked from the preforker: SGLang reads SGLANG_TEST_RETRACT when its scheduler module is imported
    yield from start_server(tiny_qwen35, tmp_path_factory, *FLAGS, env=RETRACTING, spawn=True)


def test_a_retracted_approximate_request_stays_approximate_after_a_miss(server):
    """A fork of a published prompt past the exact budget (approximate) decodes beside a longer-running request,
    is retracted (SGLang's own count), and comes back to a miss: its answer still says approximate."""
    base = random_ids(400, seed=81)
    flush_cache(server.base_url)
    generate(server, base, 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        ahead = pool.submit(generate, server, random_ids(40, seed=82), 300)  # decodes first: never the one retracted
        time.sleep(1.0)
        fork = generate(server, base[:300] + random_ids(10, seed=83), 12, rid="f2-fork")
        assert len(ahead.result()["output_ids"]) == 300
    meta = fork["meta_info"]
    assert meta["num_retractions"] >= 1, meta  # SGLang retracted it and admitted it again
    assert len(fork["output_ids"]) == 12
    assert meta["tail_replay_exact"] is False, meta
