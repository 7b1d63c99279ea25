"""RULER-style synthetic long-context tasks, generated locally from a seed (no downloads).

    samples = generate("niah_multikey", n=20, length_tokens=4096, tokenizer=tok, seed=0)
    score(samples[0], " 4821.")  # RULER string match, in [0, 1]

A sample is a long document (`context`, cached by a first request in bench/quality.py) and a short `question` that
arrives after it, ending where the answer begins. The tasks follow RULER (Hsieh et al., 2024), at sizes a small
model can answer in a few tokens:

- niah_single: one "special number" needle for one key in a haystack of filler sentences;
- niah_multikey: four needles with different keys, the question asks for one (three distractors);
- niah_multivalue: four needles with the same key, the question asks for all four values;
- variable_tracking: two chains "VAR ABCD = 4821. ... VAR EFGH = ABCD. ...", the question asks which names hold
  one chain's value (all four names of that chain);
- common_words: a list of words, three of them much more frequent than the rest; the answer is those three;
- qa: four facts of one kind ("Omar keeps a pet camel at home.") for four people; the question asks about one
  person in other words ("What pet does Omar keep?").

Lengths are counted with the given tokenizer; from 512 tokens up a context is within 10% of the request (shorter
requests still hold every needle, so may come out longer).
"""

from __future__ import annotations

import functools
import math
import random
import string
from dataclasses import dataclass

from tailreplay_eval.corpus import sentence, training_corpus

TASKS = ("niah_single", "niah_multikey", "niah_multivalue", "variable_tracking", "common_words", "qa")

# The question opens with a newline, a pre-tokenizer boundary of our byte-level BPE: the prompt's token ids are the
# context's followed by the question's. (Qwen's pre-tokenizer glues "." to a following newline, so bench/quality.py
# sends the two tokenized apart: the cached prefix is always exactly the context.)
QUESTION = "\nQuestion: {}\nAnswer:"
# As in RULER, the answer opens with a prefix that restates what is asked ("The special number for falcon is"), so
# the answer is the continuation of a phrase in the context.
ANSWER_PREFIX = {
    "niah": "The special number for {key} is",
    "niah_multivalue": "The special numbers for {key} are",
    "variable_tracking": "The variables equal to {value} are",
    "common_words": "The {n} most common words are",
}
NEEDLE = "The special number for {key} is {value}."
MULTI_NEEDLES = 4
VT_CHAINS, VT_NAMES_PER_CHAIN = 2, 4
CWE_TOP = 3
QA_FACTS = 4

# Needle keys: words the haystack never uses, so a key in the question points at its needles only.
KEYS = (
    "falcon", "copper", "ember", "glacier", "compass", "anchor", "meadow", "thunder", "marble", "canyon", "orbit",
    "pocket", "ladder", "signal", "forest", "walnut", "pepper", "saddle", "tunnel", "helmet", "magnet", "pillow",
    "rocket", "candle", "kettle", "button", "carpet", "mirror", "basket", "hammer", "wallet", "jacket", "pencil",
    "cactus", "harp", "zebra",
)
NAMES = (
    "Alice", "Omar", "Priya", "Tomas", "Kofi", "Lena", "Ravi", "Sara", "Ivan", "Nadia", "Hugo", "Aiko", "Pablo",
    "Zara", "Emil", "Yusuf", "Ines", "Bruno", "Leila", "Marta",
)
# (fact, question, answer prefix, values): values of four letters or more, so a plain substring match has few
# accidental hits.
QA_RELATIONS = (
    ("{p} keeps a pet {x} at home.", "What pet does {p} keep?", "{p} keeps a pet",
     ("horse", "rabbit", "parrot", "goat", "turtle", "hamster", "donkey", "ferret", "camel", "llama")),
    ("{p} was born in the town of {x}.", "In which town was {p} born?", "{p} was born in the town of",
     ("Lima", "Oslo", "Cairo", "Delhi", "Tokyo", "Rome", "Quito", "Dakar", "Perth", "Riga")),
    ("{p} likes the colour {x} best.", "Which colour does {p} like best?", "{p} likes the colour",
     ("yellow", "purple", "orange", "pink", "grey", "brown", "black", "white", "gold", "crimson")),
)


@dataclass(frozen=True)
class Sample:
    task: str
    context: str  # the long document: cached by a first request
    question: str  # the suffix: arrives after the context is cached; ends right where the answer begins
    answers: tuple[str, ...]  # every expected answer string (several for multi-value, variables, common words)

    def __post_init__(self):
        if not self.answers or not all(self.answers):
            raise ValueError(f"a {self.task} sample needs non-empty answers, got {self.answers!r}")

    @property
    def prompt(self) -> str:
        return self.context + self.question

    def target(self) -> str:
        """The completion a model is trained to produce after the prompt: the answers in order, e.g. " 4821 7390."."""
        return " " + " ".join(self.answers) + "."


def generate(task: str, n: int, length_tokens: int, tokenizer, seed: int) -> list[Sample]:
    """`n` samples of `task` with contexts of about `length_tokens` tokens of `tokenizer` (a HF tokenizer).

    Sample i depends only on (task, length_tokens, seed, i): the first samples of a larger n are the same.
    """
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks: {', '.join(TASKS)}")
    if n < 0 or length_tokens < 1:
        raise ValueError(f"need n >= 0 and length_tokens >= 1, got n={n}, length_tokens={length_tokens}")
    build = _BUILDERS[task]
    samples = []
    for i in range(n):
        rng = random.Random(f"{task}/{length_tokens}/{seed}/{i}")  # str seeds hash the same in every process
        context, question, prefix, answers = build(rng, tokenizer, length_tokens)
        samples.append(Sample(task, context, ask(question, prefix), tuple(answers)))
    return samples


def conversation(turns: int, length_tokens: int, tokenizer, seed: int) -> list[Sample]:
    """One context with `turns` needles of distinct keys, and one question per key: the turns of a multi-turn
    conversation in which each turn's prompt extends the previous one (bench/quality.py's drift check)."""
    if not 1 <= turns <= len(KEYS):
        raise ValueError(f"turns must be in [1, {len(KEYS)}], got {turns}")
    rng = random.Random(f"conversation/{turns}/{length_tokens}/{seed}")
    keys, values = rng.sample(KEYS, turns), _numbers(rng, turns)
    context = _document(rng, tokenizer, length_tokens, [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)])
    order = rng.sample(range(turns), turns)
    return [Sample("conversation", context, _ask_number(keys[i]), (values[i],)) for i in order]


def ask(question: str, prefix: str = "") -> str:
    """The question suffix: the question, then "Answer:" and the answer's prefix, if any."""
    return QUESTION.format(question) + (f" {prefix}" if prefix else "")


def _number_question(key: str) -> tuple[str, str]:
    """(question, answer prefix) asking for a key's special number."""
    return f"What is the special number for {key}?", ANSWER_PREFIX["niah"].format(key=key)


def _ask_number(key: str) -> str:
    return ask(*_number_question(key))


def vocabulary_texts(repeats: int = 2) -> tuple[str, ...]:
    """Every template and word the tasks use, a few times over: added to a tokenizer's corpus (the quality model's,
    `models.Preset.task_words`) so keys, names and template words become whole tokens."""
    rng = random.Random("vocabulary")
    texts = []
    for _ in range(repeats):
        for key in KEYS:
            (value,) = _numbers(rng, 1)
            texts += [NEEDLE.format(key=key, value=value), _ask_number(key) + f" {value}.",
                      ask(f"What are all the special numbers for {key}?",
                          ANSWER_PREFIX["niah_multivalue"].format(key=key))]
        for fact, question, prefix, values in QA_RELATIONS:
            for person in NAMES:
                texts += [fact.format(p=person, x=rng.choice(values)),
                          ask(question.format(p=person), prefix.format(p=person))]
        texts += [f"VAR {name} = {value}." for name, value in zip(("ABCD", "QRST"), _numbers(rng, 2))]
        value = _numbers(rng, 1)[0]
        texts += [ask(f"Which variables are equal to {value}?",
                      ANSWER_PREFIX["variable_tracking"].format(value=value)),
                  ask(f"What are the {CWE_TOP} most common words in the list?",
                      ANSWER_PREFIX["common_words"].format(n=CWE_TOP))]
    return tuple(texts)


def recall_drill(rng: random.Random, tokenizer, length_tokens: int, facts: int) -> tuple[str, list[tuple[str, str]]]:
    """A training document in the style of MQAR: `facts` needles and QA facts (distinct keys and people) in
    filler, and every one of them asked, in random order: (context, [(question, target), ...]). Many answers per
    document give retrieval a dense learning signal; each question is asked as the evaluation asks it."""
    n_keys = rng.randint(0, min(facts, len(KEYS)))
    n_people = min(facts - n_keys, len(NAMES))
    keys, values = rng.sample(KEYS, n_keys), _numbers(rng, n_keys)
    needles = [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)]
    asked = [(_ask_number(k), v) for k, v in zip(keys, values)]
    for person in rng.sample(NAMES, n_people):
        fact, question, prefix, choices = rng.choice(QA_RELATIONS)
        value = rng.choice(choices)
        needles.append(fact.format(p=person, x=value))
        asked.append((ask(question.format(p=person), prefix.format(p=person)), value))
    order = rng.sample(range(len(needles)), len(needles))  # needles go in at random depths, in a random order
    context = _document(rng, tokenizer, length_tokens, [needles[i] for i in order])
    rng.shuffle(asked)
    return context, [(q, f" {a}.") for q, a in asked]


def score(sample: Sample, prediction: str) -> float:
    """RULER's string match: the fraction of `sample.answers` found in `prediction`, ignoring case."""
    text = prediction.lower()
    return sum(answer.lower() in text for answer in sample.answers) / len(sample.answers)


def token_ids(sample: Sample, tokenizer) -> tuple[list[int], list[int]]:
    """(context ids, question ids): the context alone is what a first request caches."""
    return tokenizer(sample.context).input_ids, tokenizer(sample.question, add_special_tokens=False).input_ids


# --- haystack ----------------------------------------------------------------------------------------------------


def _lengths(tokenizer, texts: list[str]) -> list[int]:
    return [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]] if texts else []


def _filler(rng: random.Random, tokenizer, budget: int) -> list[str]:
    """Filler sentences until they hold `budget` tokens (each counted with the space that joins it)."""
    out, total = [], 0
    while total < budget:
        batch = [sentence(rng) for _ in range(32)]  # tokenized together: one call per 32 sentences
        for text, n in zip(batch, _lengths(tokenizer, [" " + s for s in batch])):
            if total >= budget:
                break
            out.append(text)
            total += n
    return out


def _document(rng: random.Random, tokenizer, length_tokens: int, needles: list[str]) -> str:
    """Filler with `needles` inserted at uniformly random depths, in the order given, about `length_tokens` in all."""
    filler = _filler(rng, tokenizer, length_tokens - sum(_lengths(tokenizer, [" " + s for s in needles])))
    slots = sorted(rng.randint(0, len(filler)) for _ in needles)
    for offset, (slot, needle) in enumerate(zip(slots, needles)):
        filler.insert(slot + offset, needle)
    return " ".join(filler)


def _numbers(rng: random.Random, k: int) -> list[str]:
    # Four digits: short in tokens even for a 1K-token vocabulary, and never a prefix of one another.
    return [str(v) for v in rng.sample(range(1000, 10000), k)]


# --- tasks -------------------------------------------------------------------------------------------------------


def _niah_single(rng, tokenizer, length):
    key, (value,) = rng.choice(KEYS), _numbers(rng, 1)
    context = _document(rng, tokenizer, length, [NEEDLE.format(key=key, value=value)])
    return context, *_number_question(key), [value]


def _niah_multikey(rng, tokenizer, length):
    keys, values = rng.sample(KEYS, MULTI_NEEDLES), _numbers(rng, MULTI_NEEDLES)
    context = _document(rng, tokenizer, length, [NEEDLE.format(key=k, value=v) for k, v in zip(keys, values)])
    asked = rng.randrange(MULTI_NEEDLES)
    return context, *_number_question(keys[asked]), [values[asked]]


def _niah_multivalue(rng, tokenizer, length):
    key, values = rng.choice(KEYS), _numbers(rng, MULTI_NEEDLES)
    context = _document(rng, tokenizer, length, [NEEDLE.format(key=key, value=v) for v in values])
    prefix = ANSWER_PREFIX["niah_multivalue"].format(key=key)
    return context, f"What are all the special numbers for {key}?", prefix, values  # in the order they appear


def _variable_tracking(rng, tokenizer, length):
    names: list[str] = []
    while len(names) < VT_CHAINS * VT_NAMES_PER_CHAIN:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(4))
        names += [name] if name not in names else []
    values = _numbers(rng, VT_CHAINS)
    chains = [names[c * VT_NAMES_PER_CHAIN:(c + 1) * VT_NAMES_PER_CHAIN] for c in range(VT_CHAINS)]
    statements = [[f"VAR {chain[0]} = {value}."] + [f"VAR {b} = {a}." for a, b in zip(chain, chain[1:])]
                  for chain, value in zip(chains, values)]
    # Interleave the chains, each in its own order: a name is always assigned before it is copied.
    picks = [c for c in range(VT_CHAINS) for _ in range(VT_NAMES_PER_CHAIN)]
    rng.shuffle(picks)
    needles = [statements[c].pop(0) for c in picks]
    context = _document(rng, tokenizer, length, needles)
    prefix = ANSWER_PREFIX["variable_tracking"].format(value=values[0])
    return context, f"Which variables are equal to {values[0]}?", prefix, chains[0]


@functools.lru_cache(maxsize=1)
def _word_pool() -> tuple[str, ...]:
    """The corpus's content words (four letters or more): ones the tokenizer knows, none of them a needle key."""
    words = {w.lower() for text in training_corpus() for w in text.split() if w.isalpha() and len(w) >= 4}
    return tuple(sorted(words - set(KEYS)))


def _common_words(rng, tokenizer, length):
    """The top words appear 4m, 3m and 2m times and every other word m or m - 1 times, m scaled to the length."""
    pool = list(_word_pool())
    rng.shuffle(pool)
    top, rest = pool[:CWE_TOP], pool[CWE_TOP:]
    cost = dict(zip(pool, _lengths(tokenizer, [" " + w for w in pool])))
    top_weight = sum((CWE_TOP + 1 - i) * cost[w] for i, w in enumerate(top))  # 4, 3, 2 occurrences per m
    m = max(1, math.ceil(length / (sum(cost[w] for w in rest) + top_weight)))  # rounds of the whole pool
    counts = {w: (CWE_TOP + 1 - i) * m for i, w in enumerate(top)}
    budget = length - top_weight * m
    for w in rest:  # everyone gets m - 1, then as many as fit get one more
        counts[w] = m - 1
        budget -= (m - 1) * cost[w]
    for w in rest:
        if budget >= cost[w]:
            counts[w] += 1
            budget -= cost[w]
    words = [w for w, c in counts.items() for _ in range(c)]
    rng.shuffle(words)
    question, prefix = f"What are the {CWE_TOP} most common words in the list?", ANSWER_PREFIX["common_words"]
    return " ".join(words), question, prefix.format(n=CWE_TOP), top  # most frequent first


def _qa(rng, tokenizer, length):
    fact, question, prefix, choices = rng.choice(QA_RELATIONS)
    people, values = rng.sample(NAMES, QA_FACTS), rng.sample(choices, QA_FACTS)
    context = _document(rng, tokenizer, length, [fact.format(p=p, x=x) for p, x in zip(people, values)])
    person = people[rng.randrange(QA_FACTS)]
    return context, question.format(p=person), prefix.format(p=person), [values[people.index(person)]]


_BUILDERS = {
    "niah_single": _niah_single, "niah_multikey": _niah_multikey, "niah_multivalue": _niah_multivalue,
    "variable_tracking": _variable_tracking, "common_words": _common_words, "qa": _qa,
}
