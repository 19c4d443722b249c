"""``ops.kernels.small_linear`` (the compression head's float32 Linear + SiLU kernel) and
the head's fused serve path, on CPU through the Triton interpreter (``tl.dot`` is then an
IEEE float32 product). The 3xTF32 tensor-core run at the Llama-1B head's size is in
``tests/gpu/test_latent_graphs.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch
import torch.nn.functional as F

from latentserve.latent.bundle import random_bundle
from latentserve.ops.kernels.small_linear import small_linear
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


@pytest.mark.parametrize("m,k,n", [(1, 64, 32), (5, 40, 24), (64, 96, 16), (70, 128, 33)])
@pytest.mark.parametrize("bias,act", [(True, "silu"), (True, None), (False, None)])
def test_small_linear_matches_torch(m, k, n, bias, act):
    """Odd M, K and N (masked tiles), M above one 64-row tile, with and without bias/SiLU."""
    g = torch.Generator().manual_seed(m * 1000 + k + n)
    x = torch.randn(m, k, generator=g)
    w = torch.randn(n, k, generator=g) / k**0.5
    b = torch.randn(n, generator=g) if bias else None
    ref = F.linear(x, w, b)
    if act:
        ref = F.silu(ref)
    torch.testing.assert_close(small_linear(x, w, b, act), ref, rtol=1e-5, atol=1e-6)


def test_small_linear_out_features_and_empty():
    """``out_features`` computes the first rows of the weight only; zero rows work."""
    x, w, b = torch.randn(3, 32), torch.randn(40, 32), torch.randn(40)
    y = small_linear(x, w, b, out_features=16)
    assert y.shape == (3, 16)
    torch.testing.assert_close(y, F.linear(x, w, b)[:, :16], rtol=1e-5, atol=1e-6)
    assert small_linear(torch.empty(0, 32), w).shape == (0, 40)


@pytest.mark.parametrize("bad,match", [
    ({"x": torch.randn(2, 8, dtype=torch.float64)}, "float32"),
    ({"x": torch.randn(2, 9)}, "share K"),
    ({"x": torch.randn(8, 2).t()}, "contiguous"),
    ({"activation": "gelu"}, "activation"),
    ({"out_features": 0}, "out_features"),
    ({"out_features": 5}, "out_features"),
    ({"bias": torch.randn(3)}, "bias"),
    ({"precision": "fp64"}, "precision"),  # was a Triton assertion from inside the kernel
    ({"out_features": True}, "out_features"),  # was read as 1, then a Triton type error
    ({"out_features": 2.0}, "out_features"),  # was a TypeError from torch.empty
    ({"weight": torch.randn(4, 8, device="meta")}, "device"),  # was an error from the launch
    ({"bias": torch.randn(4, device="meta")}, "device"),
])
def test_small_linear_refuses_bad_arguments(bad, match):
    args = {"x": torch.randn(2, 8), "weight": torch.randn(4, 8), "bias": None, "activation": None,
                "out_features": None, "precision": "tf32x3"}
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        small_linear(**args)


@pytest.mark.parametrize("stop", [True, False])
def test_fused_serve_outputs_match_the_modules(stop):
    """The head's fused serve path (the CUDA default) equals ``latent_input`` and
    ``stop_prob`` within float32 rounding, for a bf16 anchor as the graphs capture it."""
    head = random_bundle(64, 16, 40, seed=3, stop_bias=0.2).build()
    if not stop:
        head.reasoning_head.stop_head = None
    x = torch.randn(7, 64, dtype=torch.bfloat16)
    vecs, probs = head.serve_outputs(x, fused=True)
    torch.testing.assert_close(vecs, head.latent_input(x), rtol=1e-5, atol=1e-6)
    if stop:
        torch.testing.assert_close(probs, head.stop_prob(x), rtol=1e-5, atol=1e-6)
    else:
        assert probs is None


def test_autotuned_launch_runs_each_config_and_keeps_the_fastest(monkeypatch):
    """The CUDA path's autotuner (forced on here, with a stand-in timer) launches every
    configuration with its own grid, keeps one per (N, K, row tile), and every configuration
    computes the same product."""
    from latentserve.ops.kernels import small_linear as sl

    timed = []

    def fake_bench(kernel_call, quantiles):
        kernel_call()
        timed.append(len(timed))
        return [float(len(timed) % 4 + 1)] * len(quantiles)  # a stand-in time per config

    monkeypatch.setattr(sl._tuned_kernel, "_do_bench", fake_bench)
    monkeypatch.setattr(sl._tuned_kernel, "cache", {})
    x, w, b = torch.randn(20, 96), torch.randn(70, 96) / 10, torch.randn(70)
    ref = F.silu(F.linear(x, w, b))
    torch.testing.assert_close(small_linear(x, w, b, "silu", tuned=True), ref,
                               rtol=1e-5, atol=1e-6)
    assert len(timed) == len(sl._TUNE_CONFIGS)
    torch.testing.assert_close(small_linear(x, w, b, "silu", tuned=True), ref,
                               rtol=1e-5, atol=1e-6)
    assert len(timed) == len(sl._TUNE_CONFIGS) and len(sl._tuned_kernel.cache) == 1
