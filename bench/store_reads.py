"""A storage hit's time on a Mooncake store while the server whose segment holds its pages is idle or busy.

    python bench/store_reads.py [--preset small] [--context 480] [--busy 6000] [--reps 3] [--out runs/store_reads.json]

Why: in docs/results.md 2i storage hits took 26-82 s where a full prefill took 6-7 s, and a write logged "no
transfer progress within 30s". Over Mooncake's TCP transport a read of a page in another client's segment is served
by that client's transfer-engine threads, in that server's process. Two Tail-Replay servers (SGLang's GPU
scheduling, `mooncake_store.server_flags`, one `mooncake_master`), A pinned to core 0 and B to core 1
(`SGLANG_CPU_OMP_THREADS_BIND`, as bench/router.py pins workers). A computes a context; B, flushed, hits it in the
store (within the exact budget: no state is read). Three conditions, each --reps times on fresh contexts:
- idle: nothing else runs;
- A busy: A prefills a --busy-token prompt while B's hit runs (B's core is free);
- B's no-cache prefill of the same prompt while A is busy (what the hit saves, on the same cores).
The store places each page in some client's segment, so part of every hit is read from A's. Prints a table (TTFT
p50 per condition) and writes the JSON with every request.
"""

import argparse
import concurrent.futures
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import harness
from tailreplay_eval.client import stream_generate
from tailreplay_eval.mooncake_store import MooncakeMaster, server_flags
from tailreplay_eval.server import flush_cache

QUESTION = 32


def ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(10, vocab) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "store_reads.json")
    ap.add_argument("--context", type=int, default=480, help="tokens of the stored context B hits (within 512)")
    ap.add_argument("--busy", type=int, default=6000, help="tokens of the prompt that keeps A busy")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    run, console = harness.Run.begin(args), Console(width=150)
    vocab, rng = harness.vocab_size(run.model_path), random.Random(args.seed)
    cores = sorted(os.sched_getaffinity(0))
    master = MooncakeMaster(log_path=run.out.with_suffix(".mooncake.log")).start().wait_healthy(timeout=60)
    flags = (*run.server_args, "--enable-tail-replay", *server_flags(master.address))
    rows = []
    try:
        with harness.running_servers(run.model_path, {"A": flags, "B": flags}, run.out, console,
                                     envs={"A": {"SGLANG_CPU_OMP_THREADS_BIND": str(cores[0])},
                                           "B": {"SGLANG_CPU_OMP_THREADS_BIND": str(cores[-1])}},
                                     gpu_scheduling=True, max_total_tokens=16384) as servers:
            a, b = servers["A"].base_url, servers["B"].base_url
            for rep in range(args.reps):
                for condition in ("idle", "A busy", "B no cache, A busy"):
                    context = ids(rng, args.context, vocab)
                    stream_generate(a, context, 1)
                    time.sleep(2)  # the pages reach the store from A's storage thread
                    flush_cache(b)
                    prompt = context + ids(rng, QUESTION, vocab)
                    extra = {"extra_key": f"no-cache {rep}"} if condition.startswith("B no cache") else {}
                    with concurrent.futures.ThreadPoolExecutor(1) as pool:
                        busy = pool.submit(stream_generate, a, ids(rng, args.busy, vocab), 1) \
                            if "busy" in condition else None
                        if busy is not None:
                            time.sleep(0.5)  # A is inside its prefill
                        hit = stream_generate(b, prompt, 1, **extra)
                        busy_s = busy.result()["ttft_s"] if busy is not None else None
                    meta = hit["meta_info"]
                    rows.append({"rep": rep, "condition": condition, "ttft_s": hit["ttft_s"],
                                 "cached": meta["cached_tokens"],
                                 "storage": (meta.get("cached_tokens_details") or {}).get("storage", 0),
                                 "busy_prefill_s": busy_s})
                    console.print(rows[-1])
    finally:
        master.stop()
    table = Table(title=f"A storage hit of {args.context} + {QUESTION} tokens on B, pages partly in A's segment")
    for column in ("condition", "TTFT p50 (s)", "TTFT max (s)", "tokens from the store (p50)"):
        table.add_column(column)
    for condition in dict.fromkeys(r["condition"] for r in rows):
        got = [r for r in rows if r["condition"] == condition]
        table.add_row(condition, f"{statistics.median(r['ttft_s'] for r in got):.2f}",
                      f"{max(r['ttft_s'] for r in got):.2f}", f"{statistics.median(r['storage'] for r in got):.0f}")
    console.print(table)
    run.out.write_text(json.dumps({"command": " ".join([Path(sys.executable).name, *sys.argv]),
                                   "machine_before": run.machine_before, "machine_after": harness.machine(),
                                   "elapsed_s": run.elapsed(), "model": str(run.model_path),
                                   "server_args": list(flags), "rows": rows}, indent=1))
    console.print(f"wrote {run.out}")


if __name__ == "__main__":
    main()
