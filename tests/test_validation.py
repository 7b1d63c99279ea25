"""The token-id check the plugin runs on every prompt (tailreplay_sglang/validation.py), without a server."""

import pytest

from tailreplay_sglang.validation import InvalidTokenIdError, check_token_ids


@pytest.mark.parametrize("ids", [[], [0], [0, 5, 9], list(range(10)) * 50])
def test_ids_inside_the_vocabulary_pass(ids):
    check_token_ids(ids, vocab_size=10)


@pytest.mark.parametrize("ids,message", [
    ([1, -1], "input_ids[1] = -1 is outside the model's vocabulary [0, 10)"),
    ([10], "input_ids[0] = 10 is outside the model's vocabulary [0, 10)"),
    ([3, 4, 2**63], f"input_ids[2] = {2**63} is outside"),
    ([1, True], "input_ids[1] = True is not an integer token id"),
    ([1, 2.0], "input_ids[1] = 2.0 is not an integer token id"),
    (["7"], "input_ids[0] = '7' is not an integer token id"),
    ([None], "input_ids[0] = None is not an integer token id"),
])
def test_bad_ids_raise_a_value_error_naming_the_first_bad_position(ids, message):
    with pytest.raises(InvalidTokenIdError) as err:
        check_token_ids(ids, vocab_size=10)
    assert message in str(err.value)
    assert isinstance(err.value, ValueError)  # what SGLang's HTTP layer turns into a 400
