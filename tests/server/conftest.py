"""Real servers (subprocesses, free ports) over tiny Llamas with SmolLM2's tokenizer.

* ``server``: a tiny random Llama behind an API key (``API_KEY``), shared by the session;
* ``scripted_server``: the scripted tiny Llama of ``server_testlib`` (no API key);
* ``tool_chat_server``: a scripted chat model (``TOOL_CHAT_*`` below) that calls a tool,
  answers after the tool's result, or thinks in ``<think>`` text, served with
  ``--tool-call-parser hermes --reasoning-parser qwen3`` (no API key);
* ``colar_key_server``: a tiny CoLaR whose stop fires (``COLAR_STOPS``) behind ``API_KEY``
  (the viewer's and the streamed latent trace's tests).
"""

import pytest
from server_testlib import (
    API_KEY,
    MAX_MODEL_LEN,
    VOCAB,
    save_scripted,
    script,
    scripted_chat,
)

# The tool chat model's template: Qwen2.5-like, with a generation prompt whose last token
# says what the model answers: "assistant" (a call), "assistant with the result" (the
# answer after a tool result), "assistant thinking" (enable_thinking: <think> text).
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }} {% endfor %}</tools>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{\"name\": \"{{ c.function.name }}\", "
    "\"arguments\": {{ c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant"
    "{% if messages[-1].role == 'tool' %} with the result{% elif enable_thinking %} thinking"
    "{% endif %}{% endif %}")
TOOL_CHAT_CALL = ['<tool_call>', '\n{"name": "get_weather", ',
                  '"arguments": {"city": "Paris"}}', '\n</tool_call>']
TOOL_CHAT_ANSWER = ["It is 18C", " in Paris."]
TOOL_CHAT_THINK = ["<think>", "\nThe user greets me.", "\n</think>", "\n\nHello!"]

# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Tiny random Llama (hidden 64, 2 layers, 4/2 heads, 256 positions, vocab 49152)."""
    from latentserve.bench.baseline.tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("session-server") / "tiny-llama", "llama",
                     max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory, smollm2_dir):
    return save_scripted(tmp_path_factory.mktemp("session-server") / "scripted-llama", script())


@pytest.fixture(scope="session")
def tool_chat_dir(tmp_path_factory, smollm2_dir):
    """The scripted chat model: its replies' pieces are tokens added to SmolLM2's tokenizer
    (``server_testlib.scripted_chat``)."""
    from latentserve.models.checkpoint import load_tokenizer

    out = tmp_path_factory.mktemp("session-server") / "tool-chat"
    tok = load_tokenizer(smollm2_dir)
    tail = {t: tok.encode(f"<|im_start|>assistant{t}")[-1]
            for t in ("", " with the result", " thinking")}
    assert len(set(tail.values())) == 3
    table = scripted_chat(tok, {tail[""]: TOOL_CHAT_CALL,
                                tail[" with the result"]: TOOL_CHAT_ANSWER,
                                tail[" thinking"]: TOOL_CHAT_THINK})
    save_scripted(out, table, vocab_size=VOCAB + 64)
    tok.chat_template = TOOL_CHAT_TEMPLATE
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tool_chat_server(tool_chat_dir):
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(tool_chat_dir), max_num_seqs=4,
                                    reasoning_parser="qwen3"), timeout=300,
                       tool_call_parser="hermes")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The server (API key ``API_KEY``), started once per session and stopped at the end."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8), timeout=300,
                       api_key=API_KEY)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def colar_key_server(tmp_path_factory):
    """A tiny CoLaR (speed 2 of 1..5, ``max_latent`` 12) behind ``API_KEY``; its
    ``model_dir`` attribute is the directory it serves."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server
    from tests.support.colar_models import save_colar_tiny

    d = save_colar_tiny(tmp_path_factory.mktemp("session-colar-key") / "m", stop_push=16.0,
                        compression_factor=2, max_compression_factor=5, max_latent=12)
    srv = start_server(EngineConfig(model=str(d), max_num_seqs=4), timeout=300,
                       api_key=API_KEY)
    srv.model_dir = str(d)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def scripted_server(scripted_model_dir):
    """A server over the scripted model (no API key)."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(scripted_model_dir), max_num_seqs=4),
                       timeout=300)
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def model(tiny_model_dir):
    """The served model's name (the directory it was loaded from)."""
    return str(tiny_model_dir)


@pytest.fixture
def client(server):
    """An ``openai.OpenAI`` client of the server (no retries: every error is seen once)."""
    import openai

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=API_KEY, max_retries=0,
                         timeout=120)


@pytest.fixture
def anthropic_client(server):
    """An ``anthropic.Anthropic`` client of the server (sends ``x-api-key``)."""
    import anthropic

    return anthropic.Anthropic(base_url=server.base_url, api_key=API_KEY, max_retries=0,
                               timeout=120)


@pytest.fixture
def http(server):
    """A raw ``httpx.Client`` on the server with the API key, for requests the SDKs would
    not send."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"}) as c:
        yield c


@pytest.fixture
def scripted_http(scripted_server):
    import httpx

    with httpx.Client(base_url=scripted_server.base_url, timeout=120) as c:
        yield c
