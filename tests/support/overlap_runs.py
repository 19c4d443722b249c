"""Run one batch through a synchronous and an overlapped engine (tests of overlap parity)."""

from latentserve.config import EngineConfig
from latentserve.engine.llm_engine import LLMEngine


def sync_and_overlapped(model_dir, prompts: list[list[int]], params: list) -> list[dict]:
    """``[sync, overlapped]``, each ``rid -> output ids`` (rid ``r{i}`` for ``prompts[i]``
    with ``params[i]``); asserts that only the overlapped engine ran steps on pending ids."""
    results = []
    for overlap in (False, True):
        engine = LLMEngine(EngineConfig(model=str(model_dir), overlap_schedule=overlap))
        seen, run = [], engine.runner.run
        engine.runner.run = lambda batch, pending=None: (
            seen.append(pending is not None), run(batch, pending))[1]  # noqa: B023 - its own
        for i, (p, sp) in enumerate(zip(prompts, params)):
            engine.add_request(f"r{i}", p, sp)
        out = {f"r{i}": [] for i in range(len(params))}
        while engine.has_unfinished_requests():
            for o in engine.step():
                out[o.rid].extend(o.new_token_ids)
        results.append(out)
        assert any(seen) is overlap
    return results
