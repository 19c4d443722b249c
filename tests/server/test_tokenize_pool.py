"""The bounded tokenizer pool (``server/tokenize_pool.py``) and the byte bound checked
before tokenizing (``prompts.check_prompt_bytes``)."""

import asyncio
import threading

import openai
import pytest

from latentserve.server.errors import APIError
from latentserve.server.tokenize_pool import TokenizerPool


def test_pool_refuses_past_its_bound_with_503_overloaded():
    release = threading.Event()

    async def main():
        pool = TokenizerPool(workers=1, max_pending=2)
        jobs = [asyncio.create_task(pool.run(release.wait, 10)) for _ in range(2)]
        await asyncio.sleep(0.05)
        with pytest.raises(APIError) as info:
            await pool.run(len, "x")
        release.set()
        assert await asyncio.gather(*jobs) == [True, True]
        assert pool.pending == 0 and await pool.run(len, "abc") == 3
        return info.value

    err = asyncio.run(main())
    assert err.status_code == 503 and err.code == "overloaded"
    assert err.headers == {"Retry-After": "1"}


def test_a_cancelled_job_frees_its_place():
    release = threading.Event()

    async def main():
        pool = TokenizerPool(workers=1, max_pending=2)
        running = asyncio.create_task(pool.run(release.wait, 10))
        queued = asyncio.create_task(pool.run(len, "x"))
        await asyncio.sleep(0.05)
        queued.cancel()  # its client hung up before the job started
        await asyncio.sleep(0.05)
        assert pool.pending == 1
        release.set()
        await running
        return pool.pending

    assert asyncio.run(main()) == 0


def test_max_bytes_per_token_bounds_every_token(smollm2_tokenizer):
    from latentserve.server.prompts import max_bytes_per_token

    per_token = max_bytes_per_token(smollm2_tokenizer)
    assert per_token is not None
    for tid in range(0, len(smollm2_tokenizer), 97):
        assert len(smollm2_tokenizer.decode([tid]).encode()) <= per_token


def test_a_prompt_over_the_byte_bound_is_refused_before_tokenizing(client, model,
                                                                   smollm2_tokenizer):
    from latentserve.server.prompts import max_bytes_per_token

    size = 256 * max_bytes_per_token(smollm2_tokenizer) + 1  # the model's context: 256
    for call in (lambda: client.completions.create(model=model, prompt="a" * size,
                                                   max_tokens=1),
                 lambda: client.chat.completions.create(
                     model=model, max_tokens=1,
                     messages=[{"role": "user", "content": "a" * size}])):
        with pytest.raises(openai.BadRequestError) as info:
            call()
        assert info.value.body["code"] == "context_length_exceeded"
        assert f"prompt is {size} bytes" in info.value.body["message"]


def test_messages_over_the_byte_bound_are_refused_before_templating(anthropic_client, model,
                                                                    smollm2_tokenizer):
    """/v1/messages and its count_tokens: the same bound, with Anthropic's error body."""
    import anthropic

    from latentserve.server.prompts import max_bytes_per_token

    size = 256 * max_bytes_per_token(smollm2_tokenizer) + 1
    for call, total in ((lambda: anthropic_client.messages.create(
                             model=model, max_tokens=1, system="b" * size,
                             messages=[{"role": "user", "content": "hi"}]), size + 2),
                        (lambda: anthropic_client.messages.count_tokens(
                             model=model, messages=[{"role": "user", "content": "a" * size}]),
                         size)):
        with pytest.raises(anthropic.BadRequestError) as info:
            call()
        assert info.value.body["type"] == "error"
        assert info.value.body["error"]["type"] == "invalid_request_error"
        assert f"prompt is {total} bytes" in info.value.body["error"]["message"]


def test_a_prompt_under_the_byte_bound_gets_the_token_count_error(client, model):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=model, prompt="hello " * 400, max_tokens=1)
    assert info.value.body["code"] == "context_length_exceeded"
    assert "your prompt has" in info.value.body["message"]
