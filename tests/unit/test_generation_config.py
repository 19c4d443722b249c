"""A model's ``generation_config.json`` sampling defaults (vLLM's ``--generation-config``):
read by ``models.generation_config``, applied by ``LLM.get_default_sampling_params`` and
``LLM.generate`` without params, turned off by ``generation_config="vllm"``."""

import json
import shutil

import pytest

from latentserve import LLM, SamplingParams
from latentserve.config import EngineConfig
from latentserve.models.generation_config import sampling_defaults


def write_generation_config(model_dir, **fields):
    path = model_dir / "generation_config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps({**raw, **fields}))


@pytest.fixture
def top_k_1_dir(tmp_path, tiny_dirs):
    """The tiny Llama with ``top_k: 1`` (and the file's token ids) in its generation config."""
    d = shutil.copytree(tiny_dirs["llama"], tmp_path / "m")
    write_generation_config(d, top_k=1, temperature=1.0, do_sample=True)
    return d


def test_the_keys_vllm_takes_are_read_and_the_rest_ignored(tmp_path):
    write_generation_config(tmp_path, temperature=0.6, top_p=0.9, top_k=20, min_p=0.05,
                            repetition_penalty=1.1, max_new_tokens=64, do_sample=False,
                            eos_token_id=2, num_beams=4, typical_p=None)
    assert sampling_defaults(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                           "min_p": 0.05, "repetition_penalty": 1.1,
                                           "max_tokens": 64}


def test_vllm_mode_and_a_missing_file_give_no_defaults(tmp_path):
    assert sampling_defaults(tmp_path) == {}
    write_generation_config(tmp_path, temperature=0.6)
    assert sampling_defaults(tmp_path, "vllm") == {}


def test_a_folder_path_is_read_instead_of_the_models(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    write_generation_config(tmp_path / "model", top_k=5)
    write_generation_config(tmp_path / "other", top_p=0.5)
    assert sampling_defaults(tmp_path / "model", str(tmp_path / "other")) == {"top_p": 0.5}


def test_a_folder_without_the_file_is_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="^generation_config must be 'auto', 'vllm' or a "
                                         "folder holding generation_config.json"):
        sampling_defaults(tmp_path, str(tmp_path / "nope"))


def test_an_out_of_range_value_names_the_file_and_field(tmp_path):
    write_generation_config(tmp_path, top_p=0)
    with pytest.raises(ValueError, match=r"^generation_config: .*generation_config.json: "
                                         r"top_p must be in \(0.0, 1.0\]"):
        sampling_defaults(tmp_path)


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path):
    (tmp_path / "generation_config.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a JSON object, got list"):
        sampling_defaults(tmp_path)


def test_an_empty_setting_is_refused_by_engine_config():
    with pytest.raises(ValueError, match="^generation_config must be"):
        EngineConfig(generation_config="")


def test_top_k_1_makes_different_seeds_agree_and_a_set_top_k_overrides_it(top_k_1_dir):
    llm = LLM(model=str(top_k_1_dir))
    defaults = llm.get_default_sampling_params()
    assert (defaults.top_k, defaults.temperature) == (1, 1.0)

    def tokens(params):
        return llm.generate([[5, 6, 7, 8]], params, use_tqdm=False)[0].outputs[0].token_ids

    runs = []
    for seed in (1, 2, 3):
        p = llm.get_default_sampling_params()
        p.seed, p.max_tokens, p.ignore_eos = seed, 8, True
        runs.append(tokens(p))
    greedy = tokens(SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert runs == [greedy] * 3
    overridden = [tokens(SamplingParams(top_k=50, temperature=1.0, seed=s, max_tokens=8,
                                        ignore_eos=True)) for s in (1, 2, 3)]
    assert len({tuple(t) for t in overridden}) > 1
    # Without params LLM.generate takes the defaults (vLLM): greedy here.
    out = llm.generate([[5, 6, 7, 8]], use_tqdm=False)[0].outputs[0].token_ids
    n = min(len(out), len(greedy))
    assert n >= 1 and out[:n] == greedy[:n]


def test_generation_config_vllm_ignores_the_models_defaults(top_k_1_dir):
    llm = LLM(model=str(top_k_1_dir), generation_config="vllm")
    assert llm.engine.sampling_defaults == {}
    assert llm.get_default_sampling_params() == SamplingParams()
