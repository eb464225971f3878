"""uvicorn's httptools protocol with a deadline on a request's headers: a connection that opens, or starts a request,
and has not sent complete headers within `header_timeout_s` is closed (uvicorn has keep-alive and graceful-shutdown
timeouts, none for a client that trickles its headers and holds a connection for good)."""
from __future__ import annotations

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

DEFAULT_HEADER_TIMEOUT_S = 10.0


def with_header_timeout(header_timeout_s: float) -> type:
    """The protocol class to give uvicorn.Config(http=...)."""

    class HeaderDeadlineProtocol(HttpToolsProtocol):
        _deadline = None

        def _arm(self) -> None:
            if self._deadline is None:
                self._deadline = self.loop.call_later(header_timeout_s, self._expire)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self) -> None:
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._arm()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

    return HeaderDeadlineProtocol
