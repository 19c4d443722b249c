"""Fixtures for parity tests: tiny random checkpoints and engines over them."""

import pytest


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smollm2_dir):
    """``kind -> checkpoint dir`` for every tiny kind (built once per session)."""
    from latentserve.testing.tiny_models import save_tiny

    root = tmp_path_factory.mktemp("tiny")
    return {k: save_tiny(root / k, k) for k in ("llama", "llama-untied", "qwen2", "gpt2")}


@pytest.fixture(scope="session")
def hf_models():
    """Cache of HF reference models by directory (fp32, eval)."""
    cache = {}

    def get(path):
        if path not in cache:
            from transformers import AutoModelForCausalLM

            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype="float32").eval()
        return cache[path]

    return get
