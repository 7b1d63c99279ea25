"""TTFT of a prefix-cache hit against a full prefill, on real SGLang servers: stock; Tail-Replay in the paper's mode
(zero-init tail, no anchors: `--tail-replay-exact-budget 0`) at r = 0.05 and r = 0.10, the paper's TTFT table on
the small model and this CPU; and Tail-Replay's anchored replay (the default) at anchor intervals N = 512 and 1024.

    python bench/ttft.py [--preset small] [--lengths 2048 4096 8192 16384] [--with-32k] [--suffix-tokens 32] \
        [--full-reps 3] [--hit-reps 10] [--ratios 0.05 0.1] [--anchor-intervals 512 1024] \
        [--server-args "--dtype float32"] [--out runs/ttft.json]
    python bench/ttft.py --url stock=http://127.0.0.1:30000 --url tr=http://127.0.0.1:30001   # running servers
    python bench/ttft.py --url stock=http://127.0.0.1:30000 --url a512=http://127.0.0.1:30001 \
        --url-flags "a512=--enable-tail-replay --tail-replay-anchor-interval 512"   # ... planned as an anchored arm

Servers, all started at once: stock; one paper-mode server per --ratios entry (`--enable-tail-replay
--tail-replay-ratio r --tail-replay-exact-budget 0`); one anchored server per --anchor-intervals entry
(`--enable-tail-replay --tail-replay-anchor-interval N`, default ratio and exact budget, and a mamba pool that holds
every anchor of the run, so that none is evicted while measured).

Protocol. One prefix P_L of random token ids per prefix length L, and a short suffix (32 tokens).
1. All servers start at once and stay up; afterwards exactly one request is in flight at any time.
2. Warm-up, after /flush_cache: every server gets P_L + w_L once per length (timed: its first-seen prefill, which
   for Tail-Replay includes capturing the hiddens and, anchored, the anchors: a recurrent state every N tokens from
   each prefill chunk's start and where each chunk ends).
3. Repetitions, interleaved rep -> length -> arm (arm order rotated every rep) so drift hits all arms alike:
   - full prefill: a fresh random prefix of L tokens (never sent) + the suffix on the stock server; cached must be 0;
   - stock hit: P_L + a new suffix on the stock server; whatever stock's hybrid cache matches is reported
     (it holds a recurrent state only where a request or a prefill chunk ended);
   - paper hit, one arm per ratio: P_L + the same new suffix; cached must be L, the replayed tokens
     clamp(ceil(r L), min, max), and the state approximate (tail_replay_exact false: the zero-init tail);
   - anchored hit, one arm per interval N, hitting mid-interval at m = L - N/2. Interval anchors sit at multiples
     of N from the prefill start (the 4096-token prefill chunk being a multiple of N), so a hit at exactly L would
     find an anchor at its match end and replay nothing, which is not representative; half-way between two anchors
     it replays N/2 tokens, the mean distance from a random hit point to the anchor below it. A replayed hit keeps
     the state it rebuilt as an anchor at its match end, so a second hit at the same point would replay nothing:
     every repetition hits a fresh branch instead. First, untimed, a priming request P_L[:L - N] + t (t: N/2 +
     suffix fresh tokens) hits the anchor at L - N exactly (cached must be L - N); then the timed request
     (P_L[:L - N] + t)[:L - N/2] + the same new suffix. Cached must be m = L - N/2, tail_replay_exact true, the
     anchor L - N (at L = N: the root's zero state, depth 0) and the replayed tokens N/2. A length at which the
     warm-up's anchors do not fall that way (L not a multiple of N, or L < N) is skipped for that arm.
   Full prefill gets --full-reps repetitions, hits --hit-reps; a stock arm that does not hit the whole prefix
   costs up to a prefill, so it gets --full-reps too.
Speedup = mean TTFT of the full prefill at L / mean TTFT of the arm (p50 ratio also reported). Anchored vs paper =
the anchored arm's mean TTFT / the paper r = 0.05 arm's (else the first paper arm's) at the same L: the price of an
exact state, whose target is at most 1.3x at L >= 8K. Writes JSON and a PNG.

With --url the servers' Tail-Replay flags are not known unless --url-flags gives them (the server's own
--tail-replay-* flags): then its arm is planned like a started one; without them a Tail-Replay arm hits the whole
prefix and its replay is only checked to be a real one (tokens replayed, or an exact state from an anchor at the
match end).
"""

import argparse
import json
import random
import shlex
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import client, harness, memory
from tailreplay_sglang.cache import anchors

# Default budget on the 2-core CPU, small model, float32: full prefill of 2K/4K/8K/16K takes ~2.5/6/15/45 s, so
# 3 warm-ups + 3 full reps of each length are ~7 min; hits take 0.2-2 s, so 10 reps of each hit arm ~1 min per arm.
DEFAULT_LENGTHS = (2048, 4096, 8192, 16384)
DEFAULT_RATIOS = (0.05, 0.1)
DEFAULT_INTERVALS = (512, 1024)
REFERENCE_RATIO = 0.05  # anchored arms are compared with the paper arm at this ratio
TARGET_RATIO, TARGET_FROM = 1.3, 8192  # the target: anchored TTFT within 1.3x of paper r0.05 at >= 8K
CPU_CHUNK = 4096  # SGLang's prefill chunk on CPU (chunked_prefill_size), unless --chunked-prefill-size says
MAX_RUNNING = 8  # ServerProcess's --max-running-requests: each running request holds a mamba slot
CPU_MAMBA_SLOTS = 64  # --max-mamba-cache-size of the CPU flags (tailreplay_eval/server.py)
TR = "--enable-tail-replay"


@dataclass(frozen=True)
class Arm:
    name: str
    server: str  # label of the server it runs on
    kind: str  # "full" | "hit"
    tail_replay: bool
    flags: tuple | None = None  # the server's flags when we started it (then the replayed tail is known)
    mode: str = "stock"  # stock | paper (zero-init tail, no anchors) | anchored (N > 0) | tail-replay (flags unknown)
    ratio: float | None = None  # paper: --tail-replay-ratio
    anchor_interval: int | None = None  # anchored: --tail-replay-anchor-interval N

    @property
    def anchored(self) -> bool:
        return self.kind == "hit" and self.mode == "anchored"

    def matched(self, length: int) -> int:
        """Prefix tokens the arm's request shares with P_L: L - N/2 for an anchored hit (mid-interval), else L."""
        return length - self.anchor_interval // 2 if self.anchored else length

    def expected_anchor(self, length: int) -> int | None:
        """Depth of the anchor an anchored hit must start from: the interval anchor below L - N/2."""
        return length - self.anchor_interval if self.anchored else None

    def expected_tail(self, model_path: Path, length: int) -> int | None:
        """Tokens the hit must replay: N/2 anchored (from the anchor at L - N to m = L - N/2), clamp(ceil(r L))
        otherwise; None where not known (stock, a --url server without --url-flags, anchors with interval 0)."""
        if not self.tail_replay or self.flags is None:
            return None
        cfg = memory.tail_replay_config(model_path, with_tail_replay(self.flags))
        if self.anchored:
            m, tail = self.matched(length), self.anchor_interval // 2
            if not cfg.anchored or cfg.anchor_interval != self.anchor_interval:
                raise ValueError(f"{self.name}: its server keeps no anchor every {self.anchor_interval} tokens")
            if tail > cfg.budget(m):
                raise ValueError(f"{self.name} at {length}: replaying {tail} tokens from an anchor is past the exact "
                                 f"budget {cfg.budget(m)} (--tail-replay-exact-budget): the hit would be approximate")
            return tail
        if cfg.anchored:  # anchors without interval ones: where the deepest one sits depends on the run
            return None
        return cfg.tail_len(length)


def with_tail_replay(flags) -> list[str]:
    flags = list(flags)
    return flags if TR in flags else [*flags, TR]


def describe_server(model_path: Path, flags, tail_replay: bool) -> dict:
    """What a server's arm measures: {"mode", "ratio", "anchor_interval"} from its flags (see `Arm.mode`)."""
    if not tail_replay:
        return {"mode": "stock", "ratio": None, "anchor_interval": None}
    if flags is None:
        return {"mode": "tail-replay", "ratio": None, "anchor_interval": None}
    cfg = memory.tail_replay_config(model_path, with_tail_replay(flags))
    if cfg.mode != "ratio":
        return {"mode": "tail-replay", "ratio": None, "anchor_interval": None}
    if not cfg.anchored:
        return {"mode": "paper", "ratio": cfg.ratio, "anchor_interval": None}
    if cfg.anchor_interval > 0:
        return {"mode": "anchored", "ratio": cfg.ratio, "anchor_interval": cfg.anchor_interval}
    return {"mode": "tail-replay", "ratio": cfg.ratio, "anchor_interval": None}


def chunk_size(flags) -> int:
    return int(memory._flag(list(flags or ()), "--chunked-prefill-size", str(CPU_CHUNK)))


def anchor_depths(tokens: int, interval: int, chunk: int) -> list[int]:
    """Depths of the anchors a first-seen prefill of `tokens` tokens leaves, in `chunk`-token chunks: every
    `interval` tokens from each chunk's start (`anchors.offsets`, as the server takes them) and each chunk's end."""
    depths = []
    for start in range(0, tokens, chunk):
        extend = min(chunk, tokens - start)
        depths += [start + off for off in anchors.offsets(extend, interval)] + [start + extend]
    return depths


def skip_reason(arm: Arm, length: int, suffix_tokens: int, chunk: int) -> str | None:
    """Why an anchored arm cannot hit mid-interval at this length (None: it can): the deepest anchor the warm-up
    leaves at or below m = L - N/2 must be L - N (0 at L = N: with no state on the path, the root's zero state is the
    anchor, within the budget)."""
    if not arm.anchored:
        return None
    m, want = arm.matched(length), arm.expected_anchor(length)
    below = [d for d in anchor_depths(length + suffix_tokens, arm.anchor_interval, chunk) if d <= m]
    got = max(below, default=0)
    if want < 0:
        return f"L={length} < N={arm.anchor_interval}: no interval to hit the middle of"
    if got != want:  # depth 0: the root's zero state, the anchor of last resort
        return (f"L={length}, N={arm.anchor_interval}, chunk {chunk}: the anchor below m={m} is at {got}, not L - N "
                f"(L must be a multiple of N)")
    return None


def mamba_slots(lengths, suffix_tokens: int, interval: int, hit_reps: int, chunk: int) -> int:
    """Mamba pool of an anchored server that keeps every anchor of the run: the warm prefixes' (each interval and
    chunk end); per repetition and length, where the priming request ends, where the hit ends and the state the hit
    rebuilt; one per running request; room to spare. (Short of slots the server evicts the least recently used
    anchors, and the one a hit needs is refreshed by every hit on it, but a pool that keeps all leaves no doubt.)"""
    warm = sum(len(anchor_depths(L + suffix_tokens, interval, chunk)) for L in lengths)
    return max(CPU_MAMBA_SLOTS, warm + 3 * len(lengths) * hit_reps + MAX_RUNNING + 16)


def server_configs(ratios, server_args: list[str], intervals=(), lengths=(), suffix_tokens: int = 32,
                   hit_reps: int = 10) -> dict[str, tuple]:
    configs = {"stock": tuple(server_args)}
    for r in ratios:
        configs[f"paper r={r:.2f}"] = (*server_args, TR, "--tail-replay-ratio", str(r),
                                       "--tail-replay-exact-budget", "0")
    chunk = chunk_size(server_args)
    for n in intervals:
        slots = mamba_slots(lengths, suffix_tokens, n, hit_reps, chunk)
        configs[f"anchored N={n}"] = (*server_args, TR, "--tail-replay-anchor-interval", str(n),
                                      "--max-mamba-cache-size", str(slots))
    return configs


def make_arms(servers: dict[str, dict]) -> list[Arm]:
    """A full-prefill arm on the first stock server (the first server if all are Tail-Replay), a hit arm on each."""
    full_on = next((label for label, s in servers.items() if not s["tail_replay"]), next(iter(servers)))
    arms = [Arm("full prefill", full_on, "full", servers[full_on]["tail_replay"])]
    for label, s in servers.items():
        arms.append(Arm(f"{label} hit", label, "hit", s["tail_replay"], s.get("flags"), s.get("mode", "stock"),
                        s.get("ratio"), s.get("anchor_interval")))
    return arms


def paper_reference(arms: list[Arm]) -> Arm | None:
    """The paper arm anchored arms are compared with: r = REFERENCE_RATIO, else the first paper arm."""
    papers = [a for a in arms if a.kind == "hit" and a.mode == "paper"]
    return next((a for a in papers if abs(a.ratio - REFERENCE_RATIO) < 1e-9), papers[0] if papers else None)


def measure(base_url: str, ids: list[int]) -> dict:
    r = client.stream_generate(base_url, ids, max_new_tokens=1)
    meta = r["meta_info"]
    return {"prompt_tokens": len(ids), "cached_tokens": meta["cached_tokens"],
            "tail_replay_tokens": meta.get("tail_replay_tokens", 0), "tail_replay_ms": meta.get("tail_replay_ms", 0.0),
            "tail_replay_exact": meta.get("tail_replay_exact"), "tail_replay_anchor": meta.get("tail_replay_anchor"),
            "tail_replay_state_survival": meta.get("tail_replay_state_survival"), "ttft_s": r["ttft_s"]}


def check(arm: Arm, length: int, sample: dict, expected_tail: int | None) -> None:
    """Full prefill must not hit; a Tail-Replay hit must hit exactly the planned prefix and replay the planned tail:
    paper, the whole prefix, clamp(ceil(r L)) tokens from a zero-init tail; anchored, L - N/2 tokens, N/2 of them
    replayed exactly from the anchor at L - N."""
    cached, replayed = sample["cached_tokens"], sample["tail_replay_tokens"]
    exact, anchor = sample.get("tail_replay_exact"), sample.get("tail_replay_anchor")
    if arm.kind == "full" and cached != 0:
        raise RuntimeError(f"{arm.name} at {length}: a never-seen prefix got {cached} cached tokens")
    if arm.kind != "hit" or not arm.tail_replay:
        return
    m = arm.matched(length)
    if cached != m:
        raise RuntimeError(f"{arm.name} at {length}: cached {cached} tokens, expected "
                           + (f"m = L - N/2 = {m}" if arm.anchored else "the whole prefix"))
    if arm.anchored:
        if exact is not True:
            raise RuntimeError(f"{arm.name} at {length}: tail_replay_exact is {exact}, expected an exact replay from "
                               f"the anchor at {arm.expected_anchor(length)} (anchor reported: {anchor})")
        if replayed != expected_tail:
            raise RuntimeError(f"{arm.name} at {length}: replayed {replayed} tokens, expected N/2 = {expected_tail} "
                               f"(anchor reported: {anchor})")
        if anchor is not None and anchor != arm.expected_anchor(length):
            raise RuntimeError(f"{arm.name} at {length}: replayed from the anchor at {anchor}, expected "
                               f"{arm.expected_anchor(length)}")
        return
    if expected_tail is not None:
        if replayed != expected_tail:
            raise RuntimeError(f"{arm.name} at {length}: replayed {replayed} tokens, expected {expected_tail}")
        if arm.mode == "paper" and exact is not None and exact != (expected_tail == m):
            raise RuntimeError(f"{arm.name} at {length}: tail_replay_exact is {exact} in paper mode (anchor "
                               f"{anchor}): a zero-init tail is approximate unless it covers the whole prefix")
    elif replayed <= 0 and not (exact and anchor == m):  # flags unknown: a real replay, or an anchor at the end
        raise RuntimeError(f"{arm.name} at {length}: replayed {replayed} tokens, and no anchor at the match end")


def plan_skips(arms: list[Arm], lengths, suffix_tokens: int, server_args=()) -> dict[tuple, str]:
    """{(arm, L): why} for the lengths an anchored arm cannot hit mid-interval (its server's prefill chunk: from
    its flags, else the common ones, else SGLang's CPU default)."""
    return {(arm.name, L): reason for arm in arms for L in lengths
            if (reason := skip_reason(arm, L, suffix_tokens, chunk_size(arm.flags or server_args))) is not None}


def prime(arm: Arm, base_url: str, prefix: list[int], length: int, fresh: list[int]) -> tuple[list[int], dict]:
    """An anchored arm's untimed priming request: P_L[:L - N] + `fresh` (N/2 + suffix tokens never sent), which hits
    the anchor at L - N exactly. Returns the branch the timed hit shares up to m = L - N/2, and the sample."""
    ids = prefix[:length - arm.anchor_interval] + fresh
    sample = measure(base_url, ids)
    if sample["cached_tokens"] != length - arm.anchor_interval:
        raise RuntimeError(f"{arm.name} at {length}: the priming request cached {sample['cached_tokens']} tokens, "
                           f"expected L - N = {length - arm.anchor_interval} (is the warm prefix still cached?)")
    return ids, sample


def measure_arms(servers: dict[str, dict], arms: list[Arm], args, model_path: Path, console,
                 skips: dict | None = None) -> tuple[list, list, list]:
    skips = skips or {}
    vocab = harness.vocab_size(model_path)
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    prefixes = {L: heads.sequence(rng, L, vocab) for L in args.lengths}
    tails = {(arm.name, L): arm.expected_tail(model_path, L) for arm in arms for L in args.lengths
             if (arm.name, L) not in skips}

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

    samples, primes, stock_reps = [], [], {}
    for rep in range(max(args.full_reps, args.hit_reps)):
        t_rep = time.perf_counter()
        for L in args.lengths:
            s_rep = suffix()
            order = arms[rep % len(arms):] + arms[: rep % len(arms)]
            for arm in order:
                reps = args.full_reps if arm.kind == "full" else stock_reps.get((arm.name, L), args.hit_reps)
                if rep >= reps or (arm.name, L) in skips:
                    continue
                url = servers[arm.server]["url"]
                if arm.kind == "full":
                    shared = heads.sequence(rng, L, vocab)
                elif arm.anchored:  # a fresh branch off the anchor at L - N (see the module docstring)
                    fresh = heads.sequence(rng, arm.anchor_interval // 2 + args.suffix_tokens, vocab)
                    branch, primed = prime(arm, url, prefixes[L], L, fresh)
                    primes.append({"arm": arm.name, "server": arm.server, "length": L, "rep": rep, **primed})
                    shared = branch[:arm.matched(L)]
                else:
                    shared = prefixes[L]
                sample = measure(url, shared + s_rep)
                check(arm, L, sample, tails[(arm.name, L)])
                if arm.kind == "hit" and not arm.tail_replay and rep == 0 and sample["cached_tokens"] < L:
                    stock_reps[(arm.name, L)] = args.full_reps  # a partial hit recomputes part of the prefix
                samples.append({"arm": arm.name, "server": arm.server, "length": L, "rep": rep, **sample})
                console.print(f"  rep {rep} L={L:>6} {arm.name:>30}: {sample['ttft_s']:7.3f} s, cached "
                              f"{sample['cached_tokens']}, replayed {sample['tail_replay_tokens']}"
                              + (", exact" if sample["tail_replay_exact"] and arm.tail_replay else ""))
        console.print(f"rep {rep} done in {time.perf_counter() - t_rep:.0f} s")
    return warmup, samples, primes


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
            exact = [s["tail_replay_exact"] for s in picked if s.get("tail_replay_exact") is not None]
            row = {"arm": arm.name, "mode": arm.mode if arm.kind == "hit" else "full", "length": L,
                   "matched": arm.matched(L) if arm.kind == "hit" else 0, "anchor_interval": arm.anchor_interval,
                   "prompt_tokens": picked[0]["prompt_tokens"], **t,
                   "cached_min": min(cached), "cached_max": max(cached),
                   "replayed": max(s["tail_replay_tokens"] for s in picked),
                   "replay_ms_mean": sum(s["tail_replay_ms"] for s in picked) / len(picked),
                   "exact_share": sum(map(bool, exact)) / len(exact) if exact and arm.tail_replay else None,
                   "hit": min(cached) > 0}
            if full and arm.kind == "hit":
                f = harness.stats(full)
                row["speedup_mean"], row["speedup_p50"] = f["mean"] / t["mean"], f["p50"] / t["p50"]
            rows.append(row)
    return rows


def compare_with_paper(rows: list[dict], arms: list[Arm]) -> list[dict]:
    """Per anchored row: its TTFT over the reference paper arm's at the same L (also put on the row as
    vs_paper_mean / vs_paper_p50), and whether it meets the target at L >= TARGET_FROM."""
    ref = paper_reference(arms)
    if ref is None:
        return []
    papers = {r["length"]: r for r in rows if r["arm"] == ref.name}
    out = []
    for row in rows:
        paper = papers.get(row["length"])
        if row["mode"] != "anchored" or paper is None:
            continue
        row["vs_paper_mean"], row["vs_paper_p50"] = row["mean"] / paper["mean"], row["p50"] / paper["p50"]
        out.append({"arm": row["arm"], "length": row["length"], "matched": row["matched"],
                    "replayed": row["replayed"], "paper_arm": ref.name, "paper_replayed": paper["replayed"],
                    "ratio_mean": row["vs_paper_mean"], "ratio_p50": row["vs_paper_p50"],
                    "within_target": row["vs_paper_mean"] <= TARGET_RATIO if row["length"] >= TARGET_FROM else None})
    return out


def _x(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}x"


def print_table(rows: list[dict], title: str, console, reference: str | None = None) -> None:
    table = Table(title=title)
    ref = f"vs {reference.removesuffix(' hit')}\n(mean / p50)" if reference else "vs paper"
    for col in ("prefix L", "arm", "n", "cached m", "replayed", "exact", "TTFT mean s", "TTFT p50 s",
                "speedup (mean / p50)", ref):
        table.add_column(col, justify="left" if col == "arm" else "right")
    for row in rows:
        cached = str(row["cached_min"]) if row["cached_min"] == row["cached_max"] else \
            f"{row['cached_min']}-{row['cached_max']}"
        speedup = f"{row['speedup_mean']:.1f}x / {row['speedup_p50']:.1f}x" if "speedup_mean" in row else ""
        if row["arm"] != "full prefill" and not row["hit"]:
            speedup += " (no hit)"
        exact = "" if row.get("exact_share") is None else f"{100 * row['exact_share']:.0f}%"
        vs = f"{_x(row['vs_paper_mean'])} / {_x(row['vs_paper_p50'])}" if "vs_paper_mean" in row else ""
        table.add_row(str(row["length"]), row["arm"], str(row["n"]), cached, str(row["replayed"] or ""), exact,
                      f"{row['mean']:.3f}", f"{row['p50']:.3f}", speedup, vs)
    console.print(table)


def print_comparison(comparison: list[dict], console) -> None:
    if not comparison:
        return
    console.print(f"anchored / {comparison[0]['paper_arm'].removesuffix(' hit')} mean TTFT (target <= "
                  f"{TARGET_RATIO}x at L >= {TARGET_FROM // 1024}K):")
    for arm in dict.fromkeys(c["arm"] for c in comparison):
        cells = [f"{c['length']}: {c['ratio_mean']:.2f}x"
                 + ("" if c["within_target"] is None else " ok" if c["within_target"] else " MISSED")
                 for c in comparison if c["arm"] == arm]
        console.print(f"  {arm.removesuffix(' hit')}: " + ", ".join(cells))


def plot(rows: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    compared = [r for r in rows if "vs_paper_mean" in r]
    fig, axes = plt.subplots(1, 3 if compared else 2, figsize=(18 if compared else 12, 4.5))
    ax_t, ax_s = axes[0], axes[1]
    for arm in dict.fromkeys(r["arm"] for r in rows):
        pts = [r for r in rows if r["arm"] == arm]
        style = "--" if pts[0].get("mode") == "anchored" else "-"
        line, = ax_t.plot([r["length"] for r in pts], [r["mean"] for r in pts], style, marker="o", label=arm)
        misses = [r for r in pts if arm != "full prefill" and not r["hit"]]
        ax_t.plot([r["length"] for r in misses], [r["mean"] for r in misses], "x", color=line.get_color(),
                  markersize=12)  # a "hit" arm that got no hit at this length
        hits = [r for r in pts if "speedup_mean" in r and r["hit"]]
        if hits:
            ax_s.plot([r["length"] for r in hits], [r["speedup_mean"] for r in hits], style, marker="o",
                      color=line.get_color(), label=arm)
        cmp = [r for r in pts if "vs_paper_mean" in r]
        if cmp:
            axes[2].plot([r["length"] for r in cmp], [r["vs_paper_mean"] for r in cmp], style, marker="o",
                         color=line.get_color(), label=f"{arm} (replays N/2)")
    lengths = sorted({r["length"] for r in rows})
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths, [f"{n // 1024}K" if n % 1024 == 0 else str(n) for n in lengths])
        ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
        ax.set_xlabel("prefix length L (anchored arms hit L - N/2)")
        ax.grid(True, which="both", alpha=0.3)
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_t.set_ylabel("TTFT, mean (s)")
    ax_s.set_ylabel("speedup over full prefill at L (mean TTFT)")
    ax_s.set_title("speedup (arms that hit)", fontsize=10)
    ax_t.set_title("TTFT (x: no hit, cached 0)", fontsize=10)
    if compared:
        ax_c = axes[2]
        ax_c.axhline(TARGET_RATIO, color="red", linestyle=":", label=f"target {TARGET_RATIO}x (L >= "
                                                                      f"{TARGET_FROM // 1024}K)")
        ax_c.axhline(1.0, color="grey", linewidth=0.8)
        ax_c.set_ylabel("anchored TTFT / paper TTFT (mean)")
        ax_c.set_title("anchored (exact) vs paper r=0.05 (zero-init tail)", fontsize=10)
    for ax in axes:
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_url_flags(specs: list[str], servers: dict[str, dict]) -> None:
    """--url-flags 'LABEL=FLAGS': the flags a running server was started with, so its arm is planned."""
    for spec in specs:
        label = next((lb for lb in sorted(servers, key=len, reverse=True) if spec.startswith(lb + "=")), None)
        if label is None:
            raise SystemExit(f"--url-flags {spec!r}: no --url labelled as its LABEL= ({', '.join(servers)})")
        servers[label]["flags"] = tuple(shlex.split(spec[len(label) + 1:]))


def memory_accounting(model_path: Path, configs: dict, server_args: list[str], intervals) -> dict:
    """bench/memory.py's accounting: for the anchored servers' flags at every interval measured where there are
    anchored servers, else as before (the first Tail-Replay server's flags)."""
    anchored = next((f for f in configs.values() if f and "--tail-replay-anchor-interval" in f), None)
    if anchored is not None and intervals:
        return memory.account(model_path, list(anchored), intervals=tuple(intervals))
    return memory.account_for_configs(model_path, configs, server_args)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, "ttft.json")
    ap.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="prefix lengths L")
    ap.add_argument("--with-32k", action="store_true",
                    help="add 32768 (about +15 min: six more prefills of 32K tokens)")
    ap.add_argument("--suffix-tokens", type=int, default=32, help="unmatched tokens after the prefix")
    ap.add_argument("--full-reps", type=int, default=3, help="repetitions of full prefill")
    ap.add_argument("--hit-reps", type=int, default=10, help="repetitions of each hit arm")
    ap.add_argument("--ratios", type=float, nargs="*", default=list(DEFAULT_RATIOS),
                    help="one paper-mode Tail-Replay server each (--tail-replay-exact-budget 0)")
    ap.add_argument("--anchor-intervals", type=int, nargs="*", default=list(DEFAULT_INTERVALS),
                    help="one anchored Tail-Replay server each (--tail-replay-anchor-interval N; none: no anchored "
                         "arm)")
    ap.add_argument("--url-flags", action="append", default=[], metavar="LABEL=FLAGS",
                    help="with --url: the Tail-Replay flags that server runs, e.g. 'a512=--enable-tail-replay "
                         "--tail-replay-anchor-interval 512' (repeatable)")
    args = ap.parse_args(argv)
    if args.with_32k and 32768 not in args.lengths:
        args.lengths.append(32768)
    args.lengths = sorted(args.lengths)
    bad = [n for n in args.anchor_intervals if n <= 0 or n % 64]
    if bad:
        ap.error(f"--anchor-intervals must be positive multiples of 64 (the GDN chunk), got {bad}")
    if args.url_flags and not args.url:
        ap.error("--url-flags goes with --url")

    console = Console(width=170)
    run = harness.Run.begin(args)
    out, model_path = run.out, run.model_path
    if run.urls:
        servers = run.urls
        parse_url_flags(args.url_flags, servers)
        for s in servers.values():
            s.update(describe_server(model_path, s["flags"], s["tail_replay"]))
        configs = {label: s["flags"] for label, s in servers.items()}
        arms = make_arms(servers)
        skips = plan_skips(arms, args.lengths, args.suffix_tokens, run.server_args)
        for reason in dict.fromkeys(skips.values()):
            console.print(f"[yellow]skipped[/yellow] {reason}")
        warmup, samples, primes = measure_arms(servers, arms, args, model_path, console, skips)
    else:
        configs = server_configs(args.ratios, run.server_args, args.anchor_intervals, args.lengths,
                                 args.suffix_tokens, args.hit_reps)
        longest = max(args.lengths) + 2 * args.suffix_tokens + 64
        # The pool holds every warm prefix plus the longest request twice over, so LRU eviction only ever drops
        # never-reused tokens (full-prefill prompts; anchored servers: old priming branches), never a prefix that a
        # hit arm needs.
        pool = sum(args.lengths) + 2 * longest + 8192
        console.print(f"[bold]starting {len(configs)} servers[/bold] on {model_path} (KV pool {pool} tokens, "
                      f"context {longest})")
        with harness.running_servers(model_path, configs, out, console, max_total_tokens=pool,
                                     context_length=longest) as procs:
            servers = {label: {"url": p.base_url, "tail_replay": TR in configs[label], "flags": configs[label],
                               **describe_server(model_path, configs[label], TR in configs[label])}
                       for label, p in procs.items()}
            for label, s in servers.items():
                got = harness.kv_pool_tokens(s["url"])
                if got is not None and got < pool:  # requests would be refused or warm prefixes evicted
                    raise SystemExit(f"{label}: KV pool {got} tokens, needs {pool}: raise --mem-fraction-static "
                                     f"in --server-args")
            arms = make_arms(servers)
            skips = plan_skips(arms, args.lengths, args.suffix_tokens, run.server_args)
            for reason in dict.fromkeys(skips.values()):
                console.print(f"[yellow]skipped[/yellow] {reason}")
            warmup, samples, primes = measure_arms(servers, arms, args, model_path, console, skips)

    rows = summarize(arms, args.lengths, samples)
    comparison = compare_with_paper(rows, arms)
    ref = paper_reference(arms)
    method = harness.TTFT_METHOD + "; max_new_tokens=1, so the first chunk is the whole response"
    title = f"TTFT, {model_path.name} ({args.server_args}), suffix {args.suffix_tokens} tokens"
    print_table(rows, title, console, ref.name if ref and comparison else None)
    print_comparison(comparison, console)
    console.print(method)
    intervals = sorted({a.anchor_interval for a in arms if a.anchored})
    mem = memory_accounting(model_path, configs, run.server_args, intervals)
    console.print(memory.table(mem))
    result = {"method": method, "model": str(model_path), "server_args": args.server_args,
              "servers": {label: {"url": s["url"], "tail_replay": s["tail_replay"], "flags": s["flags"],
                                  "mode": s["mode"], "ratio": s["ratio"], "anchor_interval": s["anchor_interval"]}
                          for label, s in servers.items()},
              "lengths": args.lengths, "suffix_tokens": args.suffix_tokens,
              "chunked_prefill_size": chunk_size(run.server_args),
              "reps": {"full": args.full_reps, "hit": args.hit_reps}, "memory": mem,
              "skipped": [{"arm": arm, "length": L, "reason": reason} for (arm, L), reason in skips.items()],
              "anchored_vs_paper": comparison,
              "target": {"ratio": TARGET_RATIO, "from_length": TARGET_FROM, "paper_arm": ref.name if ref else None},
              "machine_before": run.machine_before, "machine_after": harness.machine(), "wall_s": run.elapsed(),
              "summary": rows, "warmup": warmup, "samples": samples, "anchored_primes": primes}
    out.write_text(json.dumps(result, indent=2))
    plot(rows, out.with_suffix(".png"), title)
    console.print(f"wrote {out} and {out.with_suffix('.png')} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
