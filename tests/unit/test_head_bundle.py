"""Compression-head modules and bundles (latent/head.py, latent/bundle.py): shapes, clamp,
write -> read round trips in both formats, every validation error, the weights_only refusal,
the answer-budget floor and the per-request controls."""

import json
import re

import pytest
import torch

from latentserve.latent.bundle import HeadBundle, random_bundle, read_bundle, validate, write_bundle
from latentserve.latent.head import (
    CompressionHead,
    HeadConfig,
    LatentHead,
    apply_output_floor,
    head_defaults,
    resolve_settings,
)
from latentserve.sampling_params import SamplingParams


def test_modules_shapes_names_and_clamp():
    cfg = HeadConfig(hidden_size=64, latent_dim=16, mlp_dim=40, source_layer=1)
    head = LatentHead(cfg, has_stop_head=True, has_target_proj=True)
    names = set(head.state_dict())
    assert {"reasoning_head.net.0.weight", "reasoning_head.net.4.bias",
            "reasoning_head.stop_head.0.weight", "reasoning_head.stop_head.2.bias",
            "decoder.net.0.weight", "decoder.net.4.weight", "target_proj.weight"} <= names
    assert "target_proj.bias" not in names
    assert head.reasoning_head.net[4].out_features == 32
    assert head.reasoning_head.stop_head[0].out_features == 20  # mlp_dim // 2
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    assert head.latent_input(x).shape == (3, 64) and head.latent_input(x).dtype == torch.float32
    assert head.stop_prob(x).shape == (3,)
    h = CompressionHead(64, 16)
    with torch.no_grad():
        h.net[4].bias.fill_(100.0)
        mu, log_sigma = h(torch.randn(2, 64))
    assert mu.shape == (2, 16) and float(log_sigma.max()) == 2.0
    with pytest.raises(ValueError, match="last dim"):
        h(torch.randn(2, 63))


@pytest.mark.parametrize("stop", [True, False])
def test_serve_outputs_equal_latent_input_and_stop_prob(stop):
    """The serve path (one LayerNorm of the anchor, no log_sigma) gives exactly the values
    of ``latent_input`` and ``stop_prob``."""
    head = random_bundle(64, 16, 40, seed=3, stop_bias=0.2).build()
    if not stop:
        head.reasoning_head.stop_head = None
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    vecs, probs = head.serve_outputs(x)  # CPU: the torch modules
    assert torch.equal(vecs, head.latent_input(x))
    if stop:
        assert torch.equal(probs, head.stop_prob(x))
    else:
        assert probs is None


def test_latent_steps_run_the_head_only_for_rows_in_their_latent_phase():
    """A callable ``precomputed`` (the decode graph's latent outputs) is called only when some
    row still thinks; then its values are used."""
    from types import SimpleNamespace

    from latentserve.latent.head_late import candidates, step_now
    from latentserve.staging import DeviceToHost

    head = random_bundle(64, 16, 40, seed=1).build()
    calls = []

    def pre():
        calls.append(1)
        return torch.full((2, 64), 7.0), torch.tensor([0.1, 0.2])

    def steps(reqs):
        out = candidates(head, None, reqs, None, torch.randn(2, 64), pre, DeviceToHost())
        return out and [step_now(r, c, 0, head.stop_token) for r, c in zip(reqs, out)]

    settings = dict(mode="closed_loop", steps=0, use_stop=True, min_latent=0, max_latent=4,
                    stop_threshold=0.5, max_stop_prob=None, end=None, stop_step=None,
                    actions=None, latent_temperature=0.0)

    def req(answer_start):
        return SimpleNamespace(state=SimpleNamespace(**settings), answer_start=answer_start,
                               params=SimpleNamespace(return_latent_trace=False))

    answering = [req(3) for _ in range(2)]
    assert steps(answering) is None and not calls
    thinking = [req(None) for _ in range(2)]
    out = steps(thinking)
    assert calls == [1]
    assert [r for _, r in out] == [0, 1] and torch.equal(out[0][0], torch.full((2, 64), 7.0))
    assert [r.state.max_stop_prob for r in thinking] == pytest.approx([0.1, 0.2])


@pytest.mark.parametrize("suffix", [".safetensors", ".pt"])
def test_write_read_round_trip(tmp_path, suffix):
    b = random_bundle(64, 16, source_layer=2, injection="prompt", think_open=" think",
                      think_close=" done")
    back = read_bundle(write_bundle(b, tmp_path / f"h{suffix}"))
    assert back.format_version == b.format_version and back.config == b.config
    for part in ("reasoning_head", "decoder", "target_proj"):
        a, c = getattr(b, part), getattr(back, part)
        assert a.keys() == c.keys()
        for k in a:
            torch.testing.assert_close(a[k], c[k], atol=0, rtol=0)
    x = torch.randn(4, 64)
    torch.testing.assert_close(b.build().latent_input(x), back.build().latent_input(x))


def test_safetensors_metadata_layout(tmp_path):
    from safetensors import safe_open

    p = write_bundle(random_bundle(64, 16), tmp_path / "h.safetensors")
    with safe_open(str(p), framework="pt") as f:
        meta, keys = f.metadata(), list(f.keys())
    assert meta["format_version"] == "3"
    cfg = json.loads(meta["config"])
    for k in ("hidden_size", "latent_dim", "mlp_dim", "source_layer", "target_layer",
              "compression_factor", "arch", "injection"):
        assert k in cfg
    assert json.loads(meta["subdicts"]) == ["reasoning_head", "decoder", "target_proj"]
    assert any(k.startswith("reasoning_head.stop_head.") for k in keys)


def _bundle(**kw):
    return random_bundle(64, 16, **kw)


def test_format_3_needs_stop_head():
    b = _bundle()
    b.reasoning_head = {k: v for k, v in b.reasoning_head.items() if "stop_head" not in k}
    with pytest.raises(ValueError, match="no stop head"):
        validate(b)
    b.format_version = 2  # a format-2 bundle has none: it loads, and never stops early
    head = b.build()
    assert not head.has_stop and head.stop_prob(torch.randn(1, 64)) is None
    s = resolve_settings(SamplingParams(use_stop=True), head_defaults({}), "closed_loop",
                         head.has_stop)
    assert s.use_stop is False


def test_unexpected_head_key_is_named():
    b = _bundle()
    b.reasoning_head["bank_proj.weight"] = torch.zeros(2, 2)
    with pytest.raises(ValueError, match="reasoning_head.bank_proj.weight"):
        validate(b)


def test_other_validation_errors(tmp_path):
    b = _bundle()
    b.decoder["net.4.weight"] = torch.zeros(63, 32)
    with pytest.raises(ValueError, match="decoder.net.4.weight has shape"):
        validate(b)
    b = _bundle()
    del b.decoder["net.2.bias"]
    with pytest.raises(ValueError, match="missing tensor decoder.net.2.bias"):
        validate(b)
    b = _bundle()
    b.config = HeadConfig(**{**b.config.to_dict(), "arch": "v2", "bank_m": 4})
    with pytest.raises(ValueError, match="arch 'v2' is not supported"):
        validate(b)
    with pytest.raises(ValueError, match="'hidden_size' is required"):
        HeadConfig.from_dict({"latent_dim": 3})
    with pytest.raises(ValueError, match="'injection'"):
        HeadConfig.from_dict({"hidden_size": 4, "latent_dim": 2, "injection": "sideways"})
    from safetensors.torch import save_file

    save_file({"reasoning_head.net.0.weight": torch.zeros(2, 2)}, str(tmp_path / "n.safetensors"))
    with pytest.raises(ValueError, match="no 'config'"):
        read_bundle(tmp_path / "n.safetensors")
    save_file({"other.w": torch.zeros(2)}, str(tmp_path / "o.safetensors"),
              metadata={"config": json.dumps({"hidden_size": 64, "latent_dim": 16})})
    with pytest.raises(ValueError, match="unexpected tensor prefix 'other'"):
        read_bundle(tmp_path / "o.safetensors")
    with pytest.raises(FileNotFoundError):
        read_bundle(tmp_path / "missing.safetensors")


class Evil:  # any object that needs unpickling
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_pt_with_pickled_object_is_refused(tmp_path):
    b = _bundle()
    d = {"format_version": 3, "config": b.config.to_dict(), "reasoning_head": b.reasoning_head,
         "decoder": b.decoder, "target_proj": None, "extra": Evil()}
    torch.save(d, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="refused"):
        read_bundle(tmp_path / "evil.pt")


@pytest.mark.parametrize("name,words", [("notes.txt", "got .txt"),
                                        ("bundle", "got a name without a suffix")])
def test_a_file_of_another_kind_is_refused_by_its_name(tmp_path, name, words):
    (tmp_path / name).write_text("not a bundle\n")
    with pytest.raises(ValueError, match=f"a head bundle is a .safetensors or .pt file, {words}"):
        read_bundle(tmp_path / name)


def test_legacy_bare_head_state_dict(tmp_path):
    b = _bundle()
    torch.save(b.reasoning_head, tmp_path / "legacy.pt")
    back = read_bundle(tmp_path / "legacy.pt")
    assert back.config.hidden_size == 64 and back.config.latent_dim == 16
    assert back.decoder is None and back.has_stop_head  # not injectable


def test_output_floor_arithmetic():
    assert apply_output_floor(1000, 4096, 256) == 4352
    assert apply_output_floor(9000, 4096, 256) == 9000
    assert apply_output_floor(1000, 0, 256) == 1000  # floor 0 disables
    assert apply_output_floor(4352, 4096, 256) == 4352
    assert apply_output_floor(10, 100, 0) == 100


def test_env_defaults_and_request_controls():
    d = head_defaults({})
    assert d == {"max_latent": 256, "min_latent": 4, "use_stop": True, "stop_threshold": 0.5,
                 "min_output_tokens": 4096}
    d = head_defaults({"LATENTSERVE_MAX_LATENT": "32", "LATENTSERVE_USE_STOP": "off",
                       "LATENTSERVE_STOP_THRESHOLD": "0.9"})
    assert d["max_latent"] == 32 and d["use_stop"] is False and d["stop_threshold"] == 0.9
    with pytest.raises(ValueError, match="LATENTSERVE_MIN_LATENT"):
        head_defaults({"LATENTSERVE_MIN_LATENT": "four"})
    with pytest.raises(ValueError, match="stop_threshold"):
        head_defaults({"LATENTSERVE_STOP_THRESHOLD": "2"})
    s = resolve_settings(SamplingParams(max_latent=7, stop_threshold=0.25), d, "closed_loop",
                         True)
    assert (s.max_latent, s.min_latent, s.use_stop, s.stop_threshold, s.thinking) == \
        (7, 4, False, 0.25, True)
    assert resolve_settings(SamplingParams(latent_budget=0), d, "prompt", True).thinking is False
    assert resolve_settings(SamplingParams(latent_budget=9), d, "prompt", True).max_latent == 9


def test_a_floor_above_the_cap_is_refused_naming_what_set_the_cap():
    """A ``min_latent`` the request sent above the cap (its own, or the model's default, or a
    ``thinking_token_budget``) is a ValueError naming both; the server's default floor yields
    to a request's lower cap; with thinking off, or a cap of 0, the floor is moot."""
    d = {"max_latent": 32, "min_latent": 4, "use_stop": True, "stop_threshold": 0.5,
         "min_output_tokens": 0}
    for params, words in ((SamplingParams(min_latent=40), "this model's max_latent (32)"),
                          (SamplingParams(min_latent=9, latent_budget=8), "latent_budget (8)"),
                          (SamplingParams(min_latent=9, thinking_token_budget=5),
                           "thinking_token_budget (5)")):
        with pytest.raises(ValueError, match=re.escape(f"min_latent must be at most {words}")):
            resolve_settings(params, d, "closed_loop", True)
    assert resolve_settings(SamplingParams(max_latent=2), d, "closed_loop", True).min_latent == 2
    for moot in (SamplingParams(min_latent=40, thinking=False), SamplingParams(
            min_latent=40, max_latent=0)):
        assert resolve_settings(moot, d, "closed_loop", True).min_latent == 40


@pytest.mark.parametrize("field,value", [("max_latent", -1), ("min_latent", 1.5),
                                         ("stop_threshold", 1.5), ("use_stop", 1),
                                         ("thinking", "yes"), ("min_output_tokens", -3)])
def test_sampling_params_validation_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bundle_dataclass_build_is_fp32_eval():
    head = _bundle(scale=0.5).build()
    assert all(p.dtype == torch.float32 and not p.requires_grad for p in head.parameters())
    assert not head.training
    assert isinstance(_bundle(), HeadBundle)


def test_pt_with_an_unexpected_part_or_version_is_refused(tmp_path):
    """A ``.pt`` bundle's dict is checked like a ``.safetensors`` one: an unexpected
    top-level key (a ``.safetensors`` file refuses an unexpected tensor prefix) and a
    ``format_version`` that is not an integer (``True``, ``3.7``) are errors naming them,
    not silently dropped or truncated."""
    b = _bundle()
    d = {"format_version": 3, "config": b.config.to_dict(), "reasoning_head": b.reasoning_head,
         "decoder": b.decoder, "target_proj": b.target_proj}
    torch.save({**d, "stop_head": {"w": torch.zeros(2)}}, tmp_path / "extra.pt")
    with pytest.raises(ValueError, match="unexpected key 'stop_head'"):
        read_bundle(tmp_path / "extra.pt")
    for bad in (True, 3.7, "3.0"):
        torch.save({**d, "format_version": bad}, tmp_path / "fv.pt")
        with pytest.raises(ValueError, match="format_version must be an integer"):
            read_bundle(tmp_path / "fv.pt")
    for good in (3, "3", 3.0):
        torch.save({**d, "format_version": good}, tmp_path / "fv.pt")
        assert read_bundle(tmp_path / "fv.pt").format_version == 3
