"""LFM2 (`Lfm2ForCausalLM`: gated short-conv layers and GQA, each with a SwiGLU MLP) and LFM2-MoE
(`Lfm2MoeForCausalLM`: the same layers, a MoE after the first two: sigmoid router with an expert bias, routed scale
2.5) on the real SGLang server on CPU, against HF transformers, and Tail-Replay's hits against the server's own
no-cache prefill. Every test runs once per model (a module-scoped parametrized fixture).

`tiny-lfm2` and `tiny-lfm2-moe` have the pattern CC*CCC*C: groups of 2, 3 and 1 conv layers of width 3
(`conv_L_cache`), whose taps and gates (`models._init_short_conv`) make the conv several times the residual stream, so
a state taken from the wrong tokens shows. A conv layer's state is its last 2 gated inputs, so every group's state is
rebuilt exactly by a replay of (3 - 1) x 3 = 6 tokens from a cleared slot (`families.short_conv`): each hit replays
min(6, m) tokens and is exact at any token boundary, with no anchor kept (the launcher sets `state_window` 6 and
exact_budget 0).

SGLang keeps conv states in bfloat16 by default (`SGLANG_MAMBA_CONV_DTYPE`). On this model, whose conv outweighs the
residual stream, that rounding moved decode log-probs by up to 2.5e-3 nats against HF's float32 (prompt log-probs:
1e-6), enough to flip a 0.002-nat near-tie. The server checked against HF keeps them in float32; the one on SGLang's
GPU-default scheduling keeps SGLang's default and is checked against its own no-cache runs.
"""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from helpers import (MODELS_DIR, Spec, assert_exact, check_cold_prompts, check_window_hits, dumped_states,
                     faults_env, generate, no_cache, random_ids, scored, start_servers)
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import greedy_generate, layer_states, load_hf_model
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

NEW = 12
WINDOW = 6  # (conv_L_cache - 1) x the most conv layers in a group
LOGPROB_TOL = 1e-3  # as test_server.py's Qwen3.5 bound
TR = ("--enable-tail-replay", "--enable-cache-report", "--dtype", "float32")
FLOAT32_CONV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
# Relative to the state's largest entry. Measured 2026-12-06: at most 1e-6 for the 6-token window; with a 5-token one
# the 3-layer group's last state was off by 0.03-0.15 at every cut from 6 on, every other layer still 1e-6
STATE_TOL = 1e-4


@pytest.fixture(scope="module", params=["tiny-lfm2", "tiny-lfm2-moe"])
def model_path(request):
    return build_model(request.param, MODELS_DIR / request.param)


@pytest.fixture(scope="module")
def hf(model_path):
    return load_hf_model(model_path), AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Where the test plugin saves the conv states a replay rebuilt for a `dump-` request."""
    return tmp_path_factory.mktemp("replayed-states")


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory, dumps):
    """Tail-Replay with the CPU flags and float32 conv states; for LFM2 also with SGLang's GPU-default scheduling (its
    mamba radix-cache strategy left to SGLang, the overlap scheduler on) and its default bfloat16 conv states (the
    family's path is the same on LFM2-MoE: one server start saved)."""
    specs = {"tr": Spec(model_path, TR, {**FLOAT32_CONV, **faults_env(dump_states=dumps)})}
    if model_path.name == "tiny-lfm2":
        specs["production"] = Spec(model_path, TR, kwargs={"gpu_scheduling": True})
    yield from start_servers(tmp_path_factory, specs)


def test_cold_prompts_equal_hf(servers, hf):
    """SGLang's own forward (cache flushed; the plugin only reads it): HF's greedy tokens and prompt log-probs."""
    check_cold_prompts(servers["tr"], hf[0], NEW, LOGPROB_TOL)


@pytest.mark.parametrize("cut", [1, 4, WINDOW, WINDOW + 1, 150, 301])
def test_a_hit_at_any_token_replays_the_window_from_zero_and_equals_no_cache(servers, hf, dumps, cut):
    """A fork at `cut` tokens of a published 400-token prompt (a token no request or chunk ended at): it reuses every
    matched token, replays min(6, cut) of them from a cleared slot, is labelled exact, and equals the server's
    no-cache prefill and HF's greedy tokens. The conv states it rebuilt (read from the pool by the test plugin's
    probe) equal HF's after the same prefix in every conv layer: a window one token short leaves one entry of the
    largest group's last state wrong, which moves only the next token or two and passed the log-prob bound."""
    model, _ = hf
    server = servers["tr"]
    base = random_ids(400, seed=cut)
    fork = base[:cut] + random_ids(10, seed=cut + 1000)
    flush_cache(server.base_url)
    generate(server, base, 1)
    rid = f"dump-{Path(server.model_path).name}-{cut}"
    hit = scored(server, fork, cut, max_new=NEW, rid=rid)
    meta = hit["meta"]
    assert meta["cached_tokens"] == cut and meta["tail_replay_exact"] is True, meta
    assert meta["tail_replay_tokens"] == min(WINDOW, cut) and meta["tail_replay_anchor"] is None, meta
    rebuilt, expected = dumped_states(dumps, rid)["conv"], layer_states(model, base[:cut])["conv"]
    assert rebuilt.keys() == expected.keys() == {0, 1, 3, 4, 5, 7}
    errors = {layer: float((rebuilt[layer] - state).abs().max() / state.abs().max()) for layer, state in
              expected.items()}
    assert max(errors.values()) < STATE_TOL, errors
    assert_exact(hit, no_cache(server, fork, cut, max_new=NEW))
    assert hit["output_ids"] == greedy_generate(model, fork, NEW)


@pytest.mark.parametrize("name", ["tr", "production"])
def test_multi_turn_and_eight_concurrent_hits(servers, hf, name):
    """A second chat turn hits the first turn's prompt and answer (captured at decode); eight requests sharing a
    system prompt hit it at once, each replaying its window in one pass. Each equals HF's greedy tokens (float32
    conv states) or the server's own no-cache run (SGLang's bfloat16 ones)."""
    model, tok = hf
    if name not in servers:
        pytest.skip("SGLang's GPU-default scheduling runs on tiny-lfm2 only")
    server = servers[name]

    def reference(ids):
        if name == "tr":
            return greedy_generate(model, ids, NEW)
        flush_cache(server.base_url)
        return generate(server, ids, NEW)["output_ids"]

    check_window_hits(server, tok, NEW, reference)
