"""Real servers (subprocesses, free ports) over tiny Llamas with SmolLM2's tokenizer.

* ``server``: a tiny random Llama behind an API key (``API_KEY``), shared by the session;
* ``scripted_server``: the scripted tiny Llama of ``server_testlib`` (no API key).
"""

import pytest
from server_testlib import API_KEY, MAX_MODEL_LEN, save_scripted, script

# --- fixtures ----------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Tiny random Llama (hidden 64, 2 layers, 4/2 heads, 256 positions, vocab 49152)."""
    from latentserve.testing.tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("server") / "tiny-llama", "llama",
                     max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def scripted_model_dir(tmp_path_factory, smollm2_dir):
    return save_scripted(tmp_path_factory.mktemp("server") / "scripted-llama", script())


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
