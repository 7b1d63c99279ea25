"""Attention data parallelism and expert parallelism, stock and with Tail-Replay, on the CPU route.

`--tp 2 --dp 2 --enable-dp-attention` gives each of two attention-DP groups its own scheduler, pools and radix tree
(one TP rank each here: attention TP 1), while the MLP and MoE blocks are sharded over both ranks and run over both
groups' rows at every step. `--tp 2 --ep-size 2` puts half the experts on each rank. One server at a time (the
fixture is parametrized): each is two ranks on the two cores (`SGLANG_CPU_OMP_THREADS_BIND=0|1`).

- stock: DP attention and EP together on tiny-qwen35-moe, greedy equal to HF (the CPU port's fixes: the padded
  rows' sequence length torch_native lacked, EP's masked expert ids, pynccl's reduce_scatterv;
  `cpu_compat/.../{dp_attention,moe}.py`);
- Tail-Replay under DP attention (Qwen3.5 MoE, anchored; dense, whole-prefix replay; Qwen3-Next, anchored) and
  with EP: off-grid hits on each group exact against no cache, the other group's tree its own, hits on both groups
  in one step, a hit on one group while the other decodes (its replay's feed-forward collectives need every rank:
  `dp_attention.py`);
- faults on the Qwen3.5 MoE one (the test plugin holds every replay pass REPLAY_DELAY_S and logs it; a `raise-`
  request's pass raises): an abort and a flush while a group's replay is held leave every group's pools whole, and a
  replay that raises on one rank stops the whole server with the error in its log, not a hang.
"""

import concurrent.futures
import time
from pathlib import Path

import pytest

from helpers import (EXACT_FLAGS, FaultEvents, Spec, assert_exact, dumped_states, faults_env, generate,
                     generate_response, no_cache, random_ids, scored, start_servers)
import requests

from soak import POOLS_KEY, pool_leaks, wait_idle
from tailreplay_eval.reference import greedy_generate, layer_states
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

TWO_RANKS = {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
DPA = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
EP = ("--tp-size", "2", "--ep-size", "2")
ANCHORED = ("--enable-tail-replay", "--tail-replay-anchor-interval", "64", "--tail-replay-fold-tokens", "0",
            "--enable-cache-report", "--dtype", "float32")
SERVERS = {
    "stock-dpa-ep": ("tiny_qwen35_moe", (*DPA, "--ep-size", "2", "--enable-cache-report")),
    "tr-dpa-moe": ("tiny_qwen35_moe", (*DPA, *ANCHORED)),
    "tr-dpa-dense": ("tiny_qwen35", (*DPA, *EXACT_FLAGS)),  # the whole prefix replayed: every layer's MLP
    "tr-dpa-next": ("tiny_qwen3next", (*DPA, *ANCHORED)),  # Qwen3-Next's own GDN and sparse MoE modules
    "tr-ep": ("tiny_qwen35_moe", (*EP, *ANCHORED)),
}
NEW = 8
HF_OF = {"tr-dpa-moe": "hf_qwen35_moe", "tr-dpa-dense": "hf_qwen35"}
# The largest difference of a rebuilt recurrent state from HF's, relative to the state's largest entry. Measured
# 2026-12-06: 3.7e-4 to 1.7e-3 for exact replays (kernel numerics: layer 0, before any feed-forward block, is at the
# same level); 0.06 to 0.30 in every layer past a feed-forward block with the mis-paired mutant (`dp-participate-order`)
STATE_TOL = 1e-2
REPLAY_DELAY_S = 0.3
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")


@pytest.fixture(scope="module")
def events(tmp_path_factory) -> FaultEvents:
    return FaultEvents(tmp_path_factory.mktemp("faults") / "held.jsonl")


@pytest.fixture(scope="module")
def dumps(tmp_path_factory) -> Path:
    """Where the test plugin saves the states a replay rebuilt for a `dump-` request."""
    return tmp_path_factory.mktemp("replayed-states")


@pytest.fixture(scope="module")
def server(request, tmp_path_factory, events, dumps):
    """One server of SERVERS at a time: each test names the servers it runs on (`on_servers`), and pytest runs one
    server's tests before it starts the next. tr-dpa-moe carries the fault plugin, tr-dpa-dense its state probe."""
    model_fixture, flags = SERVERS[request.param]
    model = request.getfixturevalue(model_fixture)
    env = {"tr-dpa-moe": faults_env(REPLAY_DELAY_S, events.path, raise_on_rid=True, dump_states=dumps),
           "tr-dpa-dense": faults_env(dump_states=dumps)}.get(request.param, {})
    env = {**TWO_RANKS, **env}
    servers = start_servers(tmp_path_factory, {request.param: Spec(model, flags, env)})
    try:
        srv = next(servers)[request.param]
        srv.name = request.param
        yield srv
    finally:
        servers.close()


def on_servers(*names):
    return pytest.mark.parametrize("server", names, indirect=True, scope="module")


def groups(server) -> tuple[int, ...]:
    return (0, 1) if "dpa" in server.name else (None,)


def leaks_in_every_group(server) -> list[list[str]]:
    """Each DP group's pools once idle (`/server_info` reports every group's scheduler): the violations per group."""
    wait_idle(server.base_url)
    states = requests.get(f"{server.base_url}/server_info", timeout=60).json()["internal_states"]
    assert len(states) == len(groups(server))
    return [pool_leaks(state[POOLS_KEY]) for state in states]


def on(server, rank, ids, max_new=NEW, **extra):
    """`generate` pinned to an attention-DP group (`routed_dp_rank`), checked to have run there."""
    routed = {} if rank is None else {"routed_dp_rank": rank}
    out = generate(server, ids, max_new, **routed, **extra)
    if rank is not None:
        assert out["meta_info"]["dp_rank"] == rank
    return out


@on_servers("stock-dpa-ep")
def test_stock_dp_attention_with_expert_parallelism_equals_hf(server, hf_qwen35_moe):
    """Each group serves SGLang's own forward: greedy equal to HF's on a cold prompt and on a prefix hit (stock's
    own hit at the state where a request ended), on both groups."""
    model, tok = hf_qwen35_moe
    flush_cache(server.base_url)
    system = tok(SYSTEM).input_ids
    question = system + tok(" what happened first?").input_ids
    for rank in (0, 1):
        cold = on(server, rank, system)
        assert cold["meta_info"]["cached_tokens"] == 0
        assert cold["output_ids"] == greedy_generate(model, system, NEW)
        resend = on(server, rank, question)
        assert resend["output_ids"] == greedy_generate(model, question, NEW)


@on_servers("tr-dpa-moe", "tr-dpa-dense", "tr-ep")
def test_cold_prompts_equal_hf(server, request):
    """The servers with Tail-Replay serve a cold prompt as SGLang does: greedy equal to HF's on every group."""
    model, tok = request.getfixturevalue("hf_qwen35" if "dense" in server.name else "hf_qwen35_moe")
    flush_cache(server.base_url)
    ids = tok(SYSTEM + " who repaired the window?").input_ids
    for rank in groups(server):
        assert on(server, rank, ids)["output_ids"] == greedy_generate(model, ids, NEW)


@on_servers("tr-dpa-moe", "tr-dpa-dense", "tr-dpa-next", "tr-ep")
@pytest.mark.parametrize("cut", [150, 237])
def test_off_grid_hits_on_each_group_are_exact(server, cut):
    """A fork at a token no request or chunk ended at, on each group: it hits that group's own copy of the
    prefix (the other group's tree has none of it), replays its tail from an interval anchor (or, on the
    whole-prefix server, the whole prefix) with every rank in the feed-forward blocks, and equals no cache."""
    base = random_ids(300, seed=cut)
    fork = base[:cut] + random_ids(12, seed=cut + 1)
    for rank in groups(server):
        flush_cache(server.base_url)
        on(server, rank, base, 1)
        hit = scored(server, fork, cut, **({} if rank is None else {"routed_dp_rank": rank}))
        meta = hit["meta"]
        assert meta["cached_tokens"] == cut and meta["tail_replay_exact"] is True, meta
        assert meta["tail_replay_tokens"] == (cut if "dense" in server.name else cut - meta["tail_replay_anchor"])
        assert meta["tail_replay_tokens"] > 0, meta
        if rank is not None:
            assert on(server, 1 - rank, fork, 1)["meta_info"]["cached_tokens"] == 0  # not in the other tree
        reference = no_cache(server, fork, cut, **({} if rank is None else {"routed_dp_rank": rank}))
        assert_exact(hit, reference)
    assert leaks_in_every_group(server) == [[]] * len(groups(server))


@on_servers("tr-dpa-moe", "tr-dpa-dense")
def test_rebuilt_states_equal_hfs(server, request, dumps):
    """The states a replay under attention DP rebuilt, read from the pool (the test plugin's probe) and compared
    with HF's after the same prefix, on each group: whole-prefix (dense) and from the interval anchor at 128 (MoE).
    A fault in the replay's feed-forward collectives (the other rank walking its blocks in another order) moved
    the fork's log-probs by only 0.003-0.009 nats per token on these models, about the exactness tolerance (issue
    65 class 10); in the states it is 6-30 times STATE_TOL."""
    model = request.getfixturevalue(HF_OF[server.name])[0]
    base, cut = random_ids(300, seed=70), 150
    fork = base[:cut] + random_ids(12, seed=71)
    expected = layer_states(model, base[:cut])["temporal"]
    for rank in (0, 1):
        flush_cache(server.base_url)
        on(server, rank, base, 1)
        rid = f"dump-{server.name}-{rank}"
        meta = on(server, rank, fork, 1, rid=rid)["meta_info"]
        assert meta["cached_tokens"] == cut and meta["tail_replay_tokens"] > 0, meta
        rebuilt = dumped_states(dumps, rid)["temporal"]
        assert rebuilt.keys() == expected.keys()
        errors = {layer: float((rebuilt[layer] - state).abs().max() / state.abs().max())
                  for layer, state in expected.items()}
        assert max(errors.values()) < STATE_TOL, errors


@on_servers("tr-dpa-moe", "tr-dpa-dense")
def test_hits_on_both_groups_at_once_and_a_hit_beside_a_decode(server):
    """Hits on both groups in flight together (their replays in one step or in consecutive ones: each rank's pass
    takes the other's rows through the feed-forward blocks), then a hit on group 0 while group 1 decodes a long
    answer (group 1 takes part in the replay pass from its decode step). Every hit exact against no cache."""
    bases = [random_ids(300, seed=40 + rank) for rank in (0, 1)]
    forks = [b[:200] + random_ids(10, seed=50 + rank) for rank, b in enumerate(bases)]
    flush_cache(server.base_url)
    for rank in (0, 1):
        on(server, rank, bases[rank], 1)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        hits = list(pool.map(lambda rank: scored(server, forks[rank], 200, routed_dp_rank=rank), (0, 1)))
        long = pool.submit(on, server, 1, random_ids(50, seed=60), 80)
        time.sleep(0.5)  # group 1 is decoding
        beside = scored(server, bases[0][:250] + [7, 8], 250, routed_dp_rank=0)
        assert len(long.result()["output_ids"]) == 80
    assert all(h["meta"]["cached_tokens"] == 200 and h["meta"]["tail_replay_exact"] for h in hits)
    assert beside["meta"]["cached_tokens"] == 250 and beside["meta"]["tail_replay_tokens"] > 0
    for rank, hit in enumerate(hits):
        assert_exact(hit, no_cache(server, forks[rank], 200, routed_dp_rank=rank))
    assert_exact(beside, no_cache(server, bases[0][:250] + [7, 8], 250, routed_dp_rank=0))
    assert leaks_in_every_group(server) == [[]] * len(groups(server))


@on_servers("tr-dpa-moe")
def test_an_abort_and_a_flush_while_a_group_replays_leave_every_groups_pools_whole(server, events):
    """Group 1's replay pass is held (the fault plugin) while its request is aborted and the cache flush is asked
    for; group 0 serves meanwhile. Afterwards both groups' pools are whole and a hit on each is exact."""
    base = random_ids(300, seed=70)
    flush_cache(server.base_url)
    for rank in (0, 1):
        on(server, rank, base, 1)
    fork = base[:210] + random_ids(10, seed=71)
    pool = concurrent.futures.ThreadPoolExecutor(2)
    held = pool.submit(generate_response, server, fork, 40, routed_dp_rank=1, rid="held-abort")
    events.wait_held("held-abort")
    requests.post(f"{server.base_url}/flush_cache", timeout=30)  # refused or done: either leaves the pools whole
    while not held.done():  # SGLang ignores an abort that reaches it before the request does
        requests.post(f"{server.base_url}/abort_request", json={"rid": "held-abort"}, timeout=30)
        time.sleep(0.02)
    beside = pool.submit(on, server, 0, random_ids(40, seed=72), 4)
    assert len(beside.result()["output_ids"]) == 4
    pool.shutdown()
    assert held.result().json()["meta_info"]["finish_reason"]["type"] == "abort"
    assert leaks_in_every_group(server) == [[], []]
    for rank in (0, 1):
        on(server, rank, base, 1)
        hit = scored(server, fork, 210, routed_dp_rank=rank)
        assert hit["meta"]["cached_tokens"] == 210 and hit["meta"]["tail_replay_exact"] is True
        assert_exact(hit, no_cache(server, fork, 210, routed_dp_rank=rank))


@on_servers("tr-dpa-moe")
def test_a_replay_that_raises_on_one_rank_stops_the_server_with_the_error(server):
    """The last test on this server. Group 1's replay pass raises after it ran; group 0 is then inside the step's
    collectives with a peer that will never come. SGLang's supervision stops every process (fails closed) within
    seconds, the error in the log, instead of a hang."""
    base = random_ids(300, seed=80)
    on(server, 1, base, 1)
    try:
        response = generate_response(server, base[:200] + [7, 8], 4, routed_dp_rank=1, rid="raise-on-group-1")
        assert response.status_code != 200, response.text
    except requests.ConnectionError:
        pass  # the server went away first
    deadline = time.monotonic() + 60
    while server.proc.poll() is None:
        assert time.monotonic() < deadline, "the server still runs a minute after a rank's replay raised"
        time.sleep(0.5)
    assert "ReplayFault: injected replay fault for ['raise-on-group-1']" in server.log_path.read_text()
