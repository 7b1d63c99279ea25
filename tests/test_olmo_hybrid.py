"""OLMo-Hybrid (`tailreplay_sglang.models`) served by the real SGLang server on CPU, against HF transformers.

The checkpoint is `tiny-olmo-hybrid`: beta = 2 sigmoid(b) (negative eigenvalues), post-norm attention layers,
pre-norm GDN layers, norm weights drawn around 1 (so a norm applied in the wrong place changes the outputs).
"""

import concurrent.futures

import pytest
from transformers import AutoTokenizer

from conftest import generate as shared_generate
from conftest import start_server
from tailreplay_sglang.eval.reference import greedy_generate, load_hf_model, prompt_logprobs

pytestmark = pytest.mark.server

NEW = 12
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")
LOGPROB_TOL = 1e-3  # what tests/test_server.py asks of Qwen3.5


@pytest.fixture(scope="module")
def hf(tiny_olmo_hybrid):
    return load_hf_model(tiny_olmo_hybrid), AutoTokenizer.from_pretrained(tiny_olmo_hybrid)


def generate(server, ids, max_new_tokens=NEW, **extra):
    return shared_generate(server, ids, max_new_tokens, **extra)


def max_logprob_error(out, model, ids, start=0) -> float:
    reference = prompt_logprobs(model, ids)  # reference[i] = log p(ids[i + 1] | ids[:i + 1])
    served = [(pos, lp) for pos, (lp, _, _) in enumerate(out["meta_info"]["input_token_logprobs"], start)
              if lp is not None and pos > 0]
    assert len(served) >= min(5, len(ids) - start - 1)
    return max(abs(lp - reference[pos - 1]) for pos, lp in served)


# ---- stock SGLang (no Tail-Replay): the model itself ----

@pytest.fixture(scope="module")
def stock(tiny_olmo_hybrid, tmp_path_factory):
    yield from start_server(tiny_olmo_hybrid, tmp_path_factory)


def test_hf_reference_uses_negative_eigenvalues(hf):
    model, _ = hf
    assert model.config.linear_allow_neg_eigval
    assert model.model.layers[0].linear_attn.allow_neg_eigval


def test_stock_fresh_prompt_matches_hf_greedy(stock, hf):
    model, tok = hf
    ids = tok(SYSTEM + " what happened first?").input_ids
    out = generate(stock, ids)
    assert out["meta_info"]["cached_tokens"] == 0
    assert out["output_ids"] == greedy_generate(model, ids, NEW)


def test_stock_prefix_cache_hit_matches_hf_greedy(stock, hf):
    model, tok = hf
    base = tok(SYSTEM).input_ids
    generate(stock, base, max_new_tokens=2)
    extended = base + tok(" who repaired the window?").input_ids
    out = generate(stock, extended)
    assert out["meta_info"]["cached_tokens"] >= len(base) - 1  # stock no_buffer hits at the inserted end
    assert out["output_ids"] == greedy_generate(model, extended, NEW)


def test_stock_prompt_logprobs_match_hf(stock, hf):
    model, tok = hf
    ids = tok(SYSTEM + " runs into the forest").input_ids
    out = generate(stock, ids, max_new_tokens=1, return_logprob=True, logprob_start_len=0)
    assert max_logprob_error(out, model, ids) < LOGPROB_TOL
