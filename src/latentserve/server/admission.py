"""``--max-waiting-requests``: admission counted in the API process, when a request arrives.
Design notes: docs/internals.md, "latentserve.server.admission"."""

from __future__ import annotations

from latentserve.server.errors import APIError
from latentserve.server.serving import overloaded


class Ticket:
    """An admitted request's ``left`` engine requests not yet sent (in ``state.reserved``)."""

    __slots__ = ("state", "left")

    def __init__(self, state, n: int):
        self.state = state
        self.left = n
        state.reserved += n

    def take(self) -> None:
        """One engine request is being sent: the client's ``num_running`` counts it now."""
        if self.left > 0:
            self.left -= 1
            self.state.reserved -= 1

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, *exc) -> None:
        self.state.reserved -= self.left
        self.left = 0


def admit(state, n: int, param: str = "n") -> Ticket:
    """Admit a request of ``n`` engine requests unless more than ``max_waiting_requests``
    would wait for the ``max_num_seqs`` seats: else the 503 ``overloaded`` (a 400 naming
    ``param`` when it could never be admitted)."""

    limit, seats = state.limits.max_waiting_requests, state.max_num_seqs
    if limit is not None and seats is not None:
        if n > seats + limit:
            raise APIError(f"{param}: this request needs {n} engine requests; this server "
                           f"admits at most {seats + limit} at once ({seats} seats + "
                           f"{limit} may wait)", param=param)
        admitted = state.client.num_running + state.reserved
        if admitted + n - seats > limit:
            waiting = max(admitted - seats, 0)
            raise overloaded(f"the server is overloaded ({waiting} requests wait for one of "
                             f"{seats} seats, at most {limit} may wait; this one needs "
                             f"{n}); retry later")
    return Ticket(state, n)
