"""A compression head on a CoLaR-format reasoning backbone (a PEFT LoRA adapter directory),
trained with SFT then DAgger (train/sft.py, train/dagger.py) on a tiny random Llama: the
adapter loads for training merged, as the engine serves it; multiplication traces are the
stage-0 training sequence split into the head's segments; a DAgger round adds rows whose
anchors are the engine's own (an eager forward over the prompt and the injected latents
gives them) labelled by the gold trace's step of the same index; after DAgger the stop head
ends the closed loop in the engine on the toy's questions."""

import json
from itertools import accumulate

import pytest
import torch

from latentserve.train.features import num_groups

SOURCE, C, OVERSHOOT = 1, 4, 2


@pytest.fixture(scope="module")
def toy(tmp_path_factory, smollm2_dir):
    """``{"base", "adapter", "data", "sft"}``: a 3-layer tiny Llama, a random PEFT LoRA
    adapter over it (every pair non-zero), 8 iCoT 2x2 multiplication lines and a head
    trained on them by ``train-head sft --prompt-format colar`` on the adapter."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from latentserve.bench.baseline.tiny_models import save_tiny
    from latentserve.cli import main
    from latentserve.train.tasks import generate_multiplication, write_icot

    root = tmp_path_factory.mktemp("dagger")
    base = save_tiny(root / "base", "llama", num_hidden_layers=3)
    torch.manual_seed(0)
    peft = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                          LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                     target_modules=["q_proj", "v_proj", "down_proj"]))
    peft.save_pretrained(str(root / "adapter"))
    conf = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(base)
    data = root / "train.txt"
    write_icot(generate_multiplication(2, 8, seed=0), data)
    sft = root / "sft.safetensors"
    assert main(["train-head", "sft", "--model", str(root / "adapter"), "--data", str(data),
                 "--prompt-format", "colar", "--steps", "100", "--batch-size", "64",
                 "--latent-dim", "16", "--source-layer", str(SOURCE), "--compression-factor",
                 str(C), "--lr", "5e-3", "--no-progress", "--out", str(sft)]) == 0
    return {"base": base, "adapter": root / "adapter", "data": data, "sft": sft}


def test_adapter_backbone_loads_merged_as_peft_merges_it(toy):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from latentserve.train.sft import load_backbone

    model, tok, _ = load_backbone(str(toy["adapter"]), "cpu", "float32")
    base = AutoModelForCausalLM.from_pretrained(toy["base"], dtype=torch.float32)
    ids = torch.tensor([tok.encode("Question: 1 2 * 3 4 Let's think step by step:")])
    with torch.no_grad():
        plain = base(ids, output_hidden_states=True).hidden_states
        merged = PeftModel.from_pretrained(base, str(toy["adapter"])).merge_and_unload()
        want = merged(ids, output_hidden_states=True).hidden_states
        got = model(ids, output_hidden_states=True).hidden_states
    assert not torch.allclose(got[-1], plain[-1], atol=1e-3)  # the adapter is in
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)


def test_colar_traces_split_the_stage0_training_sequence(smollm2_tokenizer):
    from latentserve.latent.colar import prompt_text
    from latentserve.train.cot import encode_examples
    from latentserve.train.sft import SFTConfig
    from latentserve.train.tasks import multiplication_item
    from latentserve.train.traces import build_colar_traces

    tok = smollm2_tokenizer
    item = multiplication_item(4321, 8765, 4)
    (tr,) = build_colar_traces(tok, [item])
    sep = tok.convert_tokens_to_ids("###")
    assert tok.decode(tr.prompt) == prompt_text(item.question)  # ends with the opening ###
    assert tr.prompt[-1] == sep and tr.close == [sep]
    assert tok.decode(tr.reasoning) == item.steps
    assert tr.answer[-1] == tok.eos_token_id
    assert tok.decode(tr.answer[:-1]) == "Answer:" + item.gold
    prompt, target = encode_examples(tok, [item])[0]  # what `train cot` fine-tuned on
    assert tr.ids == prompt + target
    assert build_colar_traces(tok, [item], max_reasoning_tokens=len(tr.reasoning) - 1) == []

    cfg = SFTConfig(out="h.safetensors", prompt_format="colar")
    assert (cfg.think_open, cfg.think_close) == ("", "###")
    with pytest.raises(ValueError, match="think_close"):
        SFTConfig(out="h.safetensors", prompt_format="colar", think_close="\nAnswer:")


def test_dagger_round_rows_are_the_engines_anchors_labelled_by_step_index(toy):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine
    from latentserve.latent.head_loop import set_policy_sampling
    from latentserve.train.dagger import DaggerConfig, label_rollouts, rollout_anchors
    from latentserve.train.sft import capture_traces, load_backbone

    engine = LLMEngine(EngineConfig(model=str(toy["adapter"]), latent_head=str(toy["sft"])))
    head = engine.runner.model.latent_head
    sep = engine.tokenizer.convert_tokens_to_ids("###")
    assert engine.latent_spec.start_ids == () and engine.latent_spec.end_ids == (sep,)
    model, tok, _ = load_backbone(str(toy["adapter"]), "cpu", "float32")
    cfg = DaggerConfig(bundle=str(toy["sft"]), out="d.safetensors", data=str(toy["data"]),
                       prompt_format="colar", progress=False)
    hc = head.config  # the SFT bundle's layers, speed and colar thinking text
    assert (hc.source_layer, hc.target_layer, hc.compression_factor) == (SOURCE, SOURCE + 1, C)
    assert (hc.think_open, hc.think_close) == ("", "###")
    traces, teacher = capture_traces(model, tok, cfg, hc)
    groups = [num_groups(len(t.reasoning), C) for t in traces[:3]]
    first = list(accumulate([g + 1 for g in groups], initial=0))  # row k = 0 of each trace
    traces = traces[:3]

    set_policy_sampling(head, 0.0)  # greedy latents, anchors recorded
    anchors = rollout_anchors(engine, [t.prompt for t in traces],
                              [g + OVERSHOOT for g in groups])
    set_policy_sampling(head, None)
    rows = label_rollouts(anchors, teacher, first, groups)

    r = 0
    for tr, a, f, g in zip(traces, anchors, first, groups):
        assert len(a) == g + OVERSHOOT
        # Eager forward over [prompt, latent 1 .. latent n-1]: latent j + 1 = the head's
        # input for anchor j; the source-layer hidden at positions p - 1 .. p + n - 2.
        with torch.no_grad():
            emb = model.get_input_embeddings()(torch.tensor(tr.prompt))
            x = torch.cat([emb, head.latent_input(a[:-1])])[None]
            hs = model(inputs_embeds=x, output_hidden_states=True).hidden_states[SOURCE + 1]
        torch.testing.assert_close(rows.anchor[r:r + len(a)], hs[0, len(tr.prompt) - 1:],
                                   atol=1e-4, rtol=1e-4)
        for j in range(len(a)):
            k = f + min(j, g)  # the teacher-forced row of the same step index
            assert rows.stop[r + j] == float(j >= g) == teacher.stop[k]
            assert bool(rows.has_target[r + j]) == (j < g)
            assert torch.equal(rows.target[r + j], teacher.target[k])
            assert torch.equal(rows.embed[r + j], teacher.embed[k])
        r += len(a)
    assert r == len(rows.stop)


def test_after_dagger_the_stop_head_ends_the_closed_loop(toy, tmp_path):
    from latentserve.cli import main
    from latentserve.models.checkpoint import load_tokenizer
    from latentserve.train.cot import read_items
    from latentserve.train.dagger import DaggerConfig, train_dagger
    from latentserve.train.traces import build_colar_traces

    items = read_items(toy["data"])
    traces = build_colar_traces(load_tokenizer(toy["adapter"]), items)
    groups = [num_groups(len(t.reasoning), C) for t in traces]
    out = tmp_path / "dagger.safetensors"
    log = train_dagger(DaggerConfig(bundle=str(toy["sft"]), out=str(out),
                                    model=str(toy["adapter"]), data=str(toy["data"]),
                                    prompt_format="colar", rounds=3, steps=300, batch_size=64,
                                    lr=5e-3, overshoot=OVERSHOOT, progress=False))
    h, per_round = log["history"], sum(g + OVERSHOOT for g in groups)
    assert [x["new_rows"] for x in h] == [per_round] * 3  # every trace rolled out
    assert h[-1]["rows"] == log["teacher_rows"] + 3 * per_round  # aggregated
    assert (tmp_path / "dagger-round1.safetensors").is_file()

    # Served from the written bundle, CoLaR format, stop on: every phase ends by the stop.
    res = tmp_path / "eval.json"
    assert main(["eval", "--model", str(toy["adapter"]), "--latent-head", str(out),
                 "--prompt-format", "colar", "--dataset-file", str(toy["data"]),
                 "--max-latent", "16", "--min-latent", "1", "--max-tokens", "12",
                 "--out", str(res)]) == 0
    records = json.loads(res.read_text())["records"]
    assert len(records) == len(groups) == 8
    for rec, g in zip(records, groups):
        assert rec["stop_fired"], rec  # not the cap of 16
        assert g - 1 <= rec["thinking"] <= g + OVERSHOOT, (rec["thinking"], g)


def test_dagger_refuses_a_bundle_of_another_prompt_format(toy):
    from latentserve.train.dagger import DaggerConfig, train_dagger

    with pytest.raises(ValueError, match="prompt format"):
        train_dagger(DaggerConfig(bundle=str(toy["sft"]), out="d.safetensors",
                                  model=str(toy["adapter"]), data=str(toy["data"]),
                                  prompt_format="chat", progress=False))


def test_colar_reward_scores_the_answer_after_answer_colon():
    from latentserve.train.grpo import reward

    assert reward("###Answer:2 7 8 0", "2 7 8 0", {"end": "stop"}, "colar") == pytest.approx(1.1)
    assert reward("###Answer:2 7 8 1", "2 7 8 0", {"end": "cap"}, "colar") == 0.0
    assert reward("2 7 8 0", "2 7 8 0", {"end": "cap"}, "colar") == 0.0  # no Answer:
