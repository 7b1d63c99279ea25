"""Time a cold prefill of N-token prompts through the real SGLang server on CPU (records docs/cpu.md's figures).

    python bench/prefill_time.py [--preset small] [--lengths 1024 4096 16384] [--dtype float32]

Each prompt is fresh random token ids (no cache hit), generating one token; the time is the request's end-to-end
latency, which on a one-token request is the prefill plus scheduling and HTTP.
"""

import argparse
import json
import random
import time
from pathlib import Path

import requests
from rich.console import Console
from rich.table import Table

from tailreplay_eval.models import PRESETS, build_model
from tailreplay_eval.server import ServerProcess

ROOT = Path(__file__).resolve().parents[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--dtype", default="auto", help="SGLang --dtype (auto = the checkpoint's)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "prefill_time.json"))
    args = ap.parse_args(argv)

    model = build_model(args.preset, ROOT / "models" / args.preset)
    vocab = PRESETS[args.preset].vocab_size
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    longest = max(args.lengths)
    server = ServerProcess(str(model), ("--dtype", args.dtype), log_path=out.with_suffix(".server.log"),
                           max_total_tokens=longest + 1024, context_length=longest + 1024)
    t0 = time.perf_counter()
    rows = []
    with server:
        start_s = time.perf_counter() - t0
        rng = random.Random(0)
        for n in args.lengths:
            ids = [rng.randrange(3, vocab) for _ in range(n)]
            body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            t = time.perf_counter()
            r = requests.post(f"{server.base_url}/generate", json=body, timeout=1800)
            r.raise_for_status()
            rows.append({"prompt_tokens": n, "seconds": time.perf_counter() - t,
                         "cached_tokens": r.json()["meta_info"]["cached_tokens"]})
    table = Table(title=f"cold prefill, {args.preset} ({args.dtype}), server start {start_s:.1f} s")
    for col in ("prompt tokens", "seconds", "tokens/s"):
        table.add_column(col)
    for row in rows:
        rate = row["prompt_tokens"] / row["seconds"]
        table.add_row(str(row["prompt_tokens"]), f"{row['seconds']:.2f}", f"{rate:.0f}")
    Console().print(table)
    out.write_text(json.dumps({"preset": args.preset, "dtype": args.dtype, "server_start_s": start_s,
                               "prefill": rows}, indent=2))


if __name__ == "__main__":
    main()
