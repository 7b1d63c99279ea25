"""Fixtures shared by the tests: the seed, the small models (built once per session under models/), their HF
references and tokenizers, the exact Tail-Replay server, and the soak options. Plain helpers: tests/helpers.py."""

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from helpers import EXACT_FLAGS, MODELS_DIR, start_server
from tailreplay_eval.models import build_model
from tailreplay_eval.reference import load_hf_model


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# ---- the small models, their HF references and tokenizers ----

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


@pytest.fixture(scope="session")
def tiny_nemotron_h() -> Path:
    return build_model("tiny-nemotron-h", MODELS_DIR / "tiny-nemotron-h")


@pytest.fixture(scope="session")
def tiny_kimi_linear() -> Path:
    return build_model("tiny-kimi-linear", MODELS_DIR / "tiny-kimi-linear")


@pytest.fixture(scope="session")
def tiny_falcon_h1() -> Path:
    return build_model("tiny-falcon-h1", MODELS_DIR / "tiny-falcon-h1")


@pytest.fixture(scope="session")
def tiny_qwen35_vl() -> Path:
    return build_model("tiny-qwen35-vl", MODELS_DIR / "tiny-qwen35-vl")


@pytest.fixture(scope="session")
def tiny_qwen35_moe_vl() -> Path:
    return build_model("tiny-qwen35-moe-vl", MODELS_DIR / "tiny-qwen35-moe-vl")


@pytest.fixture(scope="session")
def tok_qwen35(tiny_qwen35):
    return AutoTokenizer.from_pretrained(tiny_qwen35)


@pytest.fixture(scope="session")
def hf_qwen35(tiny_qwen35, tok_qwen35):
    """(HF transformers model in eval mode, tokenizer) of tiny-qwen35: the no-cache reference."""
    return load_hf_model(tiny_qwen35), tok_qwen35


@pytest.fixture(scope="session")
def hf_qwen35_moe(tiny_qwen35_moe):
    """(HF transformers model in eval mode, tokenizer) of tiny-qwen35-moe."""
    return load_hf_model(tiny_qwen35_moe), AutoTokenizer.from_pretrained(tiny_qwen35_moe)


@pytest.fixture(scope="session")
def hf_olmo_hybrid(tiny_olmo_hybrid):
    """(HF transformers model in eval mode, tokenizer) of tiny-olmo-hybrid."""
    return load_hf_model(tiny_olmo_hybrid), AutoTokenizer.from_pretrained(tiny_olmo_hybrid)


# ---- real SGLang servers shared by several modules ----

@pytest.fixture(scope="session")
def exact_tail_replay_server(tiny_qwen35, tmp_path_factory):
    yield from start_server(tiny_qwen35, tmp_path_factory, *EXACT_FLAGS)


@pytest.fixture(scope="session")
def stock_qwen35_server(tiny_qwen35, tmp_path_factory):
    """Stock SGLang on tiny Qwen3.5 in float32 with metrics: test_server.py's server and test_bench.py's stock arm."""
    yield from start_server(tiny_qwen35, tmp_path_factory, "--dtype", "float32", "--enable-metrics",
                            max_total_tokens=8192, context_length=4096)


def pytest_addoption(parser):
    parser.addoption("--soak-requests", type=int, default=150,
                     help="requests in tests/test_reliability.py::test_soak (CI: 150; long run: 2000)")
    parser.addoption("--soak-check-limit", type=int, default=None,
                     help="re-serve at most this many distinct soak prompts without cache (default: all)")
