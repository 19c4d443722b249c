"""The real embedded SmolLM2-135M-Instruct (``model=None``) answering through the server."""

import pytest


@pytest.mark.slow
def test_smollm2_answers_a_question(smollm2_dir):
    import openai

    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    with start_server(EngineConfig(), timeout=600) as srv:
        client = openai.OpenAI(base_url=f"{srv.base_url}/v1", api_key="unused",
                               max_retries=0, timeout=300)
        model = client.models.list().data[0].id
        r = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=48, temperature=0)
        answer = r.choices[0].message.content
        print(f"SmolLM2 answered: {answer!r} ({r.choices[0].finish_reason})")
        assert answer.strip()
        assert r.choices[0].finish_reason in {"stop", "length"}
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "What is 2 + 3?"}],
            max_tokens=48, temperature=0, stream=True))
        assert streamed == answer
