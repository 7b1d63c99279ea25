"""Qwen3.8-Flash-Next (`Qwen4ExpForConditionalGeneration`, `tailreplay_eval.qwen4exp`; issue 67): GDN and QSA
sparse-attention layers under 4 hyper-connection streams, MoE, a vision tower; served by stock SGLang on the CPU
route and with Tail-Replay (`families.hyper_gdn`).

Stock first. The CPU port supplies the QSA indexer's forward and its compressed-key gather (`sglang_cpu_compat.qsa`).
SGLang builds the hyper-connection weights in bfloat16, so the model is served in bfloat16, with SGLang's GPU-default
scheduling (its QSA needs 64-token pages, which only extra_buffer allows). Against HF transformers in float32 on the
same weights, served log-probs must lie as close as HF's own bfloat16 run does (the rounding of bfloat16 arithmetic,
measured per prompt here, not a fixed tolerance), and a hit on a state SGLang kept (what a stock hit is) must answer
as the no-cache run. Images are not compared with HF: on a 64-row image the served log-probs of the image rows
differ from HF's float32 ones by up to 0.19 nats and the text after it by 0.039 (HF's own bfloat16 run: 0.0034;
measured 2026-12-06, cause not located: transformers' Qwen4-Exp tower uses an axial 2-D RoPE, SGLang's is
Qwen3-VL's class).

Tail-Replay stores all 4 streams of each group's input (group 0's too: a vision-language checkpoint), and its hits
are checked against the server's own no-cache prefill: anchored (128-token prefill chunks, so a fork replays from a
chunk-end anchor) and paper (the whole prefix from cleared states), through text and through an image. Measured on
2026-12-06: every hit bit-equal to no cache (0.0 nats), greedy included; with one stream of the stored input zeroed
(mutant `hyper-one-stream`) the greedy outputs part at output 1.
"""

import pytest
import torch
from transformers import AutoProcessor

from helpers import (EXACT_FLAGS, EXACT_TOL, MODELS_DIR, assert_drafted_as_plain, assert_exact, generate, image,
                     no_cache, paged_fork, scored, start_gpu_scheduled, with_images)
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import ServerProcess, cpu_serving_dtype, flush_cache

pytestmark = pytest.mark.server

PRESET = "tiny-qwen3.8-flash-next"
NEW = 6
PAGE = 64  # SGLang's page for QSA: a stock hit covers whole pages
FLOOR = 2e-3  # nats: where HF's bfloat16 run happens to land on float32's, the served one may still differ this much


def prompt(content: str) -> str:
    return f"<|im_start|>user\n{content}<|im_end|>\n<|im_start|>assistant\n"


TEXTS = [prompt("Tell me about the weather over the hills and the rivers in the valley below, and then what "
                "the farmers said about it."), prompt("Count the words: one two three four five six.")]


@pytest.fixture(scope="module")
def model_path():
    return build_model(PRESET, MODELS_DIR / PRESET)


CHUNK = 128  # the anchored server's prefill chunk: a fork finds a chunk-end anchor below its match
ANCHORED = ("--enable-tail-replay", "--enable-cache-report", "--chunked-prefill-size", str(CHUNK),
            "--tail-replay-fold-tokens", "0")
# The checkpoint's MTP head as SGLang's NEXTN draft. Under QSA a verify may score at most `indexer_compress_ratio`
# tokens (SGLang: "the pending index-key ring holds one group"), 2 here: one draft step. SGLang's start-up memory check
# counts what the servers starting beside it take against --mem-fraction-static (test_speculative).
NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "1", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "2", "--mem-fraction-static", "0.5")
SERVERS = {
    "anchored": ANCHORED,
    "paper": EXACT_FLAGS,
    "nextn": ANCHORED + NEXTN,
}


@pytest.fixture(scope="module")
def servers(model_path, tmp_path_factory):
    yield from start_gpu_scheduled(tmp_path_factory, model_path, SERVERS)


@pytest.fixture(scope="module")
def server(servers):
    """The model itself is checked on the anchored server: a request after /flush_cache is SGLang's own forward (the
    plugin only reads it), and a hit on the state kept where a request's prefill ended is what a stock hit is."""
    return servers["anchored"]


@pytest.fixture(scope="module")
def hf(model_path):
    return ({dtype: load_hf_model(model_path, dtype) for dtype in (torch.float32, torch.bfloat16)},
            AutoProcessor.from_pretrained(model_path))


@torch.no_grad()
def hf_logprobs(model, inputs, output_ids: list[int]) -> list[float]:
    """Teacher-forced log-probs of `output_ids` after the prompt `inputs`."""
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([output_ids])], dim=1)
    full = dict(inputs, input_ids=ids, attention_mask=torch.ones_like(ids))
    if "mm_token_type_ids" in inputs:  # which tokens are image rows: none generated
        types = inputs["mm_token_type_ids"]
        full["mm_token_type_ids"] = torch.cat([types, types.new_zeros(1, len(output_ids))], dim=1)
    logits = model(**full).logits[0, n - 1:-1]
    return logits.float().log_softmax(-1).gather(-1, torch.tensor(output_ids)[:, None])[:, 0].tolist()


@pytest.mark.parametrize("text", range(len(TEXTS)))
def test_text_is_served_as_hf_serves_it_within_bfloat16s_own_rounding(server, hf, text):
    models, processor = hf
    inputs = processor(text=TEXTS[text], return_tensors="pt")
    flush_cache(server.base_url)
    n = inputs["input_ids"].shape[1]
    served = scored(server, inputs["input_ids"][0].tolist(), n - 1, NEW)
    outputs = served["output_ids"]
    reference = hf_logprobs(models[torch.float32], inputs, outputs)
    rounding = max(abs(a - b) for a, b in zip(hf_logprobs(models[torch.bfloat16], inputs, outputs), reference))
    error = max(abs(a - b) for a, b in zip(served["logprobs"][served["prompt_len"]:], reference))
    assert error <= 2 * rounding + FLOOR, (error, rounding)


def test_a_hit_on_a_kept_state_reuses_whole_pages_and_answers_as_no_cache(server):
    """A hit on the state SGLang's extra_buffer kept where a request's prefill ended (its last whole 64-token QSA
    page), as stock's hit: a resend of a 600-token prompt reuses 576 tokens, replays none and answers as the
    no-cache run, greedy and log-probs (a stock hit's own error, under EXACT_TOL)."""
    ids = [(7 * i) % 400 + 20 for i in range(600)]
    flush_cache(server.base_url)
    first = scored(server, ids, 590, NEW)
    again = scored(server, ids, 590, NEW)
    assert first["meta"]["cached_tokens"] == 0 and again["meta"]["cached_tokens"] == 9 * PAGE
    assert again["meta"]["tail_replay_tokens"] == 0
    assert again["output_ids"] == first["output_ids"]
    assert max(abs(a - b) for a, b in zip(again["logprobs"], first["logprobs"])) < EXACT_TOL
    assert len(generate(server, ids, 2)["output_ids"]) == 2


BASE = [(11 * i) % 450 + 30 for i in range(700)]


@pytest.mark.parametrize("cut", [200, 300, 650])
@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_fork_replays_every_stream_and_equals_no_cache(servers, name, cut):
    """A 700-token request, then a fork at `cut`: the hit (whole 64-token pages) replays, from an anchor or from
    cleared states, through both groups (group 1 from its stored 4-stream rows), and equals no cache."""
    hit = fork(servers[name], cut, NEW)
    meta = hit["meta"]
    assert meta["tail_replay_tokens"] == (meta["cached_tokens"] if name == "paper" else meta["cached_tokens"] % CHUNK)


def fork(server, cut: int, new: int) -> dict:
    return paged_fork(server, BASE, cut, [(5 * i) % 300 + 40 for i in range(40)], new, PAGE)


SPEC_NEW = 24  # enough verify steps to commit drafts both accepted and rejected


def test_speculative_decoding_gives_the_targets_tokens(servers):
    """NEXTN with the MTP head on a cold 700-token request: the draft runs (verify steps counted) and the outputs
    are the target's own, as the same target decodes them without a draft (the anchored server)."""
    assert_drafted_as_plain(servers["anchored"], servers["nextn"], BASE, 690, SPEC_NEW)


@pytest.mark.parametrize("cut", [200, 450])
def test_a_fork_under_speculative_decoding_replays_and_equals_no_cache(servers, cut):
    """With the MTP draft, a fork's hit replays from the chunk-end anchor below its page-aligned match through both
    groups, and the verify steps that follow (the draft's KV for the matched tokens read from the cache, the
    target's states from the replay) give what the server gives without a cache."""
    meta = fork(servers["nextn"], cut, SPEC_NEW)["meta"]
    assert meta["tail_replay_tokens"] == meta["cached_tokens"] % CHUNK > 0 and meta["spec_verify_ct"] > 0


@pytest.mark.parametrize("name", ["anchored", "paper"])
def test_a_hit_through_an_image_replays_its_stored_rows_and_equals_no_cache(servers, model_path, name):
    """Group 0's input is stored on this vision-language checkpoint (the embeddings with the tower's features in the
    image rows, widened into 4 copies): a second question about the same image, parting from the first before the
    first request's own last state (stock's extra_buffer keeps one at its last whole page), replays from an anchor
    (anchored) or over the image from cleared states (paper), and equals no cache."""
    server, picture = servers[name], image(seed=3)
    head = "<|vision_start|><|image_pad|><|vision_end|>" + " word" * 220
    first, again = prompt(head + " word" * 40 + " Describe it."), prompt(head + " colour" * 40 + " What is it?")
    processor = AutoProcessor.from_pretrained(model_path)
    a, b = (processor(text=t, images=[picture], return_tensors="pt")["input_ids"][0].tolist() for t in (first, again))
    shared = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
    assert shared // PAGE * PAGE % CHUNK  # a match between two chunk-end anchors
    flush_cache(server.base_url)
    generate(server, first, 2, **with_images(picture))
    hit = scored(server, again, shared, NEW, **with_images(picture))
    assert hit["meta"]["cached_tokens"] == shared // PAGE * PAGE and hit["meta"]["tail_replay_tokens"] > 0
    assert_exact(hit, no_cache(server, again, shared, NEW, **with_images(picture)))


def test_a_server_of_this_checkpoint_takes_sglangs_paged_scheduling(model_path):
    """QSA forces 64-token pages, which SGLang's no_buffer strategy refuses at start-up: a server of this checkpoint
    (a test's, a benchmark's, `make demo`'s script with `--model-path`) runs SGLang's GPU default instead, and the
    demo's script serves it in bfloat16 (SGLang builds its hyper-connections in bfloat16)."""
    command = ServerProcess(str(model_path), port=1).command()
    assert "no_buffer" not in command and "--disable-overlap-schedule" not in command
    assert "no_buffer" in ServerProcess(str(MODELS_DIR / "tiny-qwen35"), port=1).command()
    assert cpu_serving_dtype(model_path) == "bfloat16" and cpu_serving_dtype(MODELS_DIR / "tiny-qwen35") == "float32"
