"""Read timeouts: a client too slow to send its request headers or body is disconnected.
Design notes: docs/internals.md, "latentserve.server.timeouts"."""

from __future__ import annotations

DEFAULT_HEADER_TIMEOUT_S = 60.0
DEFAULT_BODY_TIMEOUT_S = 60.0


def protocol_class(header_timeout: float | None, body_timeout: float | None):
    """A uvicorn ``H11Protocol`` that closes a connection whose request headers take over
    ``header_timeout`` seconds, or its body ``body_timeout`` after them (None or 0: no
    limit)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    limits = {"headers": header_timeout, "body": body_timeout}

    class ReadTimeoutProtocol(H11Protocol):
        _phase: str | None = None
        _timer = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._watch()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._watch()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            self._watch()

        def connection_lost(self, exc) -> None:
            self._cancel()
            super().connection_lost(exc)

        def _watch(self) -> None:
            """(Re)arm the timer of the client's phase: headers (``IDLE``), body, or none."""

            state = self.conn.their_state
            phase = ("headers" if state is h11.IDLE else
                     "body" if state is h11.SEND_BODY else None)
            if phase == self._phase:
                return
            self._cancel()
            self._phase = phase
            if phase is not None and limits[phase] and not self.transport.is_closing():
                self._timer = self.loop.call_later(limits[phase], self._expired, phase)

        def _cancel(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self, phase: str) -> None:
            self._timer = None
            if not self.transport.is_closing():
                self.logger.info("closing a connection whose request %s took over %g s",
                                 phase, limits[phase])
                self.transport.close()

    return ReadTimeoutProtocol
