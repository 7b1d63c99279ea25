"""Multi-client prefix traffic against one URL (a router, or a server that places requests itself), measured the
same way for every deployment shape the benchmarks compare (bench/router.py, bench/dp_attention.py).

Each client has its own prefix, a system prompt over its own document (`client.document_clients`), so prefixes differ
between clients; the clients run at once, each sending its questions one after the other:
- shared prefix: each question on the client's system prompt;
- multi-turn: a conversation over the document, answers fed back as text.
Prompts go out as text over streaming /generate (a router's cache-aware policy matches text). Per shape: cached /
matchable tokens (matchable: the longest common prefix with anything the deployment finished before the request,
capped at len - 1: what a cache shared by every worker could reuse), the share of cached tokens in hits labelled
exact, TTFT p50 / p99, requests/s and prompt tokens/s over the shape's wall time.
"""

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import requests
from rich.table import Table

from tailreplay_eval import harness
from tailreplay_eval.client import document_clients, stream_generate
from tailreplay_eval.server import flush_cache

SHAPES = {"shared prefix": False, "multi-turn": True}  # shape -> whether answers are fed back (conversation)


def add_traffic_args(ap, clients: int = 4, system_words: int = 600) -> None:
    """The workload options of a multi-client trace (`run_shape` reads them)."""
    ap.add_argument("--clients", type=int, default=clients)
    ap.add_argument("--requests", type=int, default=4, help="questions per client (rounds, in multi-turn)")
    ap.add_argument("--system-words", type=int, default=system_words)
    ap.add_argument("--gen-tokens", type=int, default=16)


def run_shape(url: str, flush_urls: list[str], conversation: bool, tok, args, store=None, placement=None) -> dict:
    """One shape through `url` from flushed caches (`flush_urls`; `store`: a Mooncake master whose store is
    emptied first and whose bytes are reported). `placement(client)`: extra /generate fields for that client's
    requests (`routed_dp_rank`), or None. `args`: clients, requests, system_words, gen_tokens."""
    for server_url in flush_urls:
        # With a Mooncake store a flush waits for the last writes to it; one that stalls ("no transfer progress
        # within 30s", docs/results.md 2i) fails after Mooncake's own 30 s timeout, so the flush may take longer.
        flush_cache(server_url, timeout=30.0 if store is None else 120.0)
    if store is not None:  # SGLang's endpoint empties the whole store, every client's pages
        requests.post(f"{flush_urls[0]}/hicache/storage-backend/clear", timeout=60).raise_for_status()
    seen, records, lock = harness.Seen(), [], threading.Lock()

    def client(index_prefix_and_questions):
        index, (prefix, questions) = index_prefix_and_questions
        extra = placement(index) if placement is not None else {}
        history = ""
        for question in questions:
            text = f"{prefix}{history}\nUser: {question}\nAssistant:"
            ids = tok(text).input_ids
            matchable = seen.matchable(ids)
            out = stream_generate(url, text, args.gen_tokens, **extra)
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
        list(pool.map(client, enumerate(work)))
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


def table(results: dict, title: str, columns: tuple[str, str], l3: bool = False) -> Table:
    """`results[shape][(kind, placement)]`; `columns`: the headers of the two key parts."""
    t = Table(title=title)
    store_cols = ("from L3", "exact share", "store MiB") if l3 else ()
    for col in ("shape", *columns, "cached / matchable", *store_cols, "TTFT p50 (s)", "TTFT p99 (s)",
                "requests/s", "prompt tokens/s"):
        t.add_column(col, justify="right")
    for shape, by_config in results.items():
        for (kind, placement), r in by_config.items():
            reuse = r["cached"] / r["matchable"] if r["matchable"] else 0.0
            store = (f"{r['storage']:,}", f"{100 * r['exact_cached'] / max(r['cached'], 1):.1f} %",
                     f"{r['store_bytes'] / 2**20:.1f}") if l3 else ()
            t.add_row(shape, kind, placement, f"{r['cached']:,} / {r['matchable']:,} ({100 * reuse:.1f} %)", *store,
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


TRAFFIC_KEYS = ("clients", "requests", "system_words", "gen_tokens")


def write_results(run, args, results: dict, title: str, console, server_args: list[str], extra_keys=()) -> None:
    """The PNG and the JSON record of a run (`run`: harness.Run) next to `run.out`."""
    plot(results, run.out.with_suffix(".png"), title)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": server_args, "workload": {k: getattr(args, k) for k in (*TRAFFIC_KEYS, *extra_keys)},
              "results": {shape: {" / ".join(c): r for c, r in by_config.items()}
                          for shape, by_config in results.items()}}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")
