"""Reject token ids the model cannot embed before they reach the scheduler.

Stock SGLang 0.5.23 checks a prompt's length but not its ids: one `/generate` request with a negative or
out-of-vocabulary id raises IndexError in the embedding inside the scheduler and takes the whole server down (a
device-side assert on GPU). The plugin checks every prompt in `TokenizerManager._validate_one_request`, which all
request paths pass through (`/generate` with ids or text, batches, OpenAI completions with token-id prompts, chat),
so a bad id becomes a ValueError there, which SGLang answers with HTTP 400 while it keeps serving.
"""

from collections.abc import Sequence


class InvalidTokenIdError(ValueError):
    pass


def check_token_ids(input_ids: Sequence, vocab_size: int) -> None:
    """Raise InvalidTokenIdError naming the first id that is not an int in [0, vocab_size)."""
    # Fast path: one pass over plain ints, then the range from min/max.
    if all(type(t) is int for t in input_ids) and (
            not input_ids or 0 <= min(input_ids) and max(input_ids) < vocab_size):
        return
    for i, t in enumerate(input_ids):
        if type(t) is not int:  # bool is an int subclass, but True is not a token id
            raise InvalidTokenIdError(f"input_ids[{i}] = {t!r} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise InvalidTokenIdError(f"input_ids[{i}] = {t} is outside the model's vocabulary [0, {vocab_size})")


def validate_request_token_ids(manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request(obj, input_ids)."""
    if input_ids is not None and getattr(obj, "input_embeds", None) is None:
        check_token_ids(input_ids, manager.model_config.vocab_size)
    return None
