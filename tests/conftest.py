"""Shared test fixtures: the embedded SmolLM2 checkpoint, converted once per cache."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download from the hub

import pytest


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded SmolLM2-135M-Instruct as an HF-style directory (converted on first use,
    about 30 s, then cached in $LATENTSERVE_CACHE or ~/.cache/latentserve)."""
    from latentserve.models.checkpoint import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def smollm2_tokenizer(smollm2_dir):
    """The SmolLM2 tokenizer loaded from the converted directory (eos '<|im_end|>')."""
    from latentserve.models.checkpoint import load_tokenizer

    return load_tokenizer(smollm2_dir)
