"""The quality model's training script is seeded and resumable: a run killed after a checkpoint and resumed ends
with exactly the weights of an uninterrupted run, and the export is a checkpoint that transformers loads."""

import random
import re

import pytest
import torch
from safetensors.torch import load_file

from tailreplay_eval import tasks
from tailreplay_eval.training import (
    ANSWER, CONTEXT, COPY_ALPHABET, IGNORE, REPEAT, Stages, TrainConfig, copy_alphabet, copy_order, encode,
    length_range, make_batch, train,
)

# Step 0-1: copy drills; steps 2-3: the task mix.
TINY = TrainConfig(steps=4, tokens_per_step=512, min_len=128, max_len=256, copy_max_steps=2, copy_share=0.0,
                   curriculum_steps=2, save_every=2, eval_every=1000, threads=1, warmup=1)


def test_resumed_run_equals_an_uninterrupted_one(tmp_path):
    straight = train(TINY, tmp_path / "straight", tmp_path / "work-straight")
    assert train(TINY, tmp_path / "resumed", tmp_path / "work-resumed", stop_after=2) is None  # "killed" at step 2
    assert not (tmp_path / "resumed").exists()
    resumed = train(TINY, tmp_path / "resumed", tmp_path / "work-resumed")
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    init = load_file(tmp_path / "work-straight" / "init" / "model.safetensors")
    assert any(not torch.equal(a[k], init[k]) for k in a)  # it did train
    for name in ("config.json", "tokenizer.json", "training_log.json", "gdn_memory.json"):
        assert (straight / name).is_file()


def test_resuming_with_another_config_is_refused(tmp_path):
    train(TINY, tmp_path / "m", tmp_path / "work", stop_after=2)
    with pytest.raises(SystemExit, match="another config"):
        train(TrainConfig(**{**TINY.__dict__, "lr": 1.0}), tmp_path / "m", tmp_path / "work")


def test_a_run_continues_from_an_exported_model_straight_into_the_task_mix(tmp_path):
    import json

    first = train(TINY, tmp_path / "first", tmp_path / "work-first", log_every=1)
    longer = TrainConfig(**{**TINY.__dict__, "steps": 2, "max_len": 512, "init_from": str(first)})
    (tmp_path / "second").mkdir()
    (tmp_path / "second" / "README.md").write_text("model card")  # written by hand: an export keeps it
    second = train(longer, tmp_path / "second", tmp_path / "work-second", log_every=1)
    assert (second / "README.md").read_text() == "model card"
    log = json.loads((second / "training_log.json").read_text())
    assert {"continued_from": str(first)} in log
    stages = [e["stage"] for e in log if "stage" in e]
    assert stages == [1, 2, 2, 2] + [2, 2]  # the first run: a copy step, then tasks; this run: tasks only
    marker = json.loads((second / "tailreplay_build.json").read_text())
    assert marker["continued_from"]["train_config"]["max_len"] == 256 and marker["train_config"]["max_len"] == 512
    a, b = load_file(first / "model.safetensors"), load_file(second / "model.safetensors")
    # Two more steps from `first`'s weights: near them, not near a fresh init.
    init = load_file(tmp_path / "work-first" / "init" / "model.safetensors")
    k = "model.embed_tokens.weight"
    assert (b[k] - a[k]).norm() < (b[k] - init[k]).norm() and not torch.equal(a[k], b[k])
    with pytest.raises(ValueError, match="init_from"):
        TrainConfig(init_from=str(tmp_path / "nothing"))


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from transformers import AutoTokenizer

    from tailreplay_eval.models import build_model

    return AutoTokenizer.from_pretrained(build_model("quality-qwen35", tmp_path_factory.mktemp("init")))


def test_batches_are_deterministic_and_score_only_answers_after_stage_one(tok):
    stages = Stages(tasks_from=2)
    ids, kind = make_batch(TINY, 3, stages, tok)
    again, _ = make_batch(TINY, 3, stages, tok)
    assert torch.equal(ids, again)
    assert ((kind == ANSWER).sum(1) > 0).all()  # every row has answer tokens
    assert not (kind == REPEAT).any()  # copy_share 0: no copy drills after stage 1
    for row, k in zip(ids, kind):
        # The answer tokens: each a space, a value, a full stop, right after the answer prefix.
        answers = tok.decode(row[k == ANSWER])
        assert re.fullmatch(r"( [A-Za-z0-9 ]+\.)+", answers), answers
        assert k[0] == IGNORE and (k == CONTEXT).sum() > 64
    assert length_range(TINY, 0, Stages()) == (128, 128)
    assert length_range(TINY, 2, stages) == (128, 256) and length_range(TINY, 10, stages) == (128, 256)
    assert set(tasks.TASKS) >= {"niah_single", "qa"}


def test_stage_one_waits_for_the_copy_loss_to_break_then_grows_the_alphabet(tok):
    cfg = TrainConfig(copy_break_nll=1.0, copy_grow_steps=100, copy_max_steps=1000, copy_share=0.5)
    stages = Stages()
    for step in range(1, 21):
        stages.update(cfg, step, 4.1)  # the plateau: ln 64
    assert stages == Stages(recent_repeat_nll=[4.1] * 10)
    for step in range(21, 31):
        stages.update(cfg, step, 0.9)
    assert stages.copy_broke == 30 and stages.tasks_from is None
    order = copy_order(cfg, tok)
    assert len(order) == len(set(order)) == len(tok) - len(tok.all_special_ids)
    sizes = [copy_alphabet(cfg, step, stages, len(order)) for step in (30, 80, 130)]
    assert sizes[0] == COPY_ALPHABET < sizes[1] < sizes[2] == len(order)
    assert copy_alphabet(cfg, 500, Stages(), len(order)) == COPY_ALPHABET  # no break yet: no growth
    for step in range(31, 131):
        stages.update(cfg, step, 0.9)
    assert stages.tasks_from == 130  # copy_grow_steps after the break
    never = Stages()
    for step in range(1, 1001):
        never.update(cfg, step, 4.1)
    assert never.copy_broke is None and never.tasks_from == 1000  # copy_max_steps ends stage 1 anyway


def test_copy_drills_repeat_a_segment_then_stay_in_the_task_mix(tok):
    cfg = TrainConfig(copy_share=0.5)
    ids, kind = make_batch(cfg, 0, Stages(), tok)
    assert ids.shape == (cfg.tokens_per_step // cfg.min_len, cfg.min_len)
    distances = set()
    for row, k in zip(ids.tolist(), kind.tolist()):
        scored = [t for t in range(len(row)) if k[t] == REPEAT]  # only the repeats, after their first token
        runs = [[scored[0]]]
        for t in scored[1:]:
            runs[-1].append(t) if t == runs[-1][-1] + 1 else runs.append([t])
        assert len(runs) == cfg.copy_occurrences - 1
        size = len(runs[0]) + 1
        assert size >= cfg.min_len // (2 * cfg.copy_occurrences)
        repeats = [row[r[0] - 1:r[-1] + 1] for r in runs]
        assert all(len(r) == size and r == repeats[0] for r in repeats)  # one segment, again and again
        first = next(t for t in range(runs[0][0]) if row[t:t + size] == repeats[0])  # and it occurred before
        distances.add(runs[0][0] - 1 - first)
    assert len(distances) > 10  # at many distances: no fixed offset to copy from
    assert set(ids.flatten().tolist()) <= set(copy_order(cfg, tok)[:COPY_ALPHABET])
    _, kind = make_batch(cfg, 150, Stages(copy_broke=10, tasks_from=100), tok)
    is_copy = (kind == REPEAT).any(1)
    assert is_copy.any() and (~is_copy).any()


def test_a_recall_drill_asks_every_fact_it_holds(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tailreplay_eval.models import PRESETS, preset_tokenizer

    tok = PreTrainedTokenizerFast(tokenizer_object=preset_tokenizer(PRESETS["quality-qwen35"]))
    context, questions = tasks.recall_drill(random.Random(0), tok, 1024, facts=12)
    assert context == tasks.recall_drill(random.Random(0), tok, 1024, facts=12)[0]
    assert len(questions) == 12 and len({q for q, _ in questions}) == 12
    for question, target in questions:
        value = target.strip(" .")
        assert question.startswith("\nQuestion: ") and "\nAnswer: " in question
        assert f" {value}" in context  # the answer is in the document
    ids, context_end, targets = encode(context, questions, tok)
    assert ids[:context_end] == tok(context).input_ids
    assert [tok.decode(ids[a:b]) for a, b in targets] == [t for _, t in questions]
