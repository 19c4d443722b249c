"""The detokenizer's two decoders agree: ``tokenizers``' ``DecodeStream`` (fast tokenizers)
and the Python window (the fallback) give the same deltas, stops and flushes."""

import random

import pytest

from latentserve.detokenizer import IncrementalDetokenizer, decode_stream_backend

CHAT_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


class DecodeOnly:
    """The tokenizer seen through ``decode`` only: the detokenizer falls back to its window."""

    def __init__(self, tok):
        self.tok = tok

    def decode(self, ids, **kwargs):
        return self.tok.decode(ids, **kwargs)


def run(tok, prompt, chunks, stop, skip):
    detok = IncrementalDetokenizer(tok, prompt, stop=stop, skip_special_tokens=skip)
    deltas = [detok.add(c) for c in chunks]
    return deltas + [detok.flush()], detok.stopped, detok._stream is not None


def random_ids(rng, tok):
    """A mix of text tokens, byte pieces of split characters and special tokens."""
    text = rng.choice(["Hello 👋 world 🌍! naïve café 🤖🎉", "你好，世界。今天天气很好。",
                       "The answer is 42, final.\n\n  Done."])
    ids = tok(text, add_special_tokens=False).input_ids
    ids += [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(0, 12))]
    ids.insert(rng.randrange(len(ids) + 1), tok.eos_token_id)
    return ids[: rng.randrange(1, len(ids) + 1)]  # may end inside a character


def test_smollm2_decodes_through_decode_stream(smollm2_tokenizer):
    assert decode_stream_backend(smollm2_tokenizer) is smollm2_tokenizer.backend_tokenizer
    assert IncrementalDetokenizer(smollm2_tokenizer, [1, 2])._stream is not None
    assert IncrementalDetokenizer(DecodeOnly(smollm2_tokenizer), [1, 2])._stream is None


@pytest.mark.parametrize("seed", range(40))
def test_decode_stream_and_the_window_give_the_same_deltas(smollm2_tokenizer, seed):
    tok = smollm2_tokenizer
    rng = random.Random(seed)
    prompt = tok(CHAT_PROMPT).input_ids[: rng.randrange(1, 20)]
    ids = random_ids(rng, tok)
    cuts = sorted(rng.sample(range(1, len(ids)), min(3, len(ids) - 1))) if len(ids) > 1 else []
    chunks = [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)])]
    full = tok.decode(ids, skip_special_tokens=True)
    stop = [full[len(full) // 2:][:2]] if seed % 2 and full.strip() else []
    skip = seed % 3 != 0
    fast = run(tok, prompt, chunks, stop, skip)
    window = run(DecodeOnly(tok), prompt, chunks, stop, skip)
    assert fast[2] and not window[2]
    assert fast[:2] == window[:2]


def test_the_window_takes_over_when_decode_stream_refuses_a_step(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = tok("Hello 👋 world 🌍! naïve café", add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(tok, tok(CHAT_PROMPT).input_ids)
    first = detok.add(ids[:4])

    class InvalidPrefix(Exception):  # tokenizers raises a plain Exception with this text
        pass

    class Refusing:
        def step(self, tokenizer, token_id):
            raise InvalidPrefix("Invalid prefix encountered")

    detok._stream = Refusing()
    rest = detok.add(ids[4:]) + detok.flush()
    assert not detok._stream is not None
    assert first + rest == "Hello 👋 world 🌍! naïve café"


def test_a_tokenizer_whose_decode_cleans_up_spaces_uses_the_window(tmp_path):
    """transformers applies ``clean_up_tokenization_spaces`` to a word-level model's text
    (``" ."`` -> ``"."``), which DecodeStream would not: the window keeps decode's text."""
    from transformers import AutoTokenizer

    from latentserve.bench.baseline.tiny_models import save_word_tokenizer

    save_word_tokenizer(tmp_path, 64)
    tok = AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    assert decode_stream_backend(tok) is None
    tok.clean_up_tokenization_spaces = False
    assert decode_stream_backend(tok) is tok.backend_tokenizer
