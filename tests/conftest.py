"""Fixtures shared by the tests: the seed, the small models (built once per session under models/), their HF
references and tokenizers, the SGLang servers several modules share, and the soak options. Plain helpers:
tests/helpers.py."""

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

import parallel
from helpers import EXACT_FLAGS, MODELS_DIR, RunningTest, ServerRegistry, Spec
from tailreplay_eval.models import build_model
from tailreplay_eval.preforked import Preforker
from tailreplay_eval.reference import load_hf_model
from tailreplay_eval.server import CPU_ENV


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
# One server per flag set for the whole session (helpers.ServerRegistry): started by the first test that needs it,
# stopped by PID after the last one (the hooks below), so modules with the same flags share it. Each is a
# module-scoped fixture; a module that needs an empty cache flushes it (/flush_cache). tests/README.md says which
# module uses which server.

STOCK_FLAGS = ("--dtype", "float32", "--enable-metrics")
ANCHORED_FLAGS = ("--dtype", "float32", "--enable-tail-replay", "--enable-metrics")  # the plugin's defaults
BIG_POOL = {"max_total_tokens": 8192, "context_length": 4096}
# One shared server is spawned as users run it (a new interpreter, SGLang's `spawn` start method), not preforked:
# test_tail_replay, test_python_api and test_router judge Tail-Replay's exactness on the spawned path too.
SPAWNED = {"spawn": True}
SHARED_SERVERS = ("exact_tail_replay_server", "stock_qwen35_server", "anchored_qwen35_server")
_REGISTRY = pytest.StashKey[ServerRegistry]()
_LAST_USERS = pytest.StashKey[dict]()


@pytest.fixture(scope="session", autouse=True)
def preforker(tmp_path_factory, pytestconfig):
    """Test servers (every `ServerProcess` of the session, the bench scripts' included) are forked from one process
    that imported SGLang once (started by the first server that needs it), unless `--spawn-servers` asks for new
    interpreters, as `python -m sglang.launch_server` runs for a user."""
    if pytestconfig.getoption("--spawn-servers"):
        yield None
        return
    Preforker.default = Preforker(tmp_path_factory.mktemp("preforker"), CPU_ENV)
    try:
        yield Preforker.default
    finally:
        Preforker.default.close()
        Preforker.default = None


@pytest.fixture(scope="session")
def server_registry(tmp_path_factory, pytestconfig):
    registry = ServerRegistry(tmp_path_factory)
    pytestconfig.stash[_REGISTRY] = registry
    yield registry
    registry.close()


@pytest.fixture(scope="module")
def exact_tail_replay_server(server_registry, tiny_qwen35):
    """Tail-Replay in the paper's mode replaying whole prefixes (EXACT_FLAGS) on tiny Qwen3.5, spawned (SPAWNED):
    test_python_api.py, test_router.py (a worker) and test_tail_replay.py."""
    yield from server_registry.serve("exact_tail_replay_server", Spec(tiny_qwen35, EXACT_FLAGS, kwargs=SPAWNED))


@pytest.fixture(scope="module")
def stock_qwen35_server(server_registry, tiny_qwen35):
    """Stock SGLang on tiny Qwen3.5 in float32 with metrics: test_server.py's server and test_bench.py's stock arm."""
    yield from server_registry.serve("stock_qwen35_server", Spec(tiny_qwen35, STOCK_FLAGS, kwargs=BIG_POOL))


@pytest.fixture(scope="module")
def anchored_qwen35_server(server_registry, tiny_qwen35):
    """Tail-Replay's defaults (anchored replay) on tiny Qwen3.5 in float32 with metrics, the same pool as the stock
    one: test_bench.py's Tail-Replay arm and a test_router.py worker."""
    yield from server_registry.serve("anchored_qwen35_server", Spec(tiny_qwen35, ANCHORED_FLAGS, kwargs=BIG_POOL))


# pytest-timeout's limits, set-up included: the slowest server module set-up measured on the 2-core CI machine took
# 204 s with the machine loaded (tests/README.md, Durations), so these leave room for a slow run and fail a hang
SERVER_TEST_TIMEOUT_S, TEST_TIMEOUT_S = 900, 600


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:  # `pytest -n N` (make test): this worker's cores, threads and ports (tests/parallel.py)
        parallel.bind_worker(worker, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return parallel.ModuleUnitScheduling(config, log)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Order the modules heaviest first (for parallel workers; tests/parallel.py), then note, per shared server, the
    last test (after -k, -m and friends deselected theirs) that needs it."""
    parallel.order_heaviest_first(items)
    parallel.check_shared_server_modules(items, SHARED_SERVERS)
    for item in items:  # a hang (a collective that never pairs) fails its own test instead of the whole run
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(SERVER_TEST_TIMEOUT_S if item.get_closest_marker("server")
                                                else TEST_TIMEOUT_S))
    last = {}
    for item in items:
        for name in SHARED_SERVERS:
            if name in getattr(item, "fixturenames", ()):
                last[name] = item.nodeid
    users = {}
    for name, nodeid in last.items():
        users.setdefault(nodeid, []).append(name)
    config.stash[_LAST_USERS] = users


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    RunningTest.item = item
    try:
        return (yield)
    finally:
        RunningTest.item = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that needs a shared server (and its fixtures) is torn down, stop that server."""
    try:
        return (yield)
    finally:
        registry = item.config.stash.get(_REGISTRY, None)
        for name in item.config.stash.get(_LAST_USERS, {}).get(item.nodeid, ()):
            if registry is not None:
                registry.release(name)


def pytest_addoption(parser):
    parser.addoption("--spawn-servers", action="store_true",
                     help="start every test server as a new `python -m sglang.launch_server` (as users run it) "
                          "instead of forking it from the preforker (tailreplay_eval/preforked.py)")
    parser.addoption("--soak-requests", type=int, default=100,
                     help="requests in tests/test_reliability.py::test_soak (CI: 100; long run: 2000)")
    parser.addoption("--soak-check-limit", type=int, default=None,
                     help="re-serve at most this many distinct soak prompts without cache (default: all)")
