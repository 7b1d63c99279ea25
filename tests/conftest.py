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


def generate(server, input_ids, max_new_tokens, **extra) -> dict:
    """Greedy /generate of exactly max_new_tokens tokens; returns the response JSON."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                         "ignore_eos": True}, **extra}
    r = requests.post(f"{server.base_url}/generate", json=body, timeout=120)
    r.raise_for_status()
    return r.json()


def pytest_addoption(parser):
    parser.addoption("--soak-requests", type=int, default=150,
                     help="requests in tests/test_reliability.py::test_soak (CI: 150; long run: 2000)")
    parser.addoption("--soak-check-limit", type=int, default=None,
                     help="re-serve at most this many distinct soak prompts without cache (default: all)")
