"""A request's grammar compiles beside the engine loop (``server/grammar_worker.py``): the
other requests keep stepping meanwhile, a compile that takes too long is refused with an
error naming the flag, a bad grammar is refused as before, an abort drops a waiting request."""

import dataclasses
import pickle
import threading
import time

import pytest

from latentserve.config import EngineConfig
from latentserve.sampling_params import SamplingParams, StructuredOutputsParams
from latentserve.server.engine_process import EngineLoop
from latentserve.server.grammar_worker import GrammarWorker
from latentserve.server.messages import Abort, AddRequest, Answer, Query, RequestFailed, StepOutputs

PLAIN = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
CHOICE = SamplingParams(max_tokens=8, temperature=0,
                        structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))


class _Outbox:
    def __init__(self):
        self.messages = []

    def send_pyobj(self, message):
        self.messages.append(pickle.loads(pickle.dumps(message)))


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    pytest.importorskip("xgrammar")
    from latentserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(tiny_model_dir), max_num_seqs=4))


def _outputs(loop, rid):
    return [o for m in loop.outbox.messages if isinstance(m, StepOutputs)
            for o in m.outputs if o.rid == rid]


def _run_until(loop, done, timeout=60.0):
    """Turn the loop (unpark, then step) until ``done()`` or ``timeout`` s."""
    end = time.monotonic() + timeout
    while not done():
        assert time.monotonic() < end, "timed out"
        if loop.grammars.parked:
            loop._unpark()
        if loop.engine.has_unfinished_requests():
            loop._step()
        else:
            time.sleep(0.002)


def _slow_loop(engine, monkeypatch, timeout_s=30.0):
    """A loop whose grammar compiles wait for ``release`` (then compile for real)."""
    release = threading.Event()
    real = engine.compile_grammar

    def slow(so):
        assert release.wait(30)
        real(so)

    monkeypatch.setattr(engine, "compile_grammar", slow)
    loop = EngineLoop(engine, inbox=None, outbox=_Outbox())
    loop.grammars = GrammarWorker(slow, timeout_s)
    return loop, release


def test_other_requests_finish_while_a_grammar_compiles(engine, monkeypatch):
    loop, release = _slow_loop(engine, monkeypatch)
    loop.handle(AddRequest("choice", [5, 6, 7], CHOICE))
    loop.handle(AddRequest("plain", [5, 6, 7], PLAIN))
    assert [p.key for p in loop.grammars.parked] == ["choice"]
    _run_until(loop, lambda: any(o.finished for o in _outputs(loop, "plain")))
    assert _outputs(loop, "choice") == []  # still compiling: not in the engine yet
    release.set()
    _run_until(loop, lambda: any(o.finished for o in _outputs(loop, "choice")))
    text = engine.tokenizer.decode([t for o in _outputs(loop, "choice")
                                    for t in o.new_token_ids], skip_special_tokens=True)
    assert text in ("yes", "no")


def test_a_compile_past_the_timeout_is_refused_and_the_engine_goes_on(engine, monkeypatch):
    loop, release = _slow_loop(engine, monkeypatch, timeout_s=0.2)
    loop.handle(AddRequest("slow", [5, 6, 7], CHOICE))
    loop.handle(Query("check-slow", AddRequest("check-slow", [5, 6], CHOICE)))
    _run_until(loop, lambda: not loop.grammars.parked)
    failed = [m for m in loop.outbox.messages if isinstance(m, RequestFailed)]
    answers = [m for m in loop.outbox.messages if isinstance(m, Answer)]
    assert [m.rid for m in failed] == ["slow"] and not failed[0].internal
    assert failed[0].error.startswith(  # the field first: the API's 400 names it
        "structured_outputs did not compile within 0.2 s (--grammar-compile-timeout)")
    assert answers[0].key == "check-slow" and "--grammar-compile-timeout" in answers[0].error
    release.set()
    loop.handle(AddRequest("plain", [5, 6, 7], PLAIN))
    _run_until(loop, lambda: any(o.finished for o in _outputs(loop, "plain")))
    s = engine.stats()
    assert s["num_running"] == s["num_waiting"] == 0


def test_a_bad_grammar_is_refused_with_the_engine_error(engine):
    loop = EngineLoop(engine, inbox=None, outbox=_Outbox())
    bad = dataclasses.replace(CHOICE, structured_outputs=StructuredOutputsParams(
        regex="([a-z", param="guided_regex"))
    loop.handle(AddRequest("bad", [5, 6, 7], bad))
    _run_until(loop, lambda: not loop.grammars.parked)
    (failed,) = [m for m in loop.outbox.messages if isinstance(m, RequestFailed)]
    assert failed.rid == "bad" and failed.error.startswith(
        "guided_regex is not a valid regular expression")
    assert not engine.has_unfinished_requests()


def test_an_abort_drops_a_request_still_waiting_for_its_grammar(engine, monkeypatch):
    loop, release = _slow_loop(engine, monkeypatch)
    loop.handle(AddRequest("gone", [5, 6, 7], CHOICE))
    loop.handle(Abort("gone"))
    assert loop.grammars.parked == []
    release.set()
    time.sleep(0.05)
    assert loop.grammars.ready() == [] and not engine.has_unfinished_requests()
    # its final output, as for a request the engine aborts: the API side stops waiting
    (sent,) = loop.outbox.messages
    assert [(o.rid, o.finished, o.finish_reason) for o in sent.outputs] == [
        ("gone", True, "abort")]


def test_the_worker_answers_in_arrival_order():
    gate = threading.Event()
    seen = []

    def compile_fn(so):
        gate.wait(10)
        seen.append(so)
        if so == "bad":
            raise ValueError("bad grammar")

    worker = GrammarWorker(compile_fn, 30, threads=1)
    for key in ("a", "bad", "b"):
        worker.park(key, key, f"msg-{key}")
    assert worker.ready() == []
    gate.set()
    end = time.monotonic() + 10
    got = []
    while len(got) < 3 and time.monotonic() < end:
        got += worker.ready()
        time.sleep(0.001)
    assert got == [("msg-a", None), ("msg-bad", "bad grammar"), ("msg-b", None)]
    assert seen == ["a", "bad", "b"]
    with pytest.raises(ValueError, match="timeout_s must be > 0"):
        GrammarWorker(compile_fn, 0)
    with pytest.raises(ValueError, match="threads must be >= 1"):
        GrammarWorker(compile_fn, 1, threads=0)


def test_a_stuck_compile_does_not_hold_up_the_next_one():
    """Two threads: a compile that never ends (past its time) leaves the other thread to
    the requests after it."""
    stuck = threading.Event()

    def compile_fn(so):
        if so == "slow":
            stuck.wait(30)

    worker = GrammarWorker(compile_fn, 0.3)
    worker.park("slow", "slow", "msg-slow")
    worker.park("fast", "fast", "msg-fast")
    end = time.monotonic() + 10
    got = []
    while len(got) < 2 and time.monotonic() < end:
        got += worker.ready()
        time.sleep(0.001)
    stuck.set()
    assert got[0] == ("msg-fast", None)  # compiled while "slow" was stuck
    assert got[1][0] == "msg-slow" and "did not compile within 0.3 s" in got[1][1]


def test_a_timed_out_compile_gets_a_thread_in_its_place():
    """One thread, stuck past its time on a compile that cannot be stopped: the next
    request still compiles (a thread takes the stuck one's place)."""
    stuck = threading.Event()

    def compile_fn(so):
        if so == "slow":
            stuck.wait(30)

    worker = GrammarWorker(compile_fn, 0.2, threads=1)
    worker.park("slow", "slow", "msg-slow")
    end = time.monotonic() + 10
    got = []
    while not got and time.monotonic() < end:
        got = worker.ready()
        time.sleep(0.005)
    assert got[0][0] == "msg-slow"
    worker.park("fast", "fast", "msg-fast")
    got = []
    while not got and time.monotonic() < end:
        got = worker.ready()
        time.sleep(0.001)
    assert got == [("msg-fast", None)]
    stuck.set()


def test_a_dropped_running_compile_gets_a_thread_in_its_place():
    """One thread, running a compile whose request is aborted (``drop``): the compile
    cannot be stopped, so the next request compiles on a thread in its place, well within
    its timeout."""
    stuck, running = threading.Event(), threading.Event()

    def compile_fn(so):
        if so == "slow":
            running.set()
            stuck.wait(30)

    worker = GrammarWorker(compile_fn, 20, threads=1)
    worker.park("slow", "slow", "msg-slow")
    assert running.wait(10)
    assert worker.drop("slow") and not worker.parked
    worker.park("fast", "fast", "msg-fast")
    end, got = time.monotonic() + 10, []
    while not got and time.monotonic() < end:
        got = worker.ready()
        time.sleep(0.001)
    assert got == [("msg-fast", None)]
    stuck.set()


def test_a_grammar_whose_first_mask_is_too_costly_is_refused(engine, monkeypatch):
    """Some regexes compile at once, then take seconds a token to mask (nested bounded
    repeats); the grammar thread fills the first mask and refuses one over the limit."""
    import latentserve.structured as structured

    monkeypatch.setattr(structured, "FIRST_MASK_LIMIT_S", 0.0)
    loop = EngineLoop(engine, inbox=None, outbox=_Outbox())
    loop.handle(AddRequest("costly", [5, 6, 7], CHOICE))
    _run_until(loop, lambda: not loop.grammars.parked)
    (failed,) = [m for m in loop.outbox.messages if isinstance(m, RequestFailed)]
    assert failed.error.startswith("structured_outputs is too costly to follow: its first "
                                   "token mask took")
    assert not engine.has_unfinished_requests()
