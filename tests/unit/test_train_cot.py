"""Stage-0 data and training (train/tasks.py, train/cot.py): the multiplication generator
writes the iCoT format exactly and never a held-out question; GSM8K steps are its
calculator annotations; a short LoRA run on a tiny Llama lowers the loss and writes a PEFT
adapter that reproduces the trained model."""

import json
from pathlib import Path

import pytest
import torch

from latentserve.eval.datasets import data_dirs
from latentserve.train.tasks import (
    generate_multiplication,
    gsm8k_train_items,
    icot_line,
    multiplication_item,
    questions_of,
)

MULT = data_dirs()[0] / "multiplication"


def test_multiplication_item_matches_the_icot_line():
    line = ("7 6 9 2 * 1 6 3 6||7 6 9 2 0 + 0 2 0 8 7 1 ( 7 8 9 0 8 1 ) + 0 0 1 0 9 8 0 "
            "( 7 8 0 1 7 0 1 ) + 0 0 0 2 0 8 7 1 #### 7 8 0 3 7 8 8 1")
    assert icot_line(multiplication_item(2967, 6361, 4)) == line


@pytest.mark.skipif(not MULT.is_dir(), reason="shared/data not present")
@pytest.mark.parametrize("name,k", [("4x4_test.txt", 4), ("5x5_valid.txt", 5)])
def test_generator_reproduces_every_line_of_the_shared_sets(name, k):
    for line in (MULT / name).read_text().splitlines():
        a, b = (int("".join(reversed(x.split()))) for x in line.partition("||")[0].split(" * "))
        assert icot_line(multiplication_item(a, b, k)) == line


@pytest.mark.skipif(not MULT.is_dir(), reason="shared/data not present")
def test_generated_training_set_excludes_test_and_valid():
    held_out = questions_of([MULT / "4x4_test.txt", MULT / "4x4_valid.txt"])
    # 2-digit operands have few questions: exclusion is what makes the set deterministic.
    items = generate_multiplication(4, 3000, seed=1, exclude=held_out)
    qs = [it.question for it in items]
    assert len(set(qs)) == 3000 and not set(qs) & held_out


def test_generator_refuses_impossible_requests():
    with pytest.raises(ValueError, match="more than half"):
        generate_multiplication(1, 50)
    # exclusions count: 81 1x1 questions less 60 excluded leave 21, so 11 is too many
    taken = [it.question for it in generate_multiplication(1, 40, seed=0)]
    taken += [it.question for it in generate_multiplication(1, 20, seed=1, exclude=taken)]
    assert len(set(taken)) == 60
    assert len(generate_multiplication(1, 10, seed=2, exclude=taken)) == 10
    with pytest.raises(ValueError, match=r"less the 60 excluded \(21\)"):
        generate_multiplication(1, 11, seed=2, exclude=taken)
    with pytest.raises(ValueError, match="2 digits"):
        multiplication_item(5, 12, 2)


def test_gsm8k_steps_are_the_calculator_annotations(tmp_path):
    row = {"question": "Q?", "answer": "He has 3+4 = <<3+4=7>>7.\nThen 7*2 = <<7*2=14>>14.\n"
                                       "#### 1,014"}
    p = tmp_path / "train.jsonl"
    p.write_text(json.dumps(row) + "\n")
    (it,) = gsm8k_train_items(p)
    assert (it.steps, it.gold) == ("<<3+4=7>> <<7*2=14>>", "1014")


def test_encode_example_separator_is_one_token(smollm2_tokenizer):
    from latentserve.train.cot import encode_examples

    it = multiplication_item(12, 34, 2)
    sep = smollm2_tokenizer.convert_tokens_to_ids("###")
    prompt, target = encode_examples(smollm2_tokenizer, [it])[0]
    assert smollm2_tokenizer.decode(prompt).endswith("(Thinking speed: 1)")
    assert target[0] == sep and target.count(sep) == 2 and target[-1] == 2  # eos
    _, nocot = encode_examples(smollm2_tokenizer, [it], "nocot")[0]
    assert nocot[:2] == [sep, sep] and smollm2_tokenizer.decode(nocot[2:-1]) == "Answer:" + it.gold


def test_lora_run_lowers_loss_and_adapter_reproduces_model(tmp_path, tiny_dirs):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from latentserve.train.cot import CotConfig, train
    from latentserve.train.tasks import write_icot

    data = tmp_path / "train.txt"
    write_icot(generate_multiplication(2, 16, seed=0), data)
    out = tmp_path / "adapter"
    cfg = CotConfig(data=[str(data)], out=str(out), base=str(tiny_dirs["llama"]), lora_r=4,
                    lora_alpha=8, steps=30, batch_size=8, lr=1e-2, warmup=2, log_every=5)
    last = train(cfg, progress=lambda s: None)
    log = json.loads((out / "train_log.json").read_text())
    assert last["loss"] < 0.8 * log[0]["loss"]
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 4 and Path(conf["base_model_name_or_path"]) == tiny_dirs["llama"]
    base = AutoModelForCausalLM.from_pretrained(tiny_dirs["llama"], dtype=torch.float32)
    ids = torch.tensor([[5, 17, 300, 4000, 12]])
    plain = base(ids).logits
    tuned = PeftModel.from_pretrained(base, str(out))(ids).logits
    assert not torch.allclose(plain, tuned, atol=1e-3)  # the adapter changes the model


def test_a_full_fine_tune_writes_a_model_that_serves_alone(tmp_path, tiny_dirs):
    """``lora_r=0``: every weight trained, the whole model and its tokenizer written, so
    ``LLM(model=out)`` loads it with no base beside it."""
    from latentserve import LLM, SamplingParams
    from latentserve.train.cot import CotConfig, train
    from latentserve.train.tasks import write_icot

    data = tmp_path / "train.txt"
    write_icot(generate_multiplication(2, 8, seed=0), data)
    out = tmp_path / "full"
    train(CotConfig(data=[str(data)], out=str(out), base=str(tiny_dirs["llama"]), lora_r=0,
                    steps=2, batch_size=4, lr=1e-3, warmup=0), progress=lambda s: None)
    assert {"model.safetensors", "config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    out_ = LLM(model=str(out)).generate([[5, 17, 300]], SamplingParams(max_tokens=3,
                                                                        temperature=0))
    assert len(out_[0].outputs[0].token_ids) == 3


def test_cli_refuses_bad_sizes_before_loading_anything(tmp_path, capsys):
    from latentserve.cli import main

    assert main(["data", "multiplication", "--k", "0", "--n", "3", "--out",
                 str(tmp_path / "m.txt")]) != 0
    assert "need --k in [1, 30]" in capsys.readouterr().err
    data = tmp_path / "d.txt"
    data.write_text("1 * 2||2 #### 2\n")
    with pytest.raises(SystemExit) as exit_:  # refused as the command line is read
        main(["eval", "--model", str(tmp_path), "--prompt-format", "colar",
              "--dataset-file", str(data), "--limit", "-3"])
    assert exit_.value.code == 2
    assert "argument --limit: must be >= 1, got -3" in capsys.readouterr().err
