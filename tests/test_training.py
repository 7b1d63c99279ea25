"""The quality model's training script is seeded and resumable: a run killed after a checkpoint and resumed ends
with exactly the weights of an uninterrupted run, and the export is a checkpoint that transformers loads."""

import random
import re

import pytest
import torch
from safetensors.torch import load_file

from tailreplay_sglang import tasks
from tailreplay_sglang.training import TrainConfig, encode, length_range, make_batch, train

TINY = TrainConfig(steps=4, tokens_per_step=512, min_len=128, max_len=256, curriculum_steps=2, save_every=2,
                   eval_every=1000, threads=1, warmup=1)


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


def test_batches_are_deterministic_and_weight_only_answers_fully(tmp_path):
    from transformers import AutoTokenizer

    from tailreplay_sglang.models import build_model

    tok = AutoTokenizer.from_pretrained(build_model("quality-qwen35", tmp_path / "init"))
    ids, weight = make_batch(TINY, 3, tok)
    again, _ = make_batch(TINY, 3, tok)
    assert torch.equal(ids, again)
    assert ((weight == 1.0).sum(1) > 0).all()  # every row has answer tokens
    for row, w in zip(ids, weight):
        # The fully weighted tokens are the answers: each a space, a value, a full stop, right after the answer prefix.
        answers = tok.decode(row[w == 1.0])
        assert re.fullmatch(r"( [A-Za-z0-9 ]+\.)+", answers), answers
        assert (w[0] == 0) and (w[(w > 0) & (w < 1)] == TINY.context_loss_weight).all()
    assert length_range(TINY, 0) == (128, 256) and length_range(TINY, 10) == (128, 256)
    assert set(tasks.TASKS) >= {"niah_single", "qa"}


def test_a_recall_drill_asks_every_fact_it_holds(tmp_path):
    from transformers import PreTrainedTokenizerFast

    from tailreplay_sglang.models import PRESETS, preset_tokenizer

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
