"""The RULER-style task generators (tailreplay_eval/tasks.py): deterministic, of the requested length, with each
answer where the question says it is, the cache boundary at the end of the context, and a score of 1 for the target
and 0 for a wrong answer."""

import random
import re
from collections import Counter

import pytest
from transformers import PreTrainedTokenizerFast

from tailreplay_eval import tasks
from tailreplay_eval.corpus import sentence
from tailreplay_eval.models import PRESETS, preset_tokenizer


@pytest.fixture(scope="module")
def tok():
    # The quality model's tokenizer (task words are whole tokens), without weights.
    return PreTrainedTokenizerFast(tokenizer_object=preset_tokenizer(PRESETS["quality-qwen35"]))


def test_the_quality_tokenizer_keeps_task_words_whole(tok):
    """Needle keys, names and template words are single tokens: retrieval then matches one token per key."""
    def pieces(text):
        return len(tok(text, add_special_tokens=False).input_ids)

    assert all(pieces(" " + w) == 1 for w in tasks.KEYS + tasks.NAMES + ("special", "number"))
    assert pieces("Question") == pieces("Answer") == 1


@pytest.mark.parametrize("task", tasks.TASKS)
def test_same_seed_same_samples_other_seed_other_samples(task, tok):
    first = tasks.generate(task, 3, 512, tok, seed=0)
    assert first == tasks.generate(task, 3, 512, tok, seed=0)
    assert tasks.generate(task, 1, 512, tok, seed=0) == first[:1]  # sample i does not depend on n
    other = tasks.generate(task, 3, 512, tok, seed=1)
    assert all(a != b for a, b in zip(first, other))
    assert len({s.context for s in first}) == 3


@pytest.mark.parametrize("length", [512, 2048])
@pytest.mark.parametrize("task", tasks.TASKS)
def test_context_length_within_ten_percent(task, length, tok):
    for sample in tasks.generate(task, 4, length, tok, seed=7):
        n = len(tok(sample.context).input_ids)
        assert abs(n - length) <= 0.1 * length, (task, length, n)


@pytest.mark.parametrize("task", tasks.TASKS)
def test_prompt_ids_are_context_ids_then_question_ids(task, tok):
    """The first request caches the context's ids; the question request must extend exactly those."""
    for sample in tasks.generate(task, 3, 512, tok, seed=3):
        context, question = tasks.token_ids(sample, tok)
        assert tok(sample.prompt).input_ids == context + question
        assert sample.question.startswith("\nQuestion: ") and "\nAnswer: " in sample.question
        assert tok(sample.prompt + sample.target()).input_ids[:len(context) + len(question)] == context + question


@pytest.mark.parametrize("task", tasks.TASKS)
def test_target_scores_one_and_wrong_answers_zero(task, tok):
    for sample in tasks.generate(task, 3, 512, tok, seed=5):
        assert tasks.score(sample, sample.target()) == 1.0
        assert tasks.score(sample, sample.target().upper()) == 1.0  # RULER compares in lower case
        for wrong in ("", " 0.", " I do not know."):
            assert tasks.score(sample, wrong) == 0.0
        partial = tasks.score(sample, " " + sample.answers[0])
        assert partial == 1 / len(sample.answers)


def test_unknown_task_and_bad_sizes_are_refused(tok):
    with pytest.raises(ValueError, match="unknown task"):
        tasks.generate("niah", 1, 512, tok, seed=0)
    with pytest.raises(ValueError):
        tasks.generate("qa", -1, 512, tok, seed=0)
    with pytest.raises(ValueError, match="answers"):
        tasks.Sample("qa", "context", tasks.QUESTION.format("?"), ())


def _asked_key(sample):
    return re.search(r"special numbers? for (\w+)\?", sample.question).group(1)


def test_needles_hold_the_answers(tok):
    for sample in tasks.generate("niah_single", 4, 1024, tok, seed=0):
        assert sample.context.count(tasks.NEEDLE.format(key=_asked_key(sample), value=sample.answers[0])) == 1
    for sample in tasks.generate("niah_multikey", 4, 1024, tok, seed=0):
        needles = re.findall(r"The special number for (\w+) is (\d+)\.", sample.context)
        assert len(needles) == tasks.MULTI_NEEDLES and len({k for k, _ in needles}) == tasks.MULTI_NEEDLES
        assert dict(needles)[_asked_key(sample)] == sample.answers[0]
    for sample in tasks.generate("niah_multivalue", 4, 1024, tok, seed=0):
        key = _asked_key(sample)
        needles = re.findall(r"The special number for (\w+) is (\d+)\.", sample.context)
        assert needles == [(key, v) for v in sample.answers]  # the target lists them in document order


def test_variable_chain_holds_the_value(tok):
    for sample in tasks.generate("variable_tracking", 4, 1024, tok, seed=0):
        value = re.search(r"equal to (\d+)\?", sample.question).group(1)
        assignments = dict(re.findall(r"VAR (\w+) = (\w+)\.", sample.context))
        assert len(assignments) == tasks.VT_CHAINS * tasks.VT_NAMES_PER_CHAIN

        def resolve(name):
            while not assignments[name].isdigit():
                name = assignments[name]
            return assignments[name]

        assert sorted(n for n in assignments if resolve(n) == value) == sorted(sample.answers)
        positions = [sample.context.index(f"VAR {name} =") for name in sample.answers]
        assert positions == sorted(positions)  # each name is assigned before it is copied


def test_common_words_are_the_most_frequent(tok):
    for length in (512, 2048):
        for sample in tasks.generate("common_words", 4, length, tok, seed=0):
            counts = Counter(sample.context.split()).most_common()
            assert tuple(w for w, _ in counts[:tasks.CWE_TOP]) == sample.answers
            assert counts[tasks.CWE_TOP - 1][1] > counts[tasks.CWE_TOP][1]  # no tie with the first other word


def test_qa_fact_names_the_asked_person(tok):
    for sample in tasks.generate("qa", 6, 1024, tok, seed=0):
        person = next(name for name in tasks.NAMES if name in sample.question)
        facts = [f for f, _, _, _ in tasks.QA_RELATIONS]
        assert any(f.format(p=person, x=sample.answers[0]) in sample.context for f in facts)
        assert sum(sample.context.count(name) for name in tasks.NAMES) == tasks.QA_FACTS


def test_keys_and_names_never_occur_in_the_filler():
    rng = random.Random(0)
    words = {w.strip(".,!?\"").lower() for _ in range(3000) for w in sentence(rng).split()}
    assert not words & {k.lower() for k in (*tasks.KEYS, *tasks.NAMES)}
    assert not set(tasks.KEYS) & set(tasks._word_pool())


def test_conversation_turns_share_one_context(tok):
    turns = tasks.conversation(10, 1024, tok, seed=0)
    assert len(turns) == 10 and len({t.context for t in turns}) == 1
    assert len({_asked_key(t) for t in turns}) == 10
    for t in turns:
        assert tasks.NEEDLE.format(key=_asked_key(t), value=t.answers[0]) in t.context
        assert tasks.score(t, t.target()) == 1.0
