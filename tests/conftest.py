"""Shared test fixtures: the embedded SmolLM2 checkpoint, converted once per cache."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never download from the hub
# Spinning OpenMP waits stall every op on a shared 2-core machine (set before torch loads).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import shutil

import pytest

_failed_modules: set[str] = set()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    """Note the modules with a failed test (setup, call or teardown): their directories stay."""
    report = yield
    if report.failed:
        _failed_modules.add(item.nodeid.split("::")[0])
    return report


@pytest.fixture(scope="module", autouse=True)
def _module_tmp_dirs(request, tmp_path_factory):
    """Remove the temporary directories made while a module ran (its fixtures' tiny
    checkpoints) when it ends, unless one of its tests failed; those of session fixtures
    (named ``session-*``) stay. Set up before the module's other fixtures, so torn down
    after them. Without it a run holds about 3 GB under the base temporary directory."""
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    yield
    if request.node.nodeid in _failed_modules:
        return
    for path in set(base.iterdir()) - before:
        if not path.name.startswith("session-"):
            shutil.rmtree(path, ignore_errors=True)


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


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory, smollm2_dir):
    """``kind -> checkpoint dir`` for every tiny kind (built once per session)."""
    from latentserve.bench.baseline.tiny_models import save_tiny

    root = tmp_path_factory.mktemp("session-tiny")
    return {k: save_tiny(root / k, k) for k in ("llama", "llama-untied", "qwen2", "gpt2")}


@pytest.fixture(scope="session")
def small_vocab_dirs(tmp_path_factory):
    """``kind -> checkpoint dir`` of tiny ``llama`` and ``qwen2`` with a 4224-id word-level
    vocabulary (``shared_prefix_prompts`` ids fit): in the Triton interpreter their LM head
    takes 66 programs a call instead of SmolLM2's 384, for the fast-path tests."""
    from latentserve.bench.baseline.tiny_models import save_tiny

    root = tmp_path_factory.mktemp("session-tiny-small-vocab")
    return {k: save_tiny(root / k, k, word_tokenizer=True, vocab_size=4224)
            for k in ("llama", "qwen2")}


@pytest.fixture(scope="session")
def hf_models():
    """``get(path, device="cpu", dtype="float32")``: HF reference models, cached (eval mode)."""
    cache = {}

    def get(path, device="cpu", dtype="float32"):
        key = (str(path), device, dtype)
        if key not in cache:
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
            cache[key] = model.to(device).eval()
        return cache[key]

    return get
