"""Workers behind the real sglang-router: Tail-Replay against stock workers, cache-aware against round-robin.

    python bench/router.py [--preset small] [--clients 4] [--requests 4] [--system-words 1200] \
        [--gen-tokens 16] [--workers 2] [--l3 none|mooncake] [--out runs/router.json]

`--l3 mooncake` gives each kind's workers one shared HiCache L3, a Mooncake store (a `mooncake_master` per kind on
loopback, `tailreplay_eval/mooncake_store.py`; emptied before each shape), and adds per shape the tokens served
from it, the share of cached tokens in hits labelled exact and the store's allocated bytes.

`--workers` Tail-Replay workers start together, then (after them) as many stock workers (`CPU_FLAGS` plus
`--server-args`; worker i of each kind pinned to core i mod the cores with `SGLANG_CPU_OMP_THREADS_BIND`), with a
router (`python -m sglang_router.launch_router`, pinned in requirements/) per {Tail-Replay, stock} workers x
{cache_aware, round_robin} in front of them. Each shape of `tailreplay_eval/prefix_traffic.py` runs through each
router in turn, from flushed caches, with `--clients` clients at once, each with its own prefix:
- shared prefix: each client sends `--requests` questions on its own system prompt, one after the other;
- multi-turn: each client holds a `--requests`-round conversation over its own document, answers fed back as text.
Prompts go out as text (the router's cache-aware policy matches text) over streaming /generate.

Per shape and router: cached / matchable tokens (matchable: the longest common prefix with anything either worker
finished before the request, capped at len - 1: what a cluster-wide cache could reuse), TTFT p50 / p99, requests/s
and prompt tokens/s over the shape's wall time. Writes a JSON and a PNG next to it and prints a table.
"""

import argparse
import os

from rich.console import Console
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.mooncake_store import MooncakeMaster, server_flags
from tailreplay_eval.prefix_traffic import SHAPES, add_traffic_args, run_shape, table, write_results
from tailreplay_eval.server import RouterProcess

WORKERS = {"Tail-Replay": ("--enable-tail-replay",), "stock": ()}
POLICIES = ("cache_aware", "round_robin")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "router.json")
    add_traffic_args(ap, system_words=1200)
    ap.add_argument("--workers", type=int, default=2, help="workers of each kind")
    ap.add_argument("--l3", choices=("none", "mooncake"), default="none",
                    help="mooncake: each kind's workers share a Mooncake store as HiCache's L3")
    args = ap.parse_args()
    run = harness.Run.begin(args)
    console = Console(width=170)
    tok = AutoTokenizer.from_pretrained(run.model_path)
    title = f"{args.workers} workers behind sglang-router" + (", a shared Mooncake L3" if args.l3 != "none" else "")
    results = {shape: {} for shape in SHAPES}
    # Worker i on core i (mod the cores): two busy servers sharing both cores thrash each other's OpenMP spin
    # barriers (round-robin keeps both busy at once), which would charge the policy with that, not its routing. One
    # kind's workers run at a time (with their own Mooncake master under --l3): six servers with HiCache host pools
    # and store segments at once would not fit beside SGLang's 10 GiB host-memory reserve here.
    cores = sorted(os.sched_getaffinity(0))
    pinned = {f"{kind}{i}": {"SGLANG_CPU_OMP_THREADS_BIND": str(cores[i % len(cores)])}
              for kind in WORKERS for i in range(args.workers)}
    for kind, flags in WORKERS.items():
        master = MooncakeMaster(log_path=run.out.with_suffix(f".mooncake-{kind}.log")) if args.l3 == "mooncake" \
            else None
        try:
            # a host pool of twice the device pool each (the store's clients map theirs at once)
            store_flags = () if master is None else \
                server_flags(master.start().wait_healthy(timeout=60).address, host_ratio=2) + ("--enable-cache-report",)
            configs = {f"{kind}{i}": flags + store_flags + tuple(run.server_args) for i in range(args.workers)}
            logs = run.out.with_name(f"{run.out.stem}-{kind}.json")  # harness names each log after it
            with harness.running_servers(run.model_path, configs, logs, console, envs=pinned,
                                         max_total_tokens=32768, gpu_scheduling=args.gpu_scheduling) as servers:
                urls = [servers[label].base_url for label in configs]
                for policy in POLICIES:
                    log = run.out.with_suffix(f".router-{kind}-{policy}.log")
                    with RouterProcess(worker_urls=tuple(urls), policy=policy, log_path=log) as router:
                        for shape, conversation in SHAPES.items():
                            r = run_shape(router.base_url, urls, conversation, tok, args, master)
                            results[shape][(kind, policy)] = r
                            console.print(f"  {shape} / {kind} / {policy}: cached {r['cached']:,} of "
                                          f"{r['matchable']:,}, TTFT p50 {r['ttft_p50_s']:.2f} s")
        finally:
            if master is not None:
                master.stop()
    console.print(table(results, title, ("workers", "policy"), args.l3 != "none"))
    write_results(run, args, results, title, console, run.server_args, extra_keys=("workers", "l3"))


if __name__ == "__main__":
    main()
