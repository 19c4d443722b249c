"""A model directory without tokenizer files (a Huginn or Ouro directory holding only
``config.json`` and weights) serves token-id prompts offline, with the tokens of the
upstream-algorithm reference and empty text; text prompts, chat and stop strings fail with a
clear error, before anything is queued."""

import pytest

from latentserve import LLM, SamplingParams

PROMPT = [(5 * i + 13) % 900 + 20 for i in range(9)]
MAX_TOKENS = 5


def _weights_only(model_dir):
    """``model_dir`` with every file but ``config.json`` and the weights removed."""
    for f in model_dir.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            f.unlink()
    return model_dir


@pytest.fixture(scope="module", params=["huginn", "ouro"])
def bare(request, tmp_path_factory):
    """``(kind, directory without tokenizer files, reference tokens for PROMPT)``."""
    from latentserve.bench.baseline import recurrent_models, recurrent_reference

    kind = request.param
    d = tmp_path_factory.mktemp("no-tokenizer") / kind
    if kind == "huginn":
        recurrent_models.write_huginn(d)
        ref = recurrent_reference.HuginnReference(d).generate(PROMPT, MAX_TOKENS, 4)
    else:
        recurrent_models.write_ouro(d)
        ref = recurrent_reference.OuroReference(d).generate(PROMPT, MAX_TOKENS)
    return kind, _weights_only(d), ref["tokens"]


@pytest.fixture(scope="module")
def llm(bare):
    return LLM(model=str(bare[1]), device="cpu", dtype="float32")


def _greedy(**kw):
    return SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, **kw)


def test_token_id_prompts_give_the_reference_tokens_and_empty_text(bare, llm):
    kind, _, ref_tokens = bare
    budget = 4 if kind == "huginn" else None  # Huginn's default (its mean_recurrence) is 8
    outs = llm.generate([PROMPT, {"prompt_token_ids": PROMPT}], _greedy(latent_budget=budget),
                        use_tqdm=False)
    for out in outs:
        assert list(out.outputs[0].token_ids) == ref_tokens
        assert out.outputs[0].text == ""
    llm.engine.cache.check_idle()


def test_text_prompt_is_refused_naming_the_missing_tokenizer(llm):
    from latentserve.models.checkpoint import NoTokenizerError

    with pytest.raises(NoTokenizerError,
                       match="this model directory has no tokenizer files; send token ids"):
        llm.generate(["What is 2 + 3?"], _greedy(), use_tqdm=False)
    with pytest.raises(NoTokenizerError, match="no tokenizer files"):
        llm.chat([{"role": "user", "content": "hi"}], _greedy(), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()


def test_stop_strings_are_refused_and_nothing_stays_queued(llm):
    from latentserve.models.checkpoint import NoTokenizerError

    with pytest.raises(NoTokenizerError, match="use stop_token_ids"):
        llm.generate([PROMPT, PROMPT], [_greedy(), _greedy(stop=["x"])], use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()
    llm.engine.cache.check_idle()


def test_a_broken_tokenizer_file_is_still_an_error(tmp_path):
    """Only a directory with no tokenizer file at all is served without one."""
    from latentserve.bench.baseline.recurrent_models import write_ouro
    from latentserve.models.checkpoint import load_tokenizer

    d = _weights_only(write_ouro(tmp_path / "ouro"))
    (d / "tokenizer.json").write_text("{not json")
    with pytest.raises(Exception):  # noqa: B017 - whatever transformers raises
        load_tokenizer(d, optional=True)
