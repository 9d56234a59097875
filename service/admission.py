"""Which weights an engine request runs under: the weights generation, its prefix-cache
partition, and the hold on new requests while the engine is paused.

vLLM keeps one prefix cache (and, beside each KV block, the routes it computed) for every
request it serves. A block computed by one set of weights must never serve a request of
another, or that request's prompt rows are the old weights' routing under the new label.
``reset_prefix_cache`` cannot promise that: vLLM refuses it while any request holds KV blocks,
which a busy RL server always has. So each engine request carries vLLM's ``cache_salt`` for the
*weights generation* it is admitted under, a counter that moves with every change of the
engine's weights: vLLM mixes the salt into the hash of a request's first block, and so into
every block after it, and a request of one generation can find no block of another.

A request admitted under a generation keeps it for its whole life once it has produced output
(a request frozen across an update goes on from its own KV, and its spans say which weights
sampled what). One that has produced nothing yet when the weights change is taken back
(:meth:`Admission.advance`) and submitted again under the new generation, so no request starts
on the old weights' cache; its client sees nothing of it but the wait.

While the engine is paused, new requests wait here rather than in the engine (vLLM 0.33 rejects
them with ``RetryableRequestError`` under ``mode=abort|wait``; 0.32 queues them): every release
behaves the same, and a request that waited through a weight update is admitted under the new
generation.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Admission", "Ticket", "cache_salt", "label_cache_salt"]

log = logging.getLogger("routereplay.service")

# How long a weight change waits for the requests it took back to leave the engine. They run on
# this event loop and leave at their next wake-up; a stall past this is logged, not waited out.
SETTLE_TIMEOUT_S = 10.0


def cache_salt(generation: int, user_salt: str | None) -> str:
    """The ``cache_salt`` of an engine request: its weights generation, and the client's own
    salt when it gave one (hashed, so the result stays within vLLM's 128 characters and its
    character rule whatever the client sent)."""
    return _salt(f"w{generation}", user_salt)


def label_cache_salt(weight_version: str, user_salt: str | None) -> str:
    """The ``cache_salt`` of a request to an upstream vLLM whose weights are known only by
    their label (its ``/weight_info``): requests under different labels share no prefix."""
    return _salt("v" + _digest(weight_version), user_salt)


def _digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _salt(partition: str, user_salt: str | None) -> str:
    return f"rr-{partition}" + ("" if user_salt is None else "-" + _digest(user_salt))


@dataclass(eq=False)
class Ticket:
    """One engine request: its engine id, the client request id it serves, and the weights
    generation it was admitted under."""

    engine_id: str
    client_id: str
    generation: int
    started: bool = False  # the engine has produced output for it: it keeps its generation
    retake: asyncio.Event = field(default_factory=asyncio.Event)  # the weights changed first
    gone: asyncio.Event = field(default_factory=asyncio.Event)  # its engine request is closed


class Admission:
    """The weights generation, the engine requests admitted under it, and the pause hold."""

    def __init__(self) -> None:
        self.generation = 0
        self.resubmitted = 0  # requests taken back by a weight change and admitted again
        self.waiting = 0  # requests held here now, waiting for the engine to resume
        self._tickets: dict[str, Ticket] = {}
        self._open = asyncio.Event()
        self._open.set()

    # -- the hold ------------------------------------------------------------------------------
    @property
    def held(self) -> bool:
        """New requests wait (the engine is paused or its weights are being changed)."""
        return not self._open.is_set()

    def hold(self) -> None:
        self._open.clear()

    def release_hold(self) -> None:
        self._open.set()

    async def wait_open(self) -> None:
        if self._open.is_set():
            return
        self.waiting += 1
        try:
            await self._open.wait()
        finally:
            self.waiting -= 1

    # -- engine requests -----------------------------------------------------------------------
    def admit(self, engine_id: str, client_id: str) -> Ticket:
        """Record an engine request about to be submitted under the current generation.
        Synchronous, so no weight change falls between reading the generation and recording it."""
        ticket = Ticket(engine_id, client_id, self.generation)
        self._tickets[engine_id] = ticket
        return ticket

    def started(self, ticket: Ticket) -> None:
        """Mark ``ticket`` as having produced output: a later weight change leaves it be. The
        caller checks ``ticket.retake`` first (a request taken back discards its output)."""
        ticket.started = True

    def close(self, ticket: Ticket) -> None:
        """The engine request of ``ticket`` has ended (or was never made)."""
        self._tickets.pop(ticket.engine_id, None)
        ticket.gone.set()

    def tickets(self) -> Iterator[Ticket]:
        return iter(list(self._tickets.values()))

    # -- weight changes ------------------------------------------------------------------------
    def advance(self) -> list[Ticket]:
        """The engine's weights changed: start a new generation and take back every request of
        an older one that has produced no output. Returns those; their engine ids must be
        aborted before generation resumes."""
        self.generation += 1
        taken = [t for t in self._tickets.values() if not t.started]
        for t in taken:
            t.retake.set()
        self.resubmitted += len(taken)
        return taken

    async def settle(self, taken: list[Ticket]) -> None:
        """Wait until each taken-back request has closed its engine request."""
        waits = [asyncio.ensure_future(t.gone.wait()) for t in taken if not t.gone.is_set()]
        if not waits:
            return
        _, pending = await asyncio.wait(waits, timeout=SETTLE_TIMEOUT_S)
        for w in pending:
            w.cancel()
        if pending:
            log.warning(
                "%d request(s) taken back by a weight change had not left the engine after "
                "%.0f s; they are aborted by id",
                len(pending), SETTLE_TIMEOUT_S,
            )  # fmt: skip
