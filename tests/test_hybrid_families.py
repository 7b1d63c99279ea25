"""The Mamba2, KDA and lightning hybrids served by the real SGLang server on CPU: the model (a cold prefill, a hit from
a kept state) against HF transformers, and Tail-Replay's hits against the server's own no-cache prefill. Every test
runs once per family (a module-scoped parametrized fixture):

- `tiny-nemotron-h` (pattern M-M*-MEM*M-, config.json spelled as NVIDIA ships Nemotron-H): group 0 replays an MLP
  stage between two Mamba2 layers, group 1 starts with an MLP stage and replays a MoE stage (Nemotron-3's: sigmoid
  router with a score-correction bias, routed scale 2.5, a shared expert) between its Mamba2 layers;
- `tiny-nemotron-h-puzzle` (`NemotronHPuzzleForCausalLM`, pattern M-ME*-EM*ME): three MoE stages, each with its own
  expert width and top-k (`block_configs`); transformers has no Puzzle, so its reference is transformers' Nemotron-H
  with each such layer's MoE rebuilt from its own config (`tailreplay_eval.nemotron_puzzle`);
- `tiny-granite-4.0-h` (layer_types mamba / attention as IBM ships Granite-4.0-H): each layer a mixer and a MoE +
  shared MLP, with Granite 4's embedding, residual, attention and logits multipliers;
- `tiny-kimi-linear` (KDA and NoPE MLA layers, linear_attn_config as Moonshot ships Kimi Linear): a dense first
  layer, then Kimi's MoE (sigmoid router with a score-correction bias, routed scale 2.446, a shared expert);
- `tiny-ling-3.0` (Ling-3.0, `BailingMoeV3ForCausalLM`: KDA and gated MLA with RoPE, every 4th layer MLA, config and
  names as Bailing's): transformers has no Ling, so its reference is `tailreplay_eval.ling`'s, transformers' Kimi
  Linear over the same weights with Ling's MLA (output gate, RoPE) in torch;
- `tiny-ling-2.5` (Ling-2.5, `BailingMoeV2_5ForCausalLM`: lightning attention and ungated MLA with RoPE): its
  reference (`tailreplay_eval.ling25`) is the same Kimi Linear body with a torch lightning mixer (float64
  recurrence) in each linear layer. Its interval anchors are the closed form of the fixed-decay state
  (`families.lightning.write_anchor_states`);
- `tiny-jet-nemotron` (Jet-Nemotron, `JetNemotronForCausalLM`: JetBlock, a gated delta rule over values passed
  through a per-token generated conv, and Qwen2 attention, config and names as NVlabs ships them): transformers has
  no Jet-Nemotron, so its reference (`tailreplay_eval.jet_nemotron`) is transformers' Qwen2 with a torch JetBlock in
  each jet layer. Its interval anchors are taken from the token-serial prefill kernel run in rounds
  (`families.jet`); its conv windows in the model's dtype, as the CPU port sets SGLang's conv pool for Jet;
- `tiny-kimi-k3` (Kimi K3's language model, `KimiK3LinearForCausalLM`: tiny-kimi-linear's layers in 12, the MLA
  output-gated, under attention residuals banked every 8 layers): transformers has no K3, so its reference
  (`tailreplay_eval.kimi_k3`) is transformers' Kimi Linear over the same weights with its layer stack run through the
  bank reads (`reference.AttnResidualKimi`). Group 1 starts mid-block and group 2 on a banking layer, so both of the
  stored prefixes (`families.attn_res_kda.prefix_read`) and a row banked by an earlier group's replay are exercised.

All have recurrent memories of 16 to 512 tokens (`models._init_mamba2_gates`, `models._init_kda_gates`) and the
Mamba2 ones unit-gain projections, so a dropped state shows in the log-probs. Stock SGLang 0.5.23 cannot run any of
them on a CPU ("name 'causal_conv1d_fn_triton' is not defined" for Mamba2; KDA's kernels unbound, MLA's fresh
prefill sent where torch_native cannot serve it, the routed-expert scale dropped): the CPU port's `mamba2.py`,
`kda.py` and `moe.py` (`sglang_cpu_compat`) fix that.

The mechanics servers keep an interval anchor every 128 tokens, taken from the chunked prefill's per-chunk states
(`families.mamba2.write_states` on the SSD scan's grid, `write_ssm_states` for KDA): a fork at 300 of a 600-token
prompt (one prefill chunk) replays [256, 300) from the anchor at 256.
"""

import concurrent.futures

import pytest

import helpers

from helpers import (EXACT_MEAN_TOL, EXACT_TOL, MODELS_DIR, Spec, assert_anchored_hit, assert_exact, check_multi_turn,
                     generate, max_error, no_cache, random_ids, scored, start_server, start_servers)
from soak import pool_leaks, wait_idle
from tailreplay_eval.models import build_model, load_tokenizer
from tailreplay_eval.reference import greedy_generate, load_hf_model, load_reference, prompt_logprobs
from tailreplay_eval.server import flush_cache

pytestmark = pytest.mark.server

NEW = 12
# Measured: up to 0.0023 nats between SGLang and HF over 300 tokens in float32 (different summation orders through
# the Mamba2 layers' grouped gated norm); Qwen3.5 gets 1e-3 in tests/test_server.py.
LOGPROB_TOL = 5e-3
MECHANICS = ("--enable-tail-replay", "--tail-replay-fold-tokens", "0", "--tail-replay-anchor-interval", "128",
             "--enable-cache-report", "--dtype", "float32")


FAMILIES = ("tiny-nemotron-h", "tiny-nemotron-h-puzzle", "tiny-granite-4.0-h", "tiny-kimi-linear", "tiny-ling-3.0",
            "tiny-ling-2.5", "tiny-jet-nemotron", "tiny-kimi-k3")
# Models whose GPU-default path is another's here: Nemotron-H Puzzle is tiny-nemotron-h's family and scheduling with
# per-layer MoE sizes, which the anchored server's tests cover (one server start less in CI)
SAME_PRODUCTION_PATH = ("tiny-nemotron-h-puzzle",)


@pytest.fixture(scope="module", params=FAMILIES)
def model_path(request):
    return build_model(request.param, MODELS_DIR / request.param)


@pytest.fixture(scope="module")
def hf(model_path):
    return load_reference(model_path), load_tokenizer(model_path)


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    """Started together, per family: Tail-Replay replaying every span (mechanics); Tail-Replay's defaults on SGLang's
    GPU scheduling (extra_buffer, overlap scheduler). The model itself is checked against HF on the mechanics
    server: a request after /flush_cache is SGLang's own forward (the plugin only reads it), a hit on the state kept
    where a request's prefill ended is what a stock hit is; so is the paper's zero-init tail, which it takes where
    no state lies within the exact budget."""
    specs = {"anchored": Spec(model_path, MECHANICS)}
    if model_path.name not in SAME_PRODUCTION_PATH:
        specs["production"] = Spec(model_path, ("--enable-tail-replay", "--enable-cache-report", "--dtype", "float32"),
                                   kwargs={"gpu_scheduling": True})
    yield from start_servers(tmp_path_factory, specs)


# ---- the model itself, against HF ----

# Stock SGLang's Kimi K3 decode (on the CPU route) differs from its own no-cache prefill of the same tokens by up to
# 0.045 nats (measured on prompts of 5 to 300 tokens, 16 decoded tokens; its prefill equals the reference within 2e-4,
# and Kimi Linear's decode its prefill within 4e-4). Without the attention-residual bank the same model's decode is
# within 1.5e-3 of the reference; the source inside the bank's decode path is not located. So a K3 near-tie is
# judged at that width; its hits are held to the server's own no-cache prefill as every model's are.
K3_DECODE_TIE_TOL = 0.05


def assert_greedy_agrees(model, ids, served):
    """helpers.assert_greedy_agrees at this module's near-tie bound (Kimi K3's decode: K3_DECODE_TIE_TOL)."""
    helpers.assert_greedy_agrees(model, ids, served, K3_DECODE_TIE_TOL if hasattr(model, "k3_stack") else LOGPROB_TOL)


def test_matches_hf_greedy_fresh_and_on_a_hit_where_its_prefill_ended(servers, hf):
    """Fresh prompts (cache flushed: SGLang's forward, the CPU port's Mamba2 / KDA ops), then a hit that starts from
    the state kept where the 300-token prefill ended (as a stock no_buffer hit does) and replays nothing."""
    model, _ = hf
    server = servers["anchored"]
    flush_cache(server.base_url)
    for n, seed in ((5, 1), (70, 2), (300, 3)):  # within one 64-token chunk, across chunks, across several
        ids = random_ids(n, seed)
        out = generate(server, ids, NEW)
        assert out["meta_info"]["cached_tokens"] == 0
        assert_greedy_agrees(model, ids, out["output_ids"])
    longer = ids + random_ids(40, 4)
    out = generate(server, longer, NEW)
    meta = out["meta_info"]
    assert meta["cached_tokens"] >= 300 and meta["tail_replay_exact"] is True
    assert meta["tail_replay_anchor"] == meta["cached_tokens"] and meta["tail_replay_tokens"] == 0, meta
    assert_greedy_agrees(model, longer, out["output_ids"])


def test_prompt_logprobs_match_hf(servers, hf):
    model, _ = hf
    ids = random_ids(200, 5)
    flush_cache(servers["anchored"].base_url)
    out = generate(servers["anchored"], ids, 1, return_logprob=True, logprob_start_len=0)
    assert out["meta_info"]["cached_tokens"] == 0
    reference = prompt_logprobs(model, ids)
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    assert len(served) == len(reference)
    assert max(abs(a - b) for a, b in zip(served, reference)) < LOGPROB_TOL


@pytest.fixture(scope="module")
def falcon_stock(tiny_falcon_h1, tmp_path_factory):
    """Falcon-H1 (attention beside Mamba2 in every layer): served by stock SGLang with the CPU Mamba2 ops; Tail-Replay
    refuses it (tests/test_layout.py)."""
    yield from start_server(tiny_falcon_h1, tmp_path_factory, "--dtype", "float32")


def test_stock_falcon_h1_matches_hf_greedy(falcon_stock, tiny_falcon_h1):
    model = load_hf_model(tiny_falcon_h1)
    for n, seed in ((5, 1), (300, 3)):
        ids = random_ids(n, seed)
        assert generate(falcon_stock, ids, NEW)["output_ids"] == greedy_generate(model, ids, NEW)


# ---- Tail-Replay: hits replayed through the Mamba2 and MLP stages ----

def test_resend_starts_at_the_finish_anchor_and_equals_no_cache(servers):
    server = servers["anchored"]
    flush_cache(server.base_url)
    prompt = random_ids(600, seed=11)
    answer = generate(server, prompt, 8)["output_ids"]
    kept = len(prompt) + len(answer) - 1
    ids = prompt + answer + random_ids(12, seed=12)
    hit = scored(server, ids, kept)
    assert hit["meta"]["cached_tokens"] == kept == hit["meta"]["tail_replay_anchor"]
    assert hit["meta"]["tail_replay_tokens"] == 0 and hit["meta"]["tail_replay_exact"] is True
    assert_exact(hit, no_cache(server, ids, kept))


@pytest.mark.parametrize("fork,anchor", [(100, 0), (300, 256), (560, 512)])
def test_fork_replays_from_the_nearest_interval_anchor_and_equals_no_cache(servers, hf, fork, anchor):
    """A fork mid-prefix: the nearest kept state is the interval anchor below it (the root's zero state before the
    first); the replay runs the Mamba2 (and MLP) stages from there and equals the server's no-cache prefill and HF."""
    server, (model, _) = servers["anchored"], hf
    flush_cache(server.base_url)
    prompt = random_ids(600, seed=21)
    generate(server, prompt, 1)
    ids = prompt[:fork] + random_ids(40, seed=fork)
    hit = scored(server, ids, fork)
    assert_anchored_hit(hit["meta"], fork, fold=0)
    assert hit["meta"]["tail_replay_anchor"] == anchor
    assert_exact(hit, no_cache(server, ids, fork))
    assert_greedy_agrees(model, ids, generate(server, ids, NEW)["output_ids"])


def test_zero_init_tail_is_approximate_and_anchored_replay_is_not(servers):
    """The same fork, 190 tokens into a decoded answer, twice. First with only the prompt prefilled: interval
    anchors are taken in prefills, so the nearest kept state is where the prompt's prefill ended, further back than
    the exact budget (max(64, 128)), and the hit takes the paper's 64-token zero-init tail. It says it is
    approximate and misses by more than the exact tolerance, so the exact checks above can fail. Then with the whole
    text prefilled: the hit replays from the interval anchor at 384, exactly."""
    server = servers["anchored"]
    flush_cache(server.base_url)
    prompt, fork = random_ids(300, seed=31), 490
    text = prompt + generate(server, prompt, 200)["output_ids"]
    ids = text[:fork] + random_ids(40, seed=32)
    hits = {"zero-init tail": scored(server, ids, fork)}
    flush_cache(server.base_url)
    generate(server, text, 1)
    hits["anchored"] = scored(server, ids, fork)
    reference = no_cache(server, ids, fork)
    for name, anchor in (("zero-init tail", None), ("anchored", 384)):
        meta = hits[name]["meta"]
        assert meta["cached_tokens"] == fork and meta["tail_replay_anchor"] == anchor, (name, meta)
        assert meta["tail_replay_exact"] is (anchor is not None), (name, meta)
    errors = {name: max_error(hit, reference) for name, hit in hits.items()}
    assert errors["anchored"] < EXACT_TOL < errors["zero-init tail"], errors


def test_multi_turn_and_eight_concurrent_hits(servers, hf):
    """Eight hits on one cached system prompt, sent at once (replayed together from its interval anchor): each is
    exact, its first token is HF's greedy one (or, at a near-tie, its runner-up) and its suffix's and output's
    log-probs (teacher-forced) equal the server's own no-cache prefill's within the suite's exactness bound
    (`assert_exact`). Whole greedy continuations are not compared: near-ties flip them (seen: the third token of one
    of the eight, after 1e-4 nats of difference)."""
    server, (model, tok) = servers["anchored"], hf
    check_multi_turn(server, model, tok, "the old sailor carried the wooden boxes near the harbour", NEW)
    system = random_ids(400, seed=41)
    generate(server, system, 1)
    prompts = [system + random_ids(10 + i, seed=50 + i) for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: scored(server, p, len(system), 1), prompts))
    for ids, out in zip(prompts, outs):
        assert out["meta"]["cached_tokens"] >= len(system) and out["meta"]["tail_replay_exact"] is True
        assert_greedy_agrees(model, ids, out["output_ids"])  # tiny-ling-3.0: one of the eight is a 2e-4-nat tie
    assert pool_leaks(wait_idle(server.base_url)) == []
    for ids, out in zip(prompts, outs):
        assert_exact(out, no_cache(server, ids, len(system), max_new=1))


# ---- SGLang's GPU default path: extra_buffer with the overlap scheduler, Tail-Replay's defaults ----

def assert_decoded_hit_exact(model_path, hit, reference):
    """`assert_exact` for a hit whose state was tracked while its answer was decoded. On Kimi K3 that state carries
    stock's decode difference (K3_DECODE_TIE_TOL): stock SGLang's own extra_buffer hit on the first turn below misses
    its no-cache prefill by 0.0244 nats (mean 0.0023), and Tail-Replay's by the same (measured side by side); the mean
    bound stays the suite's."""
    if model_path.name != "tiny-kimi-k3":
        return assert_exact(hit, reference)
    n = reference["prompt_len"]  # the prompt's tokens: the greedy outputs are decoded and may part at K3's width
    diffs = [abs(x - y) for x, y in zip(hit["logprobs"][:n], reference["logprobs"][:n])]
    assert hit["prompt_len"] == n and max(diffs) < K3_DECODE_TIE_TOL and sum(diffs) / n < EXACT_MEAN_TOL, diffs


def test_production_path_chat_turns_and_forks_are_exact(model_path, servers):
    """Track states every 64 tokens; a hit within 64 tokens of one folds into the extend, a farther one replays
    from it. Each equals the server's own no-cache prefill."""
    if "production" not in servers:
        pytest.skip("the same GPU-default path as tiny-nemotron-h (SAME_PRODUCTION_PATH)")
    server = servers["production"]
    flush_cache(server.base_url)
    turn = random_ids(300, seed=61)
    for i in range(3):  # chat turns: the previous turn, its answer and a new question
        answer = generate(server, turn, 8)["output_ids"]
        turn = turn + answer + random_ids(30, seed=62 + i)
        matched = len(turn) - 30 - 1
        hit = scored(server, turn, matched)
        assert_anchored_hit(hit["meta"], matched)  # a hit, not a miss (which reports exact too)
        assert hit["meta"]["cached_tokens"] > 0
        assert_decoded_hit_exact(model_path, hit, no_cache(server, turn, matched))
        generate(server, turn, 1)  # back in the tree for the next turn
    doc = random_ids(500, seed=71)
    generate(server, doc, 1)
    ids = doc[:450] + random_ids(20, seed=72)
    hit = scored(server, ids, 450)
    assert_anchored_hit(hit["meta"], 450)
    assert_exact(hit, no_cache(server, ids, 450))


def reference_error(server, model):
    """A function giving the largest difference between the served no-cache log-probs of a 200-token prompt and
    the reference's, as the reference is at the time of the call."""
    ids = random_ids(200, 5)
    flush_cache(server.base_url)
    out = generate(server, ids, 1, return_logprob=True, logprob_start_len=0)
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    return lambda: max(abs(a - b) for a, b in zip(served, prompt_logprobs(model, ids)))


def test_ling_reference_checks_what_ling_adds_to_kimi_linear(model_path, servers, hf):
    """Ling-3.0 only (transformers has no Ling): the reference the tests above hold the server to misses the served
    log-probs by more than LOGPROB_TOL once any of Ling's three differences from Kimi Linear is taken out of it
    (the MLA output gate, the MLA RoPE, BailingKDA's norm eps), so the matches above check each of them."""
    if model_path.name != "tiny-ling-3.0":
        pytest.skip("Ling-3.0's reference only")
    model, _ = hf
    error = reference_error(servers["anchored"], model)
    attention = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "g_proj")]
    norms = [layer.self_attn.o_norm for layer in model.model.layers if hasattr(layer.self_attn, "o_norm")]

    def without(flag: str) -> float:
        for mla in attention:
            setattr(mla, flag, False)
        try:
            return error()
        finally:
            for mla in attention:
                setattr(mla, flag, True)

    assert error() < LOGPROB_TOL
    misses = {"no output gate": without("gated"), "no RoPE": without("rotated")}
    for norm in norms:
        norm.variance_epsilon = model.config.rms_norm_eps
    try:
        misses["Kimi's KDA norm eps"] = error()
    finally:
        for norm in norms:
            norm.variance_epsilon = 1e-6
    assert error() < LOGPROB_TOL
    assert min(misses.values()) > LOGPROB_TOL, misses


def test_k3_reference_checks_what_k3_adds_to_kimi_linear(model_path, servers, hf):
    """Kimi K3 only (transformers has no K3): the reference misses the served log-probs by more than LOGPROB_TOL
    once either of K3's differences from Kimi Linear is taken out of it (the attention-residual bank, the MLA output
    gate), so the matches above check both."""
    if model_path.name != "tiny-kimi-k3":
        pytest.skip("Kimi K3's reference only")
    model, _ = hf
    error = reference_error(servers["anchored"], model)
    gated = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "g_proj")]
    assert error() < LOGPROB_TOL
    model.k3_stack.mixing = False
    misses = {"Kimi Linear's residual stream": error()}
    model.k3_stack.mixing = True
    for mla in gated:
        mla.gated = False
    misses["no output gate"] = error()
    for mla in gated:
        mla.gated = True
    assert error() < LOGPROB_TOL
    assert min(misses.values()) > LOGPROB_TOL, misses


def test_ling25_reference_checks_what_lightning_attention_does(model_path, servers, hf):
    """Ling-2.5 only (transformers has no Ling): the reference's lightning mixer misses the served log-probs by more
    than LOGPROB_TOL once any of its parts is simplified (no RoPE on q and k, no per-head q/k norm, one norm group
    instead of `group_norm_size`, one decay per head for every layer instead of SGLang's layerwise factor), so the
    matches above check each of them."""
    if model_path.name != "tiny-ling-2.5":
        pytest.skip("Ling-2.5's reference only")
    model, _ = hf
    error = reference_error(servers["anchored"], model)
    mixers = [layer.self_attn for layer in model.model.layers if hasattr(layer.self_attn, "slope")]

    assert error() < LOGPROB_TOL
    for flag in ("rotated", "qk_normed", "grouped"):
        for mixer in mixers:
            setattr(mixer, flag, False)
        assert error() > LOGPROB_TOL, flag
        for mixer in mixers:
            setattr(mixer, flag, True)
    slopes = [mixer.slope for mixer in mixers]
    for mixer in mixers:  # layer 0's rates (its layerwise factor is 1) everywhere
        mixer.slope = slopes[0]
    assert error() > LOGPROB_TOL, "layerwise decay"
    for mixer, slope in zip(mixers, slopes):
        mixer.slope = slope


def test_puzzle_reference_checks_each_layers_own_block(model_path, servers, hf):
    """Nemotron-H Puzzle only (transformers has no Puzzle class): the reference misses the served log-probs by more
    than LOGPROB_TOL once any MoE layer routes with the base config's top-k instead of its own block's, so the
    matches above check that SGLang built every layer from its own block (its sizes alone could not load otherwise)."""
    if model_path.name != "tiny-nemotron-h-puzzle":
        pytest.skip("Nemotron-H Puzzle's reference only")
    model, _ = hf
    error = reference_error(servers["anchored"], model)
    assert error() < LOGPROB_TOL
    for layer in model.model.layers:
        gate = getattr(layer.mixer, "gate", None)
        if gate is None or gate.top_k == model.config.num_experts_per_tok:
            continue
        own, gate.top_k = gate.top_k, model.config.num_experts_per_tok
        try:
            assert error() > LOGPROB_TOL, f"top-k {own} taken as {gate.top_k}"
        finally:
            gate.top_k = own
