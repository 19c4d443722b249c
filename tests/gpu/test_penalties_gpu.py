"""Penalties on CUDA: the Triton kernels (``ops.kernels.penalties``) against the torch path
(counts exact; penalized logits within float32 rounding), and an overlapped engine equal to a
synchronous one on a tiny Llama (greedy rows with penalties beside plain rows and rows with
logprobs: equal tokens, logprobs within 1e-4), the overlapped one counting each pending token on the
device."""

import pytest
import torch

from latentserve.bench.baseline.tiny_models import save_tiny
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.penalties import penalize_reference
from latentserve.sampling_params import SamplingParams

DEVICE = "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_kernels_equal_the_torch_path_on_cuda():
    from latentserve.ops.kernels.penalties import count_tokens, penalize

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, vocab = 64, 49152
    counts = torch.randint(0, 3, (rows, vocab), generator=g, dtype=torch.int32, device="cuda")
    want = counts.clone()
    tokens = torch.randint(0, vocab, (64,), generator=g, device="cuda")
    base = torch.randint(0, rows, (500,), generator=g, device="cuda") * vocab
    vals = torch.where(torch.rand(500, generator=g, device="cuda") < 0.5,
                       torch.randint(0, vocab, (500,), generator=g, device="cuda"),
                       -1 - torch.randint(0, 64, (500,), generator=g, device="cuda"))
    count_tokens(counts, torch.cat([base, vals]), tokens)
    ids = torch.where(vals >= 0, vals, tokens[(-1 - vals).clamp(min=0)])
    want.view(-1).index_put_((base + ids,), torch.ones(500, dtype=torch.int32, device="cuda"),
                             accumulate=True)
    assert torch.equal(counts, want)
    prompt = torch.rand(rows, vocab, generator=g, device="cuda") < 0.01
    logits = torch.randn(rows, vocab, generator=g, device="cuda") * 5
    r = torch.randperm(rows, device="cuda")
    r[::7] = -1
    params = torch.cat([torch.rand(rows, device="cuda") + 0.5, torch.rand(rows, device="cuda"),
                        torch.rand(rows, device="cuda") - 0.5]).double()
    got = penalize(logits, counts, prompt, r, params)
    torch.testing.assert_close(got, penalize_reference(logits, counts, prompt, r, params))
    assert torch.equal(got[::7], logits[::7])


def _run(engine: LLMEngine) -> dict:
    for i in range(12):
        fields = {} if i % 4 == 3 else {"presence_penalty": 0.7, "frequency_penalty": 0.4,
                                        "repetition_penalty": (1.0, 1.3)[i % 2]}
        engine.add_request(f"r{i}", [5 + (i * 3 + k) % 50 for k in range(6 + i)],
                           SamplingParams(max_tokens=24 + i, temperature=0.0, ignore_eos=True,
                                          logprobs=(None, 2)[i % 2], **fields))
    out: dict = {}
    steps = overlapped = 0
    while engine.has_unfinished_requests():
        for o in engine.step():
            tok, lps = out.setdefault(o.rid, ([], []))
            tok += o.new_token_ids
            lps += [(lp.logprob, lp.top) for lp in o.logprobs or []]
        steps += 1
        overlapped += engine.inflight is not None
    return out, overlapped / steps


def test_overlapped_penalties_equal_the_synchronous_engine(tmp_path):
    path = save_tiny(tmp_path / "llama", "llama", word_tokenizer=True)
    runs = []
    for on in (True, False):
        engine = LLMEngine(EngineConfig(model=str(path), device=DEVICE, dtype="float32",
                                        kv_slots=4096, max_model_len=256,
                                        overlap_schedule=on))
        runs.append(_run(engine))
        assert not engine.penalties  # every row given back
    (over, share), (sync, none) = runs
    assert share > 0.8 and none == 0
    assert {r: t for r, (t, _) in over.items()} == {r: t for r, (t, _) in sync.items()}
    for rid, (_, lps) in over.items():  # raw logprobs: batches of other shapes, 1e-4
        for (lp, top), (lp2, top2) in zip(lps, sync[rid][1], strict=True):
            assert lp == pytest.approx(lp2, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in top2]
