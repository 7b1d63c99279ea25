"""Qwen3.5-MoE (`Qwen3_5MoeForCausalLM`, SGLang's own model) on CPU against HF transformers, on one server: its
misses are stock SGLang's forward (fresh prompt: greedy tokens and prompt logprobs), its hits Tail-Replay's."""

import pytest
from transformers import AutoTokenizer

from helpers import generate, start_server
from tailreplay_eval.reference import greedy_generate, load_hf_model, prompt_logprobs

pytestmark = pytest.mark.server

NEW = 12
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")


def test_fresh_prompt_and_tail_replay_hits_match_hf(tiny_qwen35_moe, tmp_path_factory):
    """The paper's mode replaying the whole prefix: a resend, a shared prefix and a mid-prefix fork all hit and
    give HF's no-cache tokens."""
    model, tok = load_hf_model(tiny_qwen35_moe), AutoTokenizer.from_pretrained(tiny_qwen35_moe)
    base = tok(SYSTEM).input_ids
    for srv in start_server(tiny_qwen35_moe, tmp_path_factory, "--enable-tail-replay", "--tail-replay-exact-budget",
                            "0", "--tail-replay-ratio", "1", "--tail-replay-hidden-dtype", "float32"):
        fresh = generate(srv, base, NEW, return_logprob=True, logprob_start_len=0)
        assert fresh["meta_info"]["cached_tokens"] == 0
        assert fresh["output_ids"] == greedy_generate(model, base, NEW)
        served = [lp for lp, _, _ in fresh["meta_info"]["input_token_logprobs"]][1:]
        assert max(abs(a - b) for a, b in zip(served, prompt_logprobs(model, base))) < 1e-3  # as Qwen3.5
        for ids, cached in ((base, len(base) - 1), (base + tok(" why did the sailor leave").input_ids, len(base)),
                            (base[:17] + tok(" another branch").input_ids, 17)):
            out = generate(srv, ids, NEW)
            assert out["meta_info"]["cached_tokens"] == out["meta_info"]["tail_replay_tokens"] == cached
            assert out["output_ids"] == greedy_generate(model, ids, NEW)
