"""Two servers started side by side with the CPU defaults while a neighbour takes RAM in each one's load (issue 65,
item 3).

With the CPU defaults SGLang sizes each KV pool from `--mem-fraction-static` 0.1 (no `--max-total-tokens`). On the
CPU engine its memory profile reads the machine's available RAM before and after the weights load, so RAM another
process took meanwhile was charged to the weights, and a drop of more than a tenth of the RAM refused the start
("Loaded weights leave no GPU memory for the KV cache"): a second server starting beside a first, as the README's
PD and store examples do. The CPU port charges the budget with what the load itself allocated
(`sglang_cpu_compat/memory_profile.py`; its unit test with made-up readings is tests/cpu_compat/test_memory_profile.py).

Here the real servers, each with the test plugin's neighbour: a process that takes NEIGHBOUR_SHARE of the available
RAM between the two readings and gives it back once the pools exist, every time, not when timing allows. Without the
CPU port's fix both servers are refused (checked by hand, tests/README.md). Runs in parallel.py's host-memory unit:
its transient GBs never meet a HiCache server's 10 GiB host-reserve check.
"""

import pytest

from helpers import Spec, faults_env, generate, random_ids, start_servers

pytestmark = pytest.mark.server

NEIGHBOUR_SHARE = 0.2  # of the available RAM: past --mem-fraction-static 0.1, so the old profile refuses


@pytest.fixture(scope="module")
def servers(tiny_qwen35, tmp_path_factory):
    """Tail-Replay and stock, CPU defaults (pools sized by SGLang), started at once, each with a neighbour."""
    env = faults_env(neighbour_share=NEIGHBOUR_SHARE)
    yield from start_servers(tmp_path_factory, {
        "tr": Spec(tiny_qwen35, ("--enable-tail-replay", "--dtype", "float32"), env, {"max_total_tokens": None}),
        "stock": Spec(tiny_qwen35, ("--dtype", "float32"), env, {"max_total_tokens": None}),
    })


def test_two_servers_start_beside_a_neighbour_taking_ram_in_their_load_and_serve(servers):
    for name, server in servers.items():
        assert "test neighbour holds" in server.log_path.read_text(errors="replace"), name  # the fault happened
        out = generate(server, random_ids(300, seed=3), 4)
        assert len(out["output_ids"]) == 4, name
