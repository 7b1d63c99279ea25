"""Image chat on a Qwen3.5 vision-language checkpoint: stock SGLang against Tail-Replay, side by side in one run.

    python bench/image_chat.py [--preset small-qwen35-vl] [--clients 3] [--rounds 4] \
        [--out docs/results/image_chat/image_chat.json]

Two shapes:
- multi-turn chat: each client opens a chat with its own screenshot-size image and a document in its first turn,
  then asks --rounds - 1 follow-up questions; every answer (--answer-tokens, greedy) is fed back as the assistant's
  turn (stock SGLang hits these too, at the state it kept where the previous turn ended);
- screenshot fork: --forks requests on one shared image and document, each with a different question (an agent
  asking about the same screen; stock keeps no state where they part).
Prompts are the
checkpoint's chat template with the image as a vision span, sent to streaming `/generate` with the image as a data
URI (what `/v1/chat/completions` renders them to; `/generate` also returns the cache and Tail-Replay figures).
Clients interleave, and each request goes to every server in turn (who goes first rotates). Reported per shape and
server, over the requests that could hit (not a chat's turn one, not a fork's first request): cached share (cached /
prompt tokens), Tail-Replay's exact share, TTFT p50 and max; the cold requests' TTFT; and how many answers equal the
other server's token for token.
"""

import argparse
import base64
import io
import json
import statistics
import sys
import time

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table
from transformers import AutoTokenizer

from tailreplay_eval import harness
from tailreplay_eval.client import document, stream_generate

CONFIGS = {"Tail-Replay": ("--enable-tail-replay",), "stock": ()}
QUESTIONS = ("What is shown in the picture?", "Which part of the document does it illustrate?",
             "Summarise the document in one line.", "What would you change in the picture?",
             "Name one colour in it.", "Is anything missing?")


def screenshot(seed: int, width: int, height: int) -> str:
    """A noise image as a PNG data URI (content does not matter to the cache, only its hash and size)."""
    rng = np.random.default_rng(seed)
    img = Image.fromarray((rng.random((height, width, 3)) * 255).astype("uint8"))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Chat:
    """One client's conversation on one server: messages in the chat template's format, and the image."""

    def __init__(self, image: str, doc: str):
        self.image = image
        self.messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": doc}]}]

    def prompt(self, tok) -> str:
        return tok.apply_chat_template(self.messages, tokenize=False, add_generation_prompt=True)


def run_turn(url: str, tok, chat: Chat, answer_tokens: int) -> dict:
    out = stream_generate(url, chat.prompt(tok), answer_tokens, image_data=[chat.image])
    meta = out["meta_info"]
    chat.messages.append({"role": "assistant", "content": tok.decode(out["output_ids"], skip_special_tokens=True)})
    return {"prompt_tokens": meta["prompt_tokens"], "cached": meta["cached_tokens"], "ttft_s": out["ttft_s"],
            "exact": meta.get("tail_replay_exact"), "replayed": meta.get("tail_replay_tokens"),
            "output_ids": out["output_ids"]}


def conversations(args, shape: str) -> list[tuple[str, str]]:
    """(image, turn-one text) per client: its own in a chat; one shared screenshot and document in a fork."""
    if shape == "multi-turn chat":
        return [(screenshot(args.seed + c, args.width, args.height),
                 document(args.doc_words, args.seed + c) + " " + QUESTIONS[0]) for c in range(args.clients)]
    shared = screenshot(args.seed + 100, args.width, args.height), document(args.doc_words, args.seed + 100)
    return [(shared[0], shared[1] + " " + QUESTIONS[c % len(QUESTIONS)]) for c in range(args.forks)]


SHAPES = ("multi-turn chat", "screenshot fork")


def run_shape(args, shape: str, urls: dict[str, str], tok, console) -> dict[str, list[dict]]:
    labels = list(urls)
    convs = conversations(args, shape)
    rounds = args.rounds if shape == "multi-turn chat" else 1  # a fork is one request per client
    chats = {label: [Chat(image, text) for image, text in convs] for label in labels}
    turns = {label: [] for label in labels}
    for label in labels:
        harness.flush_cache(urls[label])
    step = 0
    for rnd in range(rounds):
        for c in range(len(convs)):
            if rnd > 0:
                for label in labels:
                    chats[label][c].messages.append({"role": "user", "content": QUESTIONS[rnd % len(QUESTIONS)]})
            for label in labels[step % len(labels):] + labels[:step % len(labels)]:
                turn = dict(run_turn(urls[label], tok, chats[label][c], args.answer_tokens), round=rnd, client=c,
                            first=step == 0 or (rnd == 0 and shape == "multi-turn chat"))
                turns[label].append(turn)
                console.print(f"  {shape} round {rnd} client {c} {label:>11}: prompt {turn['prompt_tokens']:>5}, "
                              f"cached {turn['cached']:>5}, TTFT {turn['ttft_s']:.3f} s")
            step += 1
    return turns


def summarise(turns: dict[str, list[dict]]) -> dict[str, dict]:
    """Per server, over the turns that could hit (`first` is False: not a chat's turn one, not a fork's first)."""
    labels = list(turns)
    summary = {}
    for label, rows in turns.items():
        follow = [t for t in rows if not t["first"]]
        other = turns[labels[1 - labels.index(label)]] if len(labels) == 2 else rows
        hits = [t for t in follow if t["cached"] > 0]
        summary[label] = {
            "hit_turns": len(follow),
            "cached_share": sum(t["cached"] for t in follow) / sum(t["prompt_tokens"] for t in follow),
            "exact_share": (sum(1 for t in hits if t["exact"]) / len(hits)) if hits and hits[0]["exact"] is not None
            else None,
            "ttft_p50_s": statistics.median(t["ttft_s"] for t in follow),
            "ttft_max_s": max(t["ttft_s"] for t in follow),
            "cold_ttft_p50_s": statistics.median(t["ttft_s"] for t in rows if t["first"]),
            "same_answers_as_other": sum(a["output_ids"] == b["output_ids"] for a, b in zip(rows, other)),
            "answers": len(rows),
        }
    return summary


def print_table(summaries: dict[str, dict], title: str, console) -> None:
    table = Table(title=title)
    for col in ("shape", "server", "cached share", "exact hits", "TTFT p50", "TTFT max", "cold TTFT p50",
                "answers = other server"):
        table.add_column(col, justify="right")
    for shape, summary in summaries.items():
        for label, s in summary.items():
            exact = "-" if s["exact_share"] is None else f"{100 * s['exact_share']:.0f} %"
            table.add_row(shape, label, f"{100 * s['cached_share']:.1f} %", exact, f"{s['ttft_p50_s']:.3f} s",
                          f"{s['ttft_max_s']:.3f} s", f"{s['cold_ttft_p50_s']:.3f} s",
                          f"{s['same_answers_as_other']} of {s['answers']}")
    console.print(table)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    harness.add_common_args(ap, "image_chat.json")
    ap.set_defaults(preset="small-qwen35-vl")
    ap.add_argument("--clients", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--forks", type=int, default=4, help="questions on the shared screenshot")
    ap.add_argument("--doc-words", type=int, default=400, help="document words in turn one (~2 tokens a word)")
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--height", type=int, default=384)
    ap.add_argument("--answer-tokens", type=int, default=16)
    args = ap.parse_args(argv)

    console = Console(width=150)
    run = harness.Run.begin(args)
    tok = AutoTokenizer.from_pretrained(run.model_path)
    configs = {label: (*run.server_args, *flags) for label, flags in CONFIGS.items()}
    def run_shapes(urls):
        return {shape: run_shape(args, shape, urls, tok, console) for shape in SHAPES}

    if run.urls:
        turns = run_shapes({label: u["url"] for label, u in run.urls.items()})
    else:
        with harness.running_servers(run.model_path, configs, run.out, console, max_total_tokens=32768,
                                     context_length=8192) as procs:
            turns = run_shapes({label: p.base_url for label, p in procs.items()})
    summary = {shape: summarise(t) for shape, t in turns.items()}
    title = (f"image chat on {run.model_path.name}: {args.clients} clients x {args.rounds} turns; {args.forks} "
             f"questions on one screenshot; {args.width}x{args.height} images, {args.doc_words}-word documents "
             f"({args.server_args})")
    print_table(summary, title, console)
    console.print(harness.TTFT_METHOD.replace("(input_ids, greedy)", "(text + image_data, greedy)"))
    command = "python bench/image_chat.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command, "model": str(run.model_path),
              "server_args": args.server_args, "configs": configs, "args": vars(args), "summary": summary,
              "turns": turns, "machine_before": run.machine_before, "machine_after": harness.machine(),
              "wall_s": run.elapsed(), "date": time.strftime("%Y-%m-%d")}
    run.out.write_text(json.dumps(result, indent=2))
    console.print(f"wrote {run.out} ({result['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
