"""Two workers behind the real sglang-router: Tail-Replay against stock workers, cache-aware against round-robin.

    python bench/router.py [--preset small] [--clients 4] [--requests 4] [--system-words 1200] \
        [--gen-tokens 16] [--out runs/router.json]

Four servers start together (two Tail-Replay workers, two stock workers; `CPU_FLAGS` plus `--server-args`; worker 0
of each kind pinned to core 0 and worker 1 to core 1 with `SGLANG_CPU_OMP_THREADS_BIND`) and four
routers (`python -m sglang_router.launch_router`, pinned in requirements/) in front of them: {Tail-Replay, stock}
workers x {cache_aware, round_robin}. Each shape runs through each router in turn, from flushed caches, with
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
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.client import document_clients, stream_generate
from tailreplay_eval.server import RouterProcess, flush_cache

WORKERS = {"Tail-Replay": ("--enable-tail-replay",), "stock": ()}
POLICIES = ("cache_aware", "round_robin")


SHAPES = {"shared prefix": False, "multi-turn": True}  # shape -> whether answers are fed back (conversation)


def run_shape(router_url: str, workers: list[str], conversation: bool, tok, args) -> dict:
    for url in workers:
        flush_cache(url)
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
            with lock:
                records.append({"prompt_tokens": len(ids), "matchable": matchable,
                                "cached": out["meta_info"]["cached_tokens"], "ttft_s": out["ttft_s"],
                                "served_prompt_tokens": out["meta_info"]["prompt_tokens"]})

    started = time.perf_counter()
    work = document_clients(args.clients, args.requests, args.system_words, seed=200 if conversation else 100)
    with ThreadPoolExecutor(len(work)) as pool:
        list(pool.map(client, work))
    wall = time.perf_counter() - started
    ttfts = [r["ttft_s"] for r in records]
    return {"requests": len(records), "wall_s": wall, "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "matchable": sum(r["matchable"] for r in records), "cached": sum(r["cached"] for r in records),
            "ttft_p50_s": float(np.percentile(ttfts, 50)), "ttft_p99_s": float(np.percentile(ttfts, 99)),
            "requests_per_s": len(records) / wall,
            "prompt_tokens_per_s": sum(r["prompt_tokens"] for r in records) / wall, "records": records}


def table(results: dict) -> Table:
    t = Table(title="Two workers behind sglang-router")
    for col in ("shape", "workers", "policy", "cached / matchable", "TTFT p50 (s)", "TTFT p99 (s)", "requests/s",
                "prompt tokens/s"):
        t.add_column(col, justify="right")
    for shape, by_config in results.items():
        for (workers, policy), r in by_config.items():
            reuse = r["cached"] / r["matchable"] if r["matchable"] else 0.0
            t.add_row(shape, workers, policy, f"{r['cached']:,} / {r['matchable']:,} ({100 * reuse:.1f} %)",
                      f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}", f"{r['requests_per_s']:.2f}",
                      f"{r['prompt_tokens_per_s']:,.0f}")
    return t


def plot(results: dict, path: Path) -> None:
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
    fig.suptitle("2 workers behind sglang-router (small preset, 2-core CPU)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "router.json")
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--requests", type=int, default=4, help="questions per client (rounds, in multi-turn)")
    ap.add_argument("--system-words", type=int, default=1200)
    ap.add_argument("--gen-tokens", type=int, default=16)
    args = ap.parse_args()
    run = harness.Run.begin(args)
    console = Console(width=150)
    tok = AutoTokenizer.from_pretrained(run.model_path)
    configs = {f"{kind}{i}": flags + tuple(run.server_args) for kind, flags in WORKERS.items() for i in range(2)}
    results = {shape: {} for shape in SHAPES}
    # Worker i on core i: two busy servers sharing both cores thrash each other's OpenMP spin barriers (round-robin
    # keeps both busy at once), which would charge the policy with that, not with its routing.
    pinned = {label: {"SGLANG_CPU_OMP_THREADS_BIND": label[-1]} for label in configs}
    with harness.running_servers(run.model_path, configs, run.out, console, envs=pinned,
                                 max_total_tokens=32768) as servers:
        for kind in WORKERS:
            urls = [servers[f"{kind}{i}"].base_url for i in range(2)]
            for policy in POLICIES:
                log = run.out.with_suffix(f".router-{kind}-{policy}.log")
                with RouterProcess(worker_urls=tuple(urls), policy=policy, log_path=log) as router:
                    for shape, conversation in SHAPES.items():
                        results[shape][(kind, policy)] = run_shape(router.base_url, urls, conversation, tok, args)
                        r = results[shape][(kind, policy)]
                        console.print(f"  {shape} / {kind} / {policy}: cached {r['cached']:,} of "
                                      f"{r['matchable']:,}, TTFT p50 {r['ttft_p50_s']:.2f} s")
    console.print(table(results))
    plot(results, run.out.with_suffix(".png"))
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": run.server_args, "workload": {k: getattr(args, k) for k in
                                                           ("clients", "requests", "system_words", "gen_tokens")},
              "results": {shape: {" / ".join(c): r for c, r in by_config.items()}
                          for shape, by_config in results.items()}}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
