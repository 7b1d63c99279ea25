"""Answer quality of Tail-Replay hits against full prefill, through real SGLang servers: the paper's Table 1 for a
model of ours, on RULER-style tasks generated locally (tailreplay_eval/tasks.py) and on local LongBench files,
under two cache protocols, the plugin's anchored replay next to the paper's pure zero-init tail.

    python bench/quality.py [--model PATH] [--tasks ...] [--lengths 2048 4096 8192] [--samples 10] \
        [--modes cache_off r0.05 anchored anchored_n512 anchored_n1024 full] \
        [--protocols context_first new_question] [--longbench-jsonl FILE ...] [--out bench/results/quality]
    python bench/quality.py --url http://HOST:30000 --mode-of-url anchored --model Qwen/Qwen3.5-4B   # a running server

Modes (one server each, started one after the other with --server-args, or the one at --url, which must run the
flags of that mode: `mode_flags`):
- cache_off: stock SGLang with --disable-radix-cache, i.e. full prefill of every prompt (the reference, 100 %);
  on a --url server it is emulated by /flush_cache before every request;
- the paper's modes, anchors off (--tail-replay-exact-budget 0: no recurrent state is kept in the tree, so every hit
  rebuilds its GDN states from zero over a tail of the match):
  - zero: --tail-replay-mode zero (FA KV reused, GDN states zeroed: the paper's baseline);
  - rX: --tail-replay-ratio X (e.g. r0.05, r0.10; the plugin's --tail-replay-min-tokens applies);
  - full: --tail-replay-mode full (the whole prefix replayed: equal to cache_off in float32);
- anchored: --enable-tail-replay alone, the plugin's defaults: states (anchors) kept where requests and prefill chunks
  end and every 512 prefill tokens; a hit of m tokens whose deepest anchor c has m - c <= max(tail, 512) replays
  [c, m) from a copy of that state (exact), any other hit takes the r=0.05 zero-init tail;
- anchored_nN: the same with --tail-replay-anchor-interval N (a multiple of 64; 0: request and chunk ends only).
Interval anchors come from the CPU GDN ops (tailreplay_sglang/cache/anchors.py); on a GPU only request-end and chunk-end
anchors are kept, so there the anchored modes differ from the paper's only where a match ends at one of those.

Protocols (--protocols), per sample and mode, each after /flush_cache; cache_off sends only the scored request, the
same in both protocols, so it runs once and its record stands for both:
- context_first: the context's ids alone with max_new_tokens=1 (caches it), then context + question. The match ends
  where the first request ended, where an anchored server keeps that request's state: a document sent ahead of its
  question.
- new_question ("shared prefix, new question"): context + question A (a generic question about the text,
  OTHER_QUESTIONS, answered greedily in up to OTHER_ANSWER_TOKENS tokens), then context + the sample's question B.
  B's match ends inside the first request, after the context and the tokens the two questions share (e.g.
  "\\nQuestion: What is the"), where no request ended: a second question on a document cached with a first one. An
  anchored server serves it exactly only from an interval or chunk-end anchor within the budget below the match
  end (a 512-token context: the anchor at 512), else through the zero-init tail.
The scored request (context + question, or B): greedy, max_new_tokens = the target's tokens + 4, stop at a newline,
with the first answer token's top logprobs. Its `cached_tokens` is recorded: a hit mode must reuse at least the
planned match - 1 (the context, resp. the context and the shared question tokens), and a miss shows in the table;
so are its `tail_replay_tokens`, `tail_replay_exact`, `tail_replay_anchor` and `tail_replay_state_survival`. Ids are
sent, not text, so the cached prefix is exactly what was sent. RULER samples are scored by tasks.score (string
match); LongBench ones by token F1 (LongBench's qa_f1_score: lower case, no punctuation or articles, best over the
reference answers).

Columns, per mode and protocol: score (Table 1's average over task x length cells, per suite), % of cache_off, mean
replayed tokens (`tail_replay_tokens` of the scored requests), share of exact hits (`tail_replay_exact` among the
scored requests that hit, i.e. cached_tokens > 0), KL; and cache use and outputs identical to cache_off.

KL: per sample, KL(cache_off || mode) of the next-token distribution at the first answer token, from SGLang's
`top_logprobs_num`; exact when that is the whole vocabulary (the default up to MAX_EXACT_VOCAB tokens), otherwise
over cache_off's top k, with tokens missing from the mode's top k given its k-th logprob (an approximation).

Drift: one conversation of --drift-turns turns over one context (the shortest length) with a needle per turn; the
context is cached first (as context_first), then each turn's prompt is the previous prompt + its answer + a new
question, so every turn's match ends where the previous request ended. Each mode runs its own conversation (its own
answers fed back); reported with the same columns where they apply (KL over the turns whose prompt is still
cache_off's, i.e. up to the first differing turn), the last turn's answer against cache_off's and the first turn
whose output differs.

Writes DIR/quality.json (config, servers, machine, per-cell and per-mode tables, drift, every sample) and
DIR/quality.md (the same tables); server logs under DIR/logs/.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import re
import shlex
import string
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import requests
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from transformers import AutoTokenizer

from tailreplay_eval import harness, tasks
from tailreplay_eval.harness import ROOT
from tailreplay_eval.models import build_model
from tailreplay_sglang.config import GDN_CHUNK, HIDDEN_DTYPES

DEFAULT_MODES = ("cache_off", "r0.05", "anchored", "anchored_n512", "anchored_n1024", "full")
PROTOCOLS = ("context_first", "new_question")
DEFAULT_LENGTHS = (2048, 4096, 8192)
TRAINED_MODEL = ROOT / "models" / "quality-qwen35"
FALLBACK_PRESET = "small"
MAX_EXACT_VOCAB = 4096  # up to this vocabulary the KL uses every token; above, the top TOP_K_APPROX
TOP_K_APPROX = 64
ANSWER_MARGIN = 4  # generated tokens beyond the target's: room for a stray leading token
LONGBENCH_MAX_NEW = 128  # LongBench's answer budget for its QA sets (narrativeqa, qasper)
# new_question's first question: tasks.generate gives one question per context, so a generic one about the text (the
# second where the first's ids would be a prefix of the sample's question: then B's match would end where A ended).
OTHER_QUESTIONS = (tasks.ask("What is the text above about?"), tasks.ask("Summarize the text above in one sentence."))
OTHER_ANSWER_TOKENS = 8
TR = "--enable-tail-replay"
PAPER = ("--tail-replay-exact-budget", "0")  # anchors off: the paper's pure zero-init tail
METHOD = ("Per sample and protocol: /flush_cache; context_first: the context's ids with max_new_tokens=1, then "
          "context + question (the match ends where a request ended); new_question: context + a generic question A "
          f"answered in up to {OTHER_ANSWER_TOKENS} tokens, then context + the sample's question B (the match ends "
          "inside the first request, after the shared tokens, where no request ended); cache_off sends only the "
          "scored request. Scored request: greedy, stop at a newline; its cached_tokens, tail_replay_tokens and "
          "tail_replay_exact recorded; exact share = exact among scored requests with cached_tokens > 0. "
          "RULER-style tasks scored by string match (tailreplay_eval/tasks.py), LongBench files by token F1. "
          "KL(cache_off || mode) of the next-token distribution at the first answer token, from top_logprobs_num.")


def mode_flags(mode: str) -> tuple[str, ...]:
    """The server flags of a mode name.

    cache_off: stock, no radix cache. The paper's modes, anchors off (--tail-replay-exact-budget 0): zero, full,
    r<ratio> (ratio in (0, 1]). The plugin's anchored replay: anchored (its defaults), anchored_n<N> (anchor interval
    N, a multiple of 64, 0: request and chunk ends only; default exact budget). Any Tail-Replay mode may end in
    @<hidden dtype> (e.g. full@float8_e4m3fn): its server stores the hiddens in that dtype.
    """
    base, at, dtype = mode.partition("@")
    if at:
        flags = mode_flags(base)
        if TR not in flags or dtype not in HIDDEN_DTYPES:
            raise ValueError(f"mode {mode!r}: @<hidden dtype> needs a Tail-Replay mode and one of "
                             f"{', '.join(HIDDEN_DTYPES)}")
        return *flags, "--tail-replay-hidden-dtype", dtype
    fixed = {"cache_off": ("--disable-radix-cache",), "zero": (TR, "--tail-replay-mode", "zero", *PAPER),
             "full": (TR, "--tail-replay-mode", "full", *PAPER), "anchored": (TR,)}
    if mode in fixed:
        return fixed[mode]
    if re.fullmatch(r"r(0?\.\d+|1(\.0*)?)", mode) and 0 < float(mode[1:]) <= 1:
        return TR, "--tail-replay-ratio", mode[1:], *PAPER
    if re.fullmatch(r"anchored_n(0|[1-9]\d*)", mode) and int(mode[10:]) % GDN_CHUNK == 0:
        return TR, "--tail-replay-anchor-interval", mode[10:]
    raise ValueError(f"unknown mode {mode!r}: cache_off, zero, full, r<ratio> with ratio in (0, 1] (e.g. r0.05), "
                     f"anchored, or anchored_n<N> with N a multiple of {GDN_CHUNK} (e.g. anchored_n512)")


@dataclass(frozen=True)
class QualityConfig:
    model: Path
    out: Path
    tasks: tuple[str, ...] = tasks.TASKS
    lengths: tuple[int, ...] = DEFAULT_LENGTHS
    samples: int = 10
    modes: tuple[str, ...] = DEFAULT_MODES
    protocols: tuple[str, ...] = PROTOCOLS
    seed: int = 0
    drift_turns: int = 10  # 0: no drift check
    longbench: tuple[Path, ...] = ()
    longbench_max_tokens: int = 8192  # longer LongBench contexts lose their middle, as LongBench's own runner does
    url: str | None = None  # a running server: then only cache_off (by flushing) and mode_of_url run on it
    mode_of_url: str | None = None
    server_args: tuple[str, ...] = ("--dtype", "float32")
    # Extra flags for the Tail-Replay modes' servers. None needed: the stored hiddens default to the model's dtype
    # (--tail-replay-hidden-dtype auto), float32 on our CPU servers, so `full` and anchored replay are exact controls.
    tail_replay_args: tuple[str, ...] = ()

    def __post_init__(self):
        unknown = set(self.tasks) - set(tasks.TASKS)
        if unknown:
            raise ValueError(f"unknown tasks {sorted(unknown)}; tasks: {', '.join(tasks.TASKS)}")
        if not self.lengths or min(self.lengths) < 64 or self.samples < 1 or self.drift_turns < 0:
            raise ValueError("need lengths >= 64, --samples >= 1 and --drift-turns >= 0")
        for mode in self.modes:
            mode_flags(mode)
        if "cache_off" not in self.modes:
            raise ValueError("--modes must include cache_off: every score is reported as a % of it")
        if len(set(self.modes)) != len(self.modes):
            raise ValueError("--modes: each mode once")
        if not self.protocols or not set(self.protocols) <= set(PROTOCOLS) or len(set(self.protocols)) < len(
                self.protocols):
            raise ValueError(f"--protocols: one or more of {', '.join(PROTOCOLS)}, each once")
        if (self.url is None) != (self.mode_of_url is None):
            raise ValueError("--url and --mode-of-url go together")
        for path in self.longbench:
            if not Path(path).is_file():
                raise ValueError(f"--longbench-jsonl {path}: no such file")

    @property
    def longest_prompt(self) -> int:
        drift = self.drift_turns * 64  # a question and an answer per turn, generously
        return int(1.1 * max(*self.lengths, self.longbench_max_tokens if self.longbench else 0)) + 256 + drift


@dataclass
class Item:
    """One question of a suite, as token ids; `key` names it across modes (and protocols)."""

    suite: str  # "ruler" | "longbench"
    task: str
    length: int  # the requested context length (LongBench: the truncation budget)
    index: int
    sample: tasks.Sample
    context_ids: list[int]
    question_ids: list[int]
    max_new_tokens: int
    other_ids: list[int]  # new_question's first question (A)

    @property
    def key(self) -> tuple:
        return self.task, self.length, self.index

    @property
    def shared_tokens(self) -> int:
        """new_question: where B's match ends, the context and the tokens questions A and B share."""
        return len(self.context_ids) + _common_prefix(self.other_ids, self.question_ids)

    def score(self, prediction: str) -> float:
        if self.suite == "longbench":
            return max(token_f1(prediction, answer) for answer in self.sample.answers)
        return tasks.score(self.sample, prediction)


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def other_question_ids(question_ids: list[int], tokenizer) -> list[int]:
    """new_question's question A: the first of OTHER_QUESTIONS that is not the sample's question or a prefix of it
    (else B's match would end where A's request ended)."""
    for text in OTHER_QUESTIONS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        if _common_prefix(ids, question_ids) < len(ids):
            return ids
    raise ValueError("every OTHER_QUESTIONS entry is a prefix of the question")  # they differ in their 4th word


# --- suites ------------------------------------------------------------------------------------------------------


def ruler_items(cfg: QualityConfig, tokenizer) -> list[Item]:
    items = []
    for length in cfg.lengths:
        for task in cfg.tasks:
            for i, sample in enumerate(tasks.generate(task, cfg.samples, length, tokenizer, cfg.seed)):
                context, question = tasks.token_ids(sample, tokenizer)
                budget = len(tokenizer(sample.target(), add_special_tokens=False).input_ids) + ANSWER_MARGIN
                items.append(Item("ruler", task, length, i, sample, context, question, budget,
                                  other_question_ids(question, tokenizer)))
    return items


def longbench_items(cfg: QualityConfig, tokenizer) -> list[Item]:
    """The first --samples lines of each file (fields context, input, answers), the generic question template of
    tasks.py (not LongBench's per-dataset instructions), contexts over the budget cut in the middle."""
    items = []
    for path in cfg.longbench:
        lines = [line for line in Path(path).read_text().splitlines() if line.strip()][: cfg.samples]
        for i, line in enumerate(lines):
            raw = json.loads(line)
            answers = [raw["answers"]] if isinstance(raw["answers"], str) else raw["answers"]
            sample = tasks.Sample(f"lb-{Path(path).stem}", raw["context"], tasks.QUESTION.format(raw["input"]),
                                  tuple(answers))
            context, question = tasks.token_ids(sample, tokenizer)
            if len(context) > cfg.longbench_max_tokens:
                half = cfg.longbench_max_tokens // 2
                context = context[:half] + context[len(context) - half:]
            longest = max(len(tokenizer(a, add_special_tokens=False).input_ids) for a in sample.answers)
            budget = min(LONGBENCH_MAX_NEW, longest + ANSWER_MARGIN)
            items.append(Item("longbench", sample.task, cfg.longbench_max_tokens, i, sample, context, question,
                              budget, other_question_ids(question, tokenizer)))
    return items


def token_f1(prediction: str, answer: str) -> float:
    """LongBench's qa_f1_score (English)."""
    pred, gold = _normalize(prediction).split(), _normalize(answer).split()
    common = sum((Counter(pred) & Counter(gold)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(gold)
    return 2 * precision * recall / (precision + recall)


_PUNCTUATION = frozenset(string.punctuation)


def _normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())



# --- requests ----------------------------------------------------------------------------------------------------


@dataclass
class Endpoint:
    """A server under test: where it is, the mode it serves, and how a cache_off request gets a cold cache."""

    url: str
    mode: str
    flags: tuple[str, ...] | None  # None: started elsewhere (--url)
    radix_cache: bool  # False with --disable-radix-cache: nothing to flush
    top_logprobs: int
    info: dict = field(default_factory=dict)

    @property
    def hits(self) -> bool:
        return self.mode != "cache_off"

    def cold(self) -> None:
        if self.radix_cache:
            harness.flush_cache(self.url)

    def generate(self, ids: list[int], max_new_tokens: int, logprobs: bool = False) -> dict:
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                      "stop": ["\n"]}}
        if logprobs:
            body.update(return_logprob=True, top_logprobs_num=self.top_logprobs)
        r = requests.post(f"{self.url}/generate", json=body, timeout=1800)
        r.raise_for_status()
        return r.json()


def _replay_fields(meta: dict) -> dict:
    """The plugin's per-request meta_info (absent on a stock server: exact None, nothing replayed)."""
    return {"replayed_tokens": meta.get("tail_replay_tokens", 0), "exact": meta.get("tail_replay_exact"),
            "anchor": meta.get("tail_replay_anchor"), "state_survival": meta.get("tail_replay_state_survival")}


def _reused_as_planned(meta: dict, planned: int) -> bool:
    """A hit reused the planned match, less at most its last token (which SGLang may keep back), or Tail-Replay
    folded a short span after its anchor into the extend (`--tail-replay-fold-tokens`: exact, nothing replayed, and
    cached tokens = the anchor's depth)."""
    cached = meta["cached_tokens"]
    folded = meta.get("tail_replay_exact") and not meta.get("tail_replay_tokens") and \
        (meta.get("tail_replay_anchor") or 0) == cached
    return cached >= planned - 1 or bool(folded)


def _first_token_logprobs(meta: dict) -> dict[int, float]:
    top = meta["output_top_logprobs"][0] if meta.get("output_top_logprobs") else []
    return {int(token): float(lp) for lp, token, *_ in top}


def ask(endpoint: Endpoint, item: Item, protocol: str) -> tuple[dict, dict[int, float]]:
    """One sample in the endpoint's mode and a protocol: (record, first answer token's top logprobs {id: logprob})."""
    endpoint.cold()
    planned = 0  # tokens the earlier request leaves cached for the scored one
    if endpoint.hits and protocol == "context_first":
        endpoint.generate(item.context_ids, 1)
        planned = len(item.context_ids)
    elif endpoint.hits:  # new_question
        endpoint.generate(item.context_ids + item.other_ids, OTHER_ANSWER_TOKENS)
        planned = item.shared_tokens
    out = endpoint.generate(item.context_ids + item.question_ids, item.max_new_tokens, logprobs=True)
    meta = out["meta_info"]
    cached = meta["cached_tokens"]
    # cache_ok: the cache did what the mode plans: a hit mode reused the planned match (`_reused_as_planned`),
    # cache_off reused nothing.
    record = {"mode": endpoint.mode, "protocol": protocol, "suite": item.suite, "task": item.task,
              "length": item.length, "index": item.index, "context_tokens": len(item.context_ids),
              "question_tokens": len(item.question_ids), "planned_match": planned, "cached_tokens": cached,
              "cache_ok": _reused_as_planned(meta, planned) if endpoint.hits else cached == 0,
              **_replay_fields(meta),
              "answers": list(item.sample.answers), "prediction": out["text"], "output_ids": out["output_ids"],
              "score": item.score(out["text"])}
    return record, _first_token_logprobs(meta)


def converse(endpoint: Endpoint, turns: list[tasks.Sample], tokenizer) -> tuple[list[dict], list[dict]]:
    """The drift conversation: each turn's prompt is the previous prompt + its output + the next question.
    (records, first answer token's top logprobs per turn)."""
    endpoint.cold()
    ids = tokenizer(turns[0].context).input_ids
    if endpoint.hits:
        endpoint.generate(ids, 1)
    records, firsts, seen = [], [], len(ids)  # seen: tokens a hit mode must have cached for the next request
    for t, sample in enumerate(turns):
        ids = ids + tokenizer(sample.question, add_special_tokens=False).input_ids
        budget = len(tokenizer(sample.target(), add_special_tokens=False).input_ids) + ANSWER_MARGIN
        if not endpoint.hits:
            endpoint.cold()
        out = endpoint.generate(ids, budget, logprobs=True)
        cached = out["meta_info"]["cached_tokens"]
        records.append({"mode": endpoint.mode, "turn": t, "prompt_tokens": len(ids), "cached_tokens": cached,
                        "cache_ok": _reused_as_planned(out["meta_info"], seen) if endpoint.hits else cached == 0,
                        **_replay_fields(out["meta_info"]), "prediction": out["text"],
                        "output_ids": out["output_ids"], "score": tasks.score(sample, out["text"])})
        firsts.append(_first_token_logprobs(out["meta_info"]))
        ids = ids + out["output_ids"]
        seen = len(ids) - 1  # SGLang caches a finished request's prompt and output but its last token
    return records, firsts


def kl_divergence(reference: dict[int, float], other: dict[int, float]) -> float | None:
    """KL(reference || other) in nats over reference's tokens; a token missing from other's top k gets its
    smallest returned logprob (exact when both hold the whole vocabulary)."""
    if not reference or not other:
        return None
    floor = min(other.values())
    return sum(math.exp(lp) * (lp - other.get(token, floor)) for token, lp in reference.items())


# --- servers -----------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serving(cfg: QualityConfig, mode: str, top_logprobs: int, console):
    """The endpoint of one mode: the --url server, or a server of ours for this mode, stopped on leaving."""
    if cfg.url:
        info = harness.server_info(cfg.url)
        if mode != "cache_off" and info.get("radix_cache_backend") != "tail_replay":
            raise SystemExit(f"{cfg.url} does not run --enable-tail-replay; it cannot serve mode {mode}")
        yield Endpoint(cfg.url, mode, None, not info.get("disable_radix_cache", False), top_logprobs,
                       _info_summary(info))
        return
    flags = (*cfg.server_args, *mode_flags(mode), *(cfg.tail_replay_args if TR in mode_flags(mode) else ()))
    log_stem = cfg.out / "logs" / mode.replace(".", "_")
    log_stem.parent.mkdir(parents=True, exist_ok=True)
    # One context (or conversation) is in the cache at a time, so twice the longest prompt is room to spare.
    pool = 2 * cfg.longest_prompt
    with harness.running_servers(cfg.model, {mode: flags}, log_stem, console, max_total_tokens=pool,
                                 context_length=cfg.longest_prompt) as procs:
        url = procs[mode].base_url
        got = harness.kv_pool_tokens(url)
        if got is not None and got < pool:
            raise SystemExit(f"{mode}: KV pool {got} tokens, needs {pool}: raise --mem-fraction-static")
        yield Endpoint(url, mode, flags, "--disable-radix-cache" not in flags, top_logprobs,
                       _info_summary(harness.server_info(url)))


def _info_summary(info: dict) -> dict:
    keys = ("model_path", "radix_cache_backend", "disable_radix_cache", "max_total_num_tokens", "dtype", "version")
    return {k: info[k] for k in keys if k in info}


def run_mode(endpoint: Endpoint, items: list[Item], protocols: tuple[str, ...], turns: list[tasks.Sample],
             tokenizer, console) -> dict:
    """Every item under every protocol, then the drift conversation. cache_off's scored request is the same in
    every protocol: it runs once, its record copied to each."""
    records, first = [], {}
    t0 = time.perf_counter()
    for protocol in protocols if endpoint.hits else protocols[:1]:
        for (task, length), cell in itertools.groupby(items, key=lambda item: (item.task, item.length)):
            done = []
            for item in cell:
                record, first[(protocol, *item.key)] = ask(endpoint, item, protocol)
                done.append(record)
            hits = [r for r in done if r["cached_tokens"] > 0]
            console.print(f"  {endpoint.mode:>14} {protocol if endpoint.hits else 'any protocol':>13} {task:>18} @ "
                          f"{length:>5}: score {_mean([r['score'] for r in done]):.3f}, cache ok "
                          f"{sum(r['cache_ok'] for r in done)}/{len(done)}, exact hits "
                          f"{sum(bool(r['exact']) for r in hits)}/{len(hits)}, {time.perf_counter() - t0:.0f} s")
            records += done
    if not endpoint.hits:
        asked = protocols[0]
        records += [{**r, "protocol": p} for p in protocols[1:] for r in records]
        first.update({(p, *key[1:]): lp for p in protocols[1:] for key, lp in list(first.items()) if key[0] == asked})
    drift, drift_first = converse(endpoint, turns, tokenizer) if turns else ([], [])
    return {"samples": records, "first_token_logprobs": first, "drift": drift, "drift_first": drift_first,
            "wall_s": time.perf_counter() - t0}


# --- summaries ---------------------------------------------------------------------------------------------------


def _mean(values: list[float]) -> float | None:
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _pct(value: float | None, reference: float | None) -> float | None:
    return None if value is None or not reference else 100.0 * value / reference


def sample_key(record: dict) -> tuple:
    return record["protocol"], record["task"], record["length"], record["index"]


def _exact(records: list[dict]) -> dict:
    """Share of exact hits: tail_replay_exact among the records that hit (cached_tokens > 0); None without hits."""
    hits = [r for r in records if r["cached_tokens"] > 0]
    exact = sum(bool(r["exact"]) for r in hits)
    return {"hits": len(hits), "exact_hits": exact, "exact_share": exact / len(hits) if hits else None}


def add_kl(runs: dict[str, dict]) -> None:
    """Each sample record gets its first-answer-token KL against cache_off's same sample (same protocol), each drift
    turn whose prompt is still cache_off's (all earlier outputs equal) its KL against cache_off's turn, else None."""
    reference = runs["cache_off"]["first_token_logprobs"]
    ref_turns, ref_first = runs["cache_off"]["drift"], runs["cache_off"]["drift_first"]
    for run in runs.values():
        for record in run["samples"]:
            key = sample_key(record)
            record["kl"] = kl_divergence(reference[key], run["first_token_logprobs"][key])
        same_prompt = True
        for turn, ref, first, ref_lp in zip(run["drift"], ref_turns, run["drift_first"], ref_first):
            turn["kl"] = kl_divergence(ref_lp, first) if same_prompt else None
            same_prompt = same_prompt and turn["output_ids"] == ref["output_ids"]


def cells(runs: dict[str, dict], modes: tuple[str, ...], protocols: tuple[str, ...]) -> list[dict]:
    """Table-1 cells: per protocol x task x length, mean score per mode and % of cache_off."""
    order = list(dict.fromkeys((r["suite"], r["task"], r["length"]) for r in runs["cache_off"]["samples"]))
    rows = []
    for protocol, (suite, task, length) in itertools.product(protocols, order):
        cell = (protocol, task, length)
        picked = {m: [r for r in runs[m]["samples"] if (r["protocol"], r["task"], r["length"]) == cell] for m in modes}
        score = {m: _mean([r["score"] for r in picked[m]]) for m in modes}
        rows.append({"protocol": protocol, "suite": suite, "task": task, "length": length,
                     "n": len(picked["cache_off"]),
                     "context_tokens": _mean([r["context_tokens"] for r in picked["cache_off"]]),
                     "score": score, "pct": {m: _pct(score[m], score["cache_off"]) for m in modes},
                     "kl": {m: _mean([r["kl"] for r in picked[m]]) for m in modes},
                     "replayed": {m: _mean([r["replayed_tokens"] for r in picked[m]]) for m in modes},
                     "exact_share": {m: _exact(picked[m])["exact_share"] for m in modes},
                     "cache_ok": {m: sum(r["cache_ok"] for r in picked[m]) for m in modes}})
    return rows


def mode_summary(runs: dict[str, dict], rows: list[dict], modes: tuple[str, ...],
                 protocols: tuple[str, ...]) -> list[dict]:
    """Per mode and protocol: the average over cells per suite (as Table 1 averages) and its % of cache_off, KL,
    cache use, mean replayed tokens, share of exact hits, outputs identical to cache_off."""
    reference = {sample_key(r): r["output_ids"] for r in runs["cache_off"]["samples"]}
    summary = []
    for m in modes:
        for p in protocols:
            samples = [r for r in runs[m]["samples"] if r["protocol"] == p]
            entry = {"mode": m, "protocol": p, "requests": len(samples),
                     "cache_ok": sum(r["cache_ok"] for r in samples),
                     "kl_mean": _mean([r["kl"] for r in samples]),
                     "kl_max": max((r["kl"] for r in samples if r["kl"] is not None), default=None),
                     "replayed_mean": _mean([r["replayed_tokens"] for r in samples]), **_exact(samples),
                     "same_output": sum(r["output_ids"] == reference[sample_key(r)] for r in samples)}
            for suite in dict.fromkeys(r["suite"] for r in rows):
                mine = [r for r in rows if r["suite"] == suite and r["protocol"] == p]
                avg, ref = _mean([r["score"][m] for r in mine]), _mean([r["score"]["cache_off"] for r in mine])
                entry[suite] = {"score": avg, "pct": _pct(avg, ref)}
            summary.append(entry)
    return summary


def drift_summary(runs: dict[str, dict], modes: tuple[str, ...]) -> list[dict]:
    reference = runs["cache_off"]["drift"]
    ref_score = _mean([t["score"] for t in reference])
    out = []
    for m in modes:
        turns = runs[m]["drift"]
        if not turns:
            continue
        differs = [t["turn"] for t, ref in zip(turns, reference) if t["output_ids"] != ref["output_ids"]]
        score = _mean([t["score"] for t in turns])
        out.append({"mode": m, "turns": len(turns), "cache_ok": sum(t["cache_ok"] for t in turns),
                    "score_mean": score, "pct": _pct(score, ref_score),
                    "replayed_mean": _mean([t["replayed_tokens"] for t in turns]), **_exact(turns),
                    "kl_mean": _mean([t["kl"] for t in turns]), "kl_turns": sum(t["kl"] is not None for t in turns),
                    "last_score": turns[-1]["score"],
                    "last_equals_cache_off": turns[-1]["output_ids"] == reference[-1]["output_ids"],
                    "first_differing_turn": differs[0] if differs else None,
                    "last_prediction": turns[-1]["prediction"]})
    return out


# --- output ------------------------------------------------------------------------------------------------------


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _kl_text(value: float | None) -> str:
    """A KL to 5 places; rounding in either forward can make a near-zero one come out negative (-1e-8): shown as 0."""
    return _fmt(None if value is None else max(value, 0.0), 5)


def _pct_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}%"


def _exact_text(entry: dict) -> str:
    return "-" if not entry["hits"] else f"{entry['exact_share']:.2f} ({entry['exact_hits']}/{entry['hits']})"


def _score_cell(row: dict, mode: str) -> str:
    text = _fmt(row["score"][mode])
    if mode != "cache_off" and row["pct"][mode] is not None:
        text += f" ({row['pct'][mode]:.1f}%)"
    if row["cache_ok"][mode] < row["n"]:
        text += f" [{row['n'] - row['cache_ok'][mode]} miss]"
    return text


def tables(result: dict) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, header, rows) of every table, shared by the console and the markdown file."""
    modes = result["config"]["modes"]
    cell_rows = []
    for protocol in dict.fromkeys(r["protocol"] for r in result["cells"]):
        mine = [r for r in result["cells"] if r["protocol"] == protocol]
        cell_rows += [[protocol, r["task"], str(r["length"]), str(r["n"]), *[_score_cell(r, m) for m in modes]]
                      for r in mine]
        for suite in dict.fromkeys(r["suite"] for r in mine):  # Table 1's rows: averages over cells
            cell_rows.append([protocol, f"average ({suite})", "", "",
                              *[_average_cell(s, suite) for s in result["modes"] if s["protocol"] == protocol]])
    suites = list(dict.fromkeys(r["suite"] for r in result["cells"]))
    label = (lambda suite: f" ({suite})") if len(suites) > 1 else (lambda suite: "")  # noqa: E731
    suite_header = [x for suite in suites for x in (f"score{label(suite)}", f"% of cache_off{label(suite)}")]
    mode_rows = [[s["mode"], s["protocol"],
                  *[x for suite in suites for x in (_fmt(s[suite]["score"]), _pct_text(s[suite]["pct"]))],
                  _fmt(s["replayed_mean"], 1), _exact_text(s), _kl_text(s["kl_mean"]), _kl_text(s["kl_max"]),
                  f"{s['cache_ok']}/{s['requests']}", f"{s['same_output']}/{s['requests']}"] for s in result["modes"]]
    drift_rows = [[d["mode"], _fmt(d["score_mean"]), _pct_text(d["pct"]), _fmt(d["replayed_mean"], 1),
                   _exact_text(d),
                   f"{_kl_text(d['kl_mean'])} ({d['kl_turns']})", f"{d['cache_ok']}/{d['turns']}",
                   _fmt(d["last_score"]), "yes" if d["last_equals_cache_off"] else "no",
                   "-" if d["first_differing_turn"] is None else str(d["first_differing_turn"])]
                  for d in result["drift"]]
    return [
        ("Score per protocol x task x length (% of cache_off; [n miss]: scored requests not cached as the mode plans)",
         ["protocol", "task", "length", "n", *modes], cell_rows),
        (f"Per mode and protocol: score (average over cells) and % of cache_off, mean replayed tokens, share of "
         f"exact hits (exact/hits), KL(cache_off || mode) at the first answer token ({result['kl_method']}), "
         f"requests cached as planned, outputs identical to cache_off",
         ["mode", "protocol", *suite_header, "replayed", "exact hits", "KL mean", "KL max", "cache ok", "same output"],
         mode_rows),
        (f"Drift: a {result['config']['drift_turns']}-turn conversation, each turn hitting the previous one "
         f"(KL over the turns whose prompt is still cache_off's: their number in brackets)",
         ["mode", "mean score", "% of cache_off", "replayed", "exact hits", "KL mean", "cache ok", "last-turn score",
          "last turn = cache_off", "first differing turn"], drift_rows),
    ]


def _average_cell(summary: dict, suite: str) -> str:
    avg = summary[suite]
    pct = "" if summary["mode"] == "cache_off" or avg["pct"] is None else f" ({avg['pct']:.1f}%)"
    return _fmt(avg["score"]) + pct


def print_tables(result: dict, console) -> None:
    for title, header, rows in tables(result):
        if not rows:
            continue
        table = Table(title=escape(title))  # escaped: "[2 miss]" is not rich markup
        for i, col in enumerate(header):
            table.add_column(col, justify="left" if i == 0 else "right")
        for row in rows:
            table.add_row(*map(escape, row))
        console.print(table)


def markdown(result: dict) -> str:
    lines = [f"# Quality: {Path(result['model']).name}", "",
             f"{result['date']}; model `{result['model']}`; servers: "
             + "; ".join(f"{m}: `{' '.join(s['flags']) if s['flags'] else s['url']}`"
                         for m, s in result["servers"].items()), "", result["method"], ""]
    for title, header, rows in tables(result):
        if not rows:
            continue
        lines += [f"## {title}", "", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        lines += ["| " + " | ".join(row) + " |" for row in rows] + [""]
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------------------


def default_model() -> Path:
    """The trained quality model if it is here, else the random-weight `small` preset (built on first use)."""
    if (TRAINED_MODEL / "config.json").is_file():
        return TRAINED_MODEL
    return build_model(FALLBACK_PRESET, ROOT / "models" / FALLBACK_PRESET)


def parse_config(argv) -> QualityConfig:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help=f"checkpoint (and tokenizer); default {TRAINED_MODEL.relative_to(ROOT)} if it "
                                    f"exists, else the {FALLBACK_PRESET} preset; with --url: what the server serves")
    ap.add_argument("--tasks", nargs="+", choices=tasks.TASKS, default=list(tasks.TASKS))
    ap.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS), help="context tokens")
    ap.add_argument("--samples", type=int, default=10, help="per task and length (and per LongBench file)")
    ap.add_argument("--modes", nargs="+", default=list(DEFAULT_MODES),
                    help="cache_off (required), the paper's modes with anchors off: zero, full, r<ratio> (e.g. "
                         "r0.05); anchored replay: anchored (the plugin's defaults), anchored_n<N> (anchor interval "
                         f"N, a multiple of {GDN_CHUNK}). Default: %(default)s")
    ap.add_argument("--protocols", nargs="+", choices=PROTOCOLS, default=list(PROTOCOLS),
                    help="context_first: the context alone, then context + question (the match ends where a request "
                         "ended); new_question: context + another question, then context + the question (it ends "
                         "where none ended). Default: both")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--drift-turns", type=int, default=10, help="turns of the drift conversation (0: none)")
    ap.add_argument("--longbench-jsonl", nargs="+", default=[], metavar="FILE",
                    help="local LongBench files (fields context, input, answers), scored by token F1")
    ap.add_argument("--longbench-max-tokens", type=int, default=8192, help="longer contexts lose their middle")
    ap.add_argument("--url", help="a running SGLang server: evaluate --mode-of-url (and cache_off by flushing)")
    ap.add_argument("--mode-of-url", help="the mode that server runs (its flags: those of the mode, see --modes), "
                                          "or cache_off")
    ap.add_argument("--server-args", default="--dtype float32", help="flags for every server we start")
    ap.add_argument("--tail-replay-args", default="", help="extra flags for the Tail-Replay modes' servers")
    ap.add_argument("--out", default=str(ROOT / "bench" / "results" / "quality"), help="output directory")
    args = ap.parse_args(argv)
    url = args.url.rstrip("/") if args.url else None
    modes = tuple(dict.fromkeys(["cache_off", args.mode_of_url])) if url and args.mode_of_url else tuple(args.modes)
    model = Path(args.model) if args.model else (Path(harness.server_model_path(url)) if url else default_model())
    return QualityConfig(model=model, out=Path(args.out), tasks=tuple(args.tasks), lengths=tuple(args.lengths),
                         samples=args.samples, modes=modes, protocols=tuple(args.protocols), seed=args.seed,
                         drift_turns=args.drift_turns, longbench=tuple(Path(p) for p in args.longbench_jsonl),
                         longbench_max_tokens=args.longbench_max_tokens, url=url, mode_of_url=args.mode_of_url,
                         server_args=tuple(shlex.split(args.server_args)),
                         tail_replay_args=tuple(shlex.split(args.tail_replay_args)))


def main(argv=None) -> dict:
    cfg = parse_config(argv)
    cfg.out.mkdir(parents=True, exist_ok=True)
    console = Console(width=200)
    started, before = time.perf_counter(), harness.machine()
    tokenizer = AutoTokenizer.from_pretrained(str(cfg.model))
    vocab = len(tokenizer)
    top_k = vocab if vocab <= MAX_EXACT_VOCAB else TOP_K_APPROX
    kl_method = (f"exact: all {vocab} tokens" if top_k == vocab else
                 f"approximated over cache_off's top {top_k} of {vocab} tokens")
    items = ruler_items(cfg, tokenizer) + longbench_items(cfg, tokenizer)
    turns = tasks.conversation(cfg.drift_turns, min(cfg.lengths), tokenizer, cfg.seed) if cfg.drift_turns else []
    console.print(f"[bold]{len(items)} samples x {len(cfg.protocols)} protocols x {len(cfg.modes)} modes[/bold] on "
                  f"{cfg.model} ({kl_method})")
    runs, servers = {}, {}
    for mode in cfg.modes:
        with serving(cfg, mode, top_k, console) as endpoint:
            runs[mode] = run_mode(endpoint, items, cfg.protocols, turns, tokenizer, console)
            servers[mode] = {"url": endpoint.url, "flags": endpoint.flags, "info": endpoint.info,
                             "wall_s": runs[mode]["wall_s"]}
    add_kl(runs)
    rows = cells(runs, cfg.modes, cfg.protocols)
    result = {"method": METHOD, "kl_method": kl_method,
              "model": str(cfg.model), "date": before["date"], "config": _jsonable(asdict(cfg)), "servers": servers,
              "cells": rows, "modes": mode_summary(runs, rows, cfg.modes, cfg.protocols),
              "drift": drift_summary(runs, cfg.modes),
              "samples": [r for m in cfg.modes for r in runs[m]["samples"]],
              "drift_records": [t for m in cfg.modes for t in runs[m]["drift"]],
              "machine_before": before, "machine_after": harness.machine(), "wall_s": time.perf_counter() - started}
    print_tables(result, console)
    (cfg.out / "quality.json").write_text(json.dumps(result, indent=1))
    (cfg.out / "quality.md").write_text(markdown(result))
    console.print(f"wrote {cfg.out / 'quality.json'} and {cfg.out / 'quality.md'} ({result['wall_s']:.0f} s)")
    return result


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return str(value) if isinstance(value, Path) else value


if __name__ == "__main__":
    main()
