"""Speculative decoding (NEXTN, the MTP draft) with and without Tail-Replay, on chat and agent traffic.

    python bench/speculative.py [--chat-clients 3] [--chat-rounds 4] [--agents 2] [--agent-steps 5] \
        [--answer-tokens 48] [--out runs/speculative.json]

The model is the project's trained quality model (models/quality-qwen35, docs/quality.md) with an MTP head distilled
from it on its training text (`tailreplay_eval.mtp.with_mtp_head`, built once into models/quality-qwen35-mtp), so
drafts are accepted as on a real checkpoint. The two servers run SGLang's GPU default scheduling (extra_buffer with
the overlap scheduler) with NEXTN 3/1/4 (SGLang's recipe for Qwen3.5), the same flags and memory fraction; one is
also `--enable-tail-replay` (its hidden store comes out of the same KV budget). They run at once; requests go to one
server after the other, one in flight.

Traffic, the same token ids for both servers (text from the model's training corpus, so the model predicts it):
- chat: clients with their own 3,000-token document, rounds of a 60-token question and an answer fed back, clients
  interleaved (a turn's prefix is the client's previous turn plus the answer stock never checkpointed);
- agent: trajectories of a 2,000-token system prompt and steps of a tool output (300 tokens) after the model's own
  answer, re-sent whole each step, and from the second step a retry whose last tool output was cut at 60 % and
  continued otherwise; agents interleaved.

Per request: cached tokens against matchable ones (`harness.Seen`), TTFT (streaming), decode rate (tokens after the
first over the time after it) and acceptance (`spec_accept_length`). Prints a table, writes JSON and a PNG.
"""

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.client import chat_ids, stream_generate
from tailreplay_eval.corpus import sentence, training_corpus
from tailreplay_eval.mtp import with_mtp_head

NEXTN = ("--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
         "--speculative-num-draft-tokens", "4")
ARMS = {"stock + NEXTN": NEXTN, "Tail-Replay + NEXTN": ("--enable-tail-replay",) + NEXTN}
SOURCE = harness.ROOT / "models" / "quality-qwen35"


def text(rng: random.Random, tokenizer, tokens: int) -> str:
    """Sentences of the training corpus's grammar, about `tokens` long."""
    words = []
    while len(tokenizer(" ".join(words), add_special_tokens=False).input_ids) < tokens:
        words.append(sentence(rng))
    return " ".join(words)


def chat(args, tokenizer, rng):
    """Yields (name, input ids) and is sent back each answer's text."""
    clients = [{"system": "Reference document: " + text(rng, tokenizer, args.document_tokens), "turns": []}
               for _ in range(args.chat_clients)]
    for r in range(args.chat_rounds):
        for c, client in enumerate(clients):
            client["turns"].append(("user", text(rng, tokenizer, 60)))
            answer = yield f"chat {c}.{r}", chat_ids(tokenizer, client["system"], client["turns"])
            client["turns"].append(("assistant", answer))


def agent(args, tokenizer, rng):
    """Each step re-sends the trajectory; from the second step on, a retry of it follows whose last tool output was
    cut at 60 % and continued otherwise (an agent re-running a tool; its answer is not kept): stock can reuse it only
    up to a state it kept, at the end of an earlier request."""
    agents = [{"system": f"You are agent {a}. Tools: search, read, write. " + text(rng, tokenizer, args.system_tokens),
               "turns": [("user", text(rng, tokenizer, 40))]} for a in range(args.agents)]
    for s in range(args.agent_steps):
        for a, trajectory in enumerate(agents):
            answer = yield f"agent {a}.{s}", chat_ids(tokenizer, trajectory["system"], trajectory["turns"])
            if s:
                role, output = trajectory["turns"][-1]
                edited = output[: int(0.6 * len(output))] + " " + text(rng, tokenizer, 60)
                yield f"agent {a}.{s} retry", chat_ids(tokenizer, trajectory["system"],
                                                       trajectory["turns"][:-1] + [(role, edited)])
            tool_output = "Tool output: " + text(rng, tokenizer, args.tool_tokens)
            trajectory["turns"] += [("assistant", answer), ("user", tool_output)]


def run_workload(name, make, args, tokenizer, servers, seen):
    """Drive one workload on every arm in lockstep: request i goes to each server in turn with the same ids (the
    answer fed back is each arm's own; greedy, so they agree unless a near-tie parts them)."""
    flows = {arm: make(args, tokenizer, random.Random(args.seed)) for arm in servers}
    pending = {arm: next(flow) for arm, flow in flows.items()}
    records = []
    while pending:
        for arm in list(pending):
            request, ids = pending[arm]
            matchable = seen[arm].matchable(ids)
            start = time.perf_counter()
            r = stream_generate(servers[arm].base_url, ids, args.answer_tokens)
            decode_s = time.perf_counter() - start - r["ttft_s"]
            seen[arm].add(ids, r["output_ids"])
            meta = r["meta_info"]
            records.append({"workload": name, "arm": arm, "request": request, "prompt_tokens": len(ids),
                            "matchable": matchable, "cached": meta["cached_tokens"], "ttft_s": r["ttft_s"],
                            "decode_tok_s": (len(r["output_ids"]) - 1) / decode_s,
                            "accept_length": meta.get("spec_accept_length"), "output_ids": r["output_ids"]})
            try:
                pending[arm] = flows[arm].send(tokenizer.decode(r["output_ids"], skip_special_tokens=True))
            except StopIteration:
                del pending[arm]
    return records


def summarize(records):
    rows = []
    for (workload, arm) in dict.fromkeys((r["workload"], r["arm"]) for r in records):
        sel = [r for r in records if (r["workload"], r["arm"]) == (workload, arm)]
        ttft = [r["ttft_s"] for r in sel]
        rows.append({"workload": workload, "arm": arm, "requests": len(sel),
                     "reused_share": sum(r["cached"] for r in sel) / max(1, sum(r["matchable"] for r in sel)),
                     "ttft_p50_s": statistics.median(ttft), "ttft_max_s": max(ttft),
                     "decode_tok_s": statistics.fmean(r["decode_tok_s"] for r in sel),
                     "accept_length": statistics.fmean(r["accept_length"] for r in sel)})
    return rows


def print_table(rows, console):
    table = Table(title="NEXTN 3/1/4 with and without Tail-Replay")
    for column in ("workload", "arm", "requests", "reused / matchable", "TTFT p50 s", "TTFT max s",
                   "decode tok/s", "accept length"):
        table.add_column(column)
    for r in rows:
        table.add_row(r["workload"], r["arm"], str(r["requests"]), f"{100 * r['reused_share']:.1f} %",
                      f"{r['ttft_p50_s']:.3f}", f"{r['ttft_max_s']:.3f}", f"{r['decode_tok_s']:.1f}",
                      f"{r['accept_length']:.2f}")
    console.print(table)


def plot(rows, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.6))
    for ax, (key, label) in zip(axes, (("ttft_p50_s", "TTFT p50 (s)"), ("decode_tok_s", "decode tokens/s"),
                                       ("accept_length", "tokens per verify"))):
        for i, arm in enumerate(ARMS):
            values = [next(r[key] for r in rows if r["workload"] == w and r["arm"] == arm) for w in workloads]
            ax.bar([x + 0.4 * i for x in range(len(workloads))], values, width=0.4, label=arm)
        ax.set_xticks([x + 0.2 for x in range(len(workloads))], workloads)
        ax.set_title(label)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chat-clients", type=int, default=3)
    ap.add_argument("--chat-rounds", type=int, default=4)
    ap.add_argument("--agents", type=int, default=2)
    ap.add_argument("--agent-steps", type=int, default=5)
    ap.add_argument("--answer-tokens", type=int, default=48)
    ap.add_argument("--document-tokens", type=int, default=3000)
    ap.add_argument("--system-tokens", type=int, default=2000)
    ap.add_argument("--tool-tokens", type=int, default=300)
    # Both servers get the same memory fraction; max_total_tokens is left for SGLang to size from it (Tail-Replay's
    # hidden store comes out of the same bytes, so its pool holds fewer tokens).
    ap.add_argument("--server-args", default="--dtype float32 --mem-fraction-static 0.2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(harness.ROOT / "runs" / "speculative.json"))
    args = ap.parse_args(argv)
    console, out = Console(), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    before = harness.machine()
    model = with_mtp_head(SOURCE, harness.ROOT / "models" / "quality-qwen35-mtp", training_corpus())
    mtp = json.loads((model / "tailreplay_mtp.json").read_text())
    console.print(f"MTP head distilled on the training corpus: {100 * mtp['heldout_accuracy']:.1f} % held-out")
    tokenizer = AutoTokenizer.from_pretrained(model)
    configs = {arm: tuple(shlex.split(args.server_args)) + flags for arm, flags in ARMS.items()}
    with harness.running_servers(model, configs, out.with_suffix(""), console, gpu_scheduling=True,
                                 max_running_requests=4, max_total_tokens=None, context_length=8192) as servers:
        seen = {arm: harness.Seen() for arm in servers}
        records = []
        for name, make in (("chat", chat), ("agent", agent)):
            records += run_workload(name, make, args, tokenizer, servers, seen)
        pools = {arm: harness.kv_pool_tokens(server.base_url) for arm, server in servers.items()}
    rows = summarize(records)
    print_table(rows, console)
    same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(records[::2], records[1::2]))
    console.print(f"greedy answers identical in both arms: {same} of {len(records) // 2}; KV pools (tokens): {pools}")
    out.write_text(json.dumps({"command": " ".join(sys.argv), "args": vars(args), "machine_before": before,
                               "machine_after": harness.machine(), "mtp_head": mtp, "kv_pool_tokens": pools,
                               "identical_answers": same, "summary": rows,
                               "records": [{k: v for k, v in r.items() if k != "output_ids"} for r in records]},
                              indent=2) + "\n")
    plot(rows, out.with_suffix(".png"))
    console.print(f"wrote {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
