"""Prints the memory accounting of tailreplay_eval/memory.py for one model or for all of them: what it counts and
where each formula comes from is that module's docstring (below, in --help).

    python bench/memory.py [--preset small | --model-path M] [--server-args "--dtype float32 --enable-tail-replay"]
    python bench/memory.py --all      # one table: the presets and the real models (memory.ALL_MODELS)
    python bench/memory.py --all --json runs/memory.json
    python bench/memory.py --per-rank # per attention-TP rank at TP 1/2/4/8, device and host tier, bf16, float8, int4
                                      # store, sharded and replicated (memory.PER_RANK_MODELS); JSON in runs/
"""

import argparse
import json
import math
import shlex
from pathlib import Path

from rich.console import Console

from tailreplay_eval import memory
from tailreplay_eval.memory import (ALL_DEFAULT_ARGS, ALL_MODELS, ANCHOR_INTERVALS, CHUNK_TOKENS, HAND_WRITTEN_NOTE,
                                    PER_RANK_HIDDEN_DTYPES, PER_RANK_MODELS, PER_RANK_NOTE, PER_RANK_TIERS, TP_SIZES,
                                    _size, account, all_table, per_rank_rows, per_rank_table, prefix_cost, table)

PER_RANK_JSON = "runs/memory_per_rank.json"


def _write_json(data, where: str | None) -> None:
    if where == "-":
        print(json.dumps(data, indent=2))
    elif where:
        Path(where).parent.mkdir(parents=True, exist_ok=True)
        Path(where).write_text(json.dumps(data, indent=2) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=f"{__doc__}\n{memory.__doc__}",
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small",
                    help="a preset (its build in models/<preset>, else its spec) or Qwen3.5-4B / Qwen3.6-27B")
    ap.add_argument("--model-path", help="a checkpoint directory with config.json (default: --preset)")
    ap.add_argument("--server-args", default=None,
                    help="the server's flags (default: --dtype float32; with --all: per model, see ALL_DEFAULT_ARGS)")
    ap.add_argument("--all", action="store_true", help=f"one table for {', '.join(ALL_MODELS)}")
    ap.add_argument("--intervals", type=int, nargs="+", default=None,
                    help=f"anchor intervals N to amortise a slot over (default: --tail-replay-anchor-interval if "
                         f"given in --server-args, else {' '.join(map(str, ANCHOR_INTERVALS))})")
    ap.add_argument("--prefix-tokens", type=int, default=16384, help="example prefix for the cost comparison")
    ap.add_argument("--per-rank", action="store_true",
                    help=f"per attention-TP rank: one table per tier and hidden dtype for {', '.join(PER_RANK_MODELS)}"
                         f" (JSON: --json, default {PER_RANK_JSON})")
    ap.add_argument("--tp", type=int, nargs="+", default=list(TP_SIZES),
                    help=f"attention-TP sizes for --per-rank (default {' '.join(map(str, TP_SIZES))})")
    ap.add_argument("--json", help="write the accounting as JSON to this file ('-': stdout)")
    args = ap.parse_args(argv)
    console = Console(width=150)
    if args.per_rank:
        return per_rank(console, args.tp, args.json or str(memory.ROOT / PER_RANK_JSON))
    if args.all:
        console = Console(width=180)
        accs = [account(name, shlex.split(args.server_args or ALL_DEFAULT_ARGS[name]), args.intervals)
                for name in ALL_MODELS]
        console.print(all_table(accs, "bytes per cached token: stock, paper mode (B=0), anchored every N tokens"))
        console.print(f"* {HAND_WRITTEN_NOTE}. Slot = one mamba slot (conv + SSM state of every recurrent "
                      f"layer) = one anchor; anchored = KV + hiddens + slot/N while every interval anchor is kept "
                      f"(the mamba LRU evicts them); request-end and prefill-chunk-end anchors (one slot each, like "
                      f"stock's checkpoints) come on top. idx = the sparse-attention indexer cache, part of SGLang's "
                      f"KV cell (stock = KV + idx). fit = tokens a pool holds at equal device memory in paper mode, "
                      f"as a share of stock's. Refused: what the store would keep (every hyper-connection stream); "
                      f"Tail-Replay serves none of it. Hidden dtype auto = the serving "
                      f"dtype. TP 1.")
        _write_json({"note": HAND_WRITTEN_NOTE, "models": accs}, args.json)
        return accs
    model = Path(args.model_path) if args.model_path else args.preset
    server_args = args.server_args or "--dtype float32"
    acc = account(model, shlex.split(server_args), args.intervals)
    note = f" (* {HAND_WRITTEN_NOTE})" if acc["config_source"] == "hand-written shapes" else ""
    console.print(table(acc, f"{acc['model']} ({server_args}){note}"))
    # One checkpoint per 4096-token chunk is what stock no_buffer keeps of a long prompt prefilled on CPU.
    checkpoints = math.ceil(args.prefix_tokens / CHUNK_TOKENS)
    cost = prefix_cost(acc, args.prefix_tokens, checkpoints)
    anchored = "; ".join(f"anchored N={n} {_size(c['bytes'])} (+ {c['anchors']} anchors)"
                         for n, c in cost["tail_replay_anchored"].items())
    console.print(f"a {args.prefix_tokens}-token prefix: stock {_size(cost['stock_bytes'])} (KV + {checkpoints} "
                  f"checkpoints), Tail-Replay paper mode {_size(cost['tail_replay_bytes'])} (KV + hiddens)"
                  + (f"; {anchored}" if anchored else ""))
    _write_json({**acc, "prefix_cost": {"tokens": args.prefix_tokens, "checkpoints": checkpoints, **cost}},
                args.json)
    return acc


def per_rank(console: Console, tps: list[int], where: str) -> list[dict]:
    rows = per_rank_rows(tps=tps)
    for tier in PER_RANK_TIERS:
        for dtype in PER_RANK_HIDDEN_DTYPES:
            part = [r for r in rows if r["tier"] == tier and r["hidden_dtype"] == dtype]
            console.print(per_rank_table(part, f"bytes per cached token per attention-TP rank: {tier} tier, "
                                               f"{dtype} hidden store"))
    console.print(f"{PER_RANK_NOTE}. * {HAND_WRITTEN_NOTE}.")
    _write_json({"note": PER_RANK_NOTE, "shapes": HAND_WRITTEN_NOTE, "tp_sizes": tps, "rows": rows}, where)
    return rows


if __name__ == "__main__":
    main()
