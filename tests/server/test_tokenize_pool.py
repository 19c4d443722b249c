"""The tokenizer pool (``server/tokenize_pool.py``) and the byte bound checked before
tokenizing (``prompts.check_prompt_bytes``)."""

import asyncio
import threading

import openai
import pytest

from latentserve.server.tokenize_pool import TokenizerPool


def test_a_burst_waits_its_turn_instead_of_a_503():
    """Jobs past the workers queue in arrival order, however many (vLLM queues them too; the
    bound on waiting requests is ``--max-waiting-requests``, counted before the pool)."""

    async def main():
        pool = TokenizerPool(workers=1)
        return await asyncio.gather(*(pool.run(len, "x" * i) for i in range(300)))

    assert asyncio.run(main()) == list(range(300))


def test_a_cancelled_job_that_has_not_started_never_runs():
    release, ran = threading.Event(), []

    async def main():
        pool = TokenizerPool(workers=1)
        running = asyncio.create_task(pool.run(release.wait, 10))
        queued = asyncio.create_task(pool.run(ran.append, "queued"))
        await asyncio.sleep(0.05)
        queued.cancel()  # its client hung up before the job started
        await asyncio.sleep(0.05)
        release.set()
        assert await running is True
        await pool.run(ran.append, "after")

    asyncio.run(main())
    assert ran == ["after"]


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
