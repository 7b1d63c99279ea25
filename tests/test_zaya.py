"""ZAYA1 (`ZayaForCausalLM`: CCA attention layers, each followed by a MoE layer) on the real SGLang server on CPU,
against HF transformers, and Tail-Replay's hits against the server's own no-cache prefill.

`tiny-zaya` (`tailreplay_eval.zaya`) has 4 CCA layers, each with a two-stage conv of width 2 + 2 over q and k, so a
layer's state is the last 2 rows of its q || k and its last input (the delayed value's source). Every state is
rebuilt exactly by a replay of the stack from the embeddings over 2 x 4 = 8 tokens from cleared slots, attending to
the KV the first prefill cached (`families/cca.py`): each hit replays min(8, m) tokens and is exact at any token
boundary, with no anchor kept and nothing stored but the token ids.

The log-probs alone do not tell a window one token short (measured 2026-12-07: within 1.4e-4 nats of no cache; a
window of 2 tokens, within 0.014 before its greedy outputs parted), so every hit also compares the states the replay
wrote, read from the pool by the test plugin's probe, with transformers' after the same prefix.
"""


import pytest
import torch
from transformers import AutoTokenizer

from helpers import (MODELS_DIR, Spec, assert_exact, check_cold_prompts, check_window_hits, dumped_states,
                     faults_env, generate, no_cache, random_ids, scored, start_servers)
from tailreplay_eval import zaya
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import greedy_generate, load_reference
from tailreplay_eval.server import flush_cache
from tailreplay_sglang.layout import HybridLayout

pytestmark = pytest.mark.server

NEW = 12
WINDOW = 8  # (cca_time0 - 1 + cca_time1 - 1) x the CCA layers
LOGPROB_TOL = 1e-3  # as test_server.py's Qwen3.5 bound
TR = ("--enable-tail-replay", "--enable-cache-report", "--dtype", "float32")
FLOAT32_CONV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}
# Relative to the state's largest entry. Measured 2026-12-07: at most 1e-6 for the 8-token window
STATE_TOL = 1e-4


@pytest.fixture(scope="module")
def model_path():
    """Built (when not yet) with SGLang's configs imported, as in a test worker that ran a server module first:
    SGLang then has its own ZayaConfig registered for `zaya` (Zyphra's fields), which the build and the reference
    must not pick up (the clean-clone CI of 558edc3: "'ZayaConfig' object has no attribute 'layer_types'")."""
    import sglang.srt.configs  # noqa: F401

    return build_model("tiny-zaya", MODELS_DIR / "tiny-zaya")


@pytest.fixture(scope="module")
def hf(model_path):
    return load_reference(model_path), AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def dumps(tmp_path_factory):
    """Where the test plugin saves the states a replay rebuilt for a `dump-` request."""
    return tmp_path_factory.mktemp("replayed-states")


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory, dumps):
    """Tail-Replay with the CPU flags and float32 conv states, checked against HF; and under SGLang's GPU-default
    scheduling (the overlap scheduler; ZAYA1 is not on SGLang's extra_buffer list, so no_buffer) with its default
    bfloat16 conv states, checked against its own no-cache runs."""
    yield from start_servers(tmp_path_factory, {
        "tr": Spec(model_path, TR, {**FLOAT32_CONV, **faults_env(dump_states=dumps)}),
        "production": Spec(model_path, TR, kwargs={"gpu_scheduling": True}),
    })


def test_the_layout_is_one_group_of_cca_layers_fed_by_the_embeddings(model_path):
    """SGLang's layers 0, 2, 4, 6 are CCA (recurrent: a conv state beside the KV), the odd ones MoE; one group up to
    the last CCA layer, nothing stored per token but the ids, and the launcher's window is 2 x 4."""
    layout = HybridLayout.from_model_path(str(model_path))
    assert [g.recurrent_layers for g in layout.groups] == [(0, 2, 4, 6)]
    assert layout.groups[0].layers == tuple(range(7)) and layout.stored_groups == ()
    from tailreplay_sglang.families import family_for

    assert family_for(layout).state_window(layout) == WINDOW


def test_the_zyphra_checkpoint_round_trips_to_transformers(model_path, tmp_path):
    """`write_as_hf` inverts the build's renaming: every weight transformers' model holds comes back under its name."""
    from safetensors.torch import load_file

    zaya.write_as_hf(model_path, tmp_path)
    back = load_file(tmp_path / "model.safetensors")
    model = load_reference(model_path)
    state = model.state_dict()
    assert set(back) == set(state)
    assert all(torch.equal(back[n], state[n]) for n in back)


def test_cold_prompts_equal_hf(servers, hf):
    """SGLang's own forward (cache flushed; the plugin only reads it): HF's greedy tokens and prompt log-probs."""
    check_cold_prompts(servers["tr"], hf[0], NEW, LOGPROB_TOL)


def _state_errors(model, dumped: dict, prefix: list[int]) -> dict:
    """Per CCA layer, the rebuilt q || k window and delayed value against transformers' after `prefix`, relative."""
    errors = {}
    for layer, (window, delayed) in zaya.cca_states(model, prefix).items():
        rebuilt_delayed = zaya.delayed_value(model, layer, dumped["conv1"][layer])
        errors[layer] = max(float((dumped["conv"][layer] - window).abs().max() / window.abs().max()),
                            float((rebuilt_delayed - delayed).abs().max() / delayed.abs().max()))
    return errors


@pytest.mark.parametrize("cut", [1, 4, WINDOW, WINDOW + 1, 150, 301])
def test_a_hit_at_any_token_replays_the_window_and_equals_no_cache(servers, hf, dumps, cut):
    """A fork at `cut` tokens of a published 400-token prompt (a token no request or chunk ended at): it reuses every
    matched token, replays min(8, cut) of them from cleared slots, is labelled exact, and equals the server's no-cache
    prefill and HF's greedy tokens; the states it wrote equal HF's after the same prefix in every CCA layer."""
    model, _ = hf
    server = servers["tr"]
    base = random_ids(400, seed=cut)
    fork = base[:cut] + random_ids(10, seed=cut + 1000)
    flush_cache(server.base_url)
    generate(server, base, 1)
    rid = f"dump-zaya-{cut}"
    hit = scored(server, fork, cut, max_new=NEW, rid=rid)
    meta = hit["meta"]
    assert meta["cached_tokens"] == cut and meta["tail_replay_exact"] is True, meta
    assert meta["tail_replay_tokens"] == min(WINDOW, cut) and meta["tail_replay_anchor"] is None, meta
    dumped = dumped_states(dumps, rid)
    assert dumped["conv"].keys() == dumped["conv1"].keys() == {0, 2, 4, 6}
    errors = _state_errors(model, dumped, base[:cut])
    assert max(errors.values()) < STATE_TOL, errors
    assert_exact(hit, no_cache(server, fork, cut, max_new=NEW))
    assert hit["output_ids"] == greedy_generate(model, fork, NEW)


@pytest.mark.parametrize("name", ["tr", "production"])
def test_multi_turn_and_eight_concurrent_hits(servers, hf, name):
    """A second chat turn hits the first turn's prompt and answer (captured at decode); eight requests sharing a
    system prompt hit it at once, each replaying its window in one pass. Each equals HF's greedy tokens (float32
    conv states) or the server's own no-cache run (SGLang's bfloat16 ones), and no pool slot leaks."""
    model, tok = hf
    server = servers[name]

    def reference(ids):
        if name == "tr":
            return greedy_generate(model, ids, NEW)
        flush_cache(server.base_url)
        return generate(server, ids, NEW)["output_ids"]

    check_window_hits(server, tok, NEW, reference)
