"""Shared-prefix traffic on one attention-DP server: Tail-Replay against stock, SGLang's own placement against
requests pinned to a group.

    python bench/dp_attention.py [--preset small] [--clients 4] [--requests 4] [--system-words 600] \
        [--gen-tokens 16] [--out runs/dp_attention.json]

Each kind, {Tail-Replay, stock}, is one server with `--tp-size 2 --dp-size 2 --enable-dp-attention` (two attention-DP
groups, one rank each, `SGLANG_CPU_OMP_THREADS_BIND=0|1`), started in turn with the same flags and pools (the same
`--max-total-tokens` per group and mamba pool; Tail-Replay's hidden store comes on top, as the bytes it reports).
Both shapes of `tailreplay_eval/prefix_traffic.py` (shared prefix, multi-turn; each client its own prefix) run
through each placement:
- round_robin: SGLang's DP controller places each request (its default, round-robin over the groups), so a
  client's follow-ups alternate between the groups' trees;
- pinned: each client's requests go to one group (`routed_dp_rank`, client i to group i mod 2), as a DP-aware
  router would send them.
Per shape, kind and placement: cached / matchable tokens, TTFT p50 / p99, requests/s and prompt tokens/s. Writes a
JSON and a PNG next to it and prints a table.
"""

import argparse

from rich.console import Console
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.prefix_traffic import SHAPES, add_traffic_args, run_shape, table, write_results

KINDS = {"Tail-Replay": ("--enable-tail-replay",), "stock": ()}
DP_ATTENTION = ("--tp-size", "2", "--dp-size", "2", "--enable-dp-attention")
GROUPS = 2
PLACEMENTS = {"round_robin": None, "pinned": lambda client: {"routed_dp_rank": client % GROUPS}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "dp_attention.json")
    add_traffic_args(ap)
    ap.add_argument("--max-total-tokens", type=int, default=16384, help="KV pool per attention-DP group")
    args = ap.parse_args()
    run = harness.Run.begin(args)
    console = Console(width=170)
    tok = AutoTokenizer.from_pretrained(run.model_path)
    title = "one server, --tp 2 --dp 2 --enable-dp-attention"
    results = {shape: {} for shape in SHAPES}
    for kind, flags in KINDS.items():  # one at a time: each server's two ranks take both cores
        configs = {kind: DP_ATTENTION + flags + tuple(run.server_args)}
        logs = run.out.with_name(f"{run.out.stem}-{kind}.json")
        with harness.running_servers(run.model_path, configs, logs, console,
                                     envs={kind: {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"}},
                                     max_total_tokens=args.max_total_tokens) as servers:
            url = servers[kind].base_url
            for placement, place in PLACEMENTS.items():
                for shape, conversation in SHAPES.items():
                    r = run_shape(url, [url], conversation, tok, args, placement=place)
                    results[shape][(kind, placement)] = r
                    console.print(f"  {shape} / {kind} / {placement}: cached {r['cached']:,} of "
                                  f"{r['matchable']:,}, TTFT p50 {r['ttft_p50_s']:.2f} s")
    console.print(table(results, title, ("server", "placement")))
    write_results(run, args, results, title, console, [*DP_ATTENTION, *run.server_args],
                  extra_keys=("max_total_tokens",))


if __name__ == "__main__":
    main()
