"""Reject token ids the model cannot embed before they reach the scheduler.

Stock SGLang 0.5.23 checks a prompt's length but not its ids: one `/generate` request with a negative or
out-of-vocabulary id raises IndexError in the embedding inside the scheduler and takes the whole server down (a
device-side assert on GPU). The plugin checks every prompt in `TokenizerManager._validate_one_request`, which all
request paths pass through (`/generate` with ids or text, batches, OpenAI completions with token-id prompts, chat),
so a bad id becomes a ValueError there, which SGLang answers with HTTP 400 while it keeps serving.

The same holds for a PD request's `bootstrap_room`: SGLang accepts any integer, and a negative one (or one of 2**63
or more) overflows the int64/uint64 metadata row on the decode server, whose scheduler then dies ("value cannot be
converted to type int64_t without overflow", measured on 0.5.23), while the prefill server waits for a decode
server that never comes. Rooms are checked against the range SGLang's own load balancer draws them from.
"""

from collections.abc import Sequence


class InvalidTokenIdError(ValueError):
    pass


class InvalidBootstrapRoomError(ValueError):
    pass


BOOTSTRAP_ROOMS = 2**63  # SGLang's load balancers draw a room from [0, 2**63)


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


def check_bootstrap_room(room) -> None:
    """Raise InvalidBootstrapRoomError unless `room` (or each of a batch's) is None or an int in [0, 2**63)."""
    for r in room if isinstance(room, list) else [room]:
        if r is not None and (type(r) is not int or not 0 <= r < BOOTSTRAP_ROOMS):
            raise InvalidBootstrapRoomError(f"bootstrap_room = {r!r} is not an integer in [0, 2**63)")


def validate_request(manager, obj, input_ids, *args, **kwargs):
    """BEFORE hook on TokenizerManager._validate_one_request(obj, input_ids)."""
    if input_ids is not None and getattr(obj, "input_embeds", None) is None:
        check_token_ids(input_ids, manager.model_config.vocab_size)
    check_bootstrap_room(getattr(obj, "bootstrap_room", None))
    return None
