"""Regression (found trying issue 26): ``latentserve convert pccot`` reads only ``r`` and
``lora_alpha`` from the adapter's ``adapter_config.json``. A PEFT ``alpha_pattern`` (PEFT
scales each matching module with its own alpha, as ``models.lora`` does for plain adapter
directories) was dropped: the conversion exited 0 and the served tokens differed from the
PEFT model's. The converter must either merge with the pattern or refuse naming the field,
before writing ``--out``."""

import json
import shutil

import pytest
import torch

from latentserve.bench.baseline.loop_reference import load_pccot_reference
from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine
from latentserve.latent.loop_convert import convert_pccot
from tests.support.loop_reference import reference_generate_loop
from tests.support.parity import run_budget_batch, shared_prefix_prompts


def test_alpha_pattern_is_merged_or_refused(tmp_path, smollm2_dir):
    pytest.importorskip("peft")
    from latentserve.bench.baseline.loop_models import write_upstream_pccot

    base, adapter = write_upstream_pccot(tmp_path, "gpt2", block_size=3, iterations=2)
    patterned = tmp_path / "patterned"
    shutil.copytree(adapter, patterned)
    path = patterned / "adapter_config.json"
    cfg = json.loads(path.read_text())
    path.write_text(json.dumps({**cfg, "alpha_pattern": {"c_fc": 8 * cfg["lora_alpha"]}}))
    out = tmp_path / "model"
    try:
        convert_pccot(base, patterned, out)
    except ValueError as e:  # refusing is fine, if it names the field and writes nothing
        assert "alpha_pattern" in str(e)
        assert not out.exists()
        return
    ref = load_pccot_reference(str(base), str(patterned))  # PEFT applies the pattern
    reqs = [(p, 1) for p in shared_prefix_prompts()[:2]]
    expected = [reference_generate_loop(ref, p, b, 4) for p, b in reqs]
    engine = LLMEngine(EngineConfig(model=str(out), device="cpu", dtype="float32"))
    for (ans, logits, _), (ref_ans, ref_logits) in zip(run_budget_batch(engine, reqs, 4),
                                                       expected):
        assert ans == ref_ans
        torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("edit, match", [
    (lambda d: (d / "adapter_config.json").write_text("{bad json"),
     r"adapter_config.json is not valid JSON"),
    (lambda d: _set(d / "adapter_config.json", use_dora=True), "use_dora"),
    (lambda d: _set(d / "config.json", num_iterations="abc"), "num_iterations"),
    (lambda d: _set(d / "config.json", model_type="pccot-llama"),
     "is a 'gpt2' model but the adapter is 'pccot-llama'"),
])
def test_bad_adapter_directories_are_refused_naming_the_field(tmp_path, smollm2_dir, edit,
                                                              match):
    """Refused before anything is written, naming the file or field (a fresh user's
    findings: these gave a bare JSON error, an int() error, or a trainable-token error)."""
    from latentserve.bench.baseline.loop_models import write_upstream_pccot

    base, adapter = write_upstream_pccot(tmp_path, "gpt2", block_size=3, iterations=2)
    edit(adapter)
    with pytest.raises(ValueError, match=match):
        convert_pccot(base, adapter, tmp_path / "model")
    assert not (tmp_path / "model").exists()


def _set(path, **fields):
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))
