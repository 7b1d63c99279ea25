"""Traffic shapes where hybrid prefix caches differ, on real SGLang servers: Tail-Replay, stock, and no cache.

    python bench/workloads.py [--preset small] [--scale 1.0] [--shapes ...] [--server-args "--dtype float32"] \
        [--configs ...] [--gpu-scheduling] [--out runs/workloads.json]

For each shape and server: cached tokens / matchable tokens, mean TTFT and total time. Matchable tokens are
computed client-side: for each request, the longest common prefix with anything the server has already seen in
this run (earlier prompts, plus what it generated for them but the last token, which never gets KV), capped at
the prompt length - 1 as SGLang caps a match; every server's cache is flushed at the start. Every shape uses
fresh random content, the same for every server; the three servers run at once and each shape runs on one server
after the other (one request or burst in flight).

Shapes (token counts at --scale 1; --scale multiplies them all):
- shared system prompt, q=40/376/1296: SGLang's own `python -m sglang.bench_serving --dataset-name
  generated-shared-prefix` (2 groups x 3 prompts, 3000-token system prompt, questions of 40 / 376 / 1296 tokens
  as in SGLang issue 22935), one request at a time, `--cache-report --output-details` for per-request cached
  tokens and TTFT; the prompts come from the dataset file bench_serving caches, so matchable is exact;
- identical resend: three 3000-token prompts, then the same three again;
- multi-turn chat: 3 clients x 4 rounds over their own 1500-token document (chat template, /generate with the
  template's token ids so matchable is exact), answers of 16 tokens fed back as text, clients interleaved;
- fork of long chains (cf. SGLang PR 38000): two chains grown in 4 steps of 1000 tokens, then 3 forks each at
  random points with a new 64-token continuation, then the whole chain again with a new continuation;
- edit / compaction: two 4000-token histories, then each edited (8 tokens at 60%) and compacted (the middle half
  replaced by a 200-token summary), each with a new 64-token turn;
- concurrent on one prefix: a 3000-token prefix sent once, then 8 requests on it at the same time.
Only the first shape fits bench_serving: it has no dataset for resends, forks, edits or a burst on a warmed prefix,
and its multi-turn mode (--gsp-num-turns) sends text, so the token ids it sent, and hence matchable tokens, would
not be known exactly. The others are written here with the streaming client of bench/shared_prefix.py
(tailreplay_eval/client.py).
"""

import argparse
import json
import os
import pickle
import random
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import harness, memory
from tailreplay_eval.models import load_tokenizer
from tailreplay_eval.client import chat_ids, document, stream_generate

CONFIGS = {"Tail-Replay": ("--enable-tail-replay",), "stock": (), "no cache": ("--disable-radix-cache",),
           # paged KV exists only under extra_buffer (SGLang's no_buffer needs page size 1): with --gpu-scheduling
           "Tail-Replay p16": ("--enable-tail-replay", "--page-size", "16")}
DEFAULT_CONFIGS = ("Tail-Replay", "stock", "no cache")
QUESTION_LENS = (40, 376, 1296)


@dataclass
class Server:
    """One config's server and what it has seen; `heads` hands out first tokens in the same order for every
    server, so the content of each shape is identical across servers."""

    label: str
    url: str
    heads: harness.DistinctHeads
    seen: harness.Seen = field(default_factory=harness.Seen)


@dataclass
class Ctx:
    args: argparse.Namespace
    model_path: Path
    tok: object
    vocab: int
    out: Path

    def n(self, tokens: int) -> int:
        return max(4, round(tokens * self.args.scale))


def send(server: Server, name: str, ids: list[int], max_new_tokens: int, matchable: int | None = None) -> dict:
    """One streamed request; records matchable (before it is sent), cached and replayed tokens, TTFT."""
    matchable = server.seen.matchable(ids) if matchable is None else matchable
    r = stream_generate(server.url, ids, max_new_tokens)
    server.seen.add(ids, r["output_ids"])
    meta = r["meta_info"]
    return {"request": name, "prompt_tokens": len(ids), "matchable": matchable, "cached": meta["cached_tokens"],
            "replayed": meta.get("tail_replay_tokens", 0), "ttft_s": r["ttft_s"], "output_ids": r["output_ids"]}


def random_seq(server: Server, rng: random.Random, ctx: Ctx, n: int) -> list[int]:
    return server.heads.sequence(rng, n, ctx.vocab)


# ---- shapes: each takes (ctx, server, rng) and returns its request records -----------------------------------


def shared_system_prompt(question_len: int):
    """SGLang's bench_serving, generated-shared-prefix dataset. It reports per-request cached tokens and TTFT
    itself (--cache-report --output-details); the prompts it sent are read back from the dataset file it caches,
    under a HOME of our own so that no other run's file (another model's token ids) is ever picked up."""

    def shape(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
        q = ctx.n(question_len)
        home = ctx.out.with_suffix(".bench_serving")
        result_file = home / f"{server.label.replace(' ', '_')}.q{question_len}.jsonl"
        home.mkdir(parents=True, exist_ok=True)
        result_file.unlink(missing_ok=True)
        seed = ctx.args.seed * 1000 + question_len  # different system prompts for each question length
        # bench_serving's sampling params, plus skip_special_tokens=False: it takes TTFT at the first chunk with
        # non-empty text, and a special token decodes to "" otherwise. One output token: TTFT is the response.
        body = {"sampling_params": {"max_new_tokens": 1, "temperature": 0.0, "ignore_eos": True,
                                    "skip_special_tokens": False}}
        cmd = [sys.executable, "-m", "sglang.bench_serving", "--backend", "sglang", "--base-url", server.url,
               "--tokenizer", str(ctx.model_path), "--model", str(ctx.model_path),
               "--dataset-name", "generated-shared-prefix", "--tokenize-prompt",
               "--gsp-num-groups", str(ctx.args.gsp_groups), "--gsp-prompts-per-group", str(ctx.args.gsp_prompts),
               "--gsp-system-prompt-len", str(ctx.n(ctx.args.gsp_system_tokens)), "--gsp-question-len", str(q),
               "--gsp-output-len", "1", "--request-rate", "inf", "--max-concurrency", "1",
               "--warmup-requests", "0", "--cache-report", "--output-details", "--disable-tqdm",
               "--extra-request-body", json.dumps(body), "--seed", str(seed), "--output-file", str(result_file)]
        proc = subprocess.run(cmd, env={**os.environ, "HOME": str(home)}, capture_output=True, text=True)
        (home / f"{result_file.stem}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0 or not result_file.exists():
            raise RuntimeError(f"bench_serving failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-3000:]}")
        res = json.loads(result_file.read_text().splitlines()[-1])
        prompts = _gsp_prompts(home, f"{seed}_{ctx.args.gsp_groups}_{ctx.args.gsp_prompts}_"
                                     f"{ctx.n(ctx.args.gsp_system_tokens)}_{q}_1")
        if [len(p) for p in prompts] != res["input_lens"]:
            raise RuntimeError("bench_serving's dataset file does not match the prompts it reports")
        records = []
        for i, (ids, ttft, cached, err) in enumerate(zip(prompts, res["ttfts"], res["cached_tokens"], res["errors"])):
            if err or not ttft:
                raise RuntimeError(f"bench_serving request {i} failed or has no TTFT: {err!r}")
            records.append({"request": f"prompt {i}", "prompt_tokens": len(ids),
                            "matchable": server.seen.matchable(ids), "cached": cached, "replayed": None,
                            "ttft_s": ttft})
            server.seen.add(ids, [])  # one output token: nothing generated gets KV
        records.append({"duration_s": res["duration"]})
        return records

    return shape


class _Row:
    """Stands in for bench_serving's DatasetRow when reading its dataset file (no sglang import needed)."""


class _RowUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        return _Row if module.startswith("sglang.") else super().find_class(module, name)


def _gsp_prompts(home: Path, key: str) -> list[list[int]]:
    """The prompts of bench_serving's cached dataset `gen_shared_prefix_{seed}_{groups}_{per group}_{system}_
    {question}_{output}_ids_{tokenizer class}.pkl` (its own naming, `get_gen_prefix_cache_path`)."""
    files = list((home / ".cache" / "sglang" / "benchmark").glob(f"gen_shared_prefix_{key}_ids_*.pkl"))
    if len(files) != 1:
        raise RuntimeError(f"expected one bench_serving dataset file gen_shared_prefix_{key}_ids_*, found {files}")
    with open(files[0], "rb") as f:
        return [row.prompt for row in _RowUnpickler(f).load()]


def identical_resend(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
    prompts = [random_seq(server, rng, ctx, ctx.n(3000)) for _ in range(3)]
    first = [send(server, f"first send {i}", p, ctx.args.max_new_tokens) for i, p in enumerate(prompts)]
    return first + [send(server, f"resend {i}", p, ctx.args.max_new_tokens) for i, p in enumerate(prompts)]


def _text(ctx: Ctx, rng: random.Random, tokens: int) -> str:
    """About `tokens` tokens of plain text (cut by the tokenizer, so the count is close)."""
    ids = ctx.tok(document(tokens, seed=rng.randrange(1 << 30)), add_special_tokens=False).input_ids[:tokens]
    return ctx.tok.decode(ids)


def multi_turn_chat(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
    clients = [{"system": f"Client {c}. Reference document: " + _text(ctx, rng, ctx.n(1500)), "turns": []}
               for c in range(ctx.args.chat_clients)]
    records = []
    for r in range(ctx.args.chat_rounds):
        for c, client in enumerate(clients):  # interleaved: the cache sees every client's branch each round
            client["turns"].append(("user", _text(ctx, rng, ctx.n(60))))
            rec = send(server, f"client {c} round {r}", chat_ids(ctx.tok, client["system"], client["turns"]),
                       ctx.args.answer_tokens)
            client["turns"].append(("assistant", ctx.tok.decode(rec["output_ids"])))
            records.append(rec)
    return records


def fork_chains(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
    records = []
    for c in range(2):
        chain = []
        for step in range(4):  # a chain grown step by step: stock keeps a state where each step ended
            chain += random_seq(server, rng, ctx, ctx.n(1000))
            records.append(send(server, f"chain {c} step {step}", chain, ctx.args.max_new_tokens))
        for f in range(3):
            point = rng.randrange(ctx.n(300), len(chain) - ctx.n(100))
            records.append(send(server, f"chain {c} fork {f} at {point}",
                                chain[:point] + random_seq(server, rng, ctx, ctx.n(64)), ctx.args.max_new_tokens))
        records.append(send(server, f"chain {c} re-send + new turn", chain + random_seq(server, rng, ctx, ctx.n(64)),
                            ctx.args.max_new_tokens))
    return records


def edit_compaction(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
    records = []
    for h in range(2):
        history = random_seq(server, rng, ctx, ctx.n(4000))
        records.append(send(server, f"history {h}", history, ctx.args.max_new_tokens))
        at = int(0.6 * len(history))
        edited = history[:at] + random_seq(server, rng, ctx, 8) + history[at + 8:]
        records.append(send(server, f"history {h} edited at {at}", edited + random_seq(server, rng, ctx, ctx.n(64)),
                            ctx.args.max_new_tokens))
        a, b = len(history) // 4, 3 * len(history) // 4
        compacted = history[:a] + random_seq(server, rng, ctx, ctx.n(200)) + history[b:]
        records.append(send(server, f"history {h} compacted [{a}, {b})",
                            compacted + random_seq(server, rng, ctx, ctx.n(64)), ctx.args.max_new_tokens))
    return records


def concurrent_on_prefix(ctx: Ctx, server: Server, rng: random.Random) -> list[dict]:
    prefix = random_seq(server, rng, ctx, ctx.n(3000))
    records = [send(server, "prefix, first request", prefix + random_seq(server, rng, ctx, ctx.n(64)),
                    ctx.args.max_new_tokens)]
    burst = [prefix + random_seq(server, rng, ctx, ctx.n(64)) for _ in range(ctx.args.burst)]
    # Matchable against what was seen before the burst: the burst's requests arrive together.
    matchable = [server.seen.matchable(ids) for ids in burst]
    with ThreadPoolExecutor(max_workers=len(burst)) as pool:
        futures = [pool.submit(send, server, f"burst {i}", ids, ctx.args.max_new_tokens, m)
                   for i, (ids, m) in enumerate(zip(burst, matchable))]
        records += [f.result() for f in futures]
    return records


SHAPES = {
    **{f"shared system prompt, q={q}": shared_system_prompt(q) for q in QUESTION_LENS},
    "identical resend": identical_resend,
    "multi-turn chat": multi_turn_chat,
    "fork of long chains": fork_chains,
    "edit / compaction": edit_compaction,
    "concurrent on one prefix": concurrent_on_prefix,
}


def run_shape(ctx: Ctx, name: str, server: Server) -> dict:
    rng = random.Random(f"{ctx.args.seed}/{name}")  # the same content for every server
    t0 = time.perf_counter()
    records = SHAPES[name](ctx, server, rng)
    total = time.perf_counter() - t0
    extra = [r for r in records if "request" not in r]
    records = [{k: v for k, v in r.items() if k != "output_ids"} for r in records if "request" in r]
    if extra:  # bench_serving's own benchmark duration, without its start-up
        total = extra[0]["duration_s"]
    matchable, cached = sum(r["matchable"] for r in records), sum(r["cached"] for r in records)
    return {"shape": name, "config": server.label, "requests": len(records), "matchable": matchable,
            "cached": cached, "hit_of_matchable": cached / matchable if matchable else None,
            "prompt_tokens": sum(r["prompt_tokens"] for r in records),
            "mean_ttft_s": sum(r["ttft_s"] for r in records) / len(records), "total_s": total, "records": records}


def print_table(results: list[dict], configs: list[str], title: str, console) -> None:
    table = Table(title=title)
    for col in ("shape", "server", "requests", "prompt tokens", "matchable", "cached (of matchable)", "mean TTFT s",
                "total s"):
        table.add_column(col, justify="left" if col in ("shape", "server") else "right")
    for shape in dict.fromkeys(r["shape"] for r in results):
        by = {r["config"]: r for r in results if r["shape"] == shape}
        for i, c in enumerate(c for c in configs if c in by):
            r = by[c]
            frac = f" ({r['hit_of_matchable']:.0%})" if r["hit_of_matchable"] is not None else ""
            table.add_row(shape if i == 0 else "", c, str(r["requests"]), str(r["prompt_tokens"]),
                          str(r["matchable"]), f"{r['cached']}{frac}", f"{r['mean_ttft_s']:.2f}",
                          f"{r['total_s']:.1f}", end_section=i == len(by) - 1)
    console.print(table)


def plot(results: list[dict], configs: list[str], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    shapes = list(dict.fromkeys(r["shape"] for r in results))
    by = {(r["shape"], r["config"]): r for r in results}
    fig, (ax_h, ax_t) = plt.subplots(1, 2, figsize=(13, 5))
    width = 0.8 / len(configs)
    for i, c in enumerate(configs):
        xs = [j + i * width for j in range(len(shapes))]
        ax_h.bar(xs, [by[s, c]["hit_of_matchable"] or 0 for s in shapes], width, label=c)
        ax_t.bar(xs, [by[s, c]["mean_ttft_s"] for s in shapes], width, label=c)
    for ax in (ax_h, ax_t):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(shapes))], shapes, rotation=30, ha="right", fontsize=8)
        ax.legend(fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
    ax_h.set_ylabel("cached / matchable tokens")
    ax_t.set_ylabel("mean TTFT (s)")
    ax_t.set_yscale("log")
    ax_t.yaxis.set_major_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    ax_t.yaxis.set_minor_formatter(matplotlib.ticker.FormatStrFormatter("%g"))
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_all(ctx: Ctx, urls: dict[str, str], console) -> list[dict]:
    """Every shape on every server, one server after the other (who goes first rotates from shape to shape)."""
    servers = [Server(label, url, harness.DistinctHeads(random.Random(ctx.args.seed), ctx.vocab))
               for label, url in urls.items()]
    for server in servers:
        harness.flush_cache(server.url)
    results = []
    for i, name in enumerate(ctx.args.shapes):
        for server in servers[i % len(servers):] + servers[: i % len(servers)]:
            res = run_shape(ctx, name, server)
            results.append(res)
            console.print(f"  {name:>32} | {server.label:>11}: cached {res['cached']:>6} of matchable "
                          f"{res['matchable']:>6}, mean TTFT {res['mean_ttft_s']:6.2f} s, "
                          f"total {res['total_s']:6.1f} s")
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, "workloads.json")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES), metavar="SHAPE",
                    help=f"subset of: {'; '.join(SHAPES)}")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(DEFAULT_CONFIGS))
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every shape's token counts")
    ap.add_argument("--gsp-system-tokens", type=int, default=3000, help="shared system prompt length")
    ap.add_argument("--gsp-groups", type=int, default=2)
    ap.add_argument("--gsp-prompts", type=int, default=3, help="prompts per system prompt")
    ap.add_argument("--chat-clients", type=int, default=3)
    ap.add_argument("--chat-rounds", type=int, default=4)
    ap.add_argument("--answer-tokens", type=int, default=16, help="generated tokens per chat answer")
    ap.add_argument("--burst", type=int, default=8, help="concurrent requests on one prefix")
    ap.add_argument("--max-new-tokens", type=int, default=4,
                    help="generated tokens for the other shapes (decode steps cost ~0.1 s each on this CPU)")
    args = ap.parse_args(argv)

    console = Console(width=170)
    run = harness.Run.begin(args)
    out, model_path, urls = run.out, run.model_path, run.urls
    configs = ({label: None for label in urls} if urls else
               {c: (*run.server_args, *CONFIGS[c]) for c in args.configs})
    ctx = Ctx(args, model_path, load_tokenizer(model_path), harness.vocab_size(model_path), out)
    if urls:
        results = run_all(ctx, {label: u["url"] for label, u in urls.items()}, console)
    else:
        # Every shape's working set fits the pool, so LRU only evicts earlier shapes' content.
        with harness.running_servers(model_path, configs, out, console, max_total_tokens=65536,
                                     context_length=16384, max_running_requests=max(8, args.burst),
                                     gpu_scheduling=args.gpu_scheduling) as procs:
            results = run_all(ctx, {label: p.base_url for label, p in procs.items()}, console)

    labels = list(configs)
    scheduling = "extra_buffer + overlap" if args.gpu_scheduling else "no_buffer"
    title = f"workloads on {model_path.name} ({args.server_args}, {scheduling}, scale {args.scale})"
    print_table(results, labels, title, console)
    method = (harness.TTFT_METHOD + " (the shared-system-prompt shapes: bench_serving's own TTFT, the same "
              "definition); total = wall time of the shape's requests (bench_serving: its benchmark duration)")
    console.print(method)
    mem = memory.account_for_configs(model_path, configs, run.server_args)
    console.print(memory.table(mem))
    result = {"method": method, "model": str(model_path), "server_args": args.server_args, "configs": configs,
              "scheduling": scheduling,
              "urls": args.url, "scale": args.scale, "memory": mem, "machine_before": run.machine_before,
              "machine_after": harness.machine(), "wall_s": run.elapsed(), "results": results}
    out.write_text(json.dumps(result, indent=2))
    plot(results, labels, out.with_suffix(".png"), title)
    console.print(f"wrote {out} and {out.with_suffix('.png')} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
