"""Two servers started side by side with the CPU defaults while a third process churns memory (issue 65, item 3).

With the CPU defaults SGLang sizes each KV pool from `--mem-fraction-static` (no `--max-total-tokens`), and on the
CPU engine its memory profile read the machine's available RAM before and after the weights load: RAM another
process took meanwhile was charged to the weights, and a server refused to start ("Loaded weights leave no GPU
memory for the KV cache"). The CPU port charges the KV budget with what the load itself allocated
(`sglang_cpu_compat/memory_profile.py`; its unit test, with made-up readings, is
tests/cpu_compat/test_memory_profile.py). Here the real servers: two starting at once, each the other's "other
process", beside a third that allocates and frees 1 GiB over and over for the whole start. Whether a load window
meets a swing is timing, so this shows the user's case starts; the unit test is what fails without the fix.
"""

import subprocess
import sys

import pytest

from helpers import Spec, generate, random_ids, start_servers

pytestmark = pytest.mark.server

# allocate 1 GiB (touched), hold it briefly, free it, for up to 10 minutes (stopped by the fixture)
CHURN = ("import time\nend = time.monotonic() + 600\nwhile time.monotonic() < end:\n"
         "    block = b'\\x01' * (1 << 30)\n    time.sleep(0.3)\n    del block\n    time.sleep(0.2)\n")


@pytest.fixture(scope="module")
def churn():
    proc = subprocess.Popen([sys.executable, "-c", CHURN])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def servers(churn, tiny_qwen35, tmp_path_factory):
    """Tail-Replay and stock, CPU defaults: the pools sized by SGLang from --mem-fraction-static 0.1."""
    yield from start_servers(tmp_path_factory, {
        "tr": Spec(tiny_qwen35, ("--enable-tail-replay", "--dtype", "float32"), kwargs={"max_total_tokens": None}),
        "stock": Spec(tiny_qwen35, ("--dtype", "float32"), kwargs={"max_total_tokens": None}),
    })


def test_two_servers_start_beside_a_process_churning_memory_and_serve(servers, churn):
    assert churn.poll() is None  # the churn ran through both starts
    for name, server in servers.items():
        out = generate(server, random_ids(300, seed=3), 4)
        assert len(out["output_ids"]) == 4, name
