"""The suite on several pytest-xdist workers (`make test` runs two: `pytest -n 2`).

Most of a server test's time is single-threaded Python (the client, SGLang's scheduler loop, start-up), so one
serial run leaves the second core idle for much of it. Two workers fill it, on three conditions:

- **One core each.** Every worker gets its own share of the cores: its servers' ranks are bound there
  (`SGLANG_CPU_OMP_THREADS_BIND`, which the CPU port applies) and its own torch runs that many threads. Two servers
  each spinning OpenMP threads on both cores would slow each other many times over (docs/scale-out.md); a test that
  binds its ranks itself (test_scale_out) keeps its own binding.
- **Whole modules, and some modules together** (`UNITS`). A module-scoped server must not start once per worker; the
  modules that use conftest's shared servers (the collection checks the list) are one unit, so each such server
  stops after its last user as in a serial run; the HiCache modules are one unit, so their host pools never meet.
- **Heaviest units first**, so that the last unit to start is a short one (`MODULE_SECONDS`, measured in CI).

Ports: each worker draws from its own slice of the test port range, so two workers never hand out the same port.
"""

import os

import torch
from xdist.scheduler import LoadScopeScheduling

from tailreplay_eval import server

SHARED_SERVER_GROUP = "shared-servers"
# Modules that run as one unit, on one worker, one after the other:
UNITS = {
    # the modules that use conftest's SHARED_SERVERS (checked at collection: check_shared_server_modules)
    SHARED_SERVER_GROUP: frozenset({"tests/test_bench.py", "tests/test_pd.py", "tests/test_python_api.py",
                                    "tests/test_router.py", "tests/test_server.py", "tests/test_tail_replay.py"}),
    # three to five HiCache servers each: SGLang refuses a host pool that leaves less than 10 GiB of host memory
    # free, which two such modules starting their servers at once came close to
    # (and test_two_servers, whose neighbours take GBs of RAM for a moment)
    "host-memory": frozenset({"tests/test_hicache.py", "tests/test_hicache_tail_replay.py",
                              "tests/test_mooncake_store.py", "tests/test_two_servers.py"}),
}
_UNIT_OF = {module: unit for unit, modules in UNITS.items() for module in modules}
SHARED_SERVER_MODULES = UNITS[SHARED_SERVER_GROUP]
# Seconds per unit in a clean-clone CI run on two workers (af2886a, junit times, 2026-12-07); a module not listed counts
# 0 (it runs after the listed ones, in collection order). Only the order depends on these: a stale figure costs
# balance, not correctness.
MODULE_SECONDS = {
    # test_python_api 311, test_bench 254, test_tail_replay 171, test_pd 163, test_router 37, test_server 8
    SHARED_SERVER_GROUP: 944,
    "tests/test_hybrid_families.py": 624,
    "host-memory": 535,  # test_mooncake_store 285, test_hicache_tail_replay 116, test_hicache 82, test_two_servers 51
    "tests/test_speculative.py": 530, "tests/test_scale_out.py": 273, "tests/test_dp_attention.py": 266,
    "tests/test_production_path.py": 185, "tests/test_reliability.py": 147, "tests/test_quality_bench.py": 131,
    "tests/test_kernels.py": 116, "tests/test_anchored_replay.py": 99, "tests/test_vision_wrappers.py": 97,
    "tests/test_qwen38.py": 175, "tests/test_zaya.py": 75, "tests/test_lfm2.py": 72, "tests/test_dp_collectives.py": 71,
    "tests/test_flags.py": 63, "tests/test_olmo_hybrid.py": 62, "tests/test_retraction.py": 61,
    "tests/test_training.py": 60, "tests/test_vision_language.py": 103, "tests/test_ttft_gpu.py": 47,
    "tests/test_cache_properties.py": 40, "tests/cpu_compat/test_cpu_ops.py": 37, "tests/test_structure.py": 22,
    "tests/test_families.py": 21,
}


def unit_of(module: str) -> str:
    """The unit of work a module belongs to: its unit in UNITS, else its own path."""
    return _UNIT_OF.get(module, module)


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
