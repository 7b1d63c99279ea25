"""Where a cold prefill's variable time goes on CPU: page faults. Stock and Tail-Replay side by side, under glibc's
own malloc policy and under the CPU port's (`sglang_cpu_compat/allocator.py`: freed memory stays with the process),
one fresh pair of servers per policy (issue 39).

    python bench/page_faults.py [--length 8192] [--reps 4] [--out runs/page_faults.json]

Per request: TTFT of a one-token streaming request on a never-seen prompt, and the minor page faults, user and system
CPU seconds of the server's whole process tree over that request (from /proc). The first request of each server is
reported apart (it grows the heap under either policy). Alternating order, one request in flight.
"""

import argparse
import json
import random
import statistics

import psutil
from rich.console import Console
from rich.table import Table

from tailreplay_eval import client, harness

POLICIES = {"glibc": {"TAILREPLAY_CPU_GLIBC_MALLOC": "default"}, "kept": {}}
ARMS = ("stock", "tail_replay")


def counters(pid: int) -> tuple[int, float, float]:
    """Minor faults, user and system CPU seconds of a process and its descendants."""
    faults, user, system = 0, 0.0, 0.0
    for p in [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]:
        with open(f"/proc/{p.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # fields after the name: minflt is the 8th, utime and stime the 12th and 13th, in USER_HZ (100) ticks
        faults, user, system = faults + int(fields[7]), user + int(fields[11]) / 100, system + int(fields[12]) / 100
    return faults, user, system


def measured(server, ids: list[int]) -> dict:
    before = counters(server.proc.pid)
    r = client.stream_generate(server.base_url, ids, max_new_tokens=1)
    after = counters(server.proc.pid)
    assert r["meta_info"]["cached_tokens"] == 0, r["meta_info"]
    return {"ttft_s": r["ttft_s"], "faults": after[0] - before[0], "user_s": after[1] - before[1],
            "system_s": after[2] - before[2]}


def span(st: dict, fmt: str) -> str:
    return f"{st['p50']:{fmt}} ({st['min']:{fmt}}-{st['max']:{fmt}})"


def ratio(samples: list[dict], policy: str) -> float:
    """Median Tail-Replay / stock TTFT over the repetitions after the first (same prompt for both)."""
    by_rep = {}
    for s in samples:
        if s["policy"] == policy and s["rep"] > 0:
            by_rep.setdefault(s["rep"], {})[s["arm"]] = s["ttft_s"]
    return statistics.median(r["tail_replay"] / r["stock"] for r in by_rep.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "page_faults.json")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=4, help="measured requests per server after the first")
    args = ap.parse_args()
    console, run_ = Console(width=150), harness.Run.begin(args)
    vocab = harness.vocab_size(run_.model_path)
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    configs = {"stock": run_.server_args, "tail_replay": [*run_.server_args, "--enable-tail-replay"]}
    samples = []
    for policy, env in POLICIES.items():
        with harness.running_servers(run_.model_path, configs, run_.out, console, envs={a: env for a in ARMS},
                                     max_total_tokens=4 * (args.length + 1024),
                                     context_length=args.length + 1024) as servers:
            for rep in range(args.reps + 1):
                ids = heads.sequence(rng, args.length, vocab)
                for arm in ARMS if rep % 2 == 0 else ARMS[::-1]:
                    samples.append({"policy": policy, "arm": arm, "rep": rep, **measured(servers[arm], ids)})
    rows = []
    table = Table(title=f"Cold {args.length}-token prefill: per request after each server's first (median, min-max)")
    for col in ("policy", "server", "first TTFT s", "TTFT s", "minor faults", "system CPU s", "user CPU s"):
        table.add_column(col)
    for policy in POLICIES:
        for arm in ARMS:
            mine = [s for s in samples if s["policy"] == policy and s["arm"] == arm]
            rest = [s for s in mine if s["rep"] > 0]
            row = {"policy": policy, "arm": arm, "first": mine[0],
                   **{k: harness.stats([s[k] for s in rest]) for k in ("ttft_s", "faults", "user_s", "system_s")}}
            rows.append(row)
            table.add_row(policy, arm, f"{mine[0]['ttft_s']:.2f}", *(span(row[k], f) for k, f in (
                ("ttft_s", ".2f"), ("faults", ".0f"), ("system_s", ".2f"), ("user_s", ".2f"))))
    console.print(table)
    result = {"machine_before": run_.machine_before, "machine_after": harness.machine(), "args": vars(args),
              "model": str(run_.model_path), "server_args": run_.server_args, "rows": rows, "samples": samples,
              "median_ttft_ratio": {p: ratio(samples, p) for p in POLICIES},
              "elapsed_s": run_.elapsed()}
    run_.out.write_text(json.dumps(result, indent=1))
    console.print(f"Tail-Replay / stock TTFT (median): {result['median_ttft_ratio']}; wrote {run_.out}")


if __name__ == "__main__":
    main()
