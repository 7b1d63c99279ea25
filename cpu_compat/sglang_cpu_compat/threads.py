"""OpenMP thread binding for SGLang ranks on CPUs without AMX.

SGLang resolves each rank's cores (`SGLANG_CPU_OMP_THREADS_BIND`, or the rank's NUMA node) on every CPU, but applies
them only through `sgl_kernel.init_cpu_threads_env`, which it calls only where AMX (or Arm) kernels are built. On
other CPUs every rank keeps torch's default (one thread per core of the machine, unbound): two ranks or two servers on
two cores then run four spinning OpenMP threads, which slows prefill many times over (docs/scale-out.md). Here the
resolved cores are applied with torch alone: the process's affinity and torch's thread count.
"""

import logging
import os

logger = logging.getLogger(__name__)


def parse_cpu_list(spec: str) -> list[int]:
    """'0-3,8' -> [0, 1, 2, 3, 8] (Linux cpulist syntax, what SGLang's bind strings use)."""
    cpus = []
    for part in str(spec).replace(" ", "").split(","):
        if not part:
            continue
        first, _, last = part.partition("-")
        cpus.extend(range(int(first), int(last or first) + 1))
    if not cpus:
        raise ValueError(f"SGLANG_CPU_OMP_THREADS_BIND: no CPU in {spec!r}")
    return sorted(set(cpus))


def bind_rank_threads(*, local_omp_cpuid, dist_init_method=None) -> None:
    """Replaces `sglang.srt.distributed.bootstrap._init_cpu_threads_env` (same keywords)."""
    import torch

    if local_omp_cpuid is None:
        return
    cpus = parse_cpu_list(local_omp_cpuid)
    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))
    logger.info("sglang_cpu_compat: rank bound to CPUs %s, %d torch threads", cpus, len(cpus))
