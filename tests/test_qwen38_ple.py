"""Qwen3.8-Flash-Next with per-layer embeddings (PLE; `tailreplay_eval.qwen4exp`; issue 67): stock SGLang on the CPU
route, against HF transformers. Tail-Replay refuses this checkpoint (docs/frontier-plan.md section 3 has the design
that would serve it); these tests are the stock baseline that design will be held to.

A PLE layer (`tiny-qwen3.8-flash-next-ple`: layers 0 and 5, both GDN; transformers allows PLE on linear-attention
layers only) adds `G + silu(conv(norm(G)))` to the streams entering it, G a gated, hashed n-gram embedding of the
token and its two predecessors, the conv depthwise with dilation ngram_size: per request it keeps the conv's last 9
inputs and the last 2 token ids beside its GDN states. The build's conv taps are drawn nonzero (HF and SGLang start
them at zero), so a wrong conv state would show. Served in bfloat16 (SGLang builds the hyper-connection weights and
n-gram tables in bfloat16) on SGLang's GPU-default scheduling (QSA's 64-token pages), as tiny-qwen3.8-flash-next.
"""

import pytest
import torch

from helpers import EXACT_TOL, MODELS_DIR, Spec, generate, scored, start_servers
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import flush_cache
from tailreplay_sglang.layout import HybridLayout

pytestmark = pytest.mark.server

PRESET = "tiny-qwen3.8-flash-next-ple"
PAGE = 64  # SGLang's QSA page: a stock hit covers whole pages
FLOOR = 2e-3  # nats: test_qwen38's floor where HF's bfloat16 run lands on its float32 one
IDS = [(7 * i) % 400 + 20 for i in range(300)]


@pytest.fixture(scope="module")
def model_path():
    return build_model(PRESET, MODELS_DIR / PRESET)


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    yield from start_servers(tmp_path_factory, {"stock": Spec(model_path, ("--enable-cache-report",),
                                                               kwargs={"gpu_scheduling": True})})


@pytest.fixture(scope="module")
def server(servers):
    return servers["stock"]


@pytest.fixture(scope="module")
def hf(model_path):
    return {dtype: load_hf_model(model_path, dtype) for dtype in (torch.float32, torch.bfloat16)}


@torch.no_grad()
def hf_prompt_logprobs(model, ids: list[int]) -> list[float]:
    """Teacher-forced log-probs of ids[1:]. Without a cache: transformers 5.19's PLE layer fails under one
    (`has_previous_state(layer, state_idx=2)`: KeyError), so HF cannot decode this model itself."""
    x = torch.tensor([ids])
    logits = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=False).logits[0, :-1]
    return logits.float().log_softmax(-1).gather(-1, x[0, 1:, None])[:, 0].tolist()


def served_prompt_logprobs(server) -> list[float]:
    flush_cache(server.base_url)
    out = scored(server, IDS, 0, 1)
    assert out["meta"]["cached_tokens"] == 0
    return out["logprobs"][:out["prompt_len"]]


def error(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def test_stock_serves_hfs_prompt_logprobs_within_bfloat16s_own_rounding(server, hf):
    """A 300-token prompt: SGLang's prompt log-probs lie as close to HF's float32 as HF's own bfloat16 run does."""
    reference = hf_prompt_logprobs(hf[torch.float32], IDS)
    rounding = error(hf_prompt_logprobs(hf[torch.bfloat16], IDS), reference)
    served = served_prompt_logprobs(server)
    assert error(served, reference) <= 2 * rounding + FLOOR, (error(served, reference), rounding)


def test_the_match_above_checks_the_ple_conv_and_the_embeddings(server, model_path):
    """The reference misses the served log-probs by far more than the match's bound (HF's bfloat16 rounding, about
    1e-3 here) once its PLE conv is zeroed, and once its whole PLE output is (value projection zeroed), so the match
    above checks both."""
    model = load_hf_model(model_path, torch.float32)
    served = served_prompt_logprobs(server)
    ples = [layer.ple for layer in model.model.language_model.layers if getattr(layer, "ple", None) is not None]
    assert len(ples) == 2
    for ple in ples:
        ple.conv1d.weight.data.zero_()
    without_conv = error(served, hf_prompt_logprobs(model, IDS))
    for ple in ples:
        ple.value_proj.weight.data.zero_()
    without_ple = error(served, hf_prompt_logprobs(model, IDS))
    assert min(without_conv, without_ple) > 0.05, (without_conv, without_ple)


def test_a_stock_hit_on_a_kept_state_carries_the_ple_states(server):
    """A resend of a 600-token prompt hits the state SGLang's extra_buffer kept at its last whole page, the PLE conv
    states and n-gram history copied with the GDN states (`MambaPool.copy_from`'s slot siblings), and answers as the
    no-cache run."""
    ids = [(11 * i) % 450 + 30 for i in range(600)]
    flush_cache(server.base_url)
    first = scored(server, ids, 590, 6)
    again = scored(server, ids, 590, 6)
    assert first["meta"]["cached_tokens"] == 0 and again["meta"]["cached_tokens"] == 9 * PAGE
    assert again["output_ids"] == first["output_ids"]
    assert error(again["logprobs"], first["logprobs"]) < EXACT_TOL
    assert len(generate(server, ids, 2)["output_ids"]) == 2


def test_tail_replay_refuses_this_checkpoint_naming_its_ple_layers(model_path):
    with pytest.raises(ValueError, match=r"per-layer embeddings yet: its PLE layers \(ple_layer_ids \[1, 6\]\)"):
        HybridLayout.from_model_path(str(model_path))
