"""TTFT of a prefix-cache hit against a full prefill, on real SGLang servers: stock, and Tail-Replay at r = 0.05
and r = 0.10 (the paper's TTFT table, on the small model and this CPU).

    python bench/ttft.py [--preset small] [--lengths 2048 4096 8192 16384] [--with-32k] [--suffix-tokens 32] \
        [--full-reps 3] [--hit-reps 10] [--ratios 0.05 0.1] [--server-args "--dtype float32"] [--out runs/ttft.json]
    python bench/ttft.py --url stock=http://127.0.0.1:30000 --url tr=http://127.0.0.1:30001   # running servers

Protocol. One prefix P_L of random token ids per matched-prefix length L, and a short suffix (32 tokens).
1. All servers start at once and stay up; afterwards exactly one request is in flight at any time.
2. Warm-up, after /flush_cache: every server gets P_L + w_L once per length (timed: its first-seen prefill,
   which for Tail-Replay includes capturing the hiddens).
3. Repetitions, interleaved rep -> length -> arm (arm order rotated every rep) so drift hits all arms alike:
   - full prefill: a fresh random prefix of L tokens (never sent) + the suffix on the stock server; cached must be 0;
   - stock hit: P_L + a new suffix on the stock server; whatever stock's hybrid cache matches is reported
     (it holds a recurrent state only where a request or a prefill chunk ended);
   - Tail-Replay hit, one arm per ratio: P_L + the same new suffix; cached must be L and the replayed tokens
     clamp(ceil(r L), min, max).
   Full prefill gets --full-reps repetitions, hits --hit-reps; a stock arm that does not hit the whole prefix
   costs up to a prefill, so it gets --full-reps too.
Speedup = mean TTFT of the full prefill / mean TTFT of the arm (p50 ratio also reported). Writes JSON and a PNG.
"""

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
import harness  # noqa: E402
import memory  # noqa: E402
from harness import ROOT  # noqa: E402

# Default budget on the 2-core CPU, small model, float32: full prefill of 2K/4K/8K/16K takes ~2.5/6/15/45 s, so
# 3 warm-ups + 3 full reps of each length are ~7 min; hits take 0.2-2 s, so 10 reps of three hit arms ~2 min.
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384)


@dataclass(frozen=True)
class Arm:
    name: str
    server: str  # label of the server it runs on
    kind: str  # "full" | "hit"
    tail_replay: bool
    flags: tuple | None = None  # the server's flags when we started it (then the replayed tail is known)

    def expected_tail(self, model_path: Path, length: int) -> int | None:
        if not self.tail_replay or self.flags is None:
            return None
        return memory.tail_replay_config(model_path, self.flags).tail_len(length)


def server_configs(ratios: list[float], server_args: list[str]) -> dict[str, tuple]:
    configs = {"stock": tuple(server_args)}
    for r in ratios:
        configs[f"Tail-Replay r={r:.2f}"] = (*server_args, "--enable-tail-replay", "--tail-replay-ratio", str(r))
    return configs


def make_arms(servers: dict[str, dict]) -> list[Arm]:
    """A full-prefill arm on the first stock server (the first server if all are Tail-Replay), a hit arm on each."""
    full_on = next((label for label, s in servers.items() if not s["tail_replay"]), next(iter(servers)))
    arms = [Arm("full prefill", full_on, "full", servers[full_on]["tail_replay"])]
    for label, s in servers.items():
        arms.append(Arm(f"{label} hit", label, "hit", s["tail_replay"], s.get("flags")))
    return arms


def measure(base_url: str, ids: list[int]) -> dict:
    r = harness.stream_generate(base_url, ids, max_new_tokens=1)
    meta = r["meta_info"]
    return {"prompt_tokens": len(ids), "cached_tokens": meta["cached_tokens"],
            "tail_replay_tokens": meta.get("tail_replay_tokens", 0), "tail_replay_ms": meta.get("tail_replay_ms", 0.0),
            "ttft_s": r["ttft_s"]}


def check(arm: Arm, length: int, sample: dict, expected_tail: int | None) -> None:
    """Full prefill must not hit; a Tail-Replay hit must hit the whole prefix and replay the planned tail."""
    cached, replayed = sample["cached_tokens"], sample["tail_replay_tokens"]
    if arm.kind == "full" and cached != 0:
        raise RuntimeError(f"{arm.name} at {length}: a never-seen prefix got {cached} cached tokens")
    if arm.kind == "hit" and arm.tail_replay:
        if cached != length:
            raise RuntimeError(f"{arm.name} at {length}: cached {cached} tokens, expected the whole prefix")
        if (expected_tail is not None and replayed != expected_tail) or replayed <= 0:
            raise RuntimeError(f"{arm.name} at {length}: replayed {replayed} tokens, expected {expected_tail}")


def measure_arms(servers: dict[str, dict], arms: list[Arm], args, model_path: Path, console) -> tuple[list, list]:
    vocab = harness.vocab_size(model_path)
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    prefixes = {L: heads.sequence(rng, L, vocab) for L in args.lengths}
    tails = {(arm.name, L): arm.expected_tail(model_path, L) for arm in arms for L in args.lengths}

    def suffix() -> list[int]:
        # A distinct first token: the hit must be exactly the prefix, not the prefix plus a lucky suffix token.
        return heads.sequence(rng, args.suffix_tokens, vocab)

    for s in servers.values():
        harness.flush_cache(s["url"])
    warmup = []
    for L in args.lengths:
        w = suffix()
        for label, s in servers.items():
            sample = measure(s["url"], prefixes[L] + w)
            warmup.append({"server": label, "length": L, **sample})
            console.print(f"  warm-up {label:>22} L={L:>6}: {sample['ttft_s']:7.2f} s, "
                          f"cached {sample['cached_tokens']}")

    samples, stock_reps = [], {}
    for rep in range(max(args.full_reps, args.hit_reps)):
        t_rep = time.perf_counter()
        for L in args.lengths:
            s_rep = suffix()
            order = arms[rep % len(arms):] + arms[: rep % len(arms)]
            for arm in order:
                reps = args.full_reps if arm.kind == "full" else stock_reps.get((arm.name, L), args.hit_reps)
                if rep >= reps:
                    continue
                ids = (heads.sequence(rng, L, vocab) if arm.kind == "full" else prefixes[L]) + s_rep
                sample = measure(servers[arm.server]["url"], ids)
                check(arm, L, sample, tails[(arm.name, L)])
                if arm.kind == "hit" and not arm.tail_replay and rep == 0 and sample["cached_tokens"] < L:
                    stock_reps[(arm.name, L)] = args.full_reps  # a partial hit recomputes part of the prefix
                samples.append({"arm": arm.name, "server": arm.server, "length": L, "rep": rep, **sample})
                console.print(f"  rep {rep} L={L:>6} {arm.name:>30}: {sample['ttft_s']:7.3f} s, cached "
                              f"{sample['cached_tokens']}, replayed {sample['tail_replay_tokens']}")
        console.print(f"rep {rep} done in {time.perf_counter() - t_rep:.0f} s")
    return warmup, samples


def summarize(arms: list[Arm], lengths: list[int], samples: list[dict]) -> list[dict]:
    rows = []
    for L in lengths:
        full = [s["ttft_s"] for s in samples if s["length"] == L and s["arm"] == "full prefill"]
        for arm in arms:
            picked = [s for s in samples if s["length"] == L and s["arm"] == arm.name]
            if not picked:
                continue
            t = harness.stats([s["ttft_s"] for s in picked])
            cached = [s["cached_tokens"] for s in picked]
            row = {"arm": arm.name, "length": L, "prompt_tokens": picked[0]["prompt_tokens"], **t,
                   "cached_min": min(cached), "cached_max": max(cached),
                   "replayed": max(s["tail_replay_tokens"] for s in picked),
                   "replay_ms_mean": sum(s["tail_replay_ms"] for s in picked) / len(picked),
                   "hit": min(cached) > 0}
            if full and arm.kind == "hit":
                f = harness.stats(full)
                row["speedup_mean"], row["speedup_p50"] = f["mean"] / t["mean"], f["p50"] / t["p50"]
            rows.append(row)
    return rows


def print_table(rows: list[dict], title: str, console) -> None:
    table = Table(title=title)
    for col in ("prefix", "arm", "n", "cached", "replayed", "TTFT mean s", "TTFT p50 s", "speedup (mean / p50)"):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for row in rows:
        cached = str(row["cached_min"]) if row["cached_min"] == row["cached_max"] else \
            f"{row['cached_min']}-{row['cached_max']}"
        speedup = f"{row['speedup_mean']:.1f}x / {row['speedup_p50']:.1f}x" if "speedup_mean" in row else ""
        if row["arm"] != "full prefill" and not row["hit"]:
            speedup += " (no hit)"
        table.add_row(str(row["length"]), row["arm"], str(row["n"]), cached, str(row["replayed"] or ""),
                      f"{row['mean']:.3f}", f"{row['p50']:.3f}", speedup)
    console.print(table)


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(12, 4.5))
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = [r for r in rows if r["arm"] == arm]
        line, = ax_t.plot([r["length"] for r in pts], [r["mean"] for r in pts], marker="o", label=arm)
        misses = [r for r in pts if arm != "full prefill" and not r["hit"]]
        ax_t.plot([r["length"] for r in misses], [r["mean"] for r in misses], "x", color=line.get_color(),
                  markersize=12)  # a "hit" arm that got no hit at this length
        hits = [r for r in pts if "speedup_mean" in r and r["hit"]]
        if hits:
            ax_s.plot([r["length"] for r in hits], [r["speedup_mean"] for r in hits], marker="o", label=arm)
    lengths = sorted({r["length"] for r in rows})
    for ax in (ax_t, ax_s):
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("matched prefix (tokens)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_t.set_ylabel("TTFT, mean (s)")
    ax_s.set_ylabel("speedup over full prefill (mean TTFT)")
    ax_s.set_title("speedup (arms that hit)", fontsize=10)
    ax_t.set_title("TTFT (x: no hit, cached 0)", fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, "ttft.json")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="matched-prefix lengths")
    ap.add_argument("--with-32k", action="store_true",
                    help="add 32768 (about +15 min: six more prefills of 32K tokens)")
    ap.add_argument("--suffix-tokens", type=int, default=32, help="unmatched tokens after the prefix")
    ap.add_argument("--full-reps", type=int, default=3, help="repetitions of full prefill")
    ap.add_argument("--hit-reps", type=int, default=10, help="repetitions of each hit arm")
    ap.add_argument("--ratios", type=float, nargs="+", default=[0.05, 0.1], help="one Tail-Replay server each")
    args = ap.parse_args(argv)
    if args.with_32k and 32768 not in args.lengths:
        args.lengths.append(32768)
    args.lengths = sorted(args.lengths)

    console = Console(width=150)
    run = harness.Run.begin(args)
    out, model_path = run.out, run.model_path
    if run.urls:
        servers = run.urls
        arms = make_arms(servers)
        warmup, samples = measure_arms(servers, arms, args, model_path, console)
        configs = {label: None for label in servers}
    else:
        configs = server_configs(args.ratios, run.server_args)
        longest = max(args.lengths) + 2 * args.suffix_tokens + 64
        # The pool holds every warm prefix plus the longest request twice over, so LRU eviction only ever drops
        # the never-reused full-prefill prompts, never a prefix that a hit arm needs.
        pool = sum(args.lengths) + 2 * longest + 8192
        console.print(f"[bold]starting {len(configs)} servers[/bold] on {model_path} (KV pool {pool} tokens, "
                      f"context {longest})")
        with harness.running_servers(model_path, configs, out, console, max_total_tokens=pool,
                                     context_length=longest) as procs:
            servers = {label: {"url": p.base_url, "tail_replay": "--enable-tail-replay" in configs[label],
                               "flags": configs[label]} for label, p in procs.items()}
            for label, s in servers.items():
                got = harness.kv_pool_tokens(s["url"])
                if got is not None and got < pool:  # requests would be refused or warm prefixes evicted
                    raise SystemExit(f"{label}: KV pool {got} tokens, needs {pool}: raise --mem-fraction-static "
                                     f"in --server-args")
            arms = make_arms(servers)
            warmup, samples = measure_arms(servers, arms, args, model_path, console)

    rows = summarize(arms, args.lengths, samples)
    method = harness.TTFT_METHOD + "; max_new_tokens=1, so the first chunk is the whole response"
    title = f"TTFT, {model_path.name} ({args.server_args}), suffix {args.suffix_tokens} tokens"
    print_table(rows, title, console)
    console.print(method)
    mem = memory.account_for_configs(model_path, configs, run.server_args)
    console.print(memory.table(mem))
    result = {"method": method, "model": str(model_path), "server_args": args.server_args,
              "servers": {label: {"url": s["url"], "tail_replay": s["tail_replay"], "flags": s["flags"]}
                          for label, s in servers.items()},
              "lengths": args.lengths, "suffix_tokens": args.suffix_tokens,
              "reps": {"full": args.full_reps, "hit": args.hit_reps}, "memory": mem,
              "machine_before": run.machine_before, "machine_after": harness.machine(), "wall_s": run.elapsed(),
              "summary": rows, "warmup": warmup, "samples": samples}
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"), title)
    console.print(f"wrote {out} and {out.with_suffix('.png')} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
