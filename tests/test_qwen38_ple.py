"""Qwen3.8-Flash-Next with per-layer embeddings (PLE; `tailreplay_eval.qwen4exp`; issue 67): served by stock SGLang on
the CPU route and with Tail-Replay (`families.hyper_gdn`, `families.ple`).

A PLE layer (`tiny-qwen3.8-flash-next-ple`: layers 0 and 5, both GDN; transformers allows PLE on linear-attention
layers only) adds `G + silu(conv(norm(G)))` to the streams entering it, G a gated, hashed n-gram embedding of the
token and its two predecessors, the conv depthwise with dilation ngram_size: per request it keeps the conv's last 9
inputs and the last 2 token ids beside its GDN states. The build's conv taps are drawn nonzero (HF and SGLang start
them at zero), so a wrong conv state would show. Served in bfloat16 (SGLang builds the hyper-connection weights and
n-gram tables in bfloat16) on SGLang's GPU-default scheduling (QSA's 64-token pages), as tiny-qwen3.8-flash-next.

Stock first: SGLang's own forward (cache flushed; the plugin only reads it) against HF. Then Tail-Replay: every PLE
layer starts a group, so its input is stored (groups (0, 1, 2), (4), (5, 6)); a PLE group's replay adds the layer's
contribution from the stored rows of the tail and the 9 before it, and every hit gets each PLE conv state and the
n-gram history at its match end rebuilt the same way. Forks are checked against the server's own no-cache prefill,
anchored (128-token chunks: from the chunk-end anchor, whose slot holds GDN states only) and paper (the whole prefix
from a cleared slot).
"""

import pytest
import torch

from helpers import EXACT_FLAGS, MODELS_DIR, assert_exact, no_cache, paged_fork, scored, start_gpu_scheduled
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model, prompt_logprobs
from tailreplay_eval.server import flush_cache
from tailreplay_sglang.layout import HybridLayout

pytestmark = pytest.mark.server

PRESET = "tiny-qwen3.8-flash-next-ple"
NEW = 6
PAGE = 64  # SGLang's QSA page: a hit covers whole pages
CHUNK = 128  # the anchored server's prefill chunk: a fork finds a chunk-end anchor below its match
FLOOR = 2e-3  # nats: test_qwen38's floor where HF's bfloat16 run lands on its float32 one
ANCHORED = ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
            "--tail-replay-fold-tokens", "0")
SERVERS = {"anchored": ANCHORED, "paper": EXACT_FLAGS}
IDS = [(7 * i) % 400 + 20 for i in range(300)]


@pytest.fixture(scope="module")
def model_path():
    return build_model(PRESET, MODELS_DIR / PRESET)


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    yield from start_gpu_scheduled(tmp_path_factory, model_path, SERVERS)


@pytest.fixture(scope="module")
def hf(model_path):
    return {dtype: load_hf_model(model_path, dtype) for dtype in (torch.float32, torch.bfloat16)}


def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """Teacher-forced, without a cache: transformers 5.19's PLE layer fails under one, so HF cannot decode this model
    itself."""
    return prompt_logprobs(model, ids, use_cache=False)


def served_prompt_logprobs(server) -> list[float]:
    flush_cache(server.base_url)
    out = scored(server, IDS, 0, 1)
    assert out["meta"]["cached_tokens"] == 0
    return out["logprobs"][:out["prompt_len"]]


def error(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_stock_serves_hfs_prompt_logprobs_within_bfloat16s_own_rounding(servers, hf):
    """A 300-token prompt: SGLang's prompt log-probs lie as close to HF's float32 as HF's own bfloat16 run does."""
    reference = hf_prompt_logprobs(hf[torch.float32], IDS)
    rounding = error(hf_prompt_logprobs(hf[torch.bfloat16], IDS), reference)
    served = served_prompt_logprobs(servers["anchored"])
    assert error(served, reference) <= 2 * rounding + FLOOR, (error(served, reference), rounding)


def test_the_match_above_checks_the_ple_conv_and_the_embeddings(servers, model_path):
    """The reference misses the served log-probs by far more than the match's bound (HF's bfloat16 rounding, about
    1e-3 here) once its PLE conv is zeroed, and once its whole PLE output is (value projection zeroed), so the match
    above checks both."""
    model = load_hf_model(model_path, torch.float32)
    served = served_prompt_logprobs(servers["anchored"])
    ples = [layer.ple for layer in model.model.language_model.layers if getattr(layer, "ple", None) is not None]
    assert len(ples) == 2
    for ple in ples:
        ple.conv1d.weight.data.zero_()
    without_conv = error(served, hf_prompt_logprobs(model, IDS))
    for ple in ples:
        ple.value_proj.weight.data.zero_()
    without_ple = error(served, hf_prompt_logprobs(model, IDS))
    assert min(without_conv, without_ple) > 0.05, (without_conv, without_ple)


def test_every_ple_layer_starts_a_stored_group(model_path):
    layout = HybridLayout.from_model_path(str(model_path))
    assert [g.layers for g in layout.groups] == [(0, 1, 2), (4,), (5, 6)]
    assert [g.first_layer for g in layout.stored_groups] == [0, 4, 5]


BASE = [(11 * i) % 450 + 30 for i in range(700)]
TAIL = [(13 * i) % 300 + 50 for i in range(40)]


@pytest.mark.parametrize("cut", [200, 450, 650])
@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_fork_rebuilds_the_ple_states_and_equals_no_cache(servers, name, cut):
    """A 700-token request, then a fork at `cut`: the hit (whole 64-token pages) replays from the chunk-end anchor
    below it or from a cleared slot through the three groups, the PLE groups adding their layer's contribution,
    and every PLE conv state and the n-gram history are rebuilt at the match end; it equals no cache. At 650 the
    anchored server's match (640) is the state kept where the prefill ended: nothing is replayed, the PLE states
    are rebuilt all the same."""
    meta = paged_fork(servers[name], BASE, cut, TAIL, NEW, PAGE)["meta"]
    anchored = {200: 64, 450: 64, 650: 0}[cut]
    assert meta["tail_replay_tokens"] == (meta["cached_tokens"] if name == "paper" else anchored)


def test_chat_turns_hit_their_history_and_equal_no_cache(servers):
    """Three turns, each the previous one, its decoded answer and a new question: each hit replays from the anchor
    below its history's whole pages and equals no cache."""
    server = servers["anchored"]
    flush_cache(server.base_url)
    turn = BASE[:300]
    for i in range(3):
        turn = turn + scored(server, turn, len(turn) - 1, 12)["output_ids"] + TAIL[10 * i:10 * i + 30]
        matched = len(turn) - 31
        hit = scored(server, turn, matched, NEW)
        assert hit["meta"]["cached_tokens"] == matched // PAGE * PAGE and hit["meta"]["tail_replay_exact"]
        assert_exact(hit, no_cache(server, turn, matched, NEW))
