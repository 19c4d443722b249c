"""A real server (subprocess, free port) over a tiny random Llama with SmolLM2's tokenizer."""

import pytest

MAX_MODEL_LEN = 256


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    """Tiny random Llama (hidden 64, 2 layers, 4/2 heads, 256 positions, vocab 49152)."""
    from latentserve.testing.tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("server") / "tiny-llama", "llama",
                     max_position_embeddings=MAX_MODEL_LEN)


@pytest.fixture(scope="session")
def server(tiny_model_dir):
    """The server, started once per session and stopped at the end."""
    from latentserve.config import EngineConfig
    from latentserve.server.launch import start_server

    srv = start_server(EngineConfig(model=str(tiny_model_dir), max_num_seqs=8), timeout=300)
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

    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0,
                         timeout=120)


@pytest.fixture
def http(server):
    """A raw ``httpx.Client`` on the server, for requests the openai SDK would not send."""
    import httpx

    with httpx.Client(base_url=server.base_url, timeout=120) as c:
        yield c
