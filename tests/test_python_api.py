"""Tail-Replay through SGLang's Python APIs: `sglang.Engine(..., enable_tail_replay=True, ...)` in this process and
`sgl.Runtime(...)` driving a frontend program, against the HTTP server started from the command line with the same
flags (`helpers.EXACT_FLAGS`)."""

import argparse
import json
import os
import subprocess
import sys

import psutil
import pytest

from helpers import EXACT_FLAGS, assert_exact, check_forked_program, no_cache, run_forked_program, scored_from
from helpers import generate as http_generate
from tailreplay_eval.server import CPU_ENV, flags_to_keywords, flush_cache
from tailreplay_eval.server import CPU_KEYWORDS as SERVER_CPU_KEYWORDS
from tailreplay_sglang import python_api
from tailreplay_sglang.cache.component import RADIX_CACHE_BACKEND
from tailreplay_sglang.config import ENV_VAR, TailReplayConfig, TailReplayConfigError
from tailreplay_sglang.plugin import add_cli_args, config_from_args

# What the helpers' servers get: CPU_FLAGS, ServerProcess' pool sizes, EXACT_FLAGS (minus metrics: HTTP only)
CPU_KEYWORDS = {**SERVER_CPU_KEYWORDS, "max_total_tokens": 4096, "max_running_requests": 8}
EXACT_KEYWORDS = flags_to_keywords(tuple(f for f in EXACT_FLAGS if f not in ("--enable-metrics",
                                                                             "--enable-cache-report")))
SYSTEM = ("you are a careful assistant. the old sailor carried the wooden boxes near the harbour yesterday, "
          "while a young engineer repaired a broken window in the library because the mayor ordered it")
BATCH_QUESTIONS = [f" {w} happened next?" for w in ("what", "who", "why", "how")]
TURNS = [" what happened first?", " and then?", " who ordered it?", " why?"]
NEW = 8
GREEDY = {"max_new_tokens": NEW, "temperature": 0, "ignore_eos": True}


@pytest.fixture(autouse=True)
def _keep_environment(monkeypatch):
    """The keywords hand the config on through this process's environment; later tests must not see it."""
    for name, value in CPU_ENV.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv(ENV_VAR, os.environ.get(ENV_VAR, ""))


# ---- keywords, without starting anything ----

@pytest.mark.parametrize("keywords,message", [
    (dict(enable_tail_replay=True, tail_replay_ratio=2.0), "--tail-replay-ratio must be in (0, 1]"),
    (dict(enable_tail_replay=True, tail_replay_ratio="0.1"), "--tail-replay-ratio must be a number"),
    (dict(enable_tail_replay=True, tail_replay_mode="most"), "--tail-replay-mode must be one of ratio, full, zero"),
    (dict(enable_tail_replay=True, tail_replay_min_tokens=1.5), "--tail-replay-min-tokens must be an integer"),
    (dict(enable_tail_replay="yes"), "--enable-tail-replay must be True or False"),
    (dict(tail_replay_ratio=0.1), "--tail-replay-ratio requires --enable-tail-replay"),
    (dict(enable_tail_replay=True, tail_replay_anchor_interval=100), "--tail-replay-anchor-interval must be 0"),
    (dict(enable_tail_replay=True, disable_radix_cache=True), "does not support --disable-radix-cache"),
    (dict(enable_tail_replay=True, pp_size=2), "supports --pp-size 1 only"),
], ids=["ratio-range", "ratio-type", "mode", "min-tokens-type", "enable-type", "without-enable", "interval", "combo",
        "pipeline"])
def test_bad_keyword_raises_naming_it_before_anything_starts(tiny_qwen35, keywords, message):
    import sglang

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    with pytest.raises(TailReplayConfigError, match=message.replace("(", r"\(").replace("]", r"\]")):
        sglang.Engine(model_path=str(tiny_qwen35), **CPU_KEYWORDS, **keywords)
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= before


def test_keywords_give_the_config_the_command_line_flags_give(tiny_qwen35):
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path")
    add_cli_args(parser)
    tail_replay_flags, _ = parser.parse_known_args(["--model-path", str(tiny_qwen35), *EXACT_FLAGS])
    from_flags = config_from_args(tail_replay_flags)
    kwargs = python_api.take_keywords({"model_path": str(tiny_qwen35), **EXACT_KEYWORDS})
    assert TailReplayConfig.from_env() == from_flags and from_flags.enabled
    assert kwargs["radix_cache_backend"] == RADIX_CACHE_BACKEND and "enable_tail_replay" not in kwargs
    # a stock Engine after it in the same process must not inherit the config
    python_api.take_keywords({"model_path": str(tiny_qwen35)})
    assert not TailReplayConfig.from_env().enabled


def test_prebuilt_server_args_take_the_keywords(tiny_qwen35):
    """`Engine(server_args=ServerArgs(...), enable_tail_replay=True)`: stock SGLang would ignore the keyword."""
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=str(tiny_qwen35), device="cpu")
    kwargs = python_api.take_keywords({"server_args": server_args, "enable_tail_replay": True,
                                       "tail_replay_ratio": 0.25})
    assert kwargs == {"server_args": server_args}
    assert server_args.radix_cache_backend == RADIX_CACHE_BACKEND
    assert TailReplayConfig.from_env().ratio == 0.25
    with pytest.raises(TailReplayConfigError, match="--tail-replay-exact-budget must be >= 0"):
        python_api.take_keywords({"server_args": ServerArgs(model_path=str(tiny_qwen35)), "enable_tail_replay": True,
                                  "tail_replay_exact_budget": -1})


# ---- a real Engine (in a process of its own: Engine.shutdown() kills every child of its process) ----

def _questions(tok, questions):
    return [tok(q).input_ids for q in questions]


@pytest.fixture(scope="module")
def engine_run(tiny_qwen35, tok_qwen35, tmp_path_factory):
    """The batch and conversation workloads through an Engine with EXACT_KEYWORDS, and how it shut down."""
    system = tok_qwen35(SYSTEM).input_ids
    spec = {"model_path": str(tiny_qwen35), "keywords": {**CPU_KEYWORDS, **EXACT_KEYWORDS}, "sampling_params": GREEDY,
            "batch": {"first": system, "batch": [system + q for q in _questions(tok_qwen35, BATCH_QUESTIONS)],
                      "logprobs": {"return_logprob": True, "logprob_start_len": len(system), "top_logprobs_num": 2}},
            "conversation": {"start": system, "turns": _questions(tok_qwen35, TURNS)}}
    folder = tmp_path_factory.mktemp("engine")
    (folder / "spec.json").write_text(json.dumps(spec))
    done = subprocess.run([sys.executable, "-m", "tailreplay_eval.engine_run", str(folder / "spec.json"),
                           str(folder / "out.json")], capture_output=True, text=True, timeout=600,
                          env={**os.environ, **CPU_ENV})
    assert done.returncode == 0, done.stderr[-4000:]
    return {**json.loads((folder / "out.json").read_text()), "system": system}


def _summary(out: dict) -> dict:
    meta = out["meta_info"]
    return {"output_ids": out["output_ids"], "cached": meta["cached_tokens"], "replayed": meta["tail_replay_tokens"],
            "exact": meta["tail_replay_exact"]}


def _no_cache(server, ids) -> dict:
    """The reference: the HTTP server's own prefill with its cache flushed first."""
    flush_cache(server.base_url)
    out = _summary(http_generate(server, ids, NEW))
    assert out["cached"] == 0
    return out


@pytest.mark.server
def test_engine_shared_prefix_batch_hits_and_answers_as_no_cache(engine_run, exact_tail_replay_server, tok_qwen35):
    """The batch's hits against the HTTP server's own no-cache prefill of each prompt (same flags and weights): every
    question token and output log-prob as close as stock's own hit, greedy outputs equal up to a near-tie."""
    system = engine_run["system"]
    first, *hits = engine_run["batch"]
    assert first["meta_info"]["cached_tokens"] == 0
    for hit, ids in zip(hits, [system + q for q in _questions(tok_qwen35, BATCH_QUESTIONS)], strict=True):
        meta = hit["meta_info"]
        assert meta["cached_tokens"] >= len(system) - 1 and meta["tail_replay_tokens"] == meta["cached_tokens"]
        assert meta["tail_replay_exact"]
        assert_exact(scored_from(hit), no_cache(exact_tail_replay_server, ids, len(system), NEW))


@pytest.mark.server
def test_engine_four_turn_conversation_hits_every_turn_and_answers_as_no_cache(engine_run, exact_tail_replay_server,
                                                                               tok_qwen35):
    got = [_summary(o) for o in engine_run["conversation"]]  # turn 1 through async_generate
    ids, want = list(engine_run["system"]), []
    for new in _questions(tok_qwen35, TURNS):
        ids = ids + new
        want.append(_no_cache(exact_tail_replay_server, ids))
        ids = ids + want[-1]["output_ids"]

    assert got[0]["cached"] == 0
    previous = len(engine_run["system"]) + len(_questions(tok_qwen35, TURNS)[0]) + NEW
    for turn, new in zip(got[1:], _questions(tok_qwen35, TURNS)[1:]):
        assert turn["cached"] >= previous - 1 and turn["replayed"] == turn["cached"]
        previous += len(new) + NEW
    assert [g["output_ids"] for g in got] == [w["output_ids"] for w in want]


@pytest.mark.server
def test_engine_shuts_down_without_leftover_processes(engine_run):
    assert len(engine_run["child_pids"]) >= 2  # scheduler and detokenizer at least
    assert engine_run["alive_after_shutdown"] == []
    assert not [pid for pid in engine_run["child_pids"] if psutil.pid_exists(pid)
                and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE]


# ---- sgl.Runtime: a frontend program on a server started with keywords ----

@pytest.mark.server
def test_runtime_takes_the_keywords_and_a_forked_program_hits(tiny_qwen35, tok_qwen35):
    import sglang as sgl

    # its own port search (from 30000 up to 40000)
    runtime = sgl.Runtime(model_path=str(tiny_qwen35), **CPU_KEYWORDS, **EXACT_KEYWORDS)
    pid = runtime.pid
    try:
        branches = run_forked_program(runtime, SYSTEM, "what happened?")
        assert all(b["meta"]["tail_replay_tokens"] == b["meta"]["cached_tokens"] for b in branches)  # ratio 1
        check_forked_program(argparse.Namespace(base_url=runtime.url), branches,
                             len(tok_qwen35(SYSTEM + " what happened?").input_ids))
    finally:
        process = psutil.Process(pid)
        tree = [process, *process.children(recursive=True)]
        runtime.shutdown()
        del runtime  # its __del__ would otherwise run at interpreter exit, after imports are torn down
        gone, alive = psutil.wait_procs(tree, timeout=30)
        assert not alive, [p.pid for p in alive]

