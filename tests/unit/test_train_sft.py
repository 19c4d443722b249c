"""Compression-head SFT (train/traces.py, train/features.py, train/sft.py) on a tiny random
Llama: traces from GSM8K-format rows, anchors at the positions the closed loop uses, the
features equal HF hidden states of each trace run alone, a short run lowers every loss
term and writes a bundle that validates, carries its config and serves in the engine with
the same answer as the eager reference."""

import json

import pytest
import torch
import torch.nn.functional as F

from latentserve.eval.datasets import parse_file
from latentserve.train.features import anchor_positions, capture
from latentserve.train.traces import build_traces, reasoning_text


def _rows(n=12):
    """GSM8K-format rows (``<<expr=value>>`` steps, ``#### N``), made up."""
    rows = []
    for i in range(n):
        a, b, c = 3 + i, 5 + 2 * i, 2 + i % 4
        s, p = a + b, (a + b) * c
        rows.append({"question": f"Tom has {a} apples and buys {b} more. He packs them into "
                                 f"{c} crates each holding that many. How many apples?",
                     "answer": f"Tom has {a}+{b} = <<{a}+{b}={s}>>{s} apples.\n"
                               f"In total {s}*{c} = <<{s}*{c}={p}>>{p} apples.\n#### {p}"})
    return rows


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    from latentserve.bench.baseline.tiny_models import save_tiny

    return save_tiny(tmp_path_factory.mktemp("sft") / "m", "llama", num_hidden_layers=3)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "train.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return p


def test_reasoning_text_strips_or_keeps_only_calculator_annotations():
    ans = "She has 2+3 = <<2+3=5>>5 cats.\nThen 5*2 = <<5*2=10>>10.\n#### 10"
    assert reasoning_text(ans) == "She has 2+3 = 5 cats.\nThen 5*2 = 10."
    assert reasoning_text(ans, "equations") == "<<2+3=5>> <<5*2=10>>"
    with pytest.raises(ValueError, match="style"):
        reasoning_text(ans, "other")


def test_anchor_positions_follow_groups_of_the_compression_factor():
    # prompt of 5 tokens (last at 4), 10 reasoning tokens at 5..14 in groups [5-8] [9-12]
    # [13-14]: anchors = last prompt token, end of group 0, end of group 1, last reasoning.
    assert anchor_positions(5, 10, 4) == [4, 8, 12, 14]
    assert anchor_positions(3, 4, 4) == [2, 6]
    assert anchor_positions(3, 1, 1) == [2, 3]


def test_features_equal_hidden_states_of_each_trace_run_alone(tiny_dir, smollm2_tokenizer,
                                                              data_file):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()
    traces = build_traces(smollm2_tokenizer, parse_file(data_file, "jsonl", "number", 3))
    c, src, tgt = 3, 1, 2
    feats = capture(model, traces, src, tgt, c, batch_size=3, progress=False)  # padded
    row = 0
    for tr in traces:
        ids = torch.tensor([tr.prompt + tr.reasoning])
        with torch.no_grad():
            hs = model(input_ids=ids, output_hidden_states=True).hidden_states
        pos = anchor_positions(len(tr.prompt), len(tr.reasoning), c)
        g = len(pos) - 1
        torch.testing.assert_close(feats.anchor[row:row + g + 1], hs[src + 1][0, pos],
                                   atol=1e-4, rtol=1e-4)
        p = len(tr.prompt)
        last_group = hs[tgt + 1][0, p + (g - 1) * c: p + len(tr.reasoning)]
        torch.testing.assert_close(feats.target[row + g - 1],
                                   F.layer_norm(last_group, (last_group.shape[-1],)).mean(0),
                                   atol=1e-4, rtol=1e-4)
        assert feats.stop[row:row + g + 1].tolist() == [0.0] * g + [1.0]
        assert feats.has_target[row:row + g + 1].tolist() == [True] * g + [False]
        row += g + 1
    assert row == len(feats.stop)


def test_sft_cli_lowers_the_loss_and_writes_a_bundle_that_serves(tiny_dir, data_file, tmp_path):
    from latentserve.cli import main
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.latent.bundle import read_bundle
    from latentserve.sampling_params import SamplingParams
    from tests.support.head_reference import head_reference_generate

    out = tmp_path / "head.safetensors"
    rc = main(["train-head", "sft", "--model", str(tiny_dir), "--data", str(data_file),
               "--steps", "40", "--batch-size", "64", "--latent-dim", "16",
               "--source-layer", "1", "--compression-factor", "3", "--lr", "3e-3",
               "--no-progress", "--out", str(out)])
    assert rc == 0
    log = json.loads((tmp_path / "head.safetensors.log.json").read_text())
    before, after = log["loss_before"], log["loss_after"]
    for term in ("loss", "soft_mse", "recon", "stop"):
        assert after[term] < before[term], (term, before[term], after[term])
    assert log["traces"] == 12
    # the rate each logged step ran at: 2 warmup steps (5% of 40) from 1/2 of --lr, then linear
    lrs = {row["step"]: row["lr"] for row in log["history"]}
    assert [lrs[0], lrs[10], lrs[39]] == pytest.approx([1.5e-3, 3e-3 * 30 / 38, 3e-3 / 38])

    b = read_bundle(out)
    assert b.has_stop_head and b.target_proj is not None and b.decoder is not None
    cfg = b.config
    assert (cfg.source_layer, cfg.target_layer, cfg.compression_factor, cfg.latent_dim) == \
        (1, 2, 3, 16)  # target default: the last of the 3 layers

    engine = LLMEngine(EngineConfig(model=str(tiny_dir), latent_head=str(out)))
    prompt = engine.tokenizer.encode("What is 2 + 3?")
    controls = {"max_latent": 4, "min_latent": 1, "use_stop": True, "stop_threshold": 0.5}
    engine.add_request("r", prompt, SamplingParams(max_tokens=12, temperature=0.0,
                                                   min_output_tokens=0, **controls))
    toks, stats = [], None
    while engine.has_unfinished_requests():
        for o in engine.step():
            toks += o.new_token_ids
            stats = o.latent_stats if o.finished else stats
    spec = engine.latent_spec
    ref = head_reference_generate(tiny_dir, out, prompt, spec.start_ids, spec.end_ids,
                                  max_tokens=12, eos_ids=engine.eos_ids, **controls)
    assert toks == ref["tokens"]
    assert (stats["steps"], stats["end"]) == (ref["steps"], ref["end"])


def test_a_non_finite_loss_stops_sft_naming_the_step_and_writes_no_bundle(
        tiny_dir, data_file, tmp_path, monkeypatch, capsys):
    """The loss turns NaN at step 2 (0-based, as logged) of 5, logged every 10: the run
    stops at the last step naming step 2, with no bundle or log written."""
    import latentserve.train.sft as sft
    from latentserve.cli import main

    real, calls = sft.sft_losses, []

    def nan_at_step_2(*args):  # call 0 is the loss before training
        terms = real(*args)
        calls.append(1)
        return {**terms, "loss": terms["loss"] * float("nan")} if len(calls) == 4 else terms

    monkeypatch.setattr(sft, "sft_losses", nan_at_step_2)
    out = tmp_path / "head.safetensors"
    rc = main(["train-head", "sft", "--model", str(tiny_dir), "--data", str(data_file),
               "--steps", "5", "--batch-size", "8", "--latent-dim", "8", "--no-progress",
               "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and "the training loss is NaN or inf at step 2" in err, err
    assert list(tmp_path.iterdir()) == []


def test_an_out_that_is_a_directory_is_refused_before_loading(data_file, tmp_path, capsys,
                                                              monkeypatch):
    """``--out d.safetensors`` naming a directory failed with a SafetensorError after
    training; now an error naming ``--out`` comes before the backbone loads."""
    import latentserve.train.sft as sft
    from latentserve.cli import main

    monkeypatch.setattr(sft, "load_backbone", lambda *a: pytest.fail("loaded before --out"))
    out = tmp_path / "d.safetensors"
    out.mkdir()
    rc = main(["train-head", "sft", "--data", str(data_file), "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2 and f"error: --out {out} is an existing directory, but it names a bundle " \
        "file" in err, err


def test_sft_config_rejects_bad_options():
    from latentserve.train.sft import SFTConfig

    with pytest.raises(ValueError, match="steps"):
        SFTConfig(out="h.safetensors", steps=0)
    with pytest.raises(ValueError, match="out"):
        SFTConfig(out="h.bin")
    with pytest.raises(ValueError, match="beta"):
        SFTConfig(out="h.pt", beta=-1.0)


@pytest.mark.parametrize("field", ["think_open", "think_close"])
def test_sft_config_rejects_an_empty_thinking_text(field):
    """An empty --think-open/--think-close trains on traces without that span, but the
    bundle's empty text makes serving look for a ``<think>``/``</think>`` token instead
    (SmolLM2 has none: the bundle could not be served at all)."""
    from latentserve.train.sft import SFTConfig

    with pytest.raises(ValueError, match=field):
        SFTConfig(out="h.safetensors", **{field: ""})
