"""The generated English corpus behind the small models' tokenizers and the task suites' haystacks.

Template sentences drawn from fixed word lists: deterministic, a few tens of KB, no downloads.
"""

import random

# Independent of any model seed: a tokenizer depends only on the preset's vocabulary size.
CORPUS_SEED = 1234
CORPUS_SENTENCES = 400

_SUBJECTS = (
    "the old sailor", "a young engineer", "my neighbour", "the committee", "our teacher", "a curious child",
    "the baker", "her brother", "the river pilot", "every student", "the quiet librarian", "a tired doctor",
    "the mayor", "his grandmother", "the new manager", "a travelling musician", "the gardener", "nobody",
    "the programmer", "a small dog", "the farmers", "their captain", "the scientist", "an honest merchant",
)
_VERBS = (
    "carried", "painted", "repaired", "described", "forgot", "discovered", "measured", "borrowed", "explained",
    "delivered", "noticed", "collected", "followed", "questioned", "remembered", "replaced", "ordered", "finished",
    "studied", "opened", "counted", "ignored", "protected", "welcomed", "compared", "organised", "wrote about",
)
_OBJECTS = (
    "the wooden boxes", "a broken window", "the morning newspaper", "three silver coins", "the long report",
    "an empty bottle", "the garden fence", "a strange letter", "the winter coats", "his favourite song",
    "the kitchen table", "a heavy suitcase", "the final chapter", "two green apples", "the village map",
    "a paper lantern", "the blue bicycle", "seven small stones", "the quarterly budget", "an ancient clock",
)
_PLACES = (
    "near the harbour", "in the library", "behind the station", "at the market", "under the bridge",
    "on the mountain road", "in the kitchen", "across the valley", "beside the lake", "inside the museum",
    "at the corner shop", "in the northern city", "along the coast", "outside the school", "over the hills",
)
_TIMES = (
    "yesterday", "this morning", "last winter", "before dawn", "after lunch", "on Tuesday", "every evening",
    "in September", "during the storm", "at midnight", "two weeks ago", "on the first day of spring",
)
_ADVERBS = (
    "slowly", "carefully", "quietly", "happily", "suddenly", "patiently", "eagerly", "nervously", "politely",
    "bravely", "quickly", "gently", "proudly", "clumsily", "silently",
)
_CONNECTORS = ("because", "although", "while", "so", "but", "and then", "until", "after")
_QUESTIONS = (
    "Why did {s} leave {o} {p}?", "Who {v} {o} {t}?", "Where did {s} find {o}?", "How many times has {s} {v} {o}?",
)


def _sentence(rng: random.Random) -> str:
    s, v, o, p, t, a = (rng.choice(words) for words in (_SUBJECTS, _VERBS, _OBJECTS, _PLACES, _TIMES, _ADVERBS))
    kind = rng.randrange(5)
    if kind == 0:
        text = f"{t.capitalize()}, {s} {a} {v} {o} {p}."
    elif kind == 1:
        text = f"{s.capitalize()} {v} {o} {rng.choice(_CONNECTORS)} {rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {p}."
    elif kind == 2:
        text = rng.choice(_QUESTIONS).format(s=s, v=v, o=o, p=p, t=t)
        text = text[0].upper() + text[1:]
    elif kind == 3:
        text = f'"{s.capitalize()} {v} {o}," she said, "and it cost {rng.randrange(2, 999)} dollars."'
    else:
        text = f"On {rng.randrange(1, 29)}/{rng.randrange(1, 13)}/{rng.randrange(1950, 2030)} {s} {a} {v} {o}!"
    return text


def sentence(rng: random.Random) -> str:
    """One filler sentence in the tokenizer corpus's style (the haystack of `tasks.py`)."""
    return _sentence(rng)


def training_corpus() -> list[str]:
    """A deterministic English corpus of about 30 KB: template sentences from the word lists above."""
    rng = random.Random(CORPUS_SEED)
    return [_sentence(rng) for _ in range(CORPUS_SENTENCES)]
