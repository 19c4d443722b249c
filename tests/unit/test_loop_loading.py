"""Loading looped-block models: ``latentserve convert pccot`` on PCCoT's upstream PEFT form
gives a directory whose ``LatentSpec`` carries upstream's token ids, block size, iteration
count and answer prompt; bad configs and incomplete upstream directories fail naming the
field or file; the server accepts loop budgets up to the model's cap."""

import json
import types

import pytest

from latentserve.cli import main as cli_main
from latentserve.latent.load import load_model
from latentserve.latent.loop_checkpoint import validate_loop_config
from latentserve.latent.loop_convert import convert_pccot
from latentserve.models.checkpoint import load_tokenizer
from latentserve.server.errors import APIError
from latentserve.server.latent_params import latent_budget


@pytest.fixture(scope="module")
def pccot_upstream(tmp_path_factory, smollm2_dir):
    pytest.importorskip("peft")  # inside: peft imports triton (test_triton_attention's interpreter)
    from latentserve.bench.baseline.loop_models import write_upstream_pccot

    root = tmp_path_factory.mktemp("pccot-upstream")
    return write_upstream_pccot(root, "llama", block_size=5, iterations=4, use_projection=True)


def test_convert_cli_gives_upstream_tokens_block_and_iterations(pccot_upstream, tmp_path):
    import torch

    base, adapter = pccot_upstream
    out = tmp_path / "model"
    assert cli_main(["convert", "pccot", "--base", str(base), "--adapter", str(adapter),
                     "--out", str(out)]) == 0
    model, _ = load_model(out, torch.float32, "cpu")
    spec = model.latent_spec
    args = json.loads((adapter / "pccot_args.json").read_text())
    answer = load_tokenizer(adapter).encode("The answer is:", add_special_tokens=False)
    assert (spec.kind, spec.family, spec.loop_rule) == ("loop", "pccot", "jacobi")
    assert spec.start_ids == (args["bot_token_id"],)
    assert spec.end_ids == (args["eot_token_id"], *answer)
    assert spec.latent_id == args["latent_token_id"]
    assert (spec.block_size, spec.default_budget) == (5, 4)
    assert isinstance(model.latent_feedback, torch.nn.Sequential)  # PCCoT's prj, not identity


def test_convert_names_the_missing_upstream_file(pccot_upstream, tmp_path):
    base, adapter = pccot_upstream
    broken = tmp_path / "adapter"
    broken.mkdir()
    for f in adapter.iterdir():
        if f.name != "pccot_args.json":
            (broken / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ValueError, match="pccot_args.json"):
        convert_pccot(base, broken, tmp_path / "out")


@pytest.mark.parametrize("change, field", [
    ({"block_size": 0}, "block_size"),
    ({"default_budget": 70, "max_budget": 64}, "default_budget"),
    ({"tokens": {"bot": 1, "eot": 2}}, "tokens"),
    ({"loop_rule": "same"}, "loop_rule"),
    ({"answer_prompt_ids": ["x"]}, "answer_prompt_ids"),
    ({"lora": {"r": 0, "alpha": 1}}, "lora.r"),
    ({"lora": {"r": 2, "alpha": float("nan")}}, "lora.alpha"),
    ({"prj": {"eps": float("inf")}}, "prj.eps"),
])
def test_bad_loop_config_names_the_field(change, field):
    cfg = {"family": "pccot", "tokens": {"bot": 1, "eot": 2, "latent": 3}, "block_size": 4,
           "default_budget": 3, **change}
    with pytest.raises(ValueError, match=f"'{field}'"):
        validate_loop_config(cfg)


def test_server_checks_loop_budgets_against_the_cap():
    from latentserve.latent.spec import LatentSpec

    spec = LatentSpec(kind="loop", family="pccot", default_budget=3, max_budget=8,
                      block_size=4, loop_rule="jacobi")
    req = types.SimpleNamespace(headers={})
    assert latent_budget(req, types.SimpleNamespace(latent_budget=8), spec) == 8
    with pytest.raises(APIError, match=r"latent_budget must be in \[0, 8\], got 9"):
        latent_budget(req, types.SimpleNamespace(latent_budget=9), spec)
