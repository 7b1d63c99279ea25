"""Speculative decoding on our CPUs (issue 40), stock and with Tail-Replay: NEXTN (Qwen3.5's MTP head as the draft)
and NGRAM on a hybrid GDN model, under SGLang's GPU default (extra_buffer with the overlap scheduler) and
extra_buffer_lazy.

The CPU port runs what SGLang calls kernels for there (`sglang_cpu_compat/speculative.py`, `spec_verify.py`,
`spec_commit.py`, `spec_kernels.py`): the GDN target verify with per-step states, the verify and draft attention on
torch_native, the commit of the accepted step's states. Greedy decoding must give the same tokens with and without
speculation (a wrong committed state changes them at once on these long-memory models), and the same as HF.

`tiny-qwen35-mtp` is tiny-qwen35 plus an MTP head distilled from it (`tailreplay_eval.mtp`), so that drafts are
accepted (about 1.5 tokens per verify, measured) and acceptance measures something: a random head's drafts almost
never are, and every verify would commit step 0 only.
"""

import concurrent.futures

import pytest

import torch
from safetensors.torch import load_file

from helpers import (MODELS_DIR, assert_anchored_hit, assert_exact, assert_greedy_agrees, generate, random_ids, scored,
                     start_servers)
from helpers import Spec as ServerSpec
from tailreplay_eval.models import build_model
from tailreplay_eval.server import flush_cache
from tailreplay_eval.reference import greedy_generate, load_hf_model, load_reference

pytestmark = pytest.mark.server

NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4")  # SGLang's recipe for Qwen3.5 / Qwen3-Next: 3 / 1 / 4
NGRAM = ("--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "4")
LAZY = ("--mamba-radix-cache-strategy", "extra_buffer_lazy")
# SGLang's start-up check counts what every other process took from memory meanwhile (1 - available / before) against
# this fraction: with four servers starting beside four running ones it asked for 0.218, and 0.116 of the plain one
# starting beside three (measured). The pools are sized by --max-total-tokens and --max-mamba-cache-size, so a larger
# fraction allocates nothing more.
MEMORY = ("--mem-fraction-static", "0.5")
GPU_DEFAULT = {"gpu_scheduling": True}  # no strategy flag: extra_buffer with the overlap scheduler, as on a GPU
# SGLang #36537: NEXTN + extra_buffer + eviction drops acceptance to zero and loops on token 0. Twelve mamba slots
# (each running request holds 3 under extra_buffer) for the "nextn" and "replay" servers: states are evicted all the
# time (test_eviction_keeps_answers_and_acceptance).
SMALL_MAMBA_POOL = ("--max-mamba-cache-size", "12")
PROMPT_LENGTHS = (5, 40, 300)
NEW_TOKENS = 48
# A verify scores 4 tokens in one pass where plain decoding scores one: float32 sums in another order. Greedy paths
# may part at a near-tie; measured: the reference's top two 0.0005 nats apart where they did.
NEAR_TIE = 0.01


@pytest.fixture(scope="module")
def tiny_qwen35_mtp():
    return build_model("tiny-qwen35-mtp", MODELS_DIR / "tiny-qwen35-mtp")


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_qwen35_mtp):
    yield from start_servers(tmp_path_factory, {
        "plain": ServerSpec(tiny_qwen35_mtp, MEMORY, kwargs=GPU_DEFAULT),
        "nextn": ServerSpec(tiny_qwen35_mtp, NEXTN + MEMORY + SMALL_MAMBA_POOL, kwargs=GPU_DEFAULT),
        "nextn_lazy": ServerSpec(tiny_qwen35_mtp, NEXTN + LAZY + MEMORY, kwargs=GPU_DEFAULT),
        "ngram": ServerSpec(tiny_qwen35_mtp, NGRAM + MEMORY, kwargs=GPU_DEFAULT),
    })


@pytest.fixture(scope="module")
def prompts():
    return [random_ids(n, seed=40 + n) for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain_outputs(servers, prompts):
    return [generate(servers["plain"], ids, NEW_TOKENS, return_logprob=True, top_logprobs_num=2) for ids in prompts]


def assert_same_greedy(tokens: list[int], reference: dict) -> None:
    """`tokens` equal the reference's greedy tokens, or part from them only where the reference's top two tokens are
    within NEAR_TIE of each other (exact ties happen: a tiny vocabulary in float32) and `tokens` took one of them."""
    expected = reference["output_ids"]
    first = next((i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b), None)
    if first is None:
        assert len(tokens) == len(expected)
        return
    (best, best_id, _), (second, second_id, _) = reference["meta_info"]["output_top_logprobs"][first]
    assert best - second < NEAR_TIE and tokens[first] in (best_id, second_id), (first, tokens[first], best - second)


@pytest.mark.parametrize("name", ["nextn", "nextn_lazy", "ngram"])
def test_greedy_tokens_equal_without_speculation(servers, prompts, plain_outputs, name):
    for ids, reference in zip(prompts, plain_outputs):
        out = generate(servers[name], ids, NEW_TOKENS)
        assert_same_greedy(out["output_ids"], reference)
        assert out["meta_info"]["spec_verify_ct"] > 0  # it did speculate


def test_plain_greedy_matches_hf(tiny_qwen35_mtp, prompts, plain_outputs):
    model = load_hf_model(tiny_qwen35_mtp)
    for ids, reference in zip(prompts, plain_outputs):
        assert_same_greedy(greedy_generate(model, ids, NEW_TOKENS), reference)


@pytest.mark.parametrize("name", ["nextn", "nextn_lazy"])
def test_mtp_drafts_are_accepted(servers, prompts, name):
    """The distilled head's drafts are accepted about half the time (1.47-1.49 tokens per verify measured): a wrong
    verify state or commit would show as acceptance collapsing to 1.0 (SGLang #36537's signature)."""
    meta = generate(servers[name], prompts[2], 200)["meta_info"]
    assert meta["spec_accept_length"] > 1.3, meta


def test_concurrent_requests_equal_without_speculation(servers, prompts, plain_outputs):
    """A verify batch of several requests: each commits its own accepted step."""
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        outs = list(pool.map(lambda ids: generate(servers["nextn"], ids, NEW_TOKENS)["output_ids"], prompts))
    for tokens, reference in zip(outs, plain_outputs):
        assert_same_greedy(tokens, reference)


# ---- Tail-Replay with NEXTN (issue 40 items 2 and 3) ----------------------------------------------------------------

# The replay path on every hit (no anchors, the whole prefix replayed), and the plugin's defaults (anchored replay).
REPLAY = ("--enable-tail-replay", "--tail-replay-exact-budget", "0", "--tail-replay-ratio", "1",
          "--tail-replay-hidden-dtype", "float32", "--dtype", "float32", "--enable-metrics")
ANCHORED = ("--enable-tail-replay", "--dtype", "float32", "--enable-metrics")
TR_POOL = {"gpu_scheduling": True, "max_total_tokens": 8192, "context_length": 4096}
# Anchors only where requests end and replays of at most 64 tokens: a hit farther from an anchor is approximate.
SHORT_BUDGET = ("--tail-replay-exact-budget", "64", "--tail-replay-anchor-interval", "0")
CONTEXT_TOKENS, ANSWER_TOKENS = 700, 16
CUTS = (333, 517, CONTEXT_TOKENS + 1)  # off the 64-token grid; the last one inside the spec-decoded answer


@pytest.fixture(scope="module")
def tr_servers(tmp_path_factory, tiny_qwen35_mtp):
    yield from start_servers(tmp_path_factory, {
        "replay": ServerSpec(tiny_qwen35_mtp, REPLAY + NEXTN + MEMORY + SMALL_MAMBA_POOL, kwargs=TR_POOL),
        "anchored_lazy": ServerSpec(tiny_qwen35_mtp, ANCHORED + NEXTN + LAZY + MEMORY, kwargs=TR_POOL),
        "short_budget": ServerSpec(tiny_qwen35_mtp, ANCHORED + SHORT_BUDGET + NEXTN + MEMORY, kwargs=TR_POOL),
        "ngram_replay": ServerSpec(tiny_qwen35_mtp, REPLAY + NGRAM + LAZY + MEMORY, kwargs=TR_POOL),
    })


def _forks(server) -> list[list[int]]:
    """A context and its spec-decoded answer, then prompts that share a prefix of it cut at CUTS."""
    context = random_ids(CONTEXT_TOKENS, seed=7)
    answer = generate(server, context, ANSWER_TOKENS)["output_ids"]
    return [(context + answer)[:cut] + random_ids(20, seed=cut) for cut in CUTS]


@pytest.mark.parametrize("name", ["replay", "anchored_lazy"])
def test_hits_at_any_boundary_equal_no_cache_with_acceptance_intact(tr_servers, name):
    """Resends and forks of a context whose answer was decoded speculatively (its hidden rows written by verify
    passes): each hit is labelled exact, equals the same server's no-cache prefill, and drafts are accepted as
    without the cache (a wrong replayed state would drive acceptance to 1.0 first). No flush between the answer and
    the hits: the reference runs in a cache namespace of its own (`extra_key`), so the hit at 701 replays the rows
    the verify of the answer's first token wrote."""
    server = tr_servers[name]
    flush_cache(server.base_url)
    for prompt, cut in zip(_forks(server), CUTS):
        reference = scored(server, prompt, cut, 24, extra_key=f"reference {cut}")
        assert reference["meta"]["cached_tokens"] == 0
        hit = scored(server, prompt, cut, 24)
        meta = hit["meta"]
        assert meta["cached_tokens"] > 0 and meta["tail_replay_exact"] is True, meta
        if name == "replay":
            assert meta["tail_replay_tokens"] == meta["cached_tokens"] == cut, meta
        assert_exact(hit, reference)
        assert hit["output_ids"] == reference["output_ids"]
        assert meta["spec_accept_length"] > 1.0
        assert abs(meta["spec_accept_length"] - reference["meta"]["spec_accept_length"]) <= 0.2, (meta, reference)


def test_concurrent_hits_each_equal_no_cache(tr_servers):
    """Three forks hit at once: their replays and first verifies share batches."""
    server = tr_servers["replay"]
    flush_cache(server.base_url)
    prompts = _forks(server)  # the rows past the context come from verify passes, as above: no flush after it
    references = [scored(server, prompt, cut, 16, extra_key=f"reference {cut}") for prompt, cut in zip(prompts, CUTS)]
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        hits = list(pool.map(lambda args: scored(server, args[0], args[1], 16), zip(prompts, CUTS)))
    for hit, reference, cut in zip(hits, references, CUTS):
        assert reference["meta"]["cached_tokens"] == 0
        assert hit["meta"]["tail_replay_tokens"] == hit["meta"]["cached_tokens"] == cut, hit["meta"]
        assert hit["meta"]["tail_replay_exact"] is True
        assert_exact(hit, reference)


def test_states_a_speculative_approximate_request_commits_never_make_a_hit_exact(tr_servers):
    """An approximate hit decodes speculatively past track points: the states its verify commits (track slots under
    extra_buffer, its finish donation) and the KV it writes derive from the approximate state. A later request
    matching into that answer must not be labelled exact, and one matching only the exact prefix still is."""
    server = tr_servers["short_budget"]
    context = random_ids(CONTEXT_TOKENS, seed=11)
    generate(server, context, 1)  # anchors at 0 and at the end of the context only
    fork = context[:400] + random_ids(40, seed=12)
    first = generate(server, fork, 300)  # 340 tokens past the match: crosses track points while verifying
    assert first["meta_info"]["tail_replay_exact"] is False and first["meta_info"]["spec_verify_ct"] > 0
    into_answer = fork + first["output_ids"][:290] + random_ids(8, seed=13)
    again = scored(server, into_answer, len(into_answer) - 8)
    assert again["meta"]["cached_tokens"] > 400 and again["meta"]["tail_replay_exact"] is False, again["meta"]
    clean = scored(server, context + random_ids(8, seed=14), CONTEXT_TOKENS)
    assert_anchored_hit(clean["meta"], CONTEXT_TOKENS)  # exact: from the context's own state (or folded into it)


def test_ngram_tree_drafts_move_hidden_rows_with_their_kv(tr_servers):
    """NGRAM verifies a draft tree and moves the accepted tokens' KV to the front of their block; the hidden rows must
    follow, or a later hit into that answer replays the rows of rejected drafts. The corpus (shared by all cache
    namespaces, `extra_key`) is seeded with the answer and, at every step of it, a decoy branch (the model's own
    next token after a different context ending in the same 17 tokens), so the answer is decoded with accepted
    drafts that are not the tree's first branch. A hit into it, replayed from those rows, equals a no-cache run."""
    server = tr_servers["ngram_replay"]
    context = random_ids(300, seed=21)
    answer = generate(server, context, 48, extra_key="seed")["output_ids"]
    sequence = context + answer
    for j in range(len(context), len(sequence)):
        generate(server, random_ids(8, seed=1000 + j) + sequence[j - 17 : j], 2, extra_key="decoy")
    decoded = generate(server, context, 48)
    assert decoded["output_ids"] == answer and decoded["meta_info"]["spec_accept_length"] > 2.0, decoded["meta_info"]
    cut = len(context) + 30
    prompt = sequence[:cut] + random_ids(8, seed=22)
    reference = scored(server, prompt, cut, 16, extra_key="reference")
    assert reference["meta"]["cached_tokens"] == 0
    hit = scored(server, prompt, cut, 16)
    assert hit["meta"]["tail_replay_tokens"] == hit["meta"]["cached_tokens"] == cut, hit["meta"]
    assert_exact(hit, reference)


def test_eviction_keeps_answers_and_acceptance(servers, tr_servers, prompts, plain_outputs):
    """SGLang #36537's scenario: NEXTN under extra_buffer with a mamba pool so small that every request's states
    evict earlier ones (12 slots, 16 contexts of 300 tokens, three at a time). Reported on GPUs: acceptance falls
    to zero and answers loop on token 0. Here, stock and Tail-Replay: answers equal the plain server's, acceptance
    stays as before the pressure, and Tail-Replay's hits after it are exact."""
    contexts = [random_ids(300, seed=500 + i) for i in range(16)]
    for name, server in (("stock", servers["nextn"]), ("tail_replay", tr_servers["replay"])):
        before = generate(server, prompts[2], 200)["meta_info"]["spec_accept_length"]
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            list(pool.map(lambda ids: generate(server, ids, 24), contexts))
        for ids, reference in zip(prompts, plain_outputs):
            out = generate(server, ids, NEW_TOKENS)
            assert_same_greedy(out["output_ids"], reference)
            assert out["output_ids"].count(0) < NEW_TOKENS // 2, (name, out["output_ids"])
        after = generate(server, prompts[2], 200)["meta_info"]["spec_accept_length"]
        assert after > 1.3 and abs(after - before) <= 0.2, (name, before, after)
    server = tr_servers["replay"]
    prompt = contexts[3][:211] + random_ids(8, seed=599)
    reference = scored(server, prompt, 211, 16, extra_key="reference")  # no flush: the cache as the pressure left it
    assert reference["meta"]["cached_tokens"] == 0
    generate(server, contexts[3], 1)  # back in the tree if the pressure evicted it
    hit = scored(server, prompt, 211, 16)
    assert hit["meta"]["tail_replay_tokens"] == 211 and hit["meta"]["tail_replay_exact"] is True, hit["meta"]
    assert_exact(hit, reference)


# ---- Ling-3.0's MTP draft: KDA's verify (issue 67) ------------------------------------------------------------------

# tiny-ling-3.0-mtp is tiny-ling-3.0 (the same weights) plus a NEXTN layer that is not distilled (transformers has no
# Ling to distil it from): its drafts are rarely accepted, and the target's tokens must come out anyway. Its verify
# runs KDA's per-draft-token states on the CPU port (`spec_verify.recurrent_kda_verify`).
LING_NEXTN_SERVER = REPLAY + NEXTN + MEMORY


@pytest.fixture(scope="module")
def ling_server(tmp_path_factory):
    model = build_model("tiny-ling-3.0-mtp", MODELS_DIR / "tiny-ling-3.0-mtp")
    for servers in start_servers(tmp_path_factory, {"ling": ServerSpec(model, LING_NEXTN_SERVER, kwargs=TR_POOL)}):
        yield servers["ling"]


def test_ling_speculative_tokens_are_the_references(ling_server, prompts):
    """Cold prompts on the Ling-3.0 NEXTN server: the draft runs, and the tokens are the greedy ones of Ling's torch
    reference on tiny-ling-3.0, whose weights the target's are (checked byte for byte)."""
    target = build_model("tiny-ling-3.0", MODELS_DIR / "tiny-ling-3.0")
    with_head = load_file(MODELS_DIR / "tiny-ling-3.0-mtp" / "model.safetensors")
    assert all(torch.equal(t, with_head[name]) for name, t in load_file(target / "model.safetensors").items())
    model = load_reference(target)
    flush_cache(ling_server.base_url)
    for ids in prompts:
        out = generate(ling_server, ids, NEW_TOKENS)
        assert out["meta_info"]["spec_verify_ct"] > 0
        assert_greedy_agrees(model, ids, out["output_ids"], NEAR_TIE)


def test_ling_hits_under_speculative_decoding_equal_no_cache(ling_server):
    """Resends and forks of a context whose answer the draft and KDA verify decoded: every prefix replayed from
    cleared states (paper mode), each hit exact against the server's own no-cache run."""
    flush_cache(ling_server.base_url)
    for prompt, cut in zip(_forks(ling_server), CUTS):
        reference = scored(ling_server, prompt, cut, 24, extra_key=f"reference {cut}")
        hit = scored(ling_server, prompt, cut, 24)
        meta = hit["meta"]
        assert meta["tail_replay_tokens"] == meta["cached_tokens"] == cut and meta["tail_replay_exact"], meta
        assert meta["spec_verify_ct"] > 0 and reference["meta"]["cached_tokens"] == 0
        assert_exact(hit, reference)
        assert hit["output_ids"] == reference["output_ids"]
