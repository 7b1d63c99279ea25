"""PD disaggregation through the PD router (smg): stock PD against Tail-Replay PD at equal device memory.

    python bench/pd.py [--preset small] [--clients 2] [--requests 4] [--system-words 600] [--gen-tokens 16] \
        [--kv-tokens 16384] [--out runs/pd.json]

Two PD deployments start together, each a prefill and a decode server joined by Mooncake's transfer engine over
TCP on loopback (`mooncake_tcp`) and `smg.launch_router --pd-disaggregation` in front: stock (both servers stock) and
Tail-Replay (`--enable-tail-replay` on both: the prefill server replays, the decode server streams its labels). Decode
servers run SGLang's default (no decode radix cache), so each request's whole prompt KV crosses the wire in both arms.
Equal device memory: the stock prefill pool holds `--kv-tokens` tokens; Tail-Replay's gets the same bytes, its hidden
store charged per token (`tailreplay_eval.memory.device_bytes_per_token`). One arm runs at a time, each trace from
flushed caches, with `--clients` clients at once, each over its own document:
- RAG / agent (shared prefix): each client asks `--requests` questions on its own system prompt and document;
- multi-turn chat: each client holds a `--requests`-round conversation, its answers fed back as text.

Per arm and trace: prefill tokens computed (prompt tokens less those the prefill server reused), tokens replayed,
reused share of the matchable tokens (the longest common prefix with any earlier prompt or answer, capped at len - 1),
exact hits, TTFT p50 / p99, requests/s, and what crossed the wire (KV tokens and bytes, one recurrent state per
request). Prints a table, writes the JSON and a PNG next to it.
"""

import argparse
import contextlib
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
from tailreplay_eval.memory import account, device_bytes_per_token
from tailreplay_eval.prefix_traffic import add_traffic_args
from tailreplay_eval.server import (PD_ENV, PDRouterProcess, ServerProcess, flush_cache, free_port, pd_decode_args,
                                    pd_prefill_args)

ARMS = {"stock": (), "Tail-Replay": ("--enable-tail-replay",)}
TRACES = {"RAG / agent": False, "multi-turn chat": True}  # trace -> whether answers are fed back
# A prefill server busy with long prompts on two cores misses the router's 5-second health checks: with its circuit
# breaker on, the router then refuses every request for that server (HTTP 503, seen in a first run of this script)
ROUTER_ARGS = ("--disable-circuit-breaker", "--health-check-timeout-secs", "120", "--health-failure-threshold", "100")


@contextlib.contextmanager
def deployment(model_path: Path, flags: tuple, kv_tokens: int, log_stem: Path):
    """A prefill server, a decode server and the PD router, all stopped by PID however we leave."""
    port = free_port()
    prefill = ServerProcess(str(model_path), (*flags, *pd_prefill_args(port)), env=PD_ENV, max_total_tokens=kv_tokens,
                            log_path=log_stem.with_suffix(".prefill.log"))
    decode = ServerProcess(str(model_path), (*flags, *pd_decode_args()), env=PD_ENV, max_total_tokens=kv_tokens,
                           log_path=log_stem.with_suffix(".decode.log"))
    router = PDRouterProcess(prefills=((prefill.base_url, port),), decodes=(decode.base_url,), extra_args=ROUTER_ARGS,
                             log_path=log_stem.with_suffix(".router.log"))
    started = []
    try:
        for server in (prefill, decode):
            started.append(server.start())
        for server in (prefill, decode):
            server.wait_healthy(900)
        started.append(router.start())
        router.wait_healthy(120)
        yield prefill, router
    finally:
        for server in started:
            server.stop()


def run_trace(router_url: str, prefill_url: str, conversation: bool, tok, args) -> dict:
    flush_cache(prefill_url)
    seen, records, lock = harness.Seen(), [], threading.Lock()

    def client(prefix_and_questions):
        prefix, questions = prefix_and_questions
        history = ""
        for question in questions:
            text = f"{prefix}{history}\nUser: {question}\nAssistant:"
            ids = tok(text).input_ids
            with lock:
                matchable = seen.matchable(ids)
            out = stream_generate(router_url, text, args.gen_tokens)
            meta = out["meta_info"]
            with lock:
                seen.add(ids, out["output_ids"])
                records.append({"prompt_tokens": meta["prompt_tokens"], "matchable": matchable,
                                "cached": meta["cached_tokens"], "replayed": meta.get("tail_replay_tokens", 0),
                                "exact": meta.get("tail_replay_exact", True), "ttft_s": out["ttft_s"]})
            if conversation:
                history += f"\nUser: {question}\nAssistant:" + tok.decode(out["output_ids"])

    started = time.perf_counter()
    work = document_clients(args.clients, args.requests, args.system_words, seed=300 if conversation else 400)
    with ThreadPoolExecutor(len(work)) as pool:
        list(pool.map(client, work))
    wall = time.perf_counter() - started
    ttfts = [r["ttft_s"] for r in records]
    prompt, cached = sum(r["prompt_tokens"] for r in records), sum(r["cached"] for r in records)
    hits = [r for r in records if r["cached"] > 0]
    return {"requests": len(records), "wall_s": wall, "prompt_tokens": prompt, "cached": cached,
            "matchable": sum(r["matchable"] for r in records), "computed": prompt - cached,
            "replayed": sum(r["replayed"] for r in records), "hits": len(hits),
            "exact_hits": sum(r["exact"] for r in hits), "ttft_p50_s": float(np.percentile(ttfts, 50)),
            "ttft_p99_s": float(np.percentile(ttfts, 99)), "requests_per_s": len(records) / wall,
            # no decode radix cache: every prompt token's KV and one recurrent state per request cross the wire
            "kv_tokens_sent": prompt, "records": records}


def add_wire_bytes(result: dict, wire: dict) -> None:
    result["transfer_bytes"] = (result["kv_tokens_sent"] * wire["kv_bytes_per_token"]
                                + result["requests"] * wire["state_bytes"])


def table(results: dict) -> Table:
    t = Table(title="PD disaggregation behind the PD router: stock against Tail-Replay, equal device memory")
    for col in ("trace", "arm", "prefill tokens computed", "replayed", "reused / matchable", "exact hits",
                "TTFT p50 (s)", "TTFT p99 (s)", "req/s", "transferred"):
        t.add_column(col, justify="right")
    for trace, by_arm in results.items():
        for arm, r in by_arm.items():
            reuse = r["cached"] / r["matchable"] if r["matchable"] else 0.0
            t.add_row(trace, arm, f"{r['computed']:,} of {r['prompt_tokens']:,}", f"{r['replayed']:,}",
                      f"{r['cached']:,} / {r['matchable']:,} ({100 * reuse:.1f} %)", f"{r['exact_hits']}/{r['hits']}",
                      f"{r['ttft_p50_s']:.2f}", f"{r['ttft_p99_s']:.2f}", f"{r['requests_per_s']:.2f}",
                      f"{r['transfer_bytes'] / 2**20:.1f} MiB")
    return t


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("computed", "prefill tokens computed"), ("ttft_p50_s", "TTFT p50 (s)"),
               ("ttft_p99_s", "TTFT p99 (s)"))
    fig, axes = plt.subplots(1, len(metrics), figsize=(13, 4))
    traces, arms = list(results), list(ARMS)
    width = 0.8 / len(arms)
    for ax, (metric, label) in zip(axes, metrics):
        for i, arm in enumerate(arms):
            ax.bar(np.arange(len(traces)) + i * width, [results[t][arm][metric] for t in traces], width, label=arm)
        ax.set_xticks(np.arange(len(traces)) + width * (len(arms) - 1) / 2, traces)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("PD (prefill + decode over Mooncake TCP) behind the PD router, 2-core CPU")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "pd.json")
    add_traffic_args(ap, clients=2)
    ap.add_argument("--kv-tokens", type=int, default=16384, help="the stock prefill server's KV pool, in tokens")
    args = ap.parse_args(argv)
    run = harness.Run.begin(args)
    console = Console(width=160)
    tok = AutoTokenizer.from_pretrained(run.model_path)
    flags = {arm: (*run.server_args, *extra) for arm, extra in ARMS.items()}
    stock_bytes = device_bytes_per_token(run.model_path, run.server_args, ())
    pools = {arm: args.kv_tokens * stock_bytes // device_bytes_per_token(run.model_path, run.server_args, extra)
             for arm, extra in ARMS.items()}
    acc = account(run.model_path, run.server_args)
    wire = {"kv_bytes_per_token": acc["fa_kv_bytes_per_token"],
            "state_bytes": int(acc["kv_tokens_per_mamba_slot"] * acc["fa_kv_bytes_per_token"])}
    results = {trace: {} for trace in TRACES}
    with contextlib.ExitStack() as stack:
        running = {arm: stack.enter_context(deployment(run.model_path, flags[arm], pools[arm],
                                                       run.out.with_name(f"{run.out.stem}-{arm.lower()}.x")))
                   for arm in ARMS}
        for trace, conversation in TRACES.items():
            for arm, (prefill, router) in running.items():
                r = results[trace][arm] = run_trace(router.base_url, prefill.base_url, conversation, tok, args)
                add_wire_bytes(r, wire)
                console.print(f"  {trace} / {arm}: computed {r['computed']:,} of {r['prompt_tokens']:,} prompt "
                              f"tokens, TTFT p50 {r['ttft_p50_s']:.2f} s")
    console.print(table(results))
    plot(results, run.out.with_suffix(".png"))
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": run.server_args, "kv_pool_tokens": pools, "wire": wire,
              "workload": {k: getattr(args, k) for k in ("clients", "requests", "system_words", "gen_tokens")},
              "results": results}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
