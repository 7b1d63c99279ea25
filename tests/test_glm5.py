"""GLM-5.3-Flash (`Glm5NextForConditionalGeneration`, `tailreplay_eval.glm5`; issue 67): KDA and DSA-indexed MLA
layers under 4 mHC streams, a dense first layer then MoE, a vision tower; served by stock SGLang on the CPU route and
with Tail-Replay (`families.mhc_kda`).

Stock first. The CPU port (`sglang_cpu_compat.glm5`) answers the launcher's capability calls, keeps the KV pool in
the served dtype, runs the clamped SwiGLU of the dense MLP and shared expert in torch, clamps the routed experts'
too without scaling them twice, and gives the DSA indexer no CPU forward: attention is dense, which is what GLM
computes up to `index_topk` (2048) tokens, so every prompt here is under it. SGLang's DSA page is 64 x index_kpool
tokens (128 here), which only its GPU-default scheduling (extra_buffer) allows. Against HF transformers in float32 on
the same weights: greedy tokens (up to a near-tie) and prompt log-probs.

Tail-Replay stores all 4 streams of each group's input (group 0's too: a vision-language checkpoint), read where
SGLang's attention boundary keeps them. Hits are checked against the server's own no-cache prefill: anchored (256-token
prefill chunks, so a fork replays a 128-token page from the chunk-end anchor below it) and paper (the whole prefix
from cleared states), chat turns on the anchored server, and a hit through an image on both; with the checkpoint's
MTP layer as the NEXTN draft (a third server), the target's tokens and exact forks. Images are not
compared with HF: the served log-probs of a 64-row image's rows differ from HF's float32 by up to 0.79 nats and the
text after it by 0.027, greedy tokens equal (measured 2026-12-07, cause not located).
"""

import pytest
import torch
from transformers import AutoProcessor

from helpers import (EXACT_FLAGS, MODELS_DIR, assert_anchored_hit, assert_drafted_as_plain, assert_exact,
                     assert_greedy_agrees, generate, image, no_cache, paged_fork, random_ids, scored,
                     start_gpu_scheduled, with_images)
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model, prompt_logprobs
from tailreplay_eval.server import ServerProcess, flush_cache

pytestmark = pytest.mark.server

PRESET = "tiny-glm-5.3-flash"
NEW = 8
PAGE = 128  # SGLang's DSA page: 64 x index_kpool tokens; a hit covers whole pages
CHUNK = 256  # the anchored server's prefill chunk: its anchors lie every other page
# Measured 2026-12-07: SGLang's float32 prompt log-probs within 2.5e-4, 5.8e-4 and 1.3e-3 nats of HF's float32 on
# prompts of 5, 70 and 300 tokens; greedy tokens equal. The bound of the other families' tests (test_hybrid_families).
LOGPROB_TOL = 5e-3
TIE = 5e-3  # nats: a near-tie where float rounding may pick either of the top two
ANCHORED = ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
            "--tail-replay-fold-tokens", "0")
# The checkpoint's MTP layer as SGLang's NEXTN draft (Glm5NextForConditionalGenerationNextN): SGLang's recipe of 3
# steps, top-1, 4 draft tokens. SGLang's start-up memory check counts what the servers starting beside it take against
# --mem-fraction-static (test_speculative).
NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4", "--mem-fraction-static", "0.5")
SERVERS = {"anchored": ANCHORED, "paper": EXACT_FLAGS, "nextn": ANCHORED + NEXTN}


@pytest.fixture(scope="module")
def model_path():
    return build_model(PRESET, MODELS_DIR / PRESET)


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    yield from start_gpu_scheduled(tmp_path_factory, model_path, SERVERS)


@pytest.fixture(scope="module")
def hf(model_path):
    return load_hf_model(model_path, torch.float32)


@pytest.mark.parametrize("n, seed", [(5, 1), (70, 2), (300, 3)])
def test_stock_serves_hfs_greedy_tokens_and_prompt_logprobs(servers, hf, n, seed):
    """SGLang's own forward (cache flushed; the plugin only reads it) on fresh prompts within one page, across
    pages and across the anchored server's chunks."""
    server, ids = servers["anchored"], random_ids(n, seed)
    flush_cache(server.base_url)
    out = generate(server, ids, NEW, return_logprob=True, logprob_start_len=0)
    assert out["meta_info"]["cached_tokens"] == 0
    assert_greedy_agrees(hf, ids, out["output_ids"], TIE)
    served = [lp for lp, _, _ in out["meta_info"]["input_token_logprobs"][1:]]
    assert max(abs(a - b) for a, b in zip(served, prompt_logprobs(hf, ids))) < LOGPROB_TOL


BASE = random_ids(700, seed=11)


@pytest.mark.parametrize("cut", [200, 450, 650])
@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_fork_replays_every_stream_and_equals_no_cache(servers, name, cut):
    """A 700-token request, then a fork at `cut`: the hit (whole 128-token pages) replays, from the chunk-end anchor
    below it or from cleared states, through both KDA groups from their stored 4-stream rows, and equals no cache.
    At 650 the anchored server's match (640) is where the 700-token prefill ended, whose state SGLang's extra_buffer
    kept (its last whole page): the stock hit, with nothing to replay."""
    meta = fork(servers[name], cut, NEW)["meta"]
    anchored = {200: 128, 450: 128, 650: 0}[cut]
    assert meta["tail_replay_tokens"] == (meta["cached_tokens"] if name == "paper" else anchored)


def fork(server, cut: int, new: int) -> dict:
    return paged_fork(server, BASE, cut, random_ids(40, seed=12), new, PAGE)


def test_chat_turns_hit_their_history_and_equal_no_cache(servers):
    """Three chat turns (the previous turn, its decoded answer, a new question): each hit reuses the history's
    whole pages, replays from the anchor below them, and equals the server's own no-cache prefill."""
    server = servers["anchored"]
    flush_cache(server.base_url)
    turn = random_ids(300, seed=21)
    for i in range(3):
        turn = turn + generate(server, turn, 12)["output_ids"] + random_ids(30, seed=22 + i)
        matched = len(turn) - 31
        hit = scored(server, turn, matched, NEW)
        assert_anchored_hit(hit["meta"], matched // PAGE * PAGE, fold=0)
        assert hit["meta"]["cached_tokens"] == matched // PAGE * PAGE
        assert_exact(hit, no_cache(server, turn, matched, NEW))


def prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_hit_through_an_image_replays_its_stored_rows_and_equals_no_cache(servers, model_path, name):
    """Group 0's input is stored on this vision-language checkpoint (the embeddings with the tower's features in the
    image's 64 rows, expanded into 4 streams): a second question about the same image, parting from the first within
    the second page, replays the first page, image rows included, from cleared states (no anchor lies below it), and
    equals no cache."""
    server, picture = servers[name], image(seed=3)
    head = "<|begin_of_image|><|image|><|end_of_image|>" + " word" * 30  # 3 tokens a word here
    first, again = prompt(head + " word" * 40 + " Describe it."), prompt(head + " colour" * 40 + " What is it?")
    processor = AutoProcessor.from_pretrained(model_path)
    a, b = (processor(text=t, images=[picture], return_tensors="pt")["input_ids"][0].tolist() for t in (first, again))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert PAGE < shared < 2 * PAGE and a.index(processor.tokenizer.convert_tokens_to_ids("<|image|>")) < PAGE
    flush_cache(server.base_url)
    generate(server, first, 2, **with_images(picture))
    hit = scored(server, again, shared, NEW, **with_images(picture))
    assert hit["meta"]["cached_tokens"] == PAGE and hit["meta"]["tail_replay_tokens"] == PAGE
    assert_exact(hit, no_cache(server, again, shared, NEW, **with_images(picture)))


SPEC_NEW = 24  # verify steps enough for drafts accepted and rejected both


def test_speculative_decoding_gives_the_targets_tokens(servers):
    """NEXTN with GLM's MTP layer (a plain-residual DeepSeek layer reading the contracted streams) on a cold
    700-token request: the target's tokens, as the anchored server decodes them without a draft."""
    assert_drafted_as_plain(servers["anchored"], servers["nextn"], BASE, 690, SPEC_NEW)


@pytest.mark.parametrize("cut", [200, 450])
def test_a_fork_under_speculative_decoding_replays_and_equals_no_cache(servers, cut):
    """With the MTP draft, a fork's hit replays the page above the chunk-end anchor below its match through both
    groups' 4 stored streams, and the verify steps that follow (the draft's KV for the matched tokens read from the
    cache, the target's states from the replay) give what the server gives without a cache."""
    meta = fork(servers["nextn"], cut, SPEC_NEW)["meta"]
    assert meta["tail_replay_tokens"] == PAGE and meta["spec_verify_ct"] > 0


def test_a_server_of_this_checkpoint_takes_sglangs_paged_scheduling(model_path):
    """DSA forces 128-token pages here, which SGLang's no_buffer strategy refuses: a server of this checkpoint (a
    test's, a benchmark's, `make demo`'s script with `--model-path`) runs SGLang's GPU default instead."""
    command = ServerProcess(str(model_path), port=1).command()
    assert "no_buffer" not in command and "--disable-overlap-schedule" not in command
