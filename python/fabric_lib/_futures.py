"""Transfer, Expectation and KvRequest: the futures that TransferEngine submissions and the KV
flow (KvDecoder.submit, KvPrefiller.start) return.

Both are concurrent.futures.Future subclasses that `await` also accepts, so plain code calls
.result(timeout) (the GIL is released while it waits) and asyncio code awaits them. The engine's
callback thread resolves them, after the submission's own callbacks ran.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import weakref
from typing import TYPE_CHECKING, Any, Generator, Optional

if TYPE_CHECKING:
    from ._fabric_lib import TransferEngine


class Transfer(concurrent.futures.Future):  # type: ignore[type-arg]
    """A submitted transfer. Resolves to None when it is done, or raises its error
    (PeerUnreachable, RemoteAccess, Cancelled, ...). Transfers cannot be cancelled."""

    id: Optional[int]
    """The engine's transfer id (None until the submission was accepted)."""

    def __init__(self) -> None:
        super().__init__()
        self.id = None

    def cancel(self) -> bool:
        """A posted transfer cannot be withdrawn: always False."""
        return False

    def wait(self, timeout: Optional[float] = None) -> None:
        """Waits up to `timeout` seconds (None: forever); raises the transfer's error, or
        TimeoutError when it is still running."""
        self.result(timeout)

    def __await__(self) -> Generator[Any, None, None]:
        return asyncio.wrap_future(self).__await__()

    def _state_text(self) -> str:
        if self.cancelled():
            return "cancelled"
        if not self.done():
            return "pending"
        return "failed" if self.exception() is not None else "finished"

    def __repr__(self) -> str:
        return f"<{type(self).__name__} id={self.id} {self._state_text()}>"


class Expectation(Transfer):
    """An expectation of immediates (TransferEngine.expect_imm): resolves to None once `count`
    arrivals of `imm` are here. cancel() withdraws it, as cancel_expect_imm does; awaiting it
    under asyncio.wait_for therefore withdraws it on timeout."""

    imm: int
    """The immediate value."""
    count: int
    """The arrivals expected."""

    def __init__(self, imm: int, count: int, engine: "weakref.ref[TransferEngine]") -> None:
        super().__init__()
        self.imm = imm
        self.count = count
        self._engine = engine

    def cancel(self) -> bool:
        """Withdraws the expectation; True when it was pending (its future is then cancelled),
        False when it already resolved."""
        if self.done():
            return self.cancelled()
        engine = self._engine()
        if engine is None:
            return False
        return engine._withdraw_expectation(self.imm, self) or self.cancelled()

    def __repr__(self) -> str:
        return f"<Expectation imm={self.imm} count={self.count} {self._state_text()}>"


class KvRequest(Transfer):
    """A KV-cache request. From KvDecoder.submit: resolves to the list of pages once every page
    of every layer landed. From KvPrefiller.start: resolves to None once every decode rank got
    every layer and no write is in flight. Raises the request's error otherwise (Cancelled,
    PeerUnreachable, Timeout, Closed, ...). cancel() returns False: cancel a request with
    KvDecoder.cancel(id) or KvPrefiller.cancel(id); this future then raises Cancelled."""

    pages: "list[int]"
    """The request's pages in this rank's pool (decoder: those reserved by submit)."""

    def __init__(self, request_id: int) -> None:
        super().__init__()
        self.id = request_id
        self.pages = []

    def __repr__(self) -> str:
        return f"<KvRequest id={self.id} pages={len(self.pages)} {self._state_text()}>"
