"""Specification of latentserve.detokenizer.IncrementalDetokenizer (real SmolLM2 tokenizer)."""

import pytest

from latentserve.detokenizer import IncrementalDetokenizer

EMOJI = "Hello 👋 world 🌍! naïve café 🤖🎉"
CHINESE = "你好，世界。今天天气很好。"
CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def tok(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tok):
    return tok(CHAT_PROMPT).input_ids


def ids_of(tok, text):
    return tok(text, add_special_tokens=False).input_ids


def stream(detok, ids):
    """Add ids one at a time, returning the list of deltas."""
    return [detok.add([i]) for i in ids]


@pytest.mark.parametrize("text", [EMOJI, CHINESE], ids=["emoji", "chinese"])
def test_concatenated_deltas_equal_decoding_all_ids(tok, prompt_ids, text):
    ids = ids_of(tok, text)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    out = "".join(stream(detok, ids)) + detok.flush()
    assert out == tok.decode(ids) == text


@pytest.mark.parametrize("text", [EMOJI, CHINESE], ids=["emoji", "chinese"])
def test_no_delta_contains_a_partial_multibyte_character(tok, prompt_ids, text):
    ids = ids_of(tok, text)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # the text does split characters
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    assert all("\ufffd" not in delta for delta in stream(detok, ids))


def test_adding_several_tokens_at_once_gives_the_same_text(tok, prompt_ids):
    ids = ids_of(tok, EMOJI)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    assert detok.add(ids[:5]) + detok.add(ids[5:]) + detok.flush() == EMOJI


def test_text_is_the_emitted_text_so_far(tok, prompt_ids):
    ids = ids_of(tok, CHINESE)
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    emitted = "".join(stream(detok, ids[:7]))
    assert detok.text == emitted
    assert CHINESE.startswith(emitted)


def test_each_step_decodes_a_small_window_not_the_whole_output(tok, prompt_ids):
    windows = []

    class Spy:
        def decode(self, ids, **kwargs):
            windows.append(len(ids))
            return tok.decode(ids, **kwargs)

    ids = ids_of(tok, "The quick brown fox jumps over the lazy dog. " * 20)
    detok = IncrementalDetokenizer(Spy(), prompt_ids, stop=[])
    out = "".join(stream(detok, ids)) + detok.flush()
    assert out == tok.decode(ids)
    assert len(ids) > 100 and max(windows) <= 8


def test_special_tokens_are_skipped_by_default(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    assert detok.add(ids_of(tok, "Hi") + [tok.eos_token_id]) + detok.flush() == "Hi"


def test_special_tokens_are_kept_when_not_skipped(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[], skip_special_tokens=False)
    assert detok.add(ids_of(tok, "Hi") + [tok.eos_token_id]) + detok.flush() == "Hi<|im_end|>"


def test_flush_emits_an_unfinished_trailing_character_as_decode_does(tok, prompt_ids):
    ids = ids_of(tok, "ok 🌍")[:-1]  # cut inside the emoji's bytes
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    out = "".join(stream(detok, ids))
    assert "\ufffd" not in out
    assert out + detok.flush() == tok.decode(ids)


# -- stop strings ------------------------------------------------------------------------------


def test_stop_string_truncates_the_text_before_it(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world"])
    out = "".join(stream(detok, ids_of(tok, "Hello world, how are you?")))
    assert out == detok.text == "Hello "
    assert detok.stopped == "world"


def test_no_text_is_emitted_after_a_stop_string(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["."])
    stream(detok, ids_of(tok, "One. Two."))
    assert detok.add(ids_of(tok, " Three")) == ""
    assert detok.flush() == ""
    assert detok.text == "One"


def test_stop_string_spanning_several_tokens_and_inside_a_token(tok, prompt_ids):
    ids = ids_of(tok, "The answer is 42, final.")
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["swer is 4"])
    assert "".join(stream(detok, ids)) == "The an"
    assert detok.stopped == "swer is 4"


def test_earliest_stop_string_wins(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["fox", "quick brown"])
    detok.add(ids_of(tok, "The quick brown fox"))
    assert detok.text == "The "
    assert detok.stopped == "quick brown"


@pytest.mark.parametrize("stop, text, stopped", [
    (["ari", " Paris"], " P", "ari"),  # completed inside one token: the first to end wins
    (["Paris", "is"], " ", "Paris"), (["is", "Paris"], " Par", "is")])  # equal ends: order
def test_the_stop_string_that_ends_first_wins_then_list_order(tok, prompt_ids, stop, text,
                                                               stopped):
    """As vLLM's ``check_stop_strings``: the result of adding the text one character at a
    time."""
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=stop)
    detok.add(ids_of(tok, " Paris is"))
    assert (detok.text, detok.stopped) == (text, stopped)


def test_stop_string_across_multibyte_characters(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["世界"])
    assert "".join(stream(detok, ids_of(tok, CHINESE))) == "你好，"
    assert detok.stopped == "世界"


def test_possible_start_of_a_stop_string_is_held_back(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    out = "".join(stream(detok, ids_of(tok, "Hello world")))
    assert out == detok.text == "Hello "
    assert detok.stopped is None


def test_held_back_text_is_released_when_it_cannot_become_a_stop_string(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    stream(detok, ids_of(tok, "Hello world"))
    assert detok.add(ids_of(tok, " today")) == "world today"
    assert detok.text == "Hello world today"


def test_held_back_text_that_completes_a_stop_string_is_dropped(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    out = "".join(stream(detok, ids_of(tok, "Hello world peace now")))
    assert out == detok.text == "Hello "
    assert detok.stopped == "world peace"


def test_flush_returns_the_held_back_text(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=["world peace"])
    stream(detok, ids_of(tok, "Hello world"))
    assert detok.flush() == "world"
    assert detok.text == "Hello world"
    assert detok.stopped is None


def test_add_after_flush_raises(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[])
    detok.add(ids_of(tok, "Hi"))
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.add(ids_of(tok, "!"))


def test_empty_stop_strings_are_ignored(tok, prompt_ids):
    detok = IncrementalDetokenizer(tok, prompt_ids, stop=[""])
    assert detok.add(ids_of(tok, "Hi there")) == "Hi there"
    assert detok.stopped is None
