"""Tail-Replay under load at equal device memory, through SGLang's own `python -m sglang.bench_serving`.

    python bench/load.py [--preset small] [--budget-mib 128] [--tight-budget-mib 24] [--rates 1 2 4] \
        [--groups 3] [--prompts-per-group 8] [--system-len 1024] [--question-len 64] [--output-len 16] \
        [--out runs/load.json]

Systems (all three servers up at once, interleaved run by run): stock, Tail-Replay with its hidden store on the device
(`--tail-replay-hidden-tier device`) and in host
memory (`host`). Equal memory: every server gets the same device-memory budget for its token pool, and its
`--max-total-tokens` is that budget over the bytes per token its pool charges to the device (FA KV; plus the stored
hiddens on the device tier; `bench/memory.py`'s accounting). So a device-tier server holds fewer tokens than stock;
a host-tier one as many (its hiddens live in host memory, free on a GPU server; on this CPU host and device are the
same memory, so the host tier's copies cost time but its memory is not charged).

Workloads, each a bench_serving dataset with fixed seeds and Poisson arrivals at every `--rates` value, from a
flushed cache:
- shared prefix: `generated-shared-prefix`, `--groups` system prompts of `--system-len` tokens, each followed by
  `--prompts-per-group` questions of `--question-len` tokens, in shuffled order;
- multi-turn chat: the same generator with 3 turns per conversation (`--gsp-num-turns 3`, backend
  `sglang-oai-chat`: each turn's answer is fed back through the chat template), half as many conversations;
- no reuse: `random-ids`, prompts as long as the shared-prefix ones and nothing shared: what capture costs.
Pools: `--budget-mib` (the shared-prefix working set fits stock's pool, not the device tier's) runs all three
workloads; `--tight-budget-mib` (smaller than the working set for every system) runs the shared-prefix one.

Per run: requests/s, output and input tokens/s, TTFT p50 / p99 (bench_serving's), cached / prompt tokens
(`--cache-report`), tokens evicted (`sglang:evicted_tokens_total`) and replayed (`sglang:tail_replay_tokens_total`)
during the run. Writes a JSON (every bench_serving record), a table and a PNG of p99 TTFT against request rate.
"""

import argparse
import json
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import bench_serving, harness
from tailreplay_eval.memory import device_bytes_per_token

SYSTEMS = {"stock": (), "Tail-Replay device": ("--enable-tail-replay", "--tail-replay-hidden-tier", "device"),
           "Tail-Replay host": ("--enable-tail-replay", "--tail-replay-hidden-tier", "host")}
SERVER_FLAGS = ("--enable-metrics", "--enable-cache-report")


def table(rows: list[dict]) -> Table:
    t = Table(title="Under load at equal device memory (bench_serving, Poisson arrivals)")
    for col in ("pool", "workload", "system", "tokens", "rate", "req/s", "out tok/s", "TTFT p50 (s)",
                "TTFT p99 (s)", "cached / prompt", "evicted", "replayed", "failed"):
        t.add_column(col, justify="right")
    for r in rows:
        s = r["summary"]
        share = s["cached_tokens"] / s["prompt_tokens"] if s["prompt_tokens"] else 0.0
        t.add_row(r["pool"], r["workload"], r["system"], f"{r['max_total_tokens']:,}", f"{r['rate']:g}",
                  f"{s['requests_per_s']:.2f}", f"{s['output_tokens_per_s']:.1f}", f"{s['ttft_p50_s']:.2f}",
                  f"{s['ttft_p99_s']:.2f}", f"{s['cached_tokens']:,} / {s['prompt_tokens']:,} ({100 * share:.0f} %)",
                  f"{s['evicted_tokens']:,.0f}", f"{s['replayed_tokens']:,.0f}", str(s["failed"]))
    return t


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["pool"], r["workload"]) for r in rows},
                    key=lambda p: (p[0] != "fits", bench_serving.WORKLOADS.index(p[1])))
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    for ax, (pool, workload) in zip(axes[0], panels):
        for system in SYSTEMS:
            pts = sorted((r["rate"], r["summary"]["ttft_p99_s"]) for r in rows
                         if (r["pool"], r["workload"], r["system"]) == (pool, workload, system))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=system)
        ax.set_title(f"{workload} ({pool} pool)", fontsize=9)
        ax.set_xlabel("request rate (req/s)")
        ax.set_yscale("log")
    axes[0][0].set_ylabel("TTFT p99 (s)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def measure(server, run, pool, mib, workload, name, flags, tokens, rate, args, console) -> dict:
    started = time.perf_counter()
    record = bench_serving.run(server, run.model_path, workload, rate, args,
                               run.out.with_suffix(".bench_serving.jsonl"))
    row = {"pool": pool, "budget_mib": mib, "workload": workload, "system": name, "flags": list(flags),
           "max_total_tokens": tokens, "rate": rate, "summary": bench_serving.summary(record),
           "bench_serving": record,
           "wall_s": time.perf_counter() - started}
    s = row["summary"]
    console.print(f"  {pool} / {workload} / {name} @ {rate:g}/s: {s['requests_per_s']:.2f} req/s, TTFT p50 "
                  f"{s['ttft_p50_s']:.2f} s p99 {s['ttft_p99_s']:.2f} s, cached {s['cached_tokens']} of "
                  f"{s['prompt_tokens']}, evicted {s['evicted_tokens']:.0f}")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "load.json")
    ap.add_argument("--budget-mib", type=float, default=128, help="device memory for each server's token pool")
    ap.add_argument("--tight-budget-mib", type=float, default=24, help="a pool smaller than the working set (0: skip)")
    ap.add_argument("--rates", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="requests/s (Poisson)")
    ap.add_argument("--groups", type=int, default=3)
    ap.add_argument("--prompts-per-group", type=int, default=8)
    ap.add_argument("--system-len", type=int, default=1024)
    ap.add_argument("--question-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--workloads", nargs="+", choices=bench_serving.WORKLOADS,
                    default=list(bench_serving.WORKLOADS))
    args = ap.parse_args()
    run = harness.Run.begin(args)
    console = Console(width=170)
    pools = {"fits": (args.budget_mib, args.workloads)}
    if args.tight_budget_mib:
        pools["tight"] = (args.tight_budget_mib, [w for w in args.workloads if w == "shared prefix"])
    rows = []
    for pool, (mib, workloads) in pools.items():
        tokens = {name: int(mib * 2**20 // device_bytes_per_token(run.model_path, run.server_args, flags))
                  for name, flags in SYSTEMS.items()}
        console.print(f"[bold]{pool} pool: {mib:g} MiB of device memory[/] -> max total tokens {tokens}")
        # All three servers up at once (idle ones sleep: --sleep-on-idle), and the systems interleaved per run, so
        # that a drift of the machine's speed over the run is charged to every system alike.
        configs = {name: (*SERVER_FLAGS, *flags, *run.server_args, "--max-total-tokens", str(tokens[name]))
                   for name, flags in SYSTEMS.items()}
        with harness.running_servers(run.model_path, configs, run.out.with_name(f"{run.out.stem}.{pool}.json"),
                                     console, max_running_requests=16) as servers:
            for workload in workloads:
                for rate in args.rates:
                    for name in SYSTEMS:
                        rows.append(measure(servers[name], run, pool, mib, workload, name, configs[name],
                                            tokens[name], rate, args, console))
    console.print(table(rows))
    plot(rows, run.out.with_suffix(".png"))
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": run.server_args, "config": {k: v for k, v in vars(args).items() if k != "url"},
              "rows": rows}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
