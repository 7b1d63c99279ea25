"""The suite on several pytest-xdist workers (`make test` runs two: `pytest -n 2`).

Most of a server test's time is single-threaded Python (the client, SGLang's scheduler loop, start-up), so one
serial run leaves the second core idle for much of it. Two workers fill it, on three conditions:

- **One core each.** Every worker gets its own share of the cores: its servers' ranks are bound there
  (`SGLANG_CPU_OMP_THREADS_BIND`, which the CPU port applies) and its own torch runs that many threads. Two servers
  each spinning OpenMP threads on both cores would slow each other many times over (docs/scale-out.md); a test that
  binds its ranks itself (test_scale_out) keeps its own binding.
- **Whole modules, and the modules that share a session server together.** A module-scoped server must not start
  once per worker; the modules that use conftest's shared servers (`SHARED_SERVER_MODULES`; the collection checks the
  list) are one unit, so the server stops after its last user as in a serial run.
- **Heaviest units first**, so that the last unit to start is a short one (`MODULE_SECONDS`, measured in CI).

Ports: each worker draws from its own slice of the test port range, so two workers never hand out the same port.
"""

import os

import torch
from xdist.scheduler import LoadScopeScheduling

from tailreplay_eval import server

SHARED_SERVER_GROUP = "shared-servers"
# The modules that use conftest's SHARED_SERVERS (checked at collection: check_shared_server_modules).
SHARED_SERVER_MODULES = frozenset({"tests/test_bench.py", "tests/test_pd.py", "tests/test_python_api.py",
                                   "tests/test_router.py", "tests/test_server.py", "tests/test_tail_replay.py"})
# Seconds per module in a serial clean-clone CI run (5b236aa, junit times); a module not listed counts 0 (it runs
# after the listed ones, in collection order). Only the order depends on these: a stale figure costs balance, not
# correctness.
MODULE_SECONDS = {
    "tests/test_hicache_tail_replay.py": 183, "tests/test_speculative.py": 175, "tests/test_hicache.py": 169,
    "tests/test_hybrid_families.py": 148, "tests/test_production_path.py": 116, "tests/test_reliability.py": 104,
    "tests/test_quality_bench.py": 73, "tests/test_anchored_replay.py": 63, "tests/test_scale_out.py": 49,
    "tests/test_kernels.py": 40, "tests/test_cache_properties.py": 37, "tests/test_vision_language.py": 34,
    "tests/test_olmo_hybrid.py": 33, "tests/test_training.py": 31, "tests/cpu_compat/test_cpu_ops.py": 30,
    "tests/test_ttft_gpu.py": 26, "tests/test_flags.py": 22,
    # the shared-server unit: test_bench 94, test_pd 113, test_python_api 105, test_router 22, test_server 7,
    # test_tail_replay 71
    SHARED_SERVER_GROUP: 412,
}


def unit_of(module: str) -> str:
    """The unit of work a module belongs to: its own path, or the shared-server group."""
    return SHARED_SERVER_GROUP if module in SHARED_SERVER_MODULES else module


class ModuleUnitScheduling(LoadScopeScheduling):
    """xdist's load-scope scheduling over `unit_of` units, in collection order (`order_heaviest_first` sorts it)."""

    def __init__(self, config, log=None):
        super().__init__(config, log)
        config.option.loadscopereorder = False  # xdist would sort by test count; the collection is sorted by time

    def _split_scope(self, nodeid: str) -> str:
        return unit_of(nodeid.split("::", 1)[0])


def order_heaviest_first(items) -> None:
    """Sort the items by their unit's measured time, heaviest first (stable: a unit's items keep their order)."""
    items.sort(key=lambda item: -MODULE_SECONDS.get(unit_of(item.nodeid.split("::", 1)[0]), 0))


def check_shared_server_modules(items, shared_servers) -> None:
    """A module that uses a shared server but is missing from SHARED_SERVER_MODULES would start that server on both
    workers and keep one until the session ends: fail the collection instead."""
    users = {item.nodeid.split("::", 1)[0] for item in items
             if set(shared_servers) & set(getattr(item, "fixturenames", ()))}
    missing = users - SHARED_SERVER_MODULES
    if missing:
        raise RuntimeError(f"tests/parallel.py: add {sorted(missing)} to SHARED_SERVER_MODULES (they use "
                           f"{', '.join(shared_servers)})")


def bind_worker(worker: str, workers: int) -> None:
    """This worker's share of the cores, threads and test ports (`worker` is xdist's 'gw<i>')."""
    index = int(worker.removeprefix("gw"))
    cpus = sorted(os.sched_getaffinity(0))
    mine = cpus[index % len(cpus)::min(workers, len(cpus))]
    os.environ.setdefault("SGLANG_CPU_OMP_THREADS_BIND", ",".join(map(str, mine)))
    torch.set_num_threads(len(mine))
    low, high = server.PORT_RANGE
    width = (high - low + 1) // workers
    server.PORT_RANGE = (low + index * width, low + (index + 1) * width - 1)
