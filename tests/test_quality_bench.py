"""A short run of bench/quality.py on real servers, both ways it gets one: a running Tail-Replay server passed by
--url (full replay, with cache_off by flushing), then servers of its own (stock cache_off, r=0.05), one at a time.
Hit modes must hit the whole context, full replay must answer exactly as cache_off, and the JSON and markdown must
hold every row. The model: the trained quality model if it is in models/ (then it must also answer its needles),
else the random-weight tiny Qwen3.5."""

import json
import sys
from pathlib import Path

import pytest

from conftest import MODELS_DIR, start_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import quality  # noqa: E402

pytestmark = pytest.mark.server

LENGTH, SAMPLES, TURNS = 512, 2, 3
# One single-answer and one multi-answer task keep the run short (every request decodes on two loaded cores);
# tests/test_tasks.py covers every generator.
TASKS = ("niah_multikey", "common_words")
MIN_TOKENS = 64  # the plugin's default --tail-replay-min-tokens: the r=0.05 tail at 512 tokens
LONGBENCH = [  # two LongBench-format lines (fields context, input, answers), as many as SAMPLES
    {"context": " ".join(["The lighthouse keeper counted ships every night."] * 30) + " The keeper was Anna.",
     "input": "Who kept the lighthouse?", "answers": ["Anna"]},
    {"context": " ".join(["Rain fell on the quiet village for a week."] * 30), "input": "What fell?",
     "answers": ["rain", "the rain"]},
]


@pytest.fixture(scope="module")
def model(request):
    trained = MODELS_DIR / "quality-qwen35"
    return trained if (trained / "config.json").is_file() else request.getfixturevalue("tiny_qwen35")


@pytest.fixture(scope="module")
def runs(model, tmp_path_factory):
    """{"url": result of the --url run, "own": result of the run with its own servers}."""
    tmp = tmp_path_factory.mktemp("quality")
    longbench = tmp / "toy.jsonl"
    longbench.write_text("".join(json.dumps(line) + "\n" for line in LONGBENCH))
    common = ["--model", str(model), "--tasks", *TASKS, "--lengths", str(LENGTH), "--samples", str(SAMPLES),
              "--drift-turns", str(TURNS), "--longbench-jsonl", str(longbench), "--longbench-max-tokens", "256"]
    results = {}
    server = start_server(model, tmp_path_factory, "--dtype", "float32", *quality.mode_flags("full"),
                          "--tail-replay-hidden-dtype", "float32", max_total_tokens=8192, context_length=4096)
    url = next(server).base_url
    try:
        results["url"] = quality.main([*common, "--url", url, "--mode-of-url", "full", "--out", str(tmp / "url")])
    finally:
        server.close()  # stopped before the next run starts its own servers: one server at a time
    results["own"] = quality.main([*common, "--modes", "cache_off", "r0.05", "--out", str(tmp / "own")])
    return results


def _by_key(result, mode):
    return {(r["task"], r["length"], r["index"]): r for r in result["samples"] if r["mode"] == mode}


def test_hit_modes_hit_the_whole_context_and_replay_the_planned_tail(runs):
    for result, mode in ((runs["url"], "full"), (runs["own"], "r0.05")):
        samples = _by_key(result, mode).values()
        assert len(samples) == SAMPLES * len(TASKS) + len(LONGBENCH)
        for r in samples:
            assert r["cached_tokens"] >= r["context_tokens"] - 1 and r["cache_ok"], r
            expected = r["cached_tokens"] if mode == "full" else min(MIN_TOKENS, r["cached_tokens"])
            assert r["replayed_tokens"] == expected, r
    for result in runs.values():  # cache_off, by flushing (--url) or with the radix cache off (own server)
        assert all(r["cached_tokens"] == 0 and r["cache_ok"] for r in _by_key(result, "cache_off").values())


def test_full_replay_answers_exactly_as_cache_off(runs):
    result = runs["url"]
    reference, full = _by_key(result, "cache_off"), _by_key(result, "full")
    assert reference.keys() == full.keys()
    for key, r in full.items():
        assert r["output_ids"] == reference[key]["output_ids"], key
        assert r["prediction"] == reference[key]["prediction"] and r["score"] == reference[key]["score"], key
        # Float rounding only: replay sums the prefix in another order than one-pass prefill. On the trained model's
        # sharp logits that reaches ~1e-6 (1.2e-6 on a LongBench toy line; 2.8e-7 max over docs/quality.md's 90
        # requests), where every partial replay mode is near 1.
        assert r["kl"] < 1e-5, key
    assert all(r["kl"] == 0 for r in reference.values())
    summary = {s["mode"]: s for s in result["modes"]}
    assert summary["full"]["same_output"] == summary["full"]["requests"]
    assert summary["full"]["ruler"]["score"] == summary["cache_off"]["ruler"]["score"]
    drift = {d["mode"]: d for d in result["drift"]}
    assert drift["full"]["first_differing_turn"] is None and drift["full"]["last_equals_cache_off"]
    assert drift["full"]["cache_ok"] == TURNS


def test_the_committed_model_answers_its_needles_through_the_server(runs, model):
    """The trained model answers niah_multikey at 512 tokens under full prefill (1.0 at 1024 in docs/quality.md); a
    served model that lost its context, e.g. a RoPE read differently by SGLang than by transformers, would not."""
    if model.name != "quality-qwen35":
        pytest.skip("the trained model is not in models/")
    for result in runs.values():
        scores = [r["score"] for r in _by_key(result, "cache_off").values() if r["task"] == "niah_multikey"]
        assert len(scores) == SAMPLES and sum(scores) / SAMPLES >= 0.5, scores


def test_flushed_tail_replay_server_prefills_as_stock(runs):
    """cache_off on the --url server (flush, then a full prefill with capture) equals stock without a radix cache."""
    url, own = _by_key(runs["url"], "cache_off"), _by_key(runs["own"], "cache_off")
    assert url.keys() == own.keys()
    assert all(url[k]["output_ids"] == own[k]["output_ids"] for k in url)


def test_json_and_markdown_hold_every_row(runs):
    for name, result in runs.items():
        out = Path(result["config"]["out"])
        data = json.loads((out / "quality.json").read_text())
        modes = data["config"]["modes"]
        assert modes == (["cache_off", "full"] if name == "url" else ["cache_off", "r0.05"])
        assert {"method", "kl_method", "model", "servers", "cells", "modes", "drift", "samples", "drift_records",
                "machine_before", "machine_after", "wall_s"} <= set(data)
        assert data["kl_method"].startswith("exact")
        cells = [(c["task"], c["length"]) for c in data["cells"]]
        assert cells == [(t, LENGTH) for t in TASKS] + [("lb-toy", 256)]
        assert all(set(c["score"]) == set(modes) and c["n"] == SAMPLES for c in data["cells"])
        assert [s["mode"] for s in data["modes"]] == modes and [d["mode"] for d in data["drift"]] == modes
        assert len(data["samples"]) == len(modes) * (SAMPLES * len(TASKS) + len(LONGBENCH))
        assert len(data["drift_records"]) == len(modes) * TURNS
        md = (out / "quality.md").read_text()
        for task, length in cells:
            assert f"| {task} | {length} | {SAMPLES} |" in md
        assert "| average (ruler) |" in md and "| average (longbench) |" in md
        for mode in modes:
            assert f"\n| {mode} | " in md  # its per-mode row and its drift row


def test_mode_names_and_scorers():
    assert quality.mode_flags("r0.10") == ("--enable-tail-replay", "--tail-replay-ratio", "0.10")
    for bad in ("r0", "r1.5", "ratio", "off"):
        with pytest.raises(ValueError):
            quality.mode_flags(bad)
    assert quality.token_f1("The Anna.", "anna") == 1.0 and quality.token_f1("Bob", "anna") == 0.0
    assert quality.token_f1("rain fell", "the rain") == pytest.approx(2 / 3)
    assert quality.kl_divergence({0: -0.5, 1: -1.0}, {0: -0.5, 1: -1.0}) == 0.0
    assert quality.kl_divergence({0: 0.0}, {1: -0.1, 0: -2.0}) == pytest.approx(2.0)
