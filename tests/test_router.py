"""Tail-Replay workers behind the real `sglang-router` (pinned in requirements/): with cache-aware routing, requests
that share a prefix reach the worker holding it and hit; round-robin scatters them. The workers are two of the
session's shared tiny Qwen3.5 servers (conftest.py): the plugin's defaults (anchored replay) and the exact one
(whole-prefix replay); either hits a prefix it holds and misses one it does not."""

import pytest
import requests

from tailreplay_eval.server import RouterProcess, ServerProcess, flush_cache

pytestmark = pytest.mark.server

PREFIXES = [
    "you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, " * 2,
    "a young engineer repaired a broken window in the library because the mayor ordered it, and then " * 2,
    "the children walked along the river to the old mill where the baker sold bread every morning; " * 2,
]
QUESTIONS = [" what happened first?", " who was there?", " why did it matter?"]


@pytest.fixture(scope="module")
def workers(anchored_qwen35_server, exact_tail_replay_server):
    """Two Tail-Replay workers."""
    return [anchored_qwen35_server, exact_tail_replay_server]


@pytest.fixture(scope="module")
def routers(workers, tmp_path_factory):
    urls = tuple(w.base_url for w in workers)
    started = {}
    try:
        for policy in ("cache_aware", "round_robin"):
            log = tmp_path_factory.mktemp("router") / f"{policy}.log"
            started[policy] = RouterProcess(worker_urls=urls, policy=policy, log_path=log).start().wait_healthy(120)
        yield started
    finally:
        for router in started.values():
            router.stop()


def _run(router: ServerProcess, workers, tok) -> list[dict]:
    """Every prefix once, then each again with new questions, interleaved: per follow-up its `text`, `answer`, the
    tokens it had `cached` and the `prefix` tokens it could have (less one: the prefix merges with the question)."""
    for w in workers:
        flush_cache(w.base_url)
    follow_ups = []
    for round_ in range(len(QUESTIONS)):
        for prefix in PREFIXES:
            text = prefix + QUESTIONS[round_]
            out = _generate(router, text)
            if round_:
                follow_ups.append({"text": text, "answer": out["output_ids"], "prefix": len(tok(prefix).input_ids) - 1,
                                   "cached": out["meta_info"]["cached_tokens"]})
    return follow_ups


def _generate(server, text: str) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    r = requests.post(f"{server.base_url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def test_cache_aware_routing_sends_a_prefix_to_its_worker_and_every_follow_up_hits(routers, workers, tok_qwen35):
    follow_ups = _run(routers["cache_aware"], workers, tok_qwen35)
    assert len(follow_ups) == len(PREFIXES) * (len(QUESTIONS) - 1)
    assert all(f["cached"] >= f["prefix"] for f in follow_ups), follow_ups
    # what came back through the router is what a worker answers with nothing cached (both hold the same weights)
    reference = workers[1]
    for f in follow_ups:
        flush_cache(reference.base_url)
        assert _generate(reference, f["text"])["output_ids"] == f["answer"], f


def test_round_robin_scatters_a_prefix_and_its_second_request_misses(routers, workers, tok_qwen35):
    """Round-robin over 2 workers and 3 prefixes: a prefix's 2nd request lands on the other worker than its 1st."""
    follow_ups = _run(routers["round_robin"], workers, tok_qwen35)
    second_requests = follow_ups[:len(PREFIXES)]
    assert all(f["cached"] < f["prefix"] for f in second_requests), follow_ups
