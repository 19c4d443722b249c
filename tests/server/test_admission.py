"""``--max-waiting-requests`` counted in the API process (``server/admission.py``), on
in-process states and apps whose engine client is a stand-in (no model runs)."""

import pytest
from server_testlib import StandInClient

from latentserve.outputs import StepOutput
from latentserve.server.errors import APIError


class _Client(StandInClient):
    """Counts requests as the engine client does (``num_running``: sent, not finished);
    each is answered with one token and ``length``."""

    def __init__(self):
        self.num_running = 0
        self.seen_reserved: list[int] = []  # state.reserved when each request was sent

    async def generate(self, rid, prompt_ids, params):
        self.num_running += 1
        self.seen_reserved.append(self.state.reserved)
        try:
            yield StepOutput(rid, [28], True, "length")
        finally:
            self.num_running -= 1


def _state(tokenizer=None, seats=2, may_wait=1):
    from latentserve.server.state import ServerLimits, ServerState

    client = _Client()
    state = ServerState(client, tokenizer, "m", 256, 49152, max_num_seqs=seats,
                        limits=ServerLimits(max_waiting_requests=may_wait))
    client.state = state
    return state


def test_admitted_requests_count_before_they_reach_the_engine():
    """Two seats, one may wait: three single requests admitted back to back (none sent
    yet) fill seats and queue; the fourth is refused at once, and admitted again once one
    reservation is given back."""
    from latentserve.server.admission import admit

    state = _state()
    held = [admit(state, 1) for _ in range(3)]
    assert state.reserved == 3
    with pytest.raises(APIError) as info:
        admit(state, 1)
    err = info.value
    assert (err.status_code, err.code, err.headers) == (503, "overloaded", {"Retry-After": "1"})
    assert "1 requests wait for one of 2 seats, at most 1 may wait" in err.message
    with held[0]:
        pass
    assert state.reserved == 2
    with admit(state, 1) as ticket:
        ticket.take()  # sent: the client counts it from here
        state.client.num_running += 1
        assert state.reserved == 2
        with pytest.raises(APIError):
            admit(state, 1)
    assert state.reserved == 2  # nothing left to give back


def test_a_request_is_admitted_for_all_its_engine_requests():
    """Completions' prompts x n, chat's n: one request of 4 with 2 seats and 1 waiting could
    never be admitted, so it is a 400 naming its field (not a 503 to retry forever); 3 fit."""
    from latentserve.server.admission import admit

    state = _state()
    with pytest.raises(APIError) as info:
        admit(state, 4, "prompt")
    err = info.value
    assert (err.status_code, err.param, err.headers) == (400, "prompt", None)
    assert err.message == ("prompt: this request needs 4 engine requests; this server admits "
                           "at most 3 at once (2 seats + 1 may wait)")
    assert state.reserved == 0
    with admit(state, 3):
        assert state.reserved == 3
    assert state.reserved == 0


def test_the_app_admits_before_tokenizing_and_gives_back_what_it_does_not_send(
        smollm2_tokenizer):
    """Over HTTP: a 400 found after admission (a prompt token id out of range) gives its
    reservation back; a served request moves each engine request from the reservation to
    the client as it is sent; a request over the bound is refused before its prompt is
    looked at (a bad prompt gets the 503, not the 400)."""
    from fastapi.testclient import TestClient

    from latentserve.server.admission import admit
    from latentserve.server.app import create_app

    state = _state(smollm2_tokenizer, seats=1, may_wait=2)
    with TestClient(create_app(state), raise_server_exceptions=False) as app:
        bad = app.post("/v1/completions", json={"prompt": [[5], [10**7]], "max_tokens": 1})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "prompt"
        assert state.reserved == 0
        ok = app.post("/v1/completions", json={"prompt": ["a", "b"], "n": 1,
                                               "max_tokens": 1})
        assert ok.status_code == 200 and len(ok.json()["choices"]) == 2
        # sent one by one: the first while the second was still reserved
        assert state.client.seen_reserved == [1, 0]
        assert (state.reserved, state.client.num_running) == (0, 0)
        chat = app.post("/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "hi"}], "n": 3, "max_tokens": 1})
        assert chat.status_code == 200 and len(chat.json()["choices"]) == 3
        with admit(state, 2):  # 1 seat + 1 waiting taken: one more may wait
            for path, body in (("/v1/completions", {"prompt": [[5], [10**7]]}),
                               ("/v1/chat/completions", {"messages": [], "n": 2})):
                r = app.post(path, json={**body, "max_tokens": 1})
                assert r.status_code == 503 and r.json()["error"]["code"] == "overloaded", r.text
        assert state.reserved == 0
        # More than seats + waiting (3) could never be admitted: a 400 naming the field.
        for path, body, param in (
                ("/v1/completions", {"prompt": ["a", "b", "c", "d"]}, "prompt"),
                ("/v1/completions", {"prompt": "a", "n": 4}, "n"),
                ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                          "n": 6}, "n")):
            r = app.post(path, json={**body, "max_tokens": 1})
            err = r.json()["error"]
            assert (r.status_code, err["param"]) == (400, param), r.text
            assert "retry-after" not in r.headers
            assert err["message"].startswith(f"{param}: this request needs ")
            assert "at most 3 at once (1 seats + 2 may wait)" in err["message"]
        assert state.reserved == 0
