"""Main job: real SGLang servers on the small hybrid model, stock and with Tail-Replay, and a shared-prefix
workload against each.

    python bench/shared_prefix.py [--preset small] [--system-words 600] [--server-args "..."] [--out runs/...]

The workload is what users of hybrid models send all the time: one long system prompt with different questions,
an identical resend, a multi-turn follow-up through the previous answer, and a fork mid-prompt. For each request and
server it prints the prompt length, SGLang's `cached_tokens`, the replayed tokens (with the anchor they started
from and whether the hit is exact) and the time to first token, and writes them as JSON. The two servers run one after
the other on the same machine.
"""

import argparse
import json
import shlex
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval.client import chat_ids, document, stream_generate
from tailreplay_eval.models import build_model, load_tokenizer
from tailreplay_eval.server import ServerProcess, cpu_serving_dtype, ships_remote_code

ROOT = Path(__file__).resolve().parents[1]


def workload(tok, system_words: int, answer_tokens: int, send):
    """Runs the requests in order through `send(name, ids)`; yields nothing, `send` records."""
    system = "You are a helpful assistant. Reference document: " + document(system_words, seed=1)
    q1 = [("user", "Which word appears most often in the document?")]
    first = send("system + question 1 (cold)", chat_ids(tok, system, q1))
    send("identical resend of question 1", chat_ids(tok, system, q1))
    send("system + question 2 (shared prefix)", chat_ids(tok, system, [("user", "Summarise the document.")]))
    answer = tok.decode(first["output_ids"][:answer_tokens])
    send("multi-turn follow-up", chat_ids(tok, system, q1 + [("assistant", answer), ("user", "And the rarest?")]))
    half = chat_ids(tok, system, q1)[: len(chat_ids(tok, system, q1)) // 2]
    send("fork mid-system-prompt", half + tok(" but instead, tell me a story").input_ids)


CONFIGS = {"stock SGLang": (), "Tail-Replay": ("--enable-tail-replay",)}


def run_workload(model_path: Path, tok, server_args: tuple, args, log_path: Path, console) -> list[dict]:
    server = ServerProcess(str(model_path), server_args, log_path=log_path, max_total_tokens=16384)
    t0 = time.perf_counter()
    results = []
    with server:
        console.print(f"  server healthy after {time.perf_counter() - t0:.1f} s (log: {log_path})")

        def send(name, ids):
            r = stream_generate(server.base_url, ids, args.max_new_tokens)
            meta = r["meta_info"]
            results.append({"request": name, "prompt_tokens": len(ids), "cached_tokens": meta["cached_tokens"],
                            "replayed_tokens": meta.get("tail_replay_tokens", 0), "ttft_s": r["ttft_s"],
                            "exact": meta.get("tail_replay_exact"), "anchor": meta.get("tail_replay_anchor"),
                            "answer": tok.decode(r["output_ids"])})
            return r

        workload(tok, args.system_words, args.max_new_tokens, send)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small")
    ap.add_argument("--model-path", help="serve this checkpoint instead of building --preset")
    ap.add_argument("--system-words", type=int, default=600, help="length of the shared document, in words")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--server-args", default=None,
                    help="flags for both servers (default: --dtype float32, these CPUs have no fast bf16 matmul; "
                         "bfloat16 where SGLang builds the model partly in bfloat16: server.cpu_serving_dtype; "
                         "with --trust-remote-code where the checkpoint ships its processor's code)")
    ap.add_argument("--out", default=str(ROOT / "runs" / "shared_prefix.json"))
    args = ap.parse_args(argv)

    console = Console(width=150)
    model_path = Path(args.model_path) if args.model_path else build_model(args.preset, ROOT / "models" / args.preset)
    tok = load_tokenizer(model_path)
    if args.server_args is None:
        args.server_args = f"--dtype {cpu_serving_dtype(model_path)}"
        if ships_remote_code(model_path):  # the checkpoint's own processor (Kimi K3's)
            args.server_args += " --trust-remote-code"
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    runs = {}
    for i, (name, flags) in enumerate(CONFIGS.items()):
        console.print(f"[bold]{name}[/bold] on {model_path}")
        runs[name] = run_workload(model_path, tok, (*shlex.split(args.server_args), *flags), args,
                                  out.with_suffix(f".server{i}.log"), console)

    table = Table(title=f"shared-prefix workload on {model_path.name} ({args.server_args})")
    table.add_column("request")
    table.add_column("prompt tokens", justify="right")
    for name in runs:
        table.add_column(f"{name}\ncached", justify="right")
        table.add_column(f"{name}\nTTFT s", justify="right")
    table.add_column("Tail-Replay\nreplayed", justify="right")
    table.add_column("Tail-Replay\nfrom anchor", justify="right")
    table.add_column("exact", justify="center")
    stock, tail = runs["stock SGLang"], runs["Tail-Replay"]
    for s_row, t_row in zip(stock, tail):
        table.add_row(s_row["request"], str(s_row["prompt_tokens"]), str(s_row["cached_tokens"]),
                      f"{s_row['ttft_s']:.2f}", str(t_row["cached_tokens"]), f"{t_row['ttft_s']:.2f}",
                      str(t_row["replayed_tokens"]), "-" if t_row["anchor"] is None else str(t_row["anchor"]),
                      {True: "yes", False: "no"}.get(t_row["exact"], "-"))
    console.print(table)
    out.write_text(json.dumps({"model": str(model_path), "server_args": args.server_args, "runs": runs}, indent=2))
    console.print(f"wrote {out}")


if __name__ == "__main__":
    main()
