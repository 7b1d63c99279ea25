"""Tail-Replay's modes on one Pareto plot: bytes per cached token vs answer quality vs replayed tokens, from a
bench/quality.py result.

    python bench/pareto.py --quality docs/results/quality/quality.json --out docs/img/pareto.png \
        [--suite ruler] [--protocol context_first] [--model PATH] [--json FILE]

One point per mode of the quality run that caches prefixes (and per cache protocol, where the run has several):
- paper mode (r<X>, and zero if present): the zero-init tail, no anchor kept: FA KV + stored hiddens per cached token;
- anchored (`anchored`: the default interval; `anchored_n<N>`): exact replay from the deepest anchor, one anchor
  (one mamba slot) every N prefill tokens: KV + hiddens + slot / N per cached token, while every anchor is kept
  (N = 0: request-end and chunk-end anchors only, one slot each, not counted per token);
- full: the whole prefix replayed (exact): KV + hiddens.
cache_off (full prefill of every prompt, nothing cached) is the reference: 100 %, drawn as a line.

x = bytes per cached token, from bench/memory.py's accounting for the quality run's model and each mode's server
flags (its KV and hidden dtypes); y = the mode's score as a % of cache_off's (quality.py's per-mode average over the
task x length cells of --suite); each marker is annotated with the mode's mean replayed tokens per request (the
replay cost, which TTFT follows) and, where the run reports it, its share of exact hits. Colour: the kind of mode;
marker shape: the protocol. A mode is on the Pareto front (black edge) when no other mode of the same protocol is
at once no costlier in bytes, no worse in quality and replays no more, and better in one of them.

Writes the PNG (--out), the points as JSON (--json, default: --out with .json) and prints a table.
"""

import argparse
import json
import re
from pathlib import Path

from rich.console import Console
from rich.table import Table

from tailreplay_eval import memory
from tailreplay_sglang.config import TailReplayConfig

REFERENCE = "cache_off"
KINDS = ("paper", "anchored", "full")
TR = "--enable-tail-replay"
# Keys of a mode's summary in quality.json, tried in order (quality.py's summary has grown over time).
REPLAYED_KEYS = ("replayed_mean", "mean_replayed", "replayed_tokens_mean", "mean_replayed_tokens")
EXACT_KEYS = ("exact_share", "exact_hit_share", "exact_hits_share", "share_exact", "exact_fraction", "exact_rate")
PCT_KEYS = ("pct", "pct_of_cache_off", "score_pct", "percent_of_cache_off")
MARKERS = ("o", "s", "^", "D", "v")


class QualityFormatError(ValueError):
    """The quality JSON lacks something the plot needs; the message says what and where."""


def classify(mode: str, flags: list[str] | None, model) -> tuple[str, int | None] | None:
    """(kind, anchor interval) of a quality mode: by its name (quality.py's modes), else by its server flags; None
    for the reference and for modes that cache nothing. `model`: a checkpoint directory or a config dict."""
    if mode == REFERENCE:
        return None
    if mode == "full":
        return "full", None
    if mode == "zero" or re.fullmatch(r"r(0?\.\d+|1(\.0*)?)", mode):
        return "paper", None  # named by quality.py for the paper's mode, whatever defaults its flags ran under
    named = re.fullmatch(r"anchored(?:_n(\d+))?", mode)
    cfg = memory.tail_replay_config(model, [*flags, TR]) if flags is not None and TR in flags else None
    if named:
        n = int(named.group(1)) if named.group(1) else (cfg.anchor_interval if cfg else
                                                         TailReplayConfig().anchor_interval)
        if cfg is not None and (not cfg.anchored or cfg.anchor_interval != n):
            raise QualityFormatError(f"mode {mode}: its server flags {flags} do not keep an anchor every {n} tokens")
        return "anchored", n
    if cfg is None:
        return None  # not a Tail-Replay mode we know of, or flags unknown
    if cfg.mode == "full":
        return "full", None
    return ("anchored", cfg.anchor_interval) if cfg.anchored else ("paper", None)


def mode_entries(result: dict) -> list[dict]:
    """quality.json's per-mode summaries, each with its "mode" (and "protocol" where the run has protocols): a list
    of {"mode": ...} or a dict keyed by mode."""
    modes = result.get("modes")
    if isinstance(modes, dict):
        return [{**v, "mode": str(k)} for k, v in modes.items()]
    if isinstance(modes, list) and modes and all(isinstance(e, dict) and "mode" in e for e in modes):
        return modes
    raise QualityFormatError(f"no per-mode summaries: expected 'modes' as a list of {{'mode': ...}} or a dict keyed "
                             f"by mode; top-level keys: {sorted(result)}")


def _first(entry: dict, keys, mode: str, what: str, required: bool = True):
    for key in keys:
        if entry.get(key) is not None:
            return entry[key]
    if required:
        raise QualityFormatError(f"mode {mode}: no {what} (tried {', '.join(keys)}); its summary has "
                                 f"{sorted(entry)}")
    return None


def pick_suite(reference: dict, suite: str | None) -> str | None:
    """The suite whose averages are plotted: --suite, else 'ruler' if present, else the first one; None where the
    summaries keep score and % at the top level."""
    suites = [k for k, v in reference.items() if isinstance(v, dict) and "score" in v]
    if suite is not None:
        if suite not in suites:
            raise QualityFormatError(f"--suite {suite}: the summaries have {suites or 'no per-suite scores'}")
        return suite
    if not suites:
        return None
    return "ruler" if "ruler" in suites else suites[0]


def quality_of(entry: dict, mode: str, suite: str | None, ref_score: float | None) -> tuple[float, float]:
    """(score, % of cache_off) of a mode's summary."""
    where = entry.get(suite) if suite else entry
    if not isinstance(where, dict):
        raise QualityFormatError(f"mode {mode}: no '{suite}' scores; its summary has {sorted(entry)}")
    score = _first(where, ("score", "score_mean"), mode, f"score{f' for {suite}' if suite else ''}")
    pct = _first(where, PCT_KEYS, mode, "% of cache_off", required=False)
    if pct is None:
        if not ref_score:
            raise QualityFormatError(f"mode {mode}: no % of cache_off (tried {', '.join(PCT_KEYS)}) and no "
                                     f"cache_off score to compute it from")
        pct = 100.0 * score / ref_score
    return score, pct


def exact_share(entry: dict, mode: str, samples: list[dict]) -> float | None:
    """Share of hits whose recurrent state was exact: from the summary (a share, or exact hits over hits), else
    from the mode's sample records (of the entry's protocol), else None (not reported, or no hit)."""
    value = _first(entry, EXACT_KEYS, mode, "exact share", required=False)
    if value is None and entry.get("exact_hits") is not None:
        hits = entry.get("hits", entry.get("requests"))
        value = entry["exact_hits"] / hits if hits else None
    if value is None and "exact_hits" not in entry and "hits" not in entry:
        picked = [s for s in samples if s.get("mode") == mode and s.get("protocol") == entry.get("protocol")
                  and s.get("cached_tokens", 1) > 0]
        flags = [f for s in picked if (f := s.get("tail_replay_exact", s.get("exact"))) is not None]
        value = sum(map(bool, flags)) / len(flags) if flags else None
    return None if value is None else value / 100.0 if value > 1 else value


def server_flags(result: dict, mode: str) -> list[str] | None:
    """The flags the mode's server ran with: from quality.json's servers, else its config's common flags (a --url
    run records none); None where neither is there."""
    server = (result.get("servers") or {}).get(mode) or {}
    if server.get("flags") is not None:
        return list(server["flags"])
    cfg = result.get("config") or {}
    if "server_args" not in cfg:
        return None
    flags = list(cfg["server_args"])
    if mode != REFERENCE:
        flags += [*cfg.get("tail_replay_args", []), TR]
    return flags


def model_ref(result: dict, model: str | None):
    """The model for bench/memory.py: --model, else the quality run's (its directory if it is here, else its name:
    a preset or a hand-written model)."""
    name = model or result.get("model") or (result.get("config") or {}).get("model")
    if name is None:
        raise QualityFormatError("no model in the quality JSON ('model'); pass --model")
    path = Path(name)
    return path if (path / "config.json").is_file() else path.name


def bytes_per_cached_token(model, flags: list[str], kind: str, interval: int | None) -> dict:
    """KV + hiddens (paper, full), + slot / N (anchored) per cached token, from bench/memory.py's accounting."""
    acc = memory.account(model, flags, intervals=(interval,) if interval else ())
    kv, hidden = acc["fa_kv_bytes_per_token"], acc["tail_replay_hidden_bytes_per_token"]
    slot = acc["mamba_slot"]["total_bytes"]
    anchors = slot / interval if kind == "anchored" and interval else 0.0
    return {"kv": kv, "hiddens": hidden, "anchors": anchors, "slot": slot, "total": kv + hidden + anchors,
            "kv_dtype": acc["kv_dtype"], "hidden_dtype": acc["hidden_dtype"]}


def dominates(a: dict, b: dict) -> bool:
    """a is no costlier in bytes, no worse in quality, replays no more, and better in one of them."""
    no_worse = a["bytes"] <= b["bytes"] and a["pct"] >= b["pct"] and a["replayed"] <= b["replayed"]
    better = a["bytes"] < b["bytes"] or a["pct"] > b["pct"] or a["replayed"] < b["replayed"]
    return no_worse and better


def points(result: dict, suite: str | None = None, model: str | None = None, protocol: str | None = None) -> dict:
    """Every caching mode's point per protocol, and the references:
    {"suite", "model", "protocols", "reference": {protocol: score}, "points", "skipped"}."""
    entries = mode_entries(result)
    protocols = list(dict.fromkeys(e.get("protocol") for e in entries))
    if protocol is not None:
        if protocol not in protocols:
            raise QualityFormatError(f"--protocol {protocol}: the run has {protocols}")
        protocols = [protocol]
    mref = model_ref(result, model)
    _, config, _ = memory.resolve_model(mref)  # a name is read as bench/memory.py reads it, not from the hub
    samples = result.get("samples") or []
    out, skipped, references, costs = [], [], {}, {}
    for proto in protocols:
        mine = [e for e in entries if e.get("protocol") == proto]
        ref = next((e for e in mine if e["mode"] == REFERENCE), None)
        if ref is None:
            raise QualityFormatError(f"no {REFERENCE} mode (the 100 % reference)"
                                     + (f" for protocol {proto}" if proto else "")
                                     + f"; modes: {', '.join(e['mode'] for e in mine)}")
        suite = pick_suite(ref, suite)
        references[proto] = ((ref.get(suite) if suite else ref) or {}).get("score")
        for entry in mine:
            mode = entry["mode"]
            flags = server_flags(result, mode)
            kind = classify(mode, flags, config)
            if kind is None:
                if mode != REFERENCE and mode not in skipped:
                    skipped.append(mode)
                continue
            kind, interval = kind
            if flags is None:
                raise QualityFormatError(f"mode {mode}: no server flags (servers.{mode}.flags or config.server_args)")
            score, pct = quality_of(entry, mode, suite, references[proto])
            replayed = _first(entry, REPLAYED_KEYS, mode, "mean replayed tokens")
            if mode not in costs:
                costs[mode] = bytes_per_cached_token(mref, flags, kind, interval)
            out.append({"mode": mode, "protocol": proto, "kind": kind, "anchor_interval": interval, "score": score,
                        "pct": pct, "replayed": replayed, "exact_share": exact_share(entry, mode, samples),
                        "bytes": costs[mode]["total"], "bytes_detail": costs[mode], "flags": flags})
    if not out:
        raise QualityFormatError(f"no caching mode to plot among {', '.join(e['mode'] for e in entries)}")
    for p in out:
        p["pareto"] = not any(dominates(q, p) for q in out if q is not p and q["protocol"] == p["protocol"])
    return {"suite": suite, "model": str(mref), "protocols": protocols, "reference": references, "points": out,
            "skipped": skipped}


def _size(n: float) -> str:
    return memory._size(n)


def _kind(p: dict) -> str:
    if p["kind"] != "anchored":
        return p["kind"]
    return f"anchored N={p['anchor_interval']}" if p["anchor_interval"] else "anchored (ends only)"


def table(data: dict, title: str) -> Table:
    t = Table(title=title)
    cols = ["mode", "kind", "bytes / cached token", "KV + hiddens + anchors", "score", "% of cache_off",
            "replayed (mean)", "exact hits", "Pareto"]
    several = len(data["protocols"]) > 1 or data["protocols"] != [None]
    if several:
        cols.insert(1, "protocol")
    for col in cols:
        t.add_column(col, justify="left" if col in ("mode", "protocol", "kind") else "right")
    for proto in data["protocols"]:
        ref = data["reference"][proto]
        t.add_row(REFERENCE, *([str(proto)] if several else []), "reference", "-", "nothing cached",
                  "-" if ref is None else f"{ref:.3f}", "100.0%", "-", "-", "")
        for p in sorted((p for p in data["points"] if p["protocol"] == proto), key=lambda p: (p["bytes"], -p["pct"])):
            d = p["bytes_detail"]
            parts = f"{_size(d['kv'])} + {_size(d['hiddens'])}" + (f" + {_size(d['anchors'])}" if d["anchors"]
                                                                     else "")
            t.add_row(p["mode"], *([str(proto)] if several else []), _kind(p), _size(p["bytes"]), parts,
                      f"{p['score']:.3f}", f"{p['pct']:.1f}%", f"{p['replayed']:.0f}",
                      "-" if p["exact_share"] is None else f"{100 * p['exact_share']:.0f}%",
                      "yes" if p["pareto"] else "")
        t.add_section()
    return t


def plot(data: dict, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {"paper": "tab:orange", "anchored": "tab:blue", "full": "tab:green"}
    labels = {"paper": "paper mode (zero-init tail)", "anchored": "anchored (exact from an anchor)",
              "full": "full replay (exact)"}
    markers = {proto: MARKERS[i % len(MARKERS)] for i, proto in enumerate(data["protocols"])}
    fig, ax = plt.subplots(figsize=(9, 6))
    for proto in data["protocols"]:
        for kind in KINDS:
            pts = [p for p in data["points"] if p["kind"] == kind and p["protocol"] == proto]
            if pts:
                ax.scatter([p["bytes"] for p in pts], [p["pct"] for p in pts], s=70, color=colors[kind],
                           marker=markers[proto], edgecolors=["black" if p["pareto"] else "none" for p in pts],
                           linewidths=1.5, zorder=3)
    # One label per position: `anchored` (the default N) and `anchored_n<N>` of the same N may coincide.
    at: dict[tuple, list[dict]] = {}
    for p in data["points"]:
        at.setdefault((round(p["bytes"], 6), round(p["pct"], 6), p["replayed"]), []).append(p)
    for group in at.values():
        p = group[0]
        exact = "" if p["exact_share"] is None else f", {100 * p['exact_share']:.0f}% exact"
        names = " = ".join(dict.fromkeys(q["mode"] for q in group))
        ax.annotate(f"{names}\n{p['replayed']:.0f} replayed{exact}", (p["bytes"], p["pct"]),
                    textcoords="offset points", xytext=(6, 6), fontsize=7)
    for kind in KINDS:  # legend: colour = kind, shape = protocol, edge = front
        if any(p["kind"] == kind for p in data["points"]):
            ax.scatter([], [], s=70, color=colors[kind], label=labels[kind])
    if data["protocols"] != [None]:
        for proto, marker in markers.items():
            ax.scatter([], [], s=70, color="lightgrey", marker=marker, label=f"protocol {proto}")
    ax.scatter([], [], s=70, color="white", edgecolors="black", linewidths=1.5,
               label="black edge: Pareto front of its protocol\n(bytes, quality, replayed tokens)")
    ax.axhline(100.0, color="grey", linestyle=":", label=f"{REFERENCE} = 100 %")
    xs = [p["bytes"] for p in data["points"]]
    span = max(xs) - min(xs) or max(xs) * 0.1
    ax.set_xlim(min(xs) - 0.15 * span, max(xs) + 0.45 * span)
    ys = [p["pct"] for p in data["points"]] + [100.0]
    ax.set_ylim(min(0.0, min(ys) - 5), max(ys) + 10)
    ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: _size(v)))
    ax.set_xlabel("bytes per cached token (FA KV + hiddens, + one anchor per N tokens)")
    ax.set_ylabel(f"score, % of {REFERENCE}" + (f" ({data['suite']})" if data["suite"] else ""))
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quality", required=True, help="a bench/quality.py result (quality.json)")
    ap.add_argument("--out", required=True, help="the PNG to write")
    ap.add_argument("--json", help="where to write the points (default: --out with .json)")
    ap.add_argument("--suite", help="the suite whose average is plotted (default: ruler if present)")
    ap.add_argument("--protocol", help="only this cache protocol of the quality run (default: all it has)")
    ap.add_argument("--model", help="model for the byte accounting (default: the quality run's)")
    args = ap.parse_args(argv)
    where = Path(args.json) if args.json else Path(args.out).with_suffix(".json")
    if where.resolve() == Path(args.quality).resolve():
        ap.error(f"the points would overwrite the quality result {args.quality}: pass --json elsewhere")
    result = json.loads(Path(args.quality).read_text())
    try:
        data = points(result, args.suite, args.model, args.protocol)
    except QualityFormatError as e:
        raise SystemExit(f"{args.quality}: {e}") from None
    data["quality"] = str(args.quality)
    console = Console(width=170)
    title = (f"Tail-Replay modes: bytes per cached token vs quality ({Path(data['model']).name}"
             + (f", {data['suite']}" if data["suite"] else "") + ")")
    console.print(table(data, title))
    if data["skipped"]:
        console.print(f"not plotted (no cached prefix, or not a Tail-Replay mode): {', '.join(data['skipped'])}")
    if not any(p["kind"] == "anchored" for p in data["points"]):
        console.print("no anchored mode in this quality run")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    plot(data, out, title)
    where.parent.mkdir(parents=True, exist_ok=True)
    where.write_text(json.dumps(data, indent=2) + "\n")
    console.print(f"wrote {out} and {where}")
    return data


if __name__ == "__main__":
    main()
