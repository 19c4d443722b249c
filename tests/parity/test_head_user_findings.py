"""Regressions for what a fresh user found trying the compression-head feature: corrupted or
malformed bundles are ValueErrors naming what is wrong (never TypeError/KeyError/
SafetensorError), a NaN bundle is refused at load, a model directory whose config names a
missing bundle is an error (not a silently bare backbone), ``--latent-head DIR`` means that
directory's bundle, an empty boolean header is malformed (empty env = the default), and the
stats report the resolved ``min_output_tokens`` too. Plus one engine run against the eager
reference with the stats checked."""

import json

import pytest
import torch
from safetensors.torch import save_file

from latentserve.latent.bundle import (
    SUBDICTS,
    find_bundle,
    random_bundle,
    read_bundle,
    write_bundle,
)
from latentserve.latent.head import head_defaults, parse_bool, resolve_settings
from latentserve.sampling_params import SamplingParams


@pytest.fixture
def bundle():
    return random_bundle(64, 16, source_layer=1)


def _flat(b):
    return {f"{s}.{k}": v.contiguous() for s in SUBDICTS for k, v in (getattr(b, s) or {}).items()}


def _meta(b, **over):
    m = {"format_version": "3", "config": json.dumps(b.config.to_dict()),
         "subdicts": json.dumps(list(SUBDICTS))}
    m.update(over)
    return m


@pytest.mark.parametrize("case, match", [
    ("dotless", "unexpected tensor 'decoder'"),
    ("subdicts_int", "metadata 'subdicts' must be a JSON list"),
    ("subdicts_bad_json", "metadata 'subdicts' is not JSON"),
    ("nan", r"decoder.net.4.bias holds non-finite"),
    ("think_open_int", "field 'think_open' must be a string"),
    ("garbage", "not a readable .safetensors file"),
    ("empty", "not a readable .safetensors file"),
])
def test_malformed_safetensors_bundles_are_value_errors(bundle, tmp_path, case, match):
    path = tmp_path / "b.safetensors"
    f, meta = _flat(bundle), _meta(bundle)
    if case == "dotless":
        f["decoder"] = torch.zeros(2)  # silently dropped before
    elif case == "subdicts_int":
        meta["subdicts"] = "5"  # TypeError before
    elif case == "subdicts_bad_json":
        meta["subdicts"] = "{oops"
    elif case == "nan":
        f["decoder.net.4.bias"] = torch.full_like(f["decoder.net.4.bias"], float("nan"))
    elif case == "think_open_int":
        cfg = bundle.config.to_dict()
        cfg["think_open"] = 5  # a tokenizer error at attach time before
        meta["config"] = json.dumps(cfg)
    if case == "garbage":
        path.write_bytes(b"\xff" * 7 + b"\x7fgarbage")  # SafetensorError before
    elif case == "empty":
        path.write_bytes(b"")
    else:
        save_file(f, str(path), metadata=meta)
    with pytest.raises(ValueError, match=match):
        read_bundle(path)


@pytest.mark.parametrize("case, match", [
    ("head_list", "reasoning_head must be a dict of tensors"),
    ("head_nontensor", r"reasoning_head.net.0.weight must be a tensor"),
    ("config_bad_json", "'config' is not JSON"),
    ("legacy_partial", "legacy head state dict has no net.4.weight"),
    ("truncated", "not a readable .pt bundle"),
])
def test_malformed_pt_bundles_are_value_errors(bundle, tmp_path, case, match):
    path = tmp_path / "b.pt"
    d = {"format_version": 3, "config": bundle.config.to_dict(),
         "reasoning_head": bundle.reasoning_head, "decoder": bundle.decoder}
    if case == "head_list":
        d["reasoning_head"] = [1, 2]  # TypeError before
    elif case == "head_nontensor":
        d["reasoning_head"] = {**bundle.reasoning_head, "net.0.weight": 5}
    elif case == "config_bad_json":
        d["config"] = "{bad"
    elif case == "legacy_partial":
        d = {"net.0.weight": bundle.reasoning_head["net.0.weight"]}  # KeyError before
    torch.save(d, path)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:300])  # RuntimeError before
    with pytest.raises(ValueError, match=match):
        read_bundle(path)


def test_config_naming_a_missing_bundle_is_an_error(bundle, tmp_path):
    """Before: find_bundle returned None and the model was served without its head, even
    with latent_reasoning_head.safetensors right there."""
    write_bundle(bundle, tmp_path / "latent_reasoning_head.safetensors")
    assert find_bundle(tmp_path) == tmp_path / "latent_reasoning_head.safetensors"
    (tmp_path / "config.json").write_text(json.dumps({"latent_reasoning_head": "typo.safetensors"}))
    with pytest.raises(FileNotFoundError, match="typo.safetensors"):
        find_bundle(tmp_path)
    assert find_bundle(tmp_path, disabled=True) is None  # --no-latent-head still wins
    (tmp_path / "config.json").write_text(json.dumps({"latent_reasoning_head": 5}))
    with pytest.raises(ValueError, match="latent_reasoning_head must be a file name"):
        find_bundle(tmp_path)


def test_override_may_be_a_model_directory(bundle, tmp_path, monkeypatch):
    """``--latent-head DIR`` (one model, one directory) used to fail with 'does not exist'."""
    monkeypatch.delenv("LATENTSERVE_LATENT_HEAD", raising=False)
    d = tmp_path / "with"
    d.mkdir()
    write_bundle(bundle, d / "latent_reasoning_head.safetensors")
    found = find_bundle(tmp_path / "other", override=str(d))
    assert found == d / "latent_reasoning_head.safetensors"
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FileNotFoundError, match="directory without a head bundle"):
        find_bundle(tmp_path / "other", override=str(empty))
    monkeypatch.setenv("LATENTSERVE_LATENT_HEAD", str(d))
    assert find_bundle(tmp_path / "other") == d / "latent_reasoning_head.safetensors"


def test_empty_boolean_is_malformed_and_empty_env_is_the_default():
    """An empty ``x-latent-thinking:`` header used to turn thinking off silently; docs/server.md
    lists 1/0, true/false, yes/no, on/off only."""
    with pytest.raises(ValueError, match="x-latent-thinking"):
        parse_bool("x-latent-thinking", "")
    assert parse_bool("h", " ON ") is True and parse_bool("h", "No") is False
    d = head_defaults({"LATENTSERVE_USE_STOP": "", "LATENTSERVE_MAX_LATENT": " "})
    assert d["use_stop"] is True and d["max_latent"] == 256


def test_stats_report_min_output_tokens():
    defaults = head_defaults({})
    hs = resolve_settings(SamplingParams(min_output_tokens=7), defaults, "closed_loop", True)
    assert hs.stats()["min_output_tokens"] == 7
    hs = resolve_settings(SamplingParams(), defaults, "closed_loop", True)
    assert hs.stats()["min_output_tokens"] == 4096


def test_engine_stats_and_tokens_match_reference(tmp_path, smollm2_dir):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from tests.support.head_models import save_head_model
    from tests.support.head_reference import head_reference_generate
    from tests.support.tp_parity import run_requests

    d = save_head_model(tmp_path / "m", source_layer=1, stop_bias=0.3)
    engine = LLMEngine(EngineConfig(model=str(d), max_model_len=256))
    prompt = list(range(20, 30))
    c = {"max_latent": 5, "min_latent": 1, "use_stop": True, "stop_threshold": 0.55}
    [(toks, _, final)] = run_requests(engine, [(prompt, SamplingParams(
        max_tokens=12, temperature=0.0, min_output_tokens=0, **c))])
    spec = engine.latent_spec
    ref = head_reference_generate(d, d / "latent_reasoning_head.safetensors", prompt,
                                  spec.start_ids, spec.end_ids, max_tokens=12,
                                  eos_ids=engine.eos_ids, **c)
    st = final.latent_stats
    assert toks == ref["tokens"]
    assert (st["steps"], st["stop_step"], st["end"]) == (ref["steps"], ref["stop_step"], ref["end"])
    assert st["max_stop_prob"] == pytest.approx(ref["max_stop_prob"], abs=1e-5)
    assert st["min_output_tokens"] == 0 and st["max_latent"] == 5
    assert engine.stats()["kv_slots_free"] + engine.stats()["kv_slots_cached"] \
        == engine.stats()["kv_slots_total"]


def test_latent_head_for_a_model_with_its_own_latents_is_refused(tmp_path, smollm2_dir):
    """--latent-head on a COCONUT or Huginn directory is refused (it was silently ignored)."""
    from latentserve.bench.baseline.latent_models import save_latent_tiny
    from latentserve.bench.baseline.recurrent_models import write_huginn
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    head = tmp_path / "head.pt"  # a path that does not exist fails earlier, in EngineConfig
    head.write_bytes(b"")
    for path in (save_latent_tiny(tmp_path / "c", "coconut-gpt2"), write_huginn(tmp_path / "h")):
        with pytest.raises(ValueError, match="latent_head.*needs a plain backbone"):
            LLMEngine(EngineConfig(model=str(path), latent_head=str(head)))
