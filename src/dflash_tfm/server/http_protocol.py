"""uvicorn's h11 protocol with a deadline for request headers.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but any byte that arrives cancels that
timer, and nothing bounds the time a client may take to finish its headers: a client that sends half a
request line and then a byte every few seconds holds its connection (and a file descriptor) forever. Here
every connection must complete each request's headers within `header_timeout` seconds of connecting or of
its previous response, or it is closed. Body reads have their own deadline (`server.guard`).
"""
from __future__ import annotations

import asyncio
import logging

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("dflash_tfm.server")


class HeaderDeadlineH11Protocol(H11Protocol):
    header_timeout = 30.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._header_timer: asyncio.TimerHandle | None = None
        self._timed_cycle = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self._timed_cycle:  # a new request's headers are in
            self._timed_cycle = self.cycle
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()  # the next request on this connection gets the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing() and (self.cycle is None or self.cycle.response_complete):
            logger.info("closing a connection that sent no complete request headers within %g s", self.header_timeout)
            self.transport.close()


def protocol_with_header_timeout(seconds: float) -> type[HeaderDeadlineH11Protocol]:
    """The protocol class to pass to uvicorn as `http=`."""
    return type("HeaderDeadlineH11Protocol", (HeaderDeadlineH11Protocol,), {"header_timeout": float(seconds)})
