import pytest
import torch


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected||, computed in float64."""
    expected = expected.double()
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-30)).item()


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- real SGLang servers, shared per module and flag set ----

import os
from pathlib import Path

import requests

from tailreplay_sglang.eval.models import build_model
from tailreplay_sglang.eval.server import ServerProcess, _group_alive

MODELS_DIR = Path(os.environ.get("TAILREPLAY_MODELS_DIR", Path(__file__).resolve().parents[1] / "models"))


@pytest.fixture(scope="session")
def tiny_qwen35() -> Path:
    return build_model("tiny-qwen35", MODELS_DIR / "tiny-qwen35")


@pytest.fixture(scope="session")
def tiny_qwen3next() -> Path:
    return build_model("tiny-qwen3next", MODELS_DIR / "tiny-qwen3next")


@pytest.fixture(scope="session")
def tiny_qwen35_moe() -> Path:
    return build_model("tiny-qwen35-moe", MODELS_DIR / "tiny-qwen35-moe")


@pytest.fixture(scope="session")
def tiny_olmo_hybrid() -> Path:
    return build_model("tiny-olmo-hybrid", MODELS_DIR / "tiny-olmo-hybrid")


def start_server(model_path, tmp_path_factory, *extra_args, env=None, **kwargs):
    """Generator body for server fixtures: start, yield the running server, always stop it by PID."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    # SGLang's idle invariant check (every KV slot, mamba slot and request row accounted for) raises, not warns
    env = {"SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1", **(env or {})}
    server = ServerProcess(str(model_path), tuple(extra_args), log_path=log, env=env, **kwargs)
    try:
        yield server.start().wait_healthy()
    finally:
        server.stop()
        assert not _group_alive(server.proc.pid), "server process group survived stop()"


# The paper's mode (no anchors: --tail-replay-exact-budget 0) replaying the whole prefix (ratio 1): exact. One
# server for the session, shared by test_tail_replay.py and test_python_api.py (anchored replay: its own file).
EXACT_FLAGS = ("--enable-tail-replay", "--tail-replay-exact-budget", "0", "--tail-replay-ratio", "1",
               "--tail-replay-hidden-dtype", "float32",
               "--enable-metrics", "--enable-cache-report", "--chunked-prefill-size", "128")


@pytest.fixture(scope="session")
def exact_tail_replay_server(tiny_qwen35, tmp_path_factory):
    yield from start_server(tiny_qwen35, tmp_path_factory, *EXACT_FLAGS)


def run_forked_program(backend, system: str, question: str) -> list[dict]:
    """An SGLang frontend program (`sgl.function`) that forks 3 branches after `system + question`, run twice (the
    first run's branches race in one prefill batch, so some miss); the second run's meta_info per branch."""
    import sglang as sgl

    @sgl.function
    def branches(s, question):
        s += system + " " + question
        forks = s.fork(3)
        for i, f in enumerate(forks):
            f += f" branch {i} says"
            f += sgl.gen("answer", max_tokens=4, temperature=0)
        return [f.get_meta_info("answer") for f in forks]

    branches.run(question=question, backend=backend)
    return branches.run(question=question, backend=backend).ret_value


def generate(server, input_ids, max_new_tokens, **extra) -> dict:
    """Greedy /generate of exactly max_new_tokens tokens; returns the response JSON."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                         "ignore_eos": True}, **extra}
    r = requests.post(f"{server.base_url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def check_multi_turn(server, model, tok, turn1_text, new_tokens) -> None:
    """Decode-time capture: a second turn containing turn one's generated tokens matches through them (all but the
    last generated token, which has no KV when the request finishes) and equals HF greedy."""
    from tailreplay_sglang.eval.reference import greedy_generate

    turn1 = tok(turn1_text).input_ids
    answer = generate(server, turn1, new_tokens)["output_ids"]
    turn2 = turn1 + answer + tok(" and a follow-up question?").input_ids
    out = generate(server, turn2, new_tokens)
    assert out["meta_info"]["cached_tokens"] >= len(turn1) + len(answer) - 1
    assert out["output_ids"] == greedy_generate(model, turn2, new_tokens)


def check_concurrent_hits(server, model, tok, system_ids, new_tokens) -> None:
    """8 requests sharing `system_ids` (already cached), sent at once: each hits it and equals HF greedy."""
    import concurrent.futures

    from tailreplay_sglang.eval.reference import greedy_generate

    prompts = [system_ids + tok(" question" * (i + 1)).input_ids for i in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda p: generate(server, p, new_tokens), prompts))
    for ids, out in zip(prompts, outs):
        assert out["meta_info"]["cached_tokens"] >= len(system_ids)
        assert out["output_ids"] == greedy_generate(model, ids, new_tokens)


def pytest_addoption(parser):
    parser.addoption("--soak-requests", type=int, default=150,
                     help="requests in tests/test_reliability.py::test_soak (CI: 150; long run: 2000)")
    parser.addoption("--soak-check-limit", type=int, default=None,
                     help="re-serve at most this many distinct soak prompts without cache (default: all)")
