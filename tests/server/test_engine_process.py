"""The engine process and its ZMQ client, without HTTP: start-up, rejection, abort, routing."""

import asyncio
import os
import signal

import pytest

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams
from latentserve.server.client import EngineClient, EngineDeadError, EngineRequestError
from latentserve.server.engine_process import EngineProcess, EngineStartupError


def test_startup_failure_is_a_clear_error_in_the_parent(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(EngineStartupError, match="no-such-model.*does not exist"):
        EngineProcess(EngineConfig(model=str(missing)), startup_timeout=300).start()


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with EngineProcess(EngineConfig(model=str(tiny_model_dir), max_num_seqs=4)) as proc:
        yield proc


def _run(engine, scenario):
    """Run ``scenario(client)`` in a fresh event loop with a connected client."""

    async def main():
        client = EngineClient(engine.addresses.input, engine.addresses.output,
                              is_alive=engine.is_alive)
        await client.start()
        try:
            return await scenario(client)
        finally:
            await client.close()

    return asyncio.run(main())


async def _collect(client, rid, ids, params):
    return [out async for out in client.generate(rid, ids, params)]


def test_engine_is_warmed_up_before_ready_and_answers_stats(engine):
    async def scenario(client):
        return await client.get_stats(timeout=10)

    stats = _run(engine, scenario)
    assert stats["num_forward_tokens"] == 5  # the warm-up: 4 prompt tokens + 1 decode
    assert stats["kv_slots_cached"] == 0  # ... which left nothing behind
    assert stats["kv_slots_free"] == stats["kv_slots_total"] > 0
    assert stats["num_running"] == stats["num_waiting"] == 0


def test_ready_carries_model_facts_and_tokenizer(engine, tiny_model_dir):
    assert engine.ready.model_name == str(tiny_model_dir)
    assert engine.ready.max_model_len == 256
    assert engine.ready.tokenizer.decode([28]) is not None


def test_rejected_request_raises_and_loop_keeps_serving(engine):
    greedy = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)

    async def scenario(client):
        with pytest.raises(EngineRequestError, match="max_model_len"):
            await _collect(client, "too-long", [5] * 300, greedy)
        with pytest.raises(EngineRequestError, match="vocab|\\[0, "):
            await _collect(client, "bad-id", [10**7], greedy)
        return await _collect(client, "fine", [5, 6, 7], greedy)

    outs = _run(engine, scenario)
    assert sum(len(o.new_token_ids) for o in outs) == 3
    assert outs[-1].finished and outs[-1].finish_reason == "length"


def test_abort_finishes_the_request_with_abort(engine):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def scenario(client):
        outs = []
        async for out in client.generate("long", [5, 6, 7], params):
            outs.append(out)
            if len(outs) == 2:
                client.abort("long")
        return outs

    outs = _run(engine, scenario)
    assert outs[-1].finished and outs[-1].finish_reason == "abort"
    assert sum(len(o.new_token_ids) for o in outs) < 200


def test_concurrent_requests_are_routed_to_their_callers(engine):
    async def scenario(client):
        jobs = [_collect(client, f"r{n}", [5, 6, 7 + n],
                         SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
                for n in (1, 4, 9)]
        return await asyncio.gather(*jobs)

    results = _run(engine, scenario)
    for n, outs in zip((1, 4, 9), results):
        assert {o.rid for o in outs} == {f"r{n}"}
        assert sum(len(o.new_token_ids) for o in outs) == n
        assert [o.finished for o in outs].count(True) == 1


def test_dead_engine_fails_pending_and_new_requests(tiny_model_dir):
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    with EngineProcess(EngineConfig(model=str(tiny_model_dir), max_num_seqs=2)) as proc:

        async def scenario(client):
            with pytest.raises(EngineDeadError):
                async for _ in client.generate("doomed", [5, 6, 7], params):
                    os.kill(proc.pid, signal.SIGKILL)  # the engine dies mid-request
            with pytest.raises(EngineDeadError):
                await _collect(client, "after", [5, 6], params)
            return client.dead_reason

        assert "stopped" in _run(proc, scenario)


def test_duplicate_request_id_is_refused_while_the_first_runs(engine):
    params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)

    async def scenario(client):
        first = client.generate("dup", [5, 6, 7], params)
        out = [await anext(first)]
        with pytest.raises(EngineRequestError, match="already running"):
            await _collect(client, "dup", [8, 9], params)
        out += [o async for o in first]
        return out

    outs = _run(engine, scenario)
    assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == "length"


def test_abort_before_the_request_is_sent_keeps_it_from_starting(engine):
    """A client that hangs up right after sending: the disconnect watcher's abort can come
    before ``generate`` sends the request; the request must not start (and run to
    max_tokens) afterwards, and a later request with another id is unaffected."""
    params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)

    async def scenario(client):
        client.abort("early")
        with pytest.raises(EngineRequestError, match="aborted before it started"):
            await _collect(client, "early", [5, 6, 7], params)
        other = await _collect(client, "other", [5, 6, 7], params)
        return other, await client.get_stats(timeout=10)

    other, stats = _run(engine, scenario)
    assert other[-1].finished and len(sum((o.new_token_ids for o in other), [])) == 50
    assert stats["num_running"] == stats["num_waiting"] == 0
    assert stats["kv_slots_free"] + stats["kv_slots_cached"] == stats["kv_slots_total"]


def test_check_answers_as_add_request_would_and_queues_nothing(engine):
    """``EngineClient.check`` (``LLMEngine.check_request`` in the engine): a request the
    engine would take passes, one it would refuse raises its reason, and neither leaves a
    request or a KV slot behind."""
    ok = SamplingParams(max_tokens=5, temperature=0)

    async def scenario(client):
        before = await client.get_stats(timeout=10)
        await client.check("a", [5, 6, 7], ok)
        with pytest.raises(EngineRequestError, match=r"token ids must be in \[0, "):
            await client.check("b", [5, 10**6], ok)
        with pytest.raises(EngineRequestError, match="latent_budget must be 0 or null"):
            await client.check("c", [5, 6], SamplingParams(max_tokens=5, latent_budget=3))
        return before, await client.get_stats(timeout=10), client.num_running

    before, after, running = _run(engine, scenario)
    assert running == after["num_running"] == after["num_waiting"] == 0
    assert after["kv_slots_free"] == before["kv_slots_free"]


def test_freeze_heap_takes_the_loaded_objects_out_of_full_collections():
    """What the engine process does once warmed up: the objects alive then are frozen, so a
    full collection no longer visits them (they leave the oldest generation)."""
    import gc

    from latentserve.server.engine_process import freeze_heap

    gc.collect()
    before = len(gc.get_objects(generation=2))
    try:
        frozen = freeze_heap()
        assert frozen == gc.get_freeze_count() >= before > 10_000  # torch and pytest alone
        assert len(gc.get_objects(generation=2)) < before // 100
    finally:
        gc.unfreeze()
    assert gc.get_freeze_count() == 0
