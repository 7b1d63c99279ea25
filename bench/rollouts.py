"""RL-rollout-shaped traffic through `sglang.Engine.generate` in this process: stock against Tail-Replay.

    python bench/rollouts.py [--preset small] [--tasks 4] [--trajectories 4] [--turns 4] [--concurrency 4] \
        [--system-tokens 1024] [--task-tokens 256] [--tool-tokens 256] [--gen-tokens 32] \
        [--arms stock tail_replay paper] [--out runs/rollouts.json]

The shape of one rollout step of agentic RL (GRPO-style): T tasks share a long system prompt (instructions and
tool specs), each task is rolled out as N trajectories, and every turn appends the model's answer and a tool result
(random token ids, different per trajectory and turn). A rollout engine keeps `--concurrency` trajectories in flight
(here in waves: wave j holds trajectory j of every task, and runs all its turns through one `Engine.generate` call
per turn), so a task's later trajectories start from a prompt the engine has already seen. Sampling is seeded per
request (`sampling_seed`), so arms that compute the same logits sample the same tokens.

Arms, each its own Engine, one after the other (the same keywords, `CPU_KEYWORDS`, but the Tail-Replay ones):
- `stock`: SGLang's own hybrid radix cache (states where requests and prefill chunks end);
- `tail_replay`: `enable_tail_replay=True` with its defaults (anchored replay: exact);
- `paper`: `enable_tail_replay=True, tail_replay_exact_budget=0` (the paper's zero-init tail, r = 0.05).

Reported per arm: total wall time of the rollout (Engine start excluded), cached / matchable tokens (matchable: the
longest common prefix with anything the engine finished before this call, capped at len - 1), replayed tokens and
exact hits. Writes a JSON (machine, keywords, per-call numbers) and prints a table.
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import harness
from tailreplay_eval.harness import ROOT
from tailreplay_eval.models import build_model
from tailreplay_eval.server import CPU_ENV, CPU_KEYWORDS

ARMS = {
    "stock": {},
    "tail_replay": {"enable_tail_replay": True},
    "paper": {"enable_tail_replay": True, "tail_replay_exact_budget": 0},
}


def rollouts(args, vocab: int) -> tuple[list[list[int]], list[list[list[int]]]]:
    """Each trajectory's first prompt (system + task; trajectory-major, so wave j is trajectory j of every task) and
    its tool results per turn."""
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    system = heads.sequence(rng, args.system_tokens, vocab)
    tasks = [system + harness.random_ids(rng, args.task_tokens, vocab) for _ in range(args.tasks)]
    firsts = [list(task) for _ in range(args.trajectories) for task in tasks]
    tools = [[harness.random_ids(rng, args.tool_tokens, vocab) for _ in range(args.turns - 1)] for _ in firsts]
    return firsts, tools


def run_arm(model_path: Path, keywords: dict, args, vocab: int) -> dict:
    import sglang

    engine = sglang.Engine(model_path=str(model_path), **CPU_KEYWORDS, **args.engine_keywords, **keywords)
    try:
        firsts, tools = rollouts(args, vocab)
        seen, calls = harness.Seen(), []
        started = time.perf_counter()
        for start in range(0, len(firsts), args.concurrency):
            wave = range(start, min(start + args.concurrency, len(firsts)))
            rows = [firsts[i] for i in wave]
            for turn in range(args.turns):
                calls.append(_generate(engine, rows, [(i, turn) for i in wave], seen, args))
                rows = [ids + out + (tools[i][turn] if turn < args.turns - 1 else [])
                        for i, ids, out in zip(wave, rows, calls[-1].pop("output_ids"))]
        total = time.perf_counter() - started
    finally:
        engine.shutdown()
    keys = ("requests", "prompt_tokens", "matchable", "cached", "replayed", "exact_hits", "hits")
    summary = {k: sum(c[k] for c in calls) for k in keys}
    return {"keywords": keywords, "total_s": total, **summary, "calls": calls}


def _generate(engine, rows, keys, seen, args) -> dict:
    """One Engine.generate call for a wave's turn; what it reused."""
    matchable = [seen.matchable(ids) for ids in rows]
    params = [{"max_new_tokens": args.gen_tokens, "temperature": args.temperature, "ignore_eos": True,
               "sampling_seed": args.seed * 1_000_003 + i * 1009 + turn} for i, turn in keys]
    tic = time.perf_counter()
    outs = engine.generate(input_ids=rows, sampling_params=params)
    seconds = time.perf_counter() - tic
    for ids, out in zip(rows, outs):
        seen.add(ids, out["output_ids"])
    return {**_turn_summary(rows, outs, matchable, seconds), "output_ids": [o["output_ids"] for o in outs]}


def _turn_summary(rows, outs, matchable, seconds: float) -> dict:
    metas = [o["meta_info"] for o in outs]
    hits = [m for m in metas if m["cached_tokens"] > 0]
    return {"requests": len(rows), "prompt_tokens": sum(map(len, rows)), "matchable": sum(matchable),
            "cached": sum(m["cached_tokens"] for m in metas),
            "replayed": sum(m.get("tail_replay_tokens", 0) for m in metas),
            "hits": len(hits), "exact_hits": sum(bool(m.get("tail_replay_exact", True)) for m in hits),
            "seconds": seconds}


def table(results: dict) -> Table:
    t = Table(title="RL rollouts through sglang.Engine.generate")
    for col in ("arm", "total (s)", "prompt tokens", "matchable", "cached / matchable", "replayed", "exact hits"):
        t.add_column(col, justify="right")
    for arm, r in results.items():
        reuse = r["cached"] / r["matchable"] if r["matchable"] else 0.0
        t.add_row(arm, f"{r['total_s']:.1f}", f"{r['prompt_tokens']:,}", f"{r['matchable']:,}",
                  f"{r['cached']:,} ({100 * reuse:.1f} %)", f"{r['replayed']:,}", f"{r['exact_hits']} / {r['hits']}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-path", help="this checkpoint instead of building --preset")
    ap.add_argument("--tasks", type=int, default=4)
    ap.add_argument("--trajectories", type=int, default=4, help="N trajectories per task")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--concurrency", type=int, default=4, help="trajectories in flight (one wave)")
    ap.add_argument("--system-tokens", type=int, default=1024, help="shared by every task")
    ap.add_argument("--task-tokens", type=int, default=256)
    ap.add_argument("--tool-tokens", type=int, default=256, help="tool result appended after each answer")
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "runs" / "rollouts.json"))
    args = ap.parse_args()
    # float32: these CPUs have no fast bf16 matmul; the pool holds every trajectory's whole context
    args.engine_keywords = {"dtype": "float32", "max_total_tokens": 65536,
                            "max_running_requests": args.concurrency}
    os.environ.update(CPU_ENV)

    console = Console(width=150)
    model = Path(args.model_path) if args.model_path else build_model(args.preset, ROOT / "models" / args.preset)
    vocab = harness.vocab_size(model)
    before, started = harness.machine(), time.perf_counter()
    results = {}
    for arm in args.arms:
        console.print(f"[bold]{arm}[/]: {args.tasks} tasks x {args.trajectories} trajectories x {args.turns} turns, "
                      f"{args.concurrency} in flight")
        results[arm] = run_arm(model, ARMS[arm], args, vocab)
        console.print(f"  {results[arm]['total_s']:.1f} s, cached {results[arm]['cached']:,} "
                      f"of {results[arm]['matchable']:,} matchable")
    console.print(table(results))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    record = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "machine_before": before,
              "machine_after": harness.machine(), "elapsed_s": time.perf_counter() - started, "model": str(model),
              "engine_keywords": {**CPU_KEYWORDS, **args.engine_keywords},
              "workload": {k: getattr(args, k) for k in ("tasks", "trajectories", "turns", "concurrency",
                                                         "system_tokens", "task_tokens", "tool_tokens", "gen_tokens",
                                                         "temperature", "seed")},
              "arms": results}
    out.write_text(json.dumps(record, indent=1))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
