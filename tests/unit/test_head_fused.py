"""The compression head's fused serve path (``LatentHead.serve_outputs(fused=True)``: each
float32 Linear + SiLU as one ``ops.kernels.decode_linear`` launch, 3xTF32 on CUDA) against
its modules, on CPU through the Triton interpreter (``tl.dot`` is then an IEEE float32
product). The 3xTF32 run at the Llama-1B head's size is in ``tests/gpu/test_latent_graphs.py``."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton or the kernels

import pytest

pytest.importorskip("triton")

import torch

from latentserve.latent.bundle import random_bundle
from latentserve.latent.head import fp32_tiling
from tests.support.triton_interpreter import patch_triton_interpreter

patch_triton_interpreter()


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


def test_fused_serve_outputs_split_k_where_the_tiling_splits():
    """A head wide enough for ``fp32_tiling`` to split K (hidden 512: the first Linear's
    K splits in two) gives the modules' outputs too."""
    assert fp32_tiling(9, 512, 256)[1] > 1
    head = random_bundle(512, 32, 256, seed=4, stop_bias=0.1).build()
    x = torch.randn(9, 512, dtype=torch.bfloat16)
    vecs, probs = head.serve_outputs(x, fused=True)
    torch.testing.assert_close(vecs, head.latent_input(x), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(probs, head.stop_prob(x), rtol=1e-5, atol=1e-6)


def test_fp32_tiling_matches_the_h100_sweep():
    """The rule gives the fastest split of ``benchmarks.head_tiling``'s H100 sweep for each
    Linear of the Llama-1B head at 64 rows (docs/bench/head_tiling_h100_s29.json)."""
    best = {(1024, 2048): 8, (1024, 1024): 4, (512, 1024): 8, (1024, 512): 4, (2048, 1024): 4,
            (512, 2048): 8}
    for (n, k), split in best.items():
        assert fp32_tiling(64, k, n) == (32, split), (n, k)
