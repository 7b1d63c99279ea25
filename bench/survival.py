"""Does a longer zero-init tail pay where the survival indicator is high? The measurement behind not building
`--tail-replay-max-survival`.

    python bench/survival.py [--model-path models/quality-qwen35] [--lengths 2048 8192] [--tails 64 256 1024 4096] \
        [--samples 4] [--out runs/survival.json]

For each context length L and each tail length k, paper-mode servers (`--tail-replay-exact-budget 0`, the tail
pinned with --tail-replay-min-tokens k --tail-replay-max-tokens k) serve hits on cached random contexts, and a
no-cache server serves the same prompts. Per (L, k): the mean `tail_replay_state_survival` the server reports and
the mean and max absolute error of the log-probs of the 32 prompt tokens after the hit against no cache. A longer
tail pays only if the error falls while the indicator still says much of the dropped state counts; a rule
"lengthen the tail while survival > s" needs the indicator to fall with k on the heads that matter.
Prints a table, writes JSON (and the table as markdown next to it).
"""

import argparse
import json
import random
import sys

import requests
from rich.console import Console
from rich.table import Table

from tailreplay_eval import harness
from tailreplay_eval.harness import ROOT

SUFFIX = 32


def scored(url: str, ids: list[int], start: int) -> dict:
    body = {"input_ids": ids, "return_logprob": True, "logprob_start_len": start,
            "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
    r = requests.post(f"{url}/generate", json=body, timeout=600)
    r.raise_for_status()
    meta = r.json()["meta_info"]
    return {"meta": meta, "logprobs": [lp for lp, _, _ in meta["input_token_logprobs"] if lp is not None]}


def measure(servers: dict, lengths: list[int], tails: list[int], samples: int, vocab: int, seed: int) -> list[dict]:
    rng, rows = random.Random(seed), []
    for length in lengths:
        prompts = [harness.random_ids(rng, length + SUFFIX, vocab) for _ in range(samples)]
        reference = []
        for ids in prompts:
            harness.flush_cache(servers["no_cache"].base_url)
            reference.append(scored(servers["no_cache"].base_url, ids, length)["logprobs"])
        for k in tails:
            url = servers[f"k{k}"].base_url
            survival, errors = [], []
            for ids, ref in zip(prompts, reference):
                harness.flush_cache(url)
                scored(url, ids[:length] + [(ids[length] + 1) % vocab], length)  # caches the context; forks at L
                hit = scored(url, ids, length)
                assert hit["meta"]["cached_tokens"] == length and hit["meta"]["tail_replay_tokens"] == min(k, length)
                # k >= L replays the whole prefix: exact, nothing dropped (the server reports no survival then)
                exact = hit["meta"]["tail_replay_exact"]
                survival.append(0.0 if exact else hit["meta"]["tail_replay_state_survival"])
                errors.append(max(abs(a - b) for a, b in zip(hit["logprobs"], ref)))
            rows.append({"length": length, "tail": k, "survival_mean": sum(survival) / len(survival),
                         "survival_min": min(survival), "logprob_err_mean": sum(errors) / len(errors),
                         "logprob_err_max": max(errors)})
    return rows


def table(rows: list[dict]) -> Table:
    t = Table(title="zero-init tail: survival indicator vs log-prob error after the hit (vs no cache)")
    for col in ("L", "tail k", "survival mean", "survival min", "err mean (nats)", "err max (nats)"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["length"]), str(r["tail"]), f"{r['survival_mean']:.3f}", f"{r['survival_min']:.3f}",
                  f"{r['logprob_err_mean']:.3f}", f"{r['logprob_err_max']:.3f}")
    return t


def markdown(rows: list[dict]) -> str:
    lines = ["| L | tail k | survival mean | survival min | error mean (nats) | error max (nats) |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['tail']} | {r['survival_mean']:.3f} | {r['survival_min']:.3f} | "
              f"{r['logprob_err_mean']:.3f} | {r['logprob_err_max']:.3f} |" for r in rows]
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, "survival.json")
    ap.set_defaults(model_path=str(ROOT / "models" / "quality-qwen35"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 8192])
    ap.add_argument("--tails", type=int, nargs="+", default=[64, 256, 1024, 4096])
    ap.add_argument("--samples", type=int, default=4)
    args = ap.parse_args(argv)
    run, console = harness.Run.begin(args), Console()
    paper = ("--enable-tail-replay", "--tail-replay-exact-budget", "0")
    configs = {"no_cache": tuple(run.server_args)}
    for k in args.tails:
        configs[f"k{k}"] = (*run.server_args, *paper, "--tail-replay-min-tokens", str(k),
                            "--tail-replay-max-tokens", str(k))
    longest = max(args.lengths) + SUFFIX + 64
    with harness.running_servers(run.model_path, configs, run.out.with_suffix(""), console,
                                 max_total_tokens=2 * longest, context_length=longest,
                                 max_running_requests=2) as servers:
        vocab = harness.vocab_size(run.model_path)
        rows = measure(servers, args.lengths, args.tails, args.samples, vocab, args.seed)
    console.print(table(rows))
    result = {"command": " ".join(sys.argv), "model": str(run.model_path), "machine": run.machine_before,
              "rows": rows, "seconds": run.elapsed()}
    run.out.write_text(json.dumps(result, indent=1))
    run.out.with_suffix(".md").write_text(markdown(rows))
    console.print(f"wrote {run.out}")


if __name__ == "__main__":
    main()
