"""What Tail-Replay costs where it cannot help: cold prefills, decode, and chat turns where stock hits, against stock
SGLang side by side (issue 39).

    python bench/overhead.py [--preset small] [--lengths 2048 4096 8192 16384] [--restarts 3] [--reps 2] \
        [--long-reps 1] [--decode-tokens 128] [--server-args "--dtype float32 --mem-fraction-static 0.5"] \
        [--tail-replay-flags "..."] [--out runs/overhead.json]

Two servers start together: stock and `--enable-tail-replay` (its defaults: anchored replay, interval anchors every
512 tokens), both with the CPU flags (`--sleep-on-idle`), so an idle one takes no CPU from the other. On these two
cores a server process keeps a speed of its own for its lifetime (two runs of 5 repetitions on one pair each measured
Tail-Replay's cold 4K-16K prefills at 1.12-1.20x and at 0.91-0.99x of stock's, same code), so the pair is started
afresh --restarts times and each pair measured --reps times. Exactly one request (or one decode batch) is in flight
at a time. One warm-up request each first. Then, per repetition, the two servers in alternating order (stock first
on even repetitions), so drift hits both alike:
- cold prefill at each length L: a random prompt of L tokens whose first token no earlier prompt had (no reuse
  possible), the same for both servers; TTFT of a one-token streaming request (cached must be 0);
- decode at batch 1 and 8: a fresh 256-token prompt per request, --decode-tokens greedy tokens each (ignore_eos);
  tokens/s = generated tokens after the first / (time of the last - time of the first) per request, summed over the
  batch's concurrent requests;
- a chat turn where stock hits: a 1024-token system prompt and a question, answered (32 tokens), then the next turn
  (the previous prompt + answer + a new question) timed; stock keeps the state where the answer ended and hits
  there, Tail-Replay hits the same tokens.
Lengths >= 16384 get --long-reps repetitions per pair. Every ratio is Tail-Replay / stock within one repetition:
above 1 a TTFT is slower, below 1 a decode rate is slower. The table shows the median ratio over all repetitions,
its min-max, and the median of each pair. Writes JSON and a PNG.
"""

import argparse
import concurrent.futures
import json
import random
import shlex
import statistics
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import client, harness

ARMS = ("stock", "tail_replay")
DECODE_PROMPT = 256
CHAT_SYSTEM, CHAT_QUESTION, CHAT_ANSWER = 1024, 24, 32


def ttft(base_url: str, ids: list[int], max_new: int = 1) -> dict:
    r = client.stream_generate(base_url, ids, max_new_tokens=max_new)
    return {"ttft_s": r["ttft_s"], "cached": r["meta_info"]["cached_tokens"], "output_ids": r["output_ids"]}


def decode_rate(base_url: str, prompts: list[list[int]], tokens: int) -> float:
    """Generated tokens per second over a batch of concurrent requests (after each one's first token)."""
    def one(ids):
        start = time.perf_counter()
        r = client.stream_generate(base_url, ids, max_new_tokens=tokens)
        return (len(r["output_ids"]) - 1) / (time.perf_counter() - start - r["ttft_s"])
    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        return sum(pool.map(one, prompts))


def measured(args) -> list[str]:
    """Every measured quantity, in table order."""
    return [f"cold {length}" for length in args.lengths] + ["decode b1", "decode b8", "chat turn"]


def run(servers: dict, args, vocab: int, console, rng: random.Random, heads, pair: int) -> list[dict]:
    """--reps repetitions on one pair of servers; samples carry the pair and a repetition index unique in the run."""
    samples = []
    for arm in ARMS:  # warm-up
        ttft(servers[arm].base_url, heads.sequence(rng, 512, vocab))
    for rep_in_pair in range(max(args.reps, args.long_reps)):
        rep = pair * max(args.reps, args.long_reps) + rep_in_pair
        order = ARMS if rep % 2 == 0 else ARMS[::-1]
        for length in args.lengths:
            if rep_in_pair >= (args.long_reps if length >= 16384 else args.reps):
                continue
            ids = heads.sequence(rng, length, vocab)
            for arm in order:
                out = ttft(servers[arm].base_url, ids)
                assert out["cached"] == 0, (arm, length, out["cached"])
                samples.append({"pair": pair, "rep": rep, "name": f"cold {length}", "arm": arm,
                                "value": out["ttft_s"]})
        if rep_in_pair >= args.reps:
            continue
        for batch in (1, 8):
            prompts = [heads.sequence(rng, DECODE_PROMPT, vocab) for _ in range(batch)]
            for arm in order:
                rate = decode_rate(servers[arm].base_url, prompts, args.decode_tokens)
                samples.append({"pair": pair, "rep": rep, "name": f"decode b{batch}", "arm": arm, "value": rate})
        system = heads.sequence(rng, CHAT_SYSTEM, vocab)
        turn1 = system + harness.random_ids(rng, CHAT_QUESTION, vocab)
        question = harness.random_ids(rng, CHAT_QUESTION, vocab)
        for arm in order:
            answer = ttft(servers[arm].base_url, turn1, CHAT_ANSWER)["output_ids"]
            out = ttft(servers[arm].base_url, turn1 + answer + question)
            samples.append({"pair": pair, "rep": rep, "name": "chat turn", "arm": arm, "value": out["ttft_s"],
                            "cached": out["cached"]})
        console.print(f"  pair {pair + 1}, repetition {rep_in_pair + 1} done")
    return samples


def summarize(samples: list[dict], names: list[str]) -> list[dict]:
    rows = []
    for name in names:
        by_rep = {}
        for s in samples:
            if s["name"] == name:
                by_rep.setdefault(s["rep"], {})[s["arm"]] = s
        pairs = {}
        for r in by_rep.values():
            if len(r) == 2:
                pairs.setdefault(r["stock"]["pair"], []).append(r["tail_replay"]["value"] / r["stock"]["value"])
        ratios = [x for per_pair in pairs.values() for x in per_pair]
        values = {arm: [r[arm]["value"] for r in by_rep.values() if arm in r] for arm in ARMS}
        cached = {arm: [r[arm].get("cached") for r in by_rep.values() if arm in r] for arm in ARMS}
        rows.append({"name": name, "reps": len(ratios), "ratio_median": statistics.median(ratios),
                     "ratio_min": min(ratios), "ratio_max": max(ratios),
                     "ratio_median_per_pair": [statistics.median(v) for _, v in sorted(pairs.items())],
                     **{f"{arm}_median": statistics.median(values[arm]) for arm in ARMS},
                     **({"cached": cached} if name == "chat turn" else {})})
    return rows


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    x = range(len(rows))
    medians = [r["ratio_median"] for r in rows]
    spread = [[m - r["ratio_min"] for m, r in zip(medians, rows)], [r["ratio_max"] - m for m, r in zip(medians, rows)]]
    ax.errorbar(x, medians, yerr=spread, fmt="o", capsize=4)
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xticks(list(x), [r["name"] for r in rows], rotation=20)
    ax.set_ylabel("Tail-Replay / stock (median, min-max)")
    ax.set_title("Cold prefill and chat-turn TTFT (lower is better), decode tokens/s (higher is better)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    harness.add_common_args(ap, "overhead.json")
    ap.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    ap.add_argument("--restarts", type=int, default=3, help="server pairs, each started afresh")
    ap.add_argument("--reps", type=int, default=2, help="repetitions per pair")
    ap.add_argument("--long-reps", type=int, default=1, help="repetitions per pair at lengths >= 16384")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--tail-replay-flags", default="",
                    help="more flags for the Tail-Replay server (e.g. \"--tail-replay-anchor-interval 0\")")
    args = ap.parse_args()
    console = Console(width=150)
    run_ = harness.Run.begin(args)
    vocab = harness.vocab_size(run_.model_path)
    configs = {"stock": run_.server_args,
               "tail_replay": [*run_.server_args, "--enable-tail-replay", *shlex.split(args.tail_replay_flags)]}
    context = max(args.lengths) + 1024
    rng = random.Random(args.seed)
    heads = harness.DistinctHeads(rng, vocab)
    samples = []
    for pair in range(args.restarts):
        console.print(f"[bold]pair {pair + 1}: starting {len(configs)} servers[/bold] on {run_.model_path}")
        with harness.running_servers(run_.model_path, configs, run_.out, console, max_total_tokens=4 * context,
                                     context_length=context) as servers:
            samples += run(servers, args, vocab, console, rng, heads, pair)
    rows = summarize(samples, measured(args))
    table = Table(title="Tail-Replay / stock, side by side (median ratio over repetitions, min-max)")
    for col in ("measure", "reps", "stock (median)", "Tail-Replay (median)", "ratio", "min-max", "per pair"):
        table.add_column(col)
    for r in rows:
        unit = "tok/s" if r["name"].startswith("decode") else "s"
        table.add_row(r["name"], str(r["reps"]), f"{r['stock_median']:.3f} {unit}",
                      f"{r['tail_replay_median']:.3f} {unit}", f"{r['ratio_median']:.3f}",
                      f"{r['ratio_min']:.3f}-{r['ratio_max']:.3f}",
                      " ".join(f"{x:.3f}" for x in r["ratio_median_per_pair"]))
    console.print(table)
    result = {"machine_before": run_.machine_before, "machine_after": harness.machine(), "args": vars(args),
              "model": str(run_.model_path), "server_args": run_.server_args, "rows": rows, "samples": samples,
              "elapsed_s": run_.elapsed()}
    run_.out.write_text(json.dumps(result, indent=1))
    plot(rows, run_.out.with_suffix(".png"))
    console.print(f"wrote {run_.out} and {run_.out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
