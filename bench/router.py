"""Workers behind the real sglang-router: Tail-Replay against stock workers, cache-aware against round-robin.

    python bench/router.py [--preset small] [--clients 4] [--requests 4] [--system-words 1200] \
        [--gen-tokens 16] [--workers 2] [--l3 none|mooncake] [--out runs/router.json]

`--l3 mooncake` gives each kind's workers one shared HiCache L3, a Mooncake store (a `mooncake_master` per kind on
loopback, `tailreplay_eval/mooncake_store.py`; emptied before each shape), and adds per shape the tokens served
from it, the share of cached tokens in hits labelled exact and the store's allocated bytes.

`--workers` Tail-Replay workers start together, then (after them) as many stock workers (`CPU_FLAGS` plus
`--server-args`; worker i of each kind pinned to core i mod the cores with `SGLANG_CPU_OMP_THREADS_BIND`), with a
router (`python -m sglang_router.launch_router`, pinned in requirements/) per {Tail-Replay, stock} workers x
{cache_aware, round_robin} in front of them. Each shape runs through each router in turn, from flushed caches, with
`--clients` clients at once, each with its own prefix (so prefixes differ between clients):
- shared prefix: each client sends `--requests` questions on its own system prompt, one after the other;
- multi-turn: each client holds a `--requests`-round conversation over its own document, answers fed back as text.
Prompts go out as text (the router's cache-aware policy matches text) over streaming /generate.

Per shape and router: cached / matchable tokens (matchable: the longest common prefix with anything either worker
finished before the request, capped at len - 1: what a cluster-wide cache could reuse), TTFT p50 / p99, requests/s
and prompt tokens/s over the shape's wall time. Writes a JSON and a PNG next to it and prints a table.
"""

import argparse
import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.client import document_clients, stream_generate
from tailreplay_eval.mooncake_store import MooncakeMaster, server_flags
from tailreplay_eval.server import RouterProcess, flush_cache

WORKERS = {"Tail-Replay": ("--enable-tail-replay",), "stock": ()}
POLICIES = ("cache_aware", "round_robin")


SHAPES = {"shared prefix": False, "multi-turn": True}  # shape -> whether answers are fed back (conversation)


def run_shape(router_url: str, workers: list[str], conversation: bool, tok, args, store=None) -> dict:
    for url in workers:
        flush_cache(url)
    if store is not None:  # SGLang's endpoint empties the whole store, every client's pages
        requests.post(f"{workers[0]}/hicache/storage-backend/clear", timeout=60).raise_for_status()
    seen, records, lock = harness.Seen(), [], threading.Lock()

    def client(prefix_and_questions):
        prefix, questions = prefix_and_questions
        history = ""
        for question in questions:
            text = f"{prefix}{history}\nUser: {question}\nAssistant:"
            ids = tok(text).input_ids
            matchable = seen.matchable(ids)
            out = stream_generate(router_url, text, args.gen_tokens)
            seen.add(ids, out["output_ids"])
            if conversation:
                history += f"\nUser: {question}\nAssistant:" + tok.decode(out["output_ids"])
            meta = out["meta_info"]
            with lock:
                records.append({"prompt_tokens": len(ids), "matchable": matchable,
                                "cached": meta["cached_tokens"], "ttft_s": out["ttft_s"],
                                "served_prompt_tokens": meta["prompt_tokens"],
                                # stock rebuilds a hit from a stored state only: exact by construction
                                "exact": meta.get("tail_replay_exact", True),
                                "storage": (meta.get("cached_tokens_details") or {}).get("storage", 0)})

    started = time.perf_counter()
    work = document_clients(args.clients, args.requests, args.system_words, seed=200 if conversation else 100)
    with ThreadPoolExecutor(len(work)) as pool:
        list(pool.map(client, work))
    wall = time.perf_counter() - started
    ttfts = [r["ttft_s"] for r in records]
    return {"requests": len(records), "wall_s": wall, "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "matchable": sum(r["matchable"] for r in records), "cached": sum(r["cached"] for r in records),
            "exact_cached": sum(r["cached"] for r in records if r["exact"]),
            "storage": sum(r["storage"] for r in records),
            "store_bytes": store.metric("master_allocated_bytes") if store is not None else None,
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "requests_per_s": len(records) / wall,
            "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in records) / wall, "records": records}


def table(results: dict, title: str, l3: bool) -> Table:
    t = Table(title=title)
    store_cols = ("from L3", "exact share", "store MiB") if l3 else ()
    for col in ("shape", "workers", "policy", "cached / matchable", *store_cols, "TTFT p50 (s)", "TTFT p99 (s)",
                "requests/s", "prompt tokens/s"):
        t.add_column(col, justify="right")
    for shape, by_config in results.items():
        for (workers, policy), r in by_config.items():
            reuse = r["cached"] / r["matchable"] if r["matchable"] else 0.0
            store = (f"{r['storage']:,}", f"{100 * r['exact_cached'] / max(r['cached'], 1):.1f} %",
                     f"{r['store_bytes'] / 2**20:.1f}") if l3 else ()
            t.add_row(shape, workers, policy, f"{r['cached']:,} / {r['matchable']:,} ({100 * reuse:.1f} %)", *store,
                      f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}", f"{r['requests_per_s']:.2f}",
                      f"{r['prompt_tokens_per_s']:,.0f}")
    return t


def plot(results: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (metric, label) in zip(axes, (("reuse", "cached / matchable (%)"), ("ttft_p50_s", "TTFT p50 (s)"))):
        configs = list(next(iter(results.values())))
        width = 0.8 / len(configs)
        for i, config in enumerate(configs):
            values = []
            for by_config in results.values():
                r = by_config[config]
                values.append(100 * r["cached"] / max(r["matchable"], 1) if metric == "reuse" else r[metric])
            ax.bar(np.arange(len(results)) + i * width, values, width, label=" / ".join(config))
        ax.set_xticks(np.arange(len(results)) + width * (len(configs) - 1) / 2, list(results))
        ax.set_ylabel(label)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{title} (2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "router.json")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="questions per client (rounds, in multi-turn)")
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--gen-tokens", type=int, default=16)
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
                                         max_total_tokens=32768) as servers:
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
    console.print(table(results, title, args.l3 != "none"))
    plot(results, run.out.with_suffix(".png"), title)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": run.server_args, "workload": {k: getattr(args, k) for k in
                                                           ("clients", "requests", "system_words", "gen_tokens",
                                                            "workers", "l3")},
              "results": {shape: {" / ".join(c): r for c, r in by_config.items()}
                          for shape, by_config in results.items()}}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
