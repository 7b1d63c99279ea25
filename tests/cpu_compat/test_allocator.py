"""glibc malloc keeps what a forward frees (`sglang_cpu_compat/allocator.py`): once the heap holds a forward's
activations, the next forwards reuse its pages instead of faulting them in again. Each case runs in a fresh
interpreter, so that the policy (and glibc's history) is its own."""

import json
import os
import subprocess
import sys

PROBE = """
import json, resource, sys, torch
from sglang_cpu_compat.allocator import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "policy" else False
def forward():  # activation-sized blocks, written, two alive at a time, all freed at the end
    live = []
    for mib in (48, 40, 24, 48):
        x = torch.empty(mib << 20, dtype=torch.uint8); x.fill_(1); live.append(x)
        if len(live) > 2:
            live.pop(0)
for _ in range(5):  # until the heap holds what a forward needs (glibc's aligned blocks fragment it at first)
    forward()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    forward()
print(json.dumps({"applied": applied, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before}))
"""
PAGES = ((48 + 40 + 24 + 48) << 20) // 4096  # faults for one forward whose blocks are all freshly mapped


def probe(mode: str, **env) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                         env={**os.environ, **env})
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults():
    default, kept = probe("glibc"), probe("policy")
    assert default["faults"] >= 3 * PAGES * 0.8, default  # glibc's own: blocks above 32 MiB are mapped anew each time
    assert kept["applied"] and kept["faults"] < PAGES // 20, kept


def test_the_policy_can_be_turned_off():
    result = probe("policy", TAILREPLAY_CPU_GLIBC_MALLOC="default")
    assert not result["applied"] and result["faults"] >= 3 * PAGES * 0.8, result
