"""Tail-Replay under memory pressure at equal device memory: a multi-tenant trace on a small mamba pool, and the
multi-turn chat where stock already hits exactly.

    python bench/pressure.py [--preset small] [--budget-mib 160] [--mamba-slots 12] [--host-anchors 256] \
        [--hicache-gb 2] [--arms ...] [--tenants 3] [--clients 4] [--scale 1.0] [--chat-clients 3] [--chat-turns 8] \
        [--tp 1] [--out runs/pressure.json]

Every server runs SGLang's GPU-default scheduling (no strategy flag: extra_buffer with the overlap scheduler), as
users run it.

Pressure trace. Arms (`--arms`): stock, Tail-Replay with device anchors only (evicted least recently used first:
`--tail-replay-anchor-keep lru`, and the default `ends`: branch points and path ends kept first), Tail-Replay with
`--tail-replay-host-anchors`, and stock and Tail-Replay with SGLang's HiCache host tier (`--hicache-size
--hicache-gb` of host memory for KV and states, the `direct` io backend the CPU port provides; Tail-Replay's hidden
rows go to a host twin of the KV host pool beside it).
Equal device memory: each server's token pool gets `--budget-mib` over the bytes per token it charges to the device
(FA KV, plus the stored hiddens for Tail-Replay: `tailreplay_eval.memory.device_bytes_per_token`), and all get the
same `--mamba-slots` device states (running requests, stock's checkpoints, Tail-Replay's anchors) and 4 running
requests; host anchors and the HiCache host tier live in host memory and are not charged. The trace, the same token
ids for every arm (answers are each server's own): `--tenants` system prompts of 1024 tokens, each with
- two chats of 4 turns (a 48-token question, a 16-token answer fed back),
- a 1500-token document sent once and then forked 3 times at random points with 48 new tokens,
- a long continuation: the document, its answer and 600 more tokens, twice growing;
as sessions taken in a fixed order by `--clients` concurrent clients (each runs one session's requests in order).
Per arm: hits (requests with cached tokens), the share of hits reported exact (`tail_replay_exact`; a stock hit is
always exact: it hits only on a kept state), reuse (cached / matchable tokens, matchable as in bench/workloads.py),
TTFT p50 / p99, requests/s over the trace, and from `/server_info` the anchors evicted and host-anchor hits.

At TP > 1 (`--tp 2`: issue 63's equal-memory comparison) the arms are stock and Tail-Replay with its hidden store
sharded over the attention-TP ranks (the default) or replicated on each (`--tail-replay-store-tp replicate`), and
`--budget-mib` is each rank's: its tokens are the budget over the rank's device bytes per token
(`memory.account_per_rank`: the rank's KV heads, and its part of each stored row or whole rows). Each rank runs on
its own core (`SGLANG_CPU_OMP_THREADS_BIND`).

Chat A/B. Stock and Tail-Replay (defaults) with roomy pools: `--chat-clients` chats over their own 1024-token
document, `--chat-turns` turns each, the two servers asked alternately (the same prompt text; each keeps its own
answers), one request in flight, so drift of the machine is charged to both. Stock hits every turn at its last
track point; the table gives TTFT p50 / mean of turns 2+ and Tail-Replay's ratio to stock.

Writes a JSON (every request), the tables, and a PNG (TTFT distribution per arm).
"""

import argparse
import contextlib
import json
import queue
import random
import sys
import threading
import time
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.table import Table

from tailreplay_eval import harness
from tailreplay_eval.client import stream_generate
from tailreplay_eval.memory import account_per_rank, device_bytes_per_token, serving_dtype_name
from tailreplay_sglang.pool_report import KEY as POOLS_KEY

ARMS = {"stock": (), "Tail-Replay, device anchors, LRU": ("--enable-tail-replay", "--tail-replay-anchor-keep", "lru"),
        "Tail-Replay, device anchors (keep ends)": ("--enable-tail-replay",),
        "Tail-Replay, host anchors": ("--enable-tail-replay", "--tail-replay-host-anchors"),  # + N
        "stock, HiCache host tier": ("--enable-hierarchical-cache", "--hicache-io-backend", "direct",
                                     "--hicache-size"),  # + GB
        "Tail-Replay, HiCache host tier": ("--enable-tail-replay", "--enable-hierarchical-cache",
                                           "--hicache-io-backend", "direct", "--hicache-size")}  # + GB
# At TP > 1: the store sharded over the ranks, or whole rows on each (issue 63), against stock
TP_ARMS = {"stock": (), "Tail-Replay, sharded store": ("--enable-tail-replay",),
           "Tail-Replay, replicated store": ("--enable-tail-replay", "--tail-replay-store-tp", "replicate")}
TP_BYTES = {"stock": "stock", "Tail-Replay, sharded store": "sharded", "Tail-Replay, replicated store": "replicated"}
SERVER_FLAGS = ("--enable-cache-report",)
SYSTEM_TOKENS, DOC_TOKENS, QUESTION_TOKENS, ANSWER_TOKENS, CONTINUATION_TOKENS = 1024, 1500, 48, 16, 600


class Arm:
    """One server of an arm and what it has seen (for matchable tokens)."""

    def __init__(self, label: str, url: str):
        self.label, self.url = label, url
        self.seen = harness.Seen()
        self.records: list[dict] = []
        self.lock = threading.Lock()

    def send(self, session: str, ids: list[int], max_new_tokens: int = ANSWER_TOKENS) -> list[int]:
        # Matchable against everything sent before, in flight included: a running request's prefill chunks are
        # already in the tree when a concurrent one matches.
        matchable = self.seen.matchable(ids)
        self.seen.add(ids, [0])
        started = time.perf_counter()
        r = stream_generate(self.url, ids, max_new_tokens)
        self.seen.add(ids, r["output_ids"])
        meta = r["meta_info"]
        with self.lock:
            self.records.append({"session": session, "prompt_tokens": len(ids), "matchable": matchable,
                                 "cached": meta["cached_tokens"], "exact": meta.get("tail_replay_exact", True),
                                 "host_cached": (meta.get("cached_tokens_details") or {}).get("host", 0),
                                 "replayed": meta.get("tail_replay_tokens", 0),
                                 "replay_ms": meta.get("tail_replay_ms", 0.0), "ttft_s": r["ttft_s"],
                                 "latency_s": time.perf_counter() - started})
        return r["output_ids"]


# ---- the pressure trace: sessions, each a function of (arm, send) with its content drawn up front -------------

def tenant_sessions(tenant: int, rng: random.Random, heads: harness.DistinctHeads, vocab: int, scale: float):
    n = lambda tokens: max(4, round(tokens * scale))  # noqa: E731
    system = heads.sequence(rng, n(SYSTEM_TOKENS), vocab)
    doc = harness.random_ids(rng, n(DOC_TOKENS), vocab)
    sessions = []
    for c in range(2):
        questions = [harness.random_ids(rng, n(QUESTION_TOKENS), vocab) for _ in range(4)]

        def chat(arm, questions=questions, name=f"tenant {tenant} chat {c}"):
            history = list(system)
            for q in questions:
                history += q
                history += arm.send(name, history)
        sessions.append(chat)
    points = [rng.randrange(len(system) + n(100), len(system) + len(doc)) for _ in range(3)]
    tails = [harness.random_ids(rng, n(QUESTION_TOKENS), vocab) for _ in points]

    def forks(arm, name=f"tenant {tenant} forks"):
        full = system + doc
        arm.send(name, full)
        for point, tail in zip(points, tails):
            arm.send(name, full[:point] + tail)
    sessions.append(forks)
    more = [harness.random_ids(rng, n(CONTINUATION_TOKENS // 2), vocab) for _ in range(2)]

    def continuation(arm, name=f"tenant {tenant} continuation"):
        history = system + doc
        history += arm.send(name, history)
        for part in more:
            history += part
            history += arm.send(name, history)
    sessions.append(continuation)
    return sessions


def trace(args, vocab: int) -> list:
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    per_tenant = [tenant_sessions(t, rng, heads, vocab, args.scale) for t in range(args.tenants)]
    order = [s for group in zip(*per_tenant) for s in group]  # tenants interleaved, kinds in turn
    return order


def run_trace(arm: Arm, sessions: list, clients: int) -> float:
    todo = queue.Queue()
    for s in sessions:
        todo.put(s)
    errors = []

    def client():
        while True:
            try:
                session = todo.get_nowait()
            except queue.Empty:
                return
            try:
                session(arm)
            except Exception as e:  # noqa: BLE001 - reported after the run
                errors.append(repr(e))

    started = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"{arm.label}: {len(errors)} sessions failed: {errors[:3]}")
    return time.perf_counter() - started


def pools(url: str) -> dict:
    """The plugin's pool report (`pool_report.py`); {} on a stock server."""
    states = harness.server_info(url).get("internal_states", [])
    return next((s[POOLS_KEY] for s in states if POOLS_KEY in s), {})


def summarize(arm: Arm, wall_s: float, before: dict, after: dict) -> dict:
    recs = arm.records
    hits = [r for r in recs if r["cached"] > 0]
    host_hits = [r for r in hits if r.get("host_cached", 0) > 0]
    ttft = np.array([r["ttft_s"] for r in recs])
    matchable, cached = sum(r["matchable"] for r in recs), sum(r["cached"] for r in recs)
    delta = lambda key: after.get(key, 0) - before.get(key, 0)  # noqa: E731
    return {"arm": arm.label, "requests": len(recs), "hits": len(hits),
            "exact_hits": sum(r["exact"] for r in hits), "exact_share": sum(r["exact"] for r in hits) / len(hits),
            "matchable": matchable, "cached": cached, "reuse": cached / matchable if matchable else None,
            "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
            "requests_per_s": len(recs) / wall_s, "wall_s": wall_s, "evicted_anchors": delta("evicted_anchors"),
            "host_anchor_hits": delta("host_anchor_hits"), "host_anchor_copy_ms": delta("host_anchor_copy_ms"),
            # HiCache arms: hits that loaded KV back from the host tier, and the replay time they took (on a GPU
            # it runs while the later layers' KV still loads; on this CPU the load is done before the forward)
            "host_hits": len(host_hits), "host_hit_replay_ms": sum(r["replay_ms"] for r in host_hits),
            "hicache_anchor_hits": delta("hicache_anchor_hits")}


def pressure_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("arm", "requests", "hits", "exact hits", "reuse (cached / matchable)", "TTFT p50 (s)",
                "TTFT p99 (s)", "req/s", "anchors evicted", "hits on host anchors", "host-tier hits (replay ms)"):
        t.add_column(col, justify="left" if col == "arm" else "right")
    for r in rows:
        t.add_row(r["arm"], str(r["requests"]), str(r["hits"]),
                  f"{r['exact_hits']} ({100 * r['exact_share']:.0f} %)",
                  f"{r['cached']:,} / {r['matchable']:,} ({100 * r['reuse']:.1f} %)", f"{r['ttft_p50_s']:.3f}",
                  f"{r['ttft_p99_s']:.3f}", f"{r['requests_per_s']:.2f}", str(r["evicted_anchors"]),
                  str(r["host_anchor_hits"] + r.get("hicache_anchor_hits", 0)),
                  f"{r.get('host_hits', 0)} ({r.get('host_hit_replay_ms', 0):.0f})")
    return t


# ---- the chat A/B: stock hits exactly on every turn ----------------------------------------------------------

def chat_ab(arms: dict[str, Arm], args, vocab: int) -> dict:
    rng = random.Random(args.seed + 1)
    heads = harness.DistinctHeads(rng, vocab)
    chats = [{"doc": heads.sequence(rng, SYSTEM_TOKENS, vocab),
              "questions": [harness.random_ids(rng, QUESTION_TOKENS, vocab) for _ in range(args.chat_turns)]}
             for _ in range(args.chat_clients)]
    history = {(label, c): list(chat["doc"]) for label in arms for c, chat in enumerate(chats)}
    for turn in range(args.chat_turns):
        for c, chat in enumerate(chats):
            labels = list(arms) if (turn + c) % 2 == 0 else list(reversed(arms))  # alternate who goes first
            for label in labels:
                h = history[(label, c)]
                h += chat["questions"][turn]
                h += arms[label].send(f"chat {c} turn {turn}", h)
    out = {}
    for label, arm in arms.items():
        follow_ups = [r for r in arm.records if not r["session"].endswith("turn 0")]
        ttft = [r["ttft_s"] for r in follow_ups]
        out[label] = {"turns": len(follow_ups), "ttft_p50_s": float(np.median(ttft)),
                      "ttft_mean_s": float(np.mean(ttft)),
                      "cached_share": (sum(r["cached"] for r in follow_ups)
                                       / sum(r["prompt_tokens"] for r in follow_ups)),
                      "exact": all(r["exact"] for r in follow_ups)}
    return out


def chat_table(result: dict) -> Table:
    t = Table(title="Multi-turn chat where stock hits exactly (follow-up turns, alternating servers)")
    for col in ("server", "turns", "cached / prompt", "all exact", "TTFT p50 (s)", "TTFT mean (s)", "p50 vs stock"):
        t.add_column(col, justify="left" if col == "server" else "right")
    base = result["stock"]["ttft_p50_s"]
    for label, r in result.items():
        t.add_row(label, str(r["turns"]), f"{100 * r['cached_share']:.1f} %", str(r["exact"]),
                  f"{r['ttft_p50_s']:.3f}", f"{r['ttft_mean_s']:.3f}", f"{r['ttft_p50_s'] / base:.3f}x")
    return t


def plot(arms: dict[str, Arm], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 3.6))
    for label, arm in arms.items():
        ttft = np.sort([r["ttft_s"] for r in arm.records])
        ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=label)
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (s)")
    ax.set_ylabel("share of requests")
    ax.set_title("Multi-tenant trace on a small mamba pool, equal device memory", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def arm_flags(args, run) -> tuple[dict[str, tuple], dict[str, int]]:
    """Each pressure arm's server flags, and the tokens its pool gets at `--budget-mib` of device memory (per rank
    at TP > 1)."""
    if args.tp > 1:
        dtype = serving_dtype_name(run.model_path, run.server_args)
        per_rank = account_per_rank(run.model_path, args.tp, hidden_dtype=dtype, flags=run.server_args)
        arms = {label: arm for label, arm in TP_ARMS.items() if label in (args.arms or TP_ARMS)}
        flags = {label: (*SERVER_FLAGS, *arm, "--tp-size", str(args.tp)) for label, arm in arms.items()}
        tokens = {label: int(args.budget_mib * 2**20 // per_rank[TP_BYTES[label]]["device_bytes_per_token"])
                  for label in flags}
        return flags, tokens
    sizes = {"--tail-replay-host-anchors": str(args.host_anchors), "--hicache-size": f"{args.hicache_gb:g}"}
    flags = {label: (*SERVER_FLAGS, *arm, *((sizes[arm[-1]],) if arm and arm[-1] in sizes else ()))
             for label, arm in ARMS.items() if label in (args.arms or ARMS)}
    tokens = {label: int(args.budget_mib * 2**20 // device_bytes_per_token(run.model_path, run.server_args, f))
              for label, f in flags.items()}
    return flags, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "pressure.json")
    ap.add_argument("--budget-mib", type=float, default=160, help="device memory for each server's token pool")
    ap.add_argument("--mamba-slots", type=int, default=12, help="--max-mamba-cache-size of every pressure server")
    ap.add_argument("--host-anchors", type=int, default=256, help="--tail-replay-host-anchors of the host arm")
    ap.add_argument("--hicache-gb", type=float, default=2, help="--hicache-size of the HiCache arm (host memory)")
    ap.add_argument("--arms", nargs="+", choices=[*ARMS, *TP_ARMS], help="pressure arms to run (default: every arm "
                    "of ARMS, or of TP_ARMS at --tp > 1)")
    ap.add_argument("--tp", type=int, default=1, help="--tp-size of every server; > 1: the store-layout arms")
    ap.add_argument("--tenants", type=int, default=3)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--scale", type=float, default=1.0, help="multiplies every token count of the trace")
    ap.add_argument("--chat-clients", type=int, default=3)
    ap.add_argument("--chat-turns", type=int, default=8, help="0: skip the chat A/B")
    ap.add_argument("--parts", nargs="+", choices=("pressure", "chat"), default=["pressure", "chat"])
    args = ap.parse_args()
    run = harness.Run.begin(args)
    console = Console(width=170)
    vocab = harness.vocab_size(run.model_path)
    flags, tokens = arm_flags(args, run)
    configs = {label: (*f, *run.server_args, "--max-total-tokens", str(tokens[label]), "--max-mamba-cache-size",
                       str(args.mamba_slots)) for label, f in flags.items()}
    pinned = {"SGLANG_CPU_OMP_THREADS_BIND": "|".join(str(r % 2) for r in range(args.tp))} if args.tp > 1 else {}
    console.print(f"[bold]{args.budget_mib:g} MiB of device memory, {args.mamba_slots} mamba slots[/] -> max total "
                  f"tokens {tokens}")
    sessions = trace(args, vocab)
    rows, trace_records = [], None
    with (harness.running_servers(run.model_path, configs, run.out.with_name(f"{run.out.stem}.pressure"), console,
                                  max_running_requests=4, gpu_scheduling=True, env=pinned)
          if "pressure" in args.parts else contextlib.nullcontext({})) as servers:
        arms = {label: Arm(label, s.base_url) for label, s in servers.items()}
        for label, arm in arms.items():  # one arm at a time: the others idle
            before = pools(arm.url)
            wall = run_trace(arm, sessions, args.clients)
            rows.append(summarize(arm, wall, before, pools(arm.url)))
            console.print(f"  {label}: {rows[-1]['exact_hits']} of {rows[-1]['hits']} hits exact, "
                          f"TTFT p50 {rows[-1]['ttft_p50_s']:.3f} s, {wall:.0f} s")
        if rows:
            console.print(pressure_table(rows, f"Multi-tenant trace, {args.mamba_slots} mamba slots, "
                                               f"{args.budget_mib:g} MiB of device memory per server"))
            plot(arms, run.out.with_suffix(".png"))
            trace_records = {label: arm.records for label, arm in arms.items()}
    chat = None
    if args.chat_turns and "chat" in args.parts:
        ab = {"stock": (*SERVER_FLAGS, *run.server_args), "Tail-Replay": (*SERVER_FLAGS, "--enable-tail-replay",
                                                                          *run.server_args)}
        with harness.running_servers(run.model_path, ab, run.out.with_name(f"{run.out.stem}.chat"), console,
                                     gpu_scheduling=True) as servers:
            arms_ab = {label: Arm(label, s.base_url) for label, s in servers.items()}
            chat = chat_ab(arms_ab, args, vocab)
            console.print(chat_table(chat))
            chat_records = {label: arm.records for label, arm in arms_ab.items()}
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": run.machine_before,
              "machine_after": harness.machine(), "elapsed_s": run.elapsed(), "model": str(run.model_path),
              "server_args": run.server_args, "config": {k: v for k, v in vars(args).items() if k != "url"},
              "max_total_tokens": tokens, "pressure": rows, "pressure_records": trace_records, "chat": chat,
              "chat_records": chat_records if chat else None}
    run.out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {run.out} and {run.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
