"""Tail-Replay with SGLang's tensor and data parallelism on the CPU (`--tp-size 2`, `--dp-size 2`), against HF.

Two ranks on these two cores need `SGLANG_CPU_OMP_THREADS_BIND` (one core each): without it SGLang's CPU path
allows no more ranks than NUMA nodes (one here).
"""

import time
from pathlib import Path

import psutil
import pytest

from helpers import (CONTEXT, QUESTION, EXACT_FLAGS, MODELS_DIR, Spec, assert_exact, generate, hicache_spec, no_cache,
                     random_ids, scored, start_server, start_servers, wait_for_pages)
from soak import pools, wait_idle
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import greedy_generate, prompt_logprobs
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
NEW = 8
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")


@pytest.fixture(scope="module")
def tp_servers(tiny_qwen35, tiny_qwen35_moe, tmp_path_factory):
    """TP 2 replaying whole prefixes, dense and MoE, started together: the dense one over the sharded store (the
    default), the MoE one with whole rows on each rank (`--tail-replay-store-tp replicate`), so the hits below run
    over both layouts."""
    yield from start_servers(tmp_path_factory, {
        "tp": Spec(tiny_qwen35, (*EXACT_FLAGS, "--tp-size", "2"), env=TWO_RANKS),
        "tp_moe": Spec(tiny_qwen35_moe, (*EXACT_FLAGS, "--tp-size", "2", "--tail-replay-store-tp", "replicate"),
                       env=TWO_RANKS),
    })


@pytest.fixture(scope="module")
def dp_server(tiny_qwen35, tmp_path_factory):
    """DP 2 with anchored replay (the defaults, interval anchors every 64 tokens, every span replayed rather than
    folded into the extend) on both ranks. Started only for the DP tests, after the TP ones (SGLang's data-parallel
    controller busy-polled a whole core of two, which slowed every TP request about twofold while it ran beside
    them; the CPU port now blocks it in poll, `sglang_cpu_compat/dp_idle.py`)."""
    yield from start_server(tiny_qwen35, tmp_path_factory, "--enable-tail-replay", "--tail-replay-anchor-interval",
                            "64", "--tail-replay-fold-tokens", "0", "--dp-size", "2", env=TWO_RANKS)


@pytest.fixture(scope="module", params=["dense", "moe"])
def tp(request, tp_servers):
    """(TP 2 server, its HF reference): Qwen3.5 and Qwen3.5-MoE, whose MoE block leaves its TP sum to the layer
    (reduce_results=False) as the dense MLP's down projection does."""
    if request.param == "dense":
        return tp_servers["tp"], request.getfixturevalue("hf_qwen35")
    return tp_servers["tp_moe"], request.getfixturevalue("hf_qwen35_moe")


def test_tp2_hits_replay_the_whole_prefix_and_match_hf(tp):
    """Each rank replays its own GDN heads; the all-reduces after the output projection and the MLP (or MoE block)
    pair up across ranks (a missing one deadlocks or gives a partial sum, and the greedy tokens differ: measured on
    the MoE before its block was reduced, 3.9e-3 nats mean and 0.014 max on a hit's prompt, other tokens)."""
    tp_server, (model, tok) = tp
    flush_cache(tp_server.base_url)
    system = tok(SYSTEM).input_ids
    cold = generate(tp_server, system, NEW)  # SGLang's own TP forward of the model
    assert cold["meta_info"]["cached_tokens"] == 0 and cold["output_ids"] == greedy_generate(model, system, NEW)
    for ids in (system, *(system + tok(q).input_ids for q in (" what happened first?", " who repaired the window?")),
                system[:17] + tok(" another branch").input_ids):  # a resend, two questions, a mid-prefix fork
        out = generate(tp_server, ids, NEW)
        meta = out["meta_info"]
        assert meta["cached_tokens"] >= min(len(ids) - 1, 17) and meta["tail_replay_tokens"] == meta["cached_tokens"]
        assert out["output_ids"] == greedy_generate(model, ids, NEW)


def test_tp2_ranks_each_store_half_of_every_row(tp_servers, tiny_qwen35):
    """Issue 63 item 1: at TP 2 each rank keeps its half of every stored row (columns 0:32 and 32:64 of 64), sliced
    from the replicated value at capture, and replays over both halves (the hits above, exact against HF): a rank's
    store costs half of TP 1's bytes per token but for the token ids (/server_info; the start-up log of each rank)."""
    import torch

    from tailreplay_sglang.layout import HybridLayout
    from tailreplay_sglang.store.hidden_store import bytes_per_token

    server = tp_servers["tp"]
    pools = wait_idle(server.base_url)
    tp1 = bytes_per_token(HybridLayout.from_model_path(str(tiny_qwen35)), torch.float32)
    assert pools["hidden_store_shard"] == [0, 2]
    assert pools["hidden_store_bytes_per_token"] == (tp1 - 8) // 2 + 8 <= 0.55 * tp1
    log = server.log_path.read_text()
    for rank, columns in ((0, "0:32"), (1, "32:64")):
        assert f"columns {columns} of 64 on attention-TP rank {rank} of 2" in log


def test_tp2_replicated_store_keeps_whole_rows_on_each_rank(tp_servers, tiny_qwen35_moe):
    """`--tail-replay-store-tp replicate` (the MoE server, whose hits above are exact against HF): each rank keeps
    whole rows, TP 1's bytes per token, and its KV cell is charged for them."""
    import torch

    from tailreplay_sglang.layout import HybridLayout
    from tailreplay_sglang.store.hidden_store import bytes_per_token

    server = tp_servers["tp_moe"]
    pools = wait_idle(server.base_url)
    assert pools["hidden_store_shard"] == [0, 1]
    assert pools["hidden_store_bytes_per_token"] == bytes_per_token(
        HybridLayout.from_model_path(str(tiny_qwen35_moe)), torch.float32)
    assert "each row split over 1 attention-TP ranks" in server.log_path.read_text()


@pytest.fixture(scope="module")
def l3_folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("l3-tp2")


@pytest.fixture(scope="module")
def tp_hicache_server(tiny_qwen35, tmp_path_factory, l3_folder):
    """TP 2 with HiCache's host tier, the `file` L3 and Tail-Replay's defaults (anchored replay): each rank's host
    twin holds its half of the hidden rows, and each rank writes its own pages and states to the folder."""
    spec = hicache_spec(tiny_qwen35, l3_folder, False, "--enable-tail-replay", "--tp-size", "2")
    yield from start_servers(tmp_path_factory, {"tp_hicache": Spec(spec.model_path, spec.args,
                                                                   env={**spec.env, **TWO_RANKS},
                                                                   kwargs=spec.kwargs)})


def test_tp2_host_tier_hits_over_the_sharded_store_are_exact(tp_hicache_server):
    """Issue 63 item 1: at TP 2 a context pushed out to HiCache's host tier is hit at 650 (replayed from an anchor
    over hidden rows each rank loads back as its half) and 333 (from the root), each exact against the server's
    no-cache prefill."""
    srv = tp_hicache_server["tp_hicache"]
    assert pools(srv.base_url)["hidden_store_shard"] == [0, 2]
    context = random_ids(CONTEXT, seed=171)
    generate(srv, context, 1)
    hits = []
    for cut in (650, 333):
        for i in range(3):  # 2,100 tokens through the 1,200-token device pool: the context goes to the host
            generate(srv, random_ids(CONTEXT, seed=1100 + cut + i), 1)
        prompt = context[:cut] + random_ids(QUESTION, seed=172 + cut)
        hit = scored(srv, prompt, cut)
        meta = hit["meta"]
        assert meta["cached_tokens"] == cut and meta["cached_tokens_details"]["host"] > 0, meta
        assert meta["tail_replay_exact"] is True and meta["tail_replay_tokens"] > 0, meta
        hits.append((cut, prompt, hit))
    for cut, prompt, hit in hits:  # references last: a flush empties the host tier too
        assert_exact(hit, no_cache(srv, prompt, cut, extra_key=f"no-cache tp2 {cut}"))


def test_tp2_ranks_whose_stored_states_differ_plan_one_storage_hit_and_stay_honest(tp_hicache_server, l3_folder):
    """Review F1 (issue 64) in the real server: TP ranks keep their own L3 objects, so one rank may hold a state its
    peer lacks. Here rank 1's stored states of a context are removed from the folder, rank 0's kept (its anchor at
    512 among them). A storage hit at 600 past the exact budget then must not read the state on rank 0 alone: the
    ranks agree on which states all of them hold before planning (`storage_anchors.agree_on_plan`), so both plan
    the same hit from the root, it completes (no collective pairs wrongly: a hang fails on the per-test timeout), it
    reads no state, and it is exact against the server's no-cache prefill."""
    srv = tp_hicache_server["tp_hicache"]
    flush_cache(srv.base_url)
    before = set(l3_folder.iterdir())
    context = random_ids(CONTEXT, seed=181)
    generate(srv, context, 1)
    wait_for_pages(l3_folder, len(before), 2 * 2 * CONTEXT)  # a KV and a hidden page per token, on each rank
    time.sleep(1)  # the anchors' states follow their nodes' pages by a scheduler step or two
    states = [f for f in set(l3_folder.iterdir()) - before if ".mamba" in f.name]
    rank1 = [f for f in states if f.stem.endswith("_1_2")]
    assert rank1 and len(rank1) < len(states), sorted(f.name for f in states)  # both ranks stored states
    for f in rank1:
        f.unlink()
    flush_cache(srv.base_url)  # the device and host tiers: the context is in L3 alone
    prompt = context[:600] + random_ids(QUESTION, seed=182)
    hit = scored(srv, prompt, 600)
    meta = hit["meta"]
    assert meta["cached_tokens_details"]["storage"] > 0, meta
    assert meta["tail_replay_anchor"] == 0, meta  # rank 0's state at 512 was not read: rank 1 lacks it
    if meta["tail_replay_exact"]:
        assert_exact(hit, no_cache(srv, prompt, 600, extra_key="no-cache tp2 f1"))


def test_tp2_prompt_logprobs_on_a_hit_match_hf(tp):
    """The same check and tolerance as test_tail_replay.py's at TP 1."""
    tp_server, (model, tok) = tp
    flush_cache(tp_server.base_url)
    ids = tok(SYSTEM + " and then the story ends").input_ids
    start = len(ids) - 6
    generate(tp_server, ids[:start], 1)
    out = generate(tp_server, ids, 1, return_logprob=True, logprob_start_len=start)
    assert out["meta_info"]["cached_tokens"] == start
    served = {pos: lp for pos, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start)
              if lp is not None}
    reference = prompt_logprobs(model, ids)
    assert len(served) >= 5
    assert max(abs(lp - reference[pos - 1]) for pos, lp in served.items()) < 1e-3


@pytest.fixture(scope="module", params=["tiny-ling-2.5", "tiny-ling-3.0"])
def ling_tp_server(request, tmp_path_factory):
    """Ling at TP 2 with interval anchors every 128 tokens: tiny-ling-2.5 (4 lightning heads, 2 norm groups) and
    tiny-ling-3.0 (4 KDA heads with their conv channels, gates and A_log per rank)."""
    path = build_model(request.param, MODELS_DIR / request.param)
    yield from start_server(path, tmp_path_factory, "--enable-tail-replay", "--tail-replay-anchor-interval", "128",
                            "--tail-replay-fold-tokens", "0", "--dtype", "float32", "--enable-cache-report",
                            "--tp-size", "2", env=TWO_RANKS)


def test_tp2_ling_hits_from_interval_anchors_are_exact(ling_tp_server):
    """Each rank replays its 2 of the 4 linear-attention heads (Ling-2.5: with its slice of SGLang's decay rates and
    its output-norm group; Ling-3.0: its KDA heads' conv, gates and decays) and writes its heads' anchors; the
    output projections and MoE blocks are reduced across ranks. A cold prefill is the reference's greedy (SGLang's
    own TP forward); forks from the root and from the anchor at 256 equal the server's no-cache prefill."""
    from tailreplay_eval.reference import load_reference

    server = ling_tp_server
    model = load_reference(server.model_path)
    prompt = random_ids(600, seed=21)
    for fork, anchor in ((100, 0), (300, 256)):
        flush_cache(server.base_url)
        cold = generate(server, prompt, NEW)  # anchors at 128, 256, 384 and 512
        assert cold["meta_info"]["cached_tokens"] == 0 and cold["output_ids"] == greedy_generate(model, prompt, NEW)
        ids = prompt[:fork] + random_ids(30, seed=fork)
        hit = scored(server, ids, fork)
        assert hit["meta"]["cached_tokens"] == fork and hit["meta"]["tail_replay_anchor"] == anchor, hit["meta"]
        assert hit["meta"]["tail_replay_exact"] is True
        assert_exact(hit, no_cache(server, ids, fork))


def test_dp2_each_rank_keeps_its_own_cache_and_replays_exactly(dp_server, hf_qwen35):
    """A prefix cached on rank 0 hits on rank 0 only; rank 1 builds its own. Both ranks run Tail-Replay (the config
    reached both schedulers): a fork mid-prefix hits at a token boundary, from an interval anchor, exactly."""
    model, tok = hf_qwen35
    flush_cache(dp_server.base_url)
    ids = tok(SYSTEM + " what happened first?").input_ids
    fork = ids[:-9] + tok(" and who ordered it?").input_ids  # matches 9 tokens short of the end: no request ended there

    def on(rank, prompt):
        out = generate(dp_server, prompt, NEW, routed_dp_rank=rank)
        assert out["meta_info"]["dp_rank"] == rank
        return out

    assert on(0, ids)["meta_info"]["cached_tokens"] == 0
    assert on(1, fork)["meta_info"]["cached_tokens"] == 0  # rank 1 has not seen it
    for rank in (0, 1):
        out = on(rank, fork if rank == 0 else ids)
        meta = out["meta_info"]
        assert meta["cached_tokens"] >= len(ids) - 10 and meta["tail_replay_exact"], meta
        assert meta["tail_replay_anchor"] is not None and meta["tail_replay_tokens"] < 64
        assert out["output_ids"] == greedy_generate(model, fork if rank == 0 else ids, NEW)


@pytest.mark.parametrize("name", ["tp", "dp"])
def test_each_rank_runs_on_its_own_core(name, request):
    """SGLang applies `SGLANG_CPU_OMP_THREADS_BIND` only through an AMX kernel; the CPU port applies it with torch
    (sglang_cpu_compat/threads.py). Unbound, two ranks on two cores run four spinning OpenMP threads and prefill ~10x
    slower."""
    server = request.getfixturevalue("tp_servers")["tp"] if name == "tp" else request.getfixturevalue("dp_server")
    schedulers = [p for p in psutil.Process(server.proc.pid).children(recursive=True)
                  if "scheduler" in p.name()]
    assert sorted(tuple(p.cpu_affinity()) for p in schedulers) == [(0,), (1,)]
    assert all(f"rank bound to CPUs [{cpu}], 1 torch threads" in server.log_path.read_text() for cpu in (0, 1))
