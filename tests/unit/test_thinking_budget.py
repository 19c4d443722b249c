"""``thinking_token_budget`` (vLLM's field; Anthropic's ``thinking.budget_tokens``): with a
reasoning parser it caps ``<think>`` text and then forces ``</think>`` (``token_masks.
ThinkBudget``); on a latent model without one it caps the latent positions."""

import random
from types import SimpleNamespace

import numpy as np
import pytest

from latentserve.sampling_params import SamplingParams
from latentserve.token_masks import ThinkBudget

END = [7, 8, 9]


def _forced_each_step(budget, start, answer):
    """What one ThinkBudget forces as ``answer`` grows a token at a time."""
    think = ThinkBudget(budget, start, END)
    return [think.forced(answer[:n]) for n in range(len(answer) + 1)]


def _forced_fresh(budget, start, answer):
    """The same, each prefix asked of a new ThinkBudget (nothing carried between calls)."""
    return [ThinkBudget(budget, start, END).forced(answer[:n]) for n in range(len(answer) + 1)]


def test_the_end_ids_are_forced_once_the_budget_is_spent():
    # no start ids: reasoning from the first token; budget 2, then 7, 8, 9, then free
    assert _forced_each_step(2, None, [1, 2, 7, 8, 9, 4]) == [None, None, 7, 8, 9, None, None]
    # the reasoning ended by itself within its budget: nothing is forced
    assert _forced_each_step(5, None, [1, 7, 8, 9, 3, 3, 3, 3]) == [None] * 9
    # start ids: counted from after them; no start, no reasoning to cap
    assert _forced_each_step(1, [5], [3, 5, 2, 7, 8, 9])[3:] == [7, 8, 9, None]
    assert _forced_each_step(1, [5], [3, 3, 3, 3]) == [None] * 5
    assert _forced_each_step(0, [5, 6], [5, 6])[-1] == 7


def test_a_prompt_that_leaves_think_open_counts_from_the_answer_start():
    """vLLM's rule: an unclosed start in the prompt (a template or an assistant prefill that
    opens ``<think>``) makes the whole answer reasoning; a closed one does not."""
    opened = ThinkBudget(1, [5], END, prompt=[3, 5, 4])
    assert [opened.forced([2] * n) for n in range(3)] == [None, 7, 8]
    closed = ThinkBudget(1, [5], END, prompt=[5, 4, 7, 8, 9, 3])
    assert [closed.forced([2] * n) for n in range(3)] == [None, None, None]


def test_reasoning_open_follows_the_parser_and_the_prompt():
    """What the server's ``<think>`` split is told (the rule ThinkBudget applies, vLLM's
    ``is_reasoning_end``): the prompt's last tag decides; with none, deepseek_r1 opens the
    answer in its reasoning and qwen3 does not; no parser, never."""
    from latentserve.token_masks import reasoning_open

    tok = SimpleNamespace(encode=lambda t, add_special_tokens: {"<think>": [5],
                                                                "</think>": END}[t])
    assert reasoning_open(tok, "deepseek_r1", [1, 2])
    assert not reasoning_open(tok, "deepseek_r1", [1, 5, 7, 8, 9, 2])  # thinking closed
    assert reasoning_open(tok, "deepseek_r1", [7, 8, 9, 1, 5])
    assert not reasoning_open(tok, None, [1, 5])
    assert reasoning_open(tok, "qwen3", [1, 5, 2])
    assert not reasoning_open(tok, "qwen3", [1, 5, 2, 7, 8, 9])
    assert not reasoning_open(tok, "qwen3", [1, 2])


def test_incremental_search_finds_what_a_fresh_search_finds():
    """Start and end ids split across steps are found as a search from scratch finds them."""
    rng = random.Random(0)
    for _ in range(300):
        answer = [rng.choice([5, 6, 7, 8, 9, 1]) for _ in range(rng.randint(0, 14))]
        budget, start = rng.randint(0, 6), rng.choice([None, [5], [5, 6]])
        assert _forced_each_step(budget, start, answer) == _forced_fresh(budget, start, answer)


def test_a_closed_reasoning_leaves_the_mask_static():
    """Once ``</think>`` is in the answer nothing can be forced: the overlap scheduler no
    longer waits for the previous tokens, and no row is restricted."""
    from latentserve.token_masks import RequestMask

    mask = RequestMask(SamplingParams(), 100, set(), think=ThinkBudget(5, None, END))
    assert not mask.static and mask.restricts(0)
    row = np.full(4, -1, dtype=np.int32)
    mask.restrict(row, [1, 7, 8, 9], 4, False)
    assert mask.static and not mask.restricts(4) and (row == -1).all()


def test_the_field_is_a_non_negative_integer():
    assert SamplingParams(thinking_token_budget=0).thinking_token_budget == 0
    with pytest.raises(ValueError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)


def _engine(path, **opts):
    from latentserve.config import EngineConfig
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(path), max_num_seqs=4, **opts))


def _outputs(engine, params: list[SamplingParams]) -> dict[str, list[int]]:
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", [1, 60, 700], p)
    out = {f"r{i}": [] for i in range(len(params))}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.rid].extend(o.new_token_ids)
    engine.cache.check_idle()
    return out


@pytest.mark.parametrize("overlap", [False, True])
def test_implicit_reasoning_is_cut_at_the_budget_then_continues(tiny_dirs, overlap):
    """deepseek_r1: the output is reasoning from its first token. Budget 3: the free run's
    first 3 tokens, then ``</think>``'s ids; a budget the run never reaches changes nothing;
    under the overlap scheduler the same tokens."""
    engine = _engine(tiny_dirs["llama"], reasoning_parser="deepseek_r1",
                     overlap_schedule=overlap)
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    base = {"max_tokens": 12, "temperature": 0, "ignore_eos": True}
    out = _outputs(engine, [SamplingParams(**base), SamplingParams(**base, thinking_token_budget=3),
                            SamplingParams(**base, thinking_token_budget=50)])
    free, cut, roomy = out["r0"], out["r1"], out["r2"]
    assert cut[:3] == free[:3] and cut[3:3 + len(end)] == end and len(cut) == 12
    assert roomy == free


def test_explicit_reasoning_is_capped_only_after_think(tiny_dirs):
    """qwen3: an output that does not open ``<think>`` has no reasoning to cap."""
    engine = _engine(tiny_dirs["llama"], reasoning_parser="qwen3")
    base = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}
    out = _outputs(engine, [SamplingParams(**base),
                            SamplingParams(**base, thinking_token_budget=0)])
    assert out["r0"] == out["r1"]


def test_think_opened_by_the_prompt_is_capped(tiny_dirs):
    """qwen3 with ``<think>`` at the prompt's end: the answer is reasoning from its first
    token."""
    engine = _engine(tiny_dirs["llama"], reasoning_parser="qwen3")
    end = engine.tokenizer.encode("</think>", add_special_tokens=False)
    start = engine.tokenizer.encode("<think>", add_special_tokens=False)
    engine.add_request("r", [1, 60] + start, SamplingParams(
        max_tokens=8, temperature=0, ignore_eos=True, thinking_token_budget=2))
    out = []
    while engine.has_unfinished_requests():
        out += [t for o in engine.step() for t in o.new_token_ids]
    assert out[2:2 + len(end)] == end
    engine.cache.check_idle()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_grammar_starts_after_the_reasoning(tiny_dirs, overlap):
    """vLLM's rule: with a reasoning parser, structured outputs constrain what follows
    ``</think>`` when the reasoning is open at the answer's start (deepseek_r1; qwen3 with
    ``<think>`` left open by the prompt). The budget ends the reasoning after 2 tokens, the
    same 2 as a free run's; then the grammar's choice. Under qwen3 with no open ``<think>``
    the grammar covers the whole answer."""
    tok = None
    outs = {}
    for parser in ("deepseek_r1", "qwen3"):
        engine = _engine(tiny_dirs["llama"], reasoning_parser=parser, overlap_schedule=overlap)
        tok = engine.tokenizer
        base = {"max_tokens": 16, "temperature": 0}
        outs[parser] = _outputs(engine, [
            SamplingParams(**base, ignore_eos=True),
            SamplingParams(**base, thinking_token_budget=2,
                           structured_outputs={"choice": ["yes", "no"]})])
    end = tok.encode("</think>", add_special_tokens=False)
    free, cut = outs["deepseek_r1"]["r0"], outs["deepseek_r1"]["r1"]
    assert cut[:2] == free[:2] and cut[2:2 + len(end)] == end
    assert tok.decode(cut[2 + len(end):], skip_special_tokens=True) in ("yes", "no")
    assert tok.decode(outs["qwen3"]["r1"], skip_special_tokens=True) in ("yes", "no")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_prompt_that_closed_the_reasoning_leaves_the_answer_to_the_grammar(tiny_dirs,
                                                                               overlap):
    """deepseek_r1 with ``<think></think>`` closed by the prompt (thinking turned off by the
    template or a prefill): as in vLLM the answer is not reasoning, so the grammar applies
    from its first token and the budget forces no second ``</think>``."""
    engine = _engine(tiny_dirs["llama"], reasoning_parser="deepseek_r1",
                     overlap_schedule=overlap)
    tok = engine.tokenizer
    prompt = [1, 60] + tok.encode("<think>\n\n</think>\n\n", add_special_tokens=False)
    base = {"max_tokens": 12, "temperature": 0}
    params = [SamplingParams(**base, structured_outputs={"choice": ["yes", "no"]}),
              SamplingParams(**base, ignore_eos=True),
              SamplingParams(**base, ignore_eos=True, thinking_token_budget=2)]
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", prompt, p)
    out = {f"r{i}": [] for i in range(3)}
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.rid].extend(o.new_token_ids)
    engine.cache.check_idle()
    assert tok.decode(out["r0"], skip_special_tokens=True) in ("yes", "no")
    assert out["r2"] == out["r1"]


def test_a_plain_model_without_a_reasoning_parser_refuses_it(tiny_dirs):
    engine = _engine(tiny_dirs["llama"])
    with pytest.raises(ValueError, match="^thinking_token_budget needs a model that reasons"):
        engine.add_request("r", [1, 2, 3], SamplingParams(thinking_token_budget=10))
    engine.cache.check_idle()


def test_feedback_latent_steps_are_capped(tmp_path):
    """COCONUT: one latent position a step, so at most ``thinking_token_budget`` steps."""
    from latentserve import LLM
    from latentserve.bench.baseline.latent_models import save_latent_tiny

    llm = LLM(str(save_latent_tiny(tmp_path, "coconut-llama")), max_num_seqs=4)
    steps = [o.outputs[0].latent_steps for o in llm.generate(
        ["The capital of France is"] * 3,
        [SamplingParams(max_tokens=4, temperature=0, latent_budget=5, thinking_token_budget=b)
         for b in (None, 2, 0)], use_tqdm=False)]
    assert steps == [5, 2, 0]


def test_head_max_latent_is_capped(tmp_path):
    from latentserve import LLM
    from tests.support.head_models import save_head_model

    llm = LLM(str(save_head_model(tmp_path / "head", stop_bias=-20.0)), max_num_seqs=4)
    steps = [o.outputs[0].latent_steps for o in llm.generate(
        ["The capital of France is"] * 2,
        [SamplingParams(max_tokens=12, temperature=0, thinking=True, max_latent=6,
                        min_output_tokens=0, thinking_token_budget=b) for b in (None, 3)],
        use_tqdm=False)]
    assert steps == [6, 3]


def test_a_looped_block_longer_than_the_budget_is_refused():
    from latentserve.latent.loop import LoopFamily

    family = LoopFamily(SimpleNamespace(block_size=6), engine=None)
    params = SamplingParams(thinking_token_budget=6)
    assert family.cap_thinking(params) is params
    with pytest.raises(ValueError, match="thinking_token_budget must be at least this model's "
                                         "6 latent positions, got 5"):
        family.cap_thinking(SamplingParams(thinking_token_budget=5))
