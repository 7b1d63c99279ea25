"""Train the quality-evaluation model: a small Qwen3.5 hybrid that must use its context, on RULER-style tasks.

    python -m tailreplay_eval.training --out models/quality-qwen35          # resumes from --work if it can

Random-weight models forget their GDN state within a token (`../shared/notes/gdn-replay-probe.md`), so replay looks
exact on them and a quality evaluation says nothing. This model is trained on the task suites of `tasks.py` (other
seeds than the evaluation's) until full prefill answers them: retrieval through its full-attention layers, and
whatever its GDN layers learn to carry. Seeded and resumable: a checkpoint (weights, optimizer, step, RNG states)
is written to `--work` every `--save-every` steps and picked up by the next run with the same config.

Data, in two stages. Recipes 1 and 2 (docs/quality.md) sat at chance for 2000 steps: retrieval needs an
induction-head copy circuit, and the sparse answers of task documents did not start one. So the run opens with
a copy drill (random tokens in which one segment occurs four times at random distances; loss on the repeats) on
a small fixed alphabet of 64 token ids, where the circuit forms sooner. The step at which it forms varies, so the
stage waits for the repeat loss to fall below `copy_break_nll`, then grows the alphabet to the whole vocabulary
over `copy_grow_steps`. Then the task mix: half the rows are the evaluation's task suites (one question each),
half are recall drills (`tasks.recall_drill`, MQAR-style: a dozen facts in the filler and every one of them
asked), and `copy_share` of the rows stay copy drills to keep the circuit. Loss per row: the mean cross-entropy
on its answer (or repeat) tokens, plus `context_loss_weight` x the mean language-model loss on its document, so
the model keeps modelling text; rows count alike however long. Context lengths follow a curriculum from short to
`--max-len`, since retrieval is learnt fastest on short haystacks and then carries over to longer ones.

`--init-from DIR` continues an exported model (its weights, a fresh optimizer, straight into the task mix), e.g.
onto longer contexts than it was trained at; `scripts/train_quality_model.sh` trains the committed model this way.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from tailreplay_eval import tasks
from tailreplay_eval.models import BUILD_MARKER, build_model
from tailreplay_eval.reference import force_torch_gdn, greedy_generate

PRESET = "quality-qwen35"
TRAIN_SEED_OFFSET = 1_000_000  # training samples use seeds far from the evaluation's (bench/quality.py: 0..)


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 1800
    tokens_per_step: int = 4096  # batch = tokens_per_step // length sequences of one length
    min_len: int = 128
    max_len: int = 2048
    # Stage 1, copy drills at min_len: the first alphabet holds until the repeat NLL (mean of 10 steps) is below
    # copy_break_nll, then grows to the vocabulary over copy_grow_steps.
    copy_break_nll: float = 1.0
    copy_grow_steps: int = 300
    copy_max_steps: int = 1500  # stage 1 ends here whatever its loss
    copy_occurrences: int = 4  # times a copy drill's segment occurs in its row
    copy_share: float = 0.15  # stage 2: of the rows, copy drills
    curriculum_steps: int = 900  # in stage 2, the length range widens from [min_len, 2 min_len] to max_len
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    context_loss_weight: float = 0.05
    drill_share: float = 0.5  # of the rows: recall drills; the rest are task samples
    max_drill_facts: int = 16
    seed: int = 0
    threads: int = 2
    save_every: int = 50
    eval_every: int = 500
    # An exported model of this preset to continue from (e.g. onto longer contexts): its weights, fresh optimizer,
    # straight into the task mix. Empty: from the preset's random init, through the copy stage.
    init_from: str = ""

    def __post_init__(self):
        if not 0 < self.min_len <= self.max_len:
            raise ValueError(f"need 0 < min_len <= max_len, got {self.min_len}, {self.max_len}")
        if self.copy_occurrences < 2:
            raise ValueError(f"copy_occurrences must be at least 2 (a segment and a repeat), "
                             f"got {self.copy_occurrences}")
        if not 0 <= self.copy_share <= 1 or not 0 <= self.drill_share <= 1:
            raise ValueError("copy_share and drill_share are fractions of the rows, in [0, 1]")
        if self.tokens_per_step < self.max_len:
            raise ValueError(f"tokens_per_step ({self.tokens_per_step}) must hold one max_len sequence")
        if self.init_from and not (Path(self.init_from) / BUILD_MARKER).exists():
            raise ValueError(f"init_from {self.init_from!r} is not an exported model (no {BUILD_MARKER})")


# Token kinds of a row: what its loss counts.
IGNORE, CONTEXT, ANSWER, REPEAT = 0, 1, 2, 3
COPY_ALPHABET = 64  # token ids in the first copy drills


@dataclass
class Stages:
    """Where a run is: the step at which the copy loss broke its plateau and the step the task mix began (None:
    not yet), from the last steps' repeat NLL. Saved in checkpoints, so a resumed run takes the same batches."""
    copy_broke: int | None = None
    tasks_from: int | None = None
    recent_repeat_nll: list[float] = field(default_factory=list)

    def update(self, cfg: TrainConfig, step: int, repeat_nll: float | None) -> None:
        """After `step` steps, of which the last had this repeat NLL."""
        if repeat_nll is not None:
            self.recent_repeat_nll = (self.recent_repeat_nll + [repeat_nll])[-10:]
        recent = self.recent_repeat_nll
        if (self.copy_broke is None and self.tasks_from is None and len(recent) == 10
                and sum(recent) / 10 < cfg.copy_break_nll):
            self.copy_broke = step
        if self.tasks_from is None and (step >= cfg.copy_max_steps or (
                self.copy_broke is not None and step >= self.copy_broke + cfg.copy_grow_steps)):
            self.tasks_from = step


def length_range(cfg: TrainConfig, step: int, stages: Stages) -> tuple[int, int]:
    if stages.tasks_from is None:
        return cfg.min_len, cfg.min_len
    frac = min(1.0, (step - stages.tasks_from) / max(1, cfg.curriculum_steps))
    hi = int(min(cfg.max_len, 2 * cfg.min_len) * (1 - frac) + cfg.max_len * frac)
    return cfg.min_len, max(cfg.min_len, hi)


def learning_rate(cfg: TrainConfig, step: int) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress))))


def encode(context: str, questions: list[tuple[str, str]], tokenizer) -> tuple[list[int], int, list[tuple[int, int]]]:
    """Token ids of a document and its (question, target) pairs, in turn; where the context ends; and the
    [start, end) of each target. The context is tokenized apart from the questions, as the evaluation sends it."""
    ids = tokenizer(context).input_ids
    context_end, targets = len(ids), []
    for question, target in questions:
        ids += tokenizer(question, add_special_tokens=False).input_ids
        answer = tokenizer(target, add_special_tokens=False).input_ids
        targets.append((len(ids), len(ids) + len(answer)))
        ids += answer
    return ids, context_end, targets


def copy_alphabet(cfg: TrainConfig, step: int, stages: Stages, vocab: int) -> int:
    """How many token ids a copy drill draws from: COPY_ALPHABET until the copy loss breaks (on the full
    vocabulary it sat at ln V for 540 steps), then geometrically to `vocab` over copy_grow_steps."""
    if stages.tasks_from is not None:
        return vocab
    if stages.copy_broke is None:
        return COPY_ALPHABET
    frac = min(1.0, (step - stages.copy_broke) / max(1, cfg.copy_grow_steps))
    return int(round(COPY_ALPHABET * (vocab / COPY_ALPHABET) ** frac))


@functools.lru_cache(maxsize=4)
def _copy_order(seed: int, vocab: int, special: tuple[int, ...]) -> list[int]:
    ids = sorted(set(range(vocab)) - set(special))
    random.Random(seed).shuffle(ids)
    return ids


def copy_order(cfg: TrainConfig, tokenizer) -> list[int]:
    """The token ids in the order copy drills take them up: a growing alphabet keeps the ids it started with (a
    fixed small alphabet, as in the probe that broke the plateau; one drawn afresh per row stayed at ln V)."""
    return _copy_order(cfg.seed, len(tokenizer), tuple(tokenizer.all_special_ids))


def copy_row(rng: random.Random, length: int, alphabet: list[int], occurrences: int
             ) -> tuple[list[int], list[int]]:
    """Random tokens in which one segment occurs `occurrences` times, with random gaps: every occurrence after the
    first (after its first token) is predictable only by finding an earlier one, an induction-head copy. Not a
    fixed distance: with the segment then its repeat at half the row, a run learnt to attend a fixed offset back,
    a copy that was gone at other lengths. Not one repeat: a single repeat at a random distance stayed at chance
    for 1200 steps, where three repeats broke the plateau within 200 (docs/quality.md)."""
    size = rng.randint(max(2, length // (2 * occurrences)), max(2, length // occurrences))
    segment = [rng.choice(alphabet) for _ in range(size)]
    weights = [rng.random() + 1e-3 for _ in range(occurrences + 1)]
    free = length - occurrences * size
    gaps = [int(free * w / sum(weights)) for w in weights]
    ids, kind = [], []
    for i in range(occurrences):
        ids += [rng.choice(alphabet) for _ in range(gaps[i])] + segment
        kind += [IGNORE] * (gaps[i] + 1) + [REPEAT if i else IGNORE] * (size - 1)
    tail = length - len(ids)
    return ids + [rng.choice(alphabet) for _ in range(tail)], kind + [IGNORE] * tail


def make_row(cfg: TrainConfig, rng: random.Random, step: int, stages: Stages, length: int, tokenizer, seed: int
             ) -> tuple[list[int], list[int]]:
    """One training row: its token ids and the kind of each (kind[t] says how predicting token t counts)."""
    if stages.tasks_from is None or rng.random() < cfg.copy_share:
        order = copy_order(cfg, tokenizer)
        return copy_row(rng, length, order[:copy_alphabet(cfg, step, stages, len(order))], cfg.copy_occurrences)
    if rng.random() < cfg.drill_share:
        facts = rng.randint(2, max(2, min(cfg.max_drill_facts, length // 32)))
        context, questions = tasks.recall_drill(rng, tokenizer, length, facts)
    else:
        sample = tasks.generate(tasks.TASKS[rng.randrange(len(tasks.TASKS))], 1, length, tokenizer, seed)[0]
        context, questions = sample.context, [(sample.question, sample.target())]
    ids, context_end, targets = encode(context, questions, tokenizer)
    kind = [IGNORE] + [CONTEXT] * (context_end - 1) + [IGNORE] * (len(ids) - context_end)
    for start, end in targets:
        kind[start:end] = [ANSWER] * (end - start)
    return ids, kind


def make_batch(cfg: TrainConfig, step: int, stages: Stages, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    """One length, several rows: (input ids [B, T], token kinds [B, T]; padding is IGNORE)."""
    rng = random.Random(cfg.seed * 7919 + step)
    lo, hi = length_range(cfg, step, stages)
    length = rng.randint(lo, hi)
    seed = TRAIN_SEED_OFFSET + cfg.seed * 10_000_000 + step * 64
    rows = [make_row(cfg, rng, step, stages, length, tokenizer, seed + i)
            for i in range(max(1, cfg.tokens_per_step // length))]
    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    kind = torch.full((len(rows), width), IGNORE, dtype=torch.long)
    for r, (row, k) in enumerate(rows):
        ids[r, :len(row)] = torch.tensor(row)
        kind[r, :len(k)] = torch.tensor(k)
    return ids, kind


def _row_mean(nll: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (nll * mask).sum(1) / mask.sum(1).clamp(min=1)


def loss_fn(model, ids: torch.Tensor, kind: torch.Tensor, context_weight: float) -> tuple[torch.Tensor, dict]:
    """Mean over rows of (mean target NLL + context_weight x mean context NLL); and the NLL per kind, to log."""
    logits = model(input_ids=ids).logits[:, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
    kind = kind[:, 1:]
    target = ((kind == ANSWER) | (kind == REPEAT)).float()
    loss = (_row_mean(nll, target) + context_weight * _row_mean(nll, (kind == CONTEXT).float())).mean()
    parts = {name: round(float(nll[kind == k].detach().mean()), 4)
             for name, k in (("answer_nll", ANSWER), ("repeat_nll", REPEAT)) if (kind == k).any()}
    return loss, parts


@torch.no_grad()
def exact_match(model, tokenizer, length: int, n: int, seed: int) -> dict[str, float]:
    """Greedy answer accuracy per task (tasks.score) with full prefill, on held-out seeds."""
    model.eval()
    scores = {}
    for task in tasks.TASKS:
        total = 0.0
        for sample in tasks.generate(task, n, length, tokenizer, seed):
            context, question = tasks.token_ids(sample, tokenizer)
            budget = len(tokenizer(sample.target(), add_special_tokens=False).input_ids) + 2
            answer = greedy_generate(model, context + question, budget)
            total += tasks.score(sample, tokenizer.decode(answer, skip_special_tokens=True))
        scores[task] = total / n
    model.train()
    return scores


@torch.no_grad()
def gdn_memory(model, tokenizer, length: int = 1024, n: int = 6, seed: int = 900_000) -> list[dict]:
    """How far back each GDN head remembers on task text: per token the state decays by exp(g), with
    g = -exp(A_log) * softplus(a_t + dt_bias); tau = 1 / mean(-g) is the e-folding memory in tokens."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in range(len(layers))}
    def keep(i, module, args, out):
        seen[i].append(out.reshape(-1, out.shape[-1]))

    hooks = [la.in_proj_a.register_forward_hook(functools.partial(keep, i))
             for i, la in enumerate(layers)]
    model.eval()
    try:
        for k, task in enumerate(tasks.TASKS[:n]):
            sample = tasks.generate(task, 1, length, tokenizer, seed + k)[0]
            model(input_ids=torch.tensor([tokenizer(sample.prompt).input_ids]))
    finally:
        for h in hooks:
            h.remove()
    rows = []
    for i, la in enumerate(layers):
        a = torch.cat(seen[i]).float()
        neg_g = la.A_log.float().exp() * torch.nn.functional.softplus(a + la.dt_bias.float())
        tau = 1.0 / neg_g.mean(0)
        rows.append({"gdn_layer": i, "tau_tokens_per_head": [round(float(t), 1) for t in tau]})
    return rows


def _resumable(config: dict) -> dict:
    """What a resumed run must share with the checkpoint's (threads and save/eval cadence may change)."""
    return {k: v for k, v in config.items() if k not in ("threads", "save_every", "eval_every")}


def _checkpoint_path(work: Path) -> Path:
    return work / "checkpoint.pt"


def _save_checkpoint(work: Path, model, opt, step: int, stages: Stages, cfg: TrainConfig, log: list) -> None:
    tmp = work / "checkpoint.pt.tmp"
    torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step, "stages": asdict(stages),
                "config": asdict(cfg), "log": log, "torch_rng": torch.get_rng_state()}, tmp)
    tmp.replace(_checkpoint_path(work))  # atomic: a killed run never leaves a torn checkpoint


def train(cfg: TrainConfig, out: Path, work: Path, log_every: int = 10, stop_after: int | None = None) -> Path | None:
    """Train (resuming from `work`), then export to `out`. `stop_after` ends the run at that step after its
    checkpoint, as a killed run would (tests use it); nothing is exported then."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    force_torch_gdn()
    torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    work.mkdir(parents=True, exist_ok=True)
    init = build_model(PRESET, work / "init", seed=cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(init)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).train()
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay, betas=(0.9, 0.95))
    step, stages, log = 0, Stages(), []
    if cfg.init_from:
        _load_trained(model, Path(cfg.init_from), init)
        stages = Stages(tasks_from=0)  # the copy circuit is there already
        # The whole record: the earlier run's log, then this one's.
        log = json.loads((Path(cfg.init_from) / "training_log.json").read_text()) + [
            {"continued_from": cfg.init_from}]
    ckpt = _checkpoint_path(work)
    if ckpt.exists():
        state = torch.load(ckpt, weights_only=False)
        if _resumable(state["config"]) != _resumable(asdict(cfg)):
            raise SystemExit(f"{ckpt} was written with another config; use another --work or delete it:\n"
                             f"  checkpoint: {state['config']}\n  now:        {asdict(cfg)}")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        step, stages, log = state["step"], Stages(**state["stages"]), state["log"]
        torch.set_rng_state(state["torch_rng"])
        print(f"resumed at step {step}", flush=True)
    start = time.time()
    while step < cfg.steps:
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step)
        ids, kind = make_batch(cfg, step, stages, tokenizer)
        loss, parts = loss_fn(model, ids, kind, cfg.context_loss_weight)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        stages.update(cfg, step, parts.get("repeat_nll"))
        entry = {"step": step, "stage": 1 if stages.tasks_from is None else 2,
                 "loss": round(float(loss.detach()), 4), **parts, "len": ids.shape[1], "batch": ids.shape[0],
                 "seconds": round(time.time() - start, 1)}
        if step % log_every == 0:
            log.append(entry)
            print(json.dumps(entry), flush=True)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            for length in sorted({min(n, cfg.max_len) for n in (256, 1024, 4096)}):
                acc = exact_match(model, tokenizer, length=length, n=4, seed=500_000 + step)
                log.append({"step": step, "eval_len": length, "accuracy": acc})
                print(json.dumps(log[-1]), flush=True)
        if step % cfg.save_every == 0 or step == cfg.steps:
            _save_checkpoint(work, model, opt, step, stages, cfg, log)
        if stop_after is not None and step >= stop_after:
            return None
    return export(model, init, out, cfg, log)


def _load_trained(model, source: Path, init: Path) -> None:
    """Weights of an exported model of the same preset build (its config must equal the init's)."""
    from safetensors.torch import load_file

    if json.loads((source / "config.json").read_text()) != json.loads((init / "config.json").read_text()):
        raise SystemExit(f"{source} has another config than preset {PRESET}'s build; cannot continue from it")
    model.load_state_dict(load_file(source / "model.safetensors"))


def export(model, init: Path, out: Path, cfg: TrainConfig, log: list) -> Path:
    """The trained checkpoint beside the init's tokenizer and configs, plus the training record. A model card
    (README.md) already in `out` is kept: it is written by hand, not by training."""
    staging = out.parent / f".{out.name}.staging"
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(init, staging)
    model.save_pretrained(staging)
    # save_pretrained rewrites config.json without the top-level RoPE keys SGLang reads (models.py); training
    # changes no config, so the init's stands.
    shutil.copy(init / "config.json", staging / "config.json")
    if (out / "README.md").exists():
        shutil.copy(out / "README.md", staging / "README.md")
    marker = json.loads((staging / BUILD_MARKER).read_text())
    marker.update(trained=True, train_config=asdict(cfg))
    if cfg.init_from:  # keep the whole recipe: the config of the run this one continued
        marker["continued_from"] = json.loads((Path(cfg.init_from) / BUILD_MARKER).read_text())
    (staging / BUILD_MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    (staging / "training_log.json").write_text(json.dumps(log, indent=1) + "\n")
    from transformers import AutoTokenizer

    memory = gdn_memory(model, AutoTokenizer.from_pretrained(init))
    (staging / "gdn_memory.json").write_text(json.dumps(memory, indent=1) + "\n")
    for f in staging.iterdir():
        f.chmod(0o644)  # save_pretrained writes 0600 files
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)
    return out


def export_checkpoint(out: Path, work: Path) -> Path:
    """Export the last checkpoint in `work` as it is (e.g. a run stopped before its last step)."""
    from transformers import AutoModelForCausalLM

    force_torch_gdn()
    state = torch.load(_checkpoint_path(work), weights_only=False)
    cfg = TrainConfig(**state["config"])
    init = build_model(PRESET, work / "init", seed=cfg.seed)
    model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
    model.load_state_dict(state["model"])
    log = state["log"] + [{"exported_at_step": state["step"]}]
    return export(model, init, out, cfg, log)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("models/quality-qwen35"))
    parser.add_argument("--work", type=Path, default=Path(".train/quality-qwen35"),
                        help="checkpoints; a run resumes from here")
    for name, spec in TrainConfig.__dataclass_fields__.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(spec.default), default=spec.default)
    parser.add_argument("--export-only", action="store_true", help="export the checkpoint in --work as it is")
    args = vars(parser.parse_args(argv))
    out, work = args.pop("out"), args.pop("work")
    if args.pop("export_only"):
        print(export_checkpoint(out, work))
        return
    print(train(TrainConfig(**args), out, work))


if __name__ == "__main__":
    main()
