"""Which ``*.safetensors`` files a model directory's weights come from
(``models.loader.weight_files``): a ``model.safetensors.index.json`` names them, an extra
``consolidated.safetensors`` (Mistral's copy) is not loaded."""

import json
import shutil

import pytest
import torch

from latentserve import LLM, SamplingParams
from latentserve.models.loader import weight_files

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
PROMPT = [[5, 6, 7, 8, 9]]


def _mistral_copy(path):
    """A ``consolidated.safetensors`` in Mistral's names (never a Llama weight name)."""
    from safetensors.torch import save_file

    save_file({"tok_embeddings.weight": torch.zeros(4, 4)}, str(path))


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, tiny_dirs):
    """The tiny Llama saved in several shards with an index, plus tokenizer files and a
    Mistral-style ``consolidated.safetensors``."""
    from transformers import AutoModelForCausalLM

    src = tiny_dirs["llama-untied"]
    out = tmp_path_factory.mktemp("sharded") / "m"
    AutoModelForCausalLM.from_pretrained(src).save_pretrained(out, max_shard_size="4MB")
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    _mistral_copy(out / "consolidated.safetensors")
    return out


def test_an_index_names_the_shards_and_nothing_else(sharded_dir):
    index = json.loads((sharded_dir / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    assert [f.name for f in weight_files(sharded_dir)] == shards


def test_a_sharded_checkpoint_with_a_consolidated_copy_loads_and_matches(sharded_dir,
                                                                         tiny_dirs):
    want = LLM(model=str(tiny_dirs["llama-untied"])).generate(PROMPT, GREEDY, use_tqdm=False)
    got = LLM(model=str(sharded_dir)).generate(PROMPT, GREEDY, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids


def test_without_an_index_a_consolidated_copy_is_skipped(tmp_path, tiny_dirs):
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "m")
    _mistral_copy(d / "consolidated.safetensors")
    assert [f.name for f in weight_files(d)] == ["model.safetensors"]
    out = LLM(model=str(d)).generate(PROMPT, GREEDY, use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 6


def test_a_consolidated_file_alone_is_the_weights(tmp_path):
    _mistral_copy(tmp_path / "consolidated.safetensors")
    assert [f.name for f in weight_files(tmp_path)] == ["consolidated.safetensors"]


def test_an_index_naming_a_missing_file_is_refused_by_name(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="names model-00002-of-00002.safetensors"):
        weight_files(tmp_path)


def test_an_index_without_a_weight_map_is_refused(tmp_path):
    (tmp_path / "model.safetensors.index.json").write_text("[]")
    with pytest.raises(ValueError, match="'weight_map'"):
        weight_files(tmp_path)
