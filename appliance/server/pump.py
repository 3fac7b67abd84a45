"""The token pump: generated tokens from the engine thread to a connection on the event loop.

Every surface that streams a generation (the MAGN session now, OpenAI server-sent events next) needs the same three
things, which :class:`TokenPump` does once:

* batching: the engine thread calls :meth:`TokenPump.on_token` for each token; the tokens are queued and delivered on
  the event loop by one call of ``sink(tokens)`` for all that arrived since the last delivery (one write, not one per
  token); the deliveries of every stream that got a token in one engine step wake the loop once
  (:mod:`appliance.engine.wakeups`);
* heartbeats: when no token was delivered for the heartbeat interval, ``heartbeat()`` is called on the loop (the
  interval is read at each arming, so a reloaded config applies to running generations);
* cancellation: when ``sink`` answers False (nobody listens any more: the writer is closing), the pump sets the
  generation's ``cancel`` event, so that the engine stops at its next token, and drops what comes after;
* backpressure: with a ``backlog`` (bytes the receiver has not read yet), a delivery that leaves more than
  :data:`~appliance.server.peer.STREAM_HIGH_WATER` unread pauses the generation: the engine thread waits in
  :meth:`TokenPump.on_token` until the receiver read the backlog down to
  :data:`~appliance.server.peer.STREAM_LOW_WATER`; a receiver that reads nothing for ``stall_timeout_s`` gets the
  generation cancelled (:attr:`TokenPump.stalled` tells the surface to answer TIMEOUT). While a stream is paused
  the engine thread is held, so other generations on the device wait too, for ``stall_timeout_s`` at most;
* writing on the engine thread: while the surface sets :attr:`TokenPump.writer`, a token that finds nothing queued
  before it is handed to it on the engine thread (the surface writes it to its connection itself: no wake-up of the
  loop); a token it does not take goes the loop's way. The pump's lock keeps the two ways in order: a delivery on
  the loop and a token handed to the writer never run at once.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from appliance.engine import wakeups
from appliance.server.peer import STREAM_HIGH_WATER, STREAM_LOW_WATER

if TYPE_CHECKING:
    from appliance.engine.interface import Token

Sink = Callable[[list["Token"]], bool]
"""Delivers a batch of tokens on the loop; returns False when the receiver is gone (the generation is cancelled)."""

Writer = Callable[["Token"], bool]
"""Writes one token on the engine thread; returns False when it cannot now (the token goes to the loop instead)."""

log = logging.getLogger(__name__)

FLOW_POLL_S = 0.05
"""How often a paused stream looks at its receiver's backlog (on the loop) and the engine thread at ``cancel``."""


class TokenPump:
    """Carries one generation's tokens from the engine thread to ``sink`` on ``loop``, with heartbeats.

    It owns the queue of tokens not yet delivered, the heartbeat timer and the time of the last delivery; ``cancel``
    belongs to the generation (the pump only sets it). Use it as a context manager around the generation (or call
    :meth:`start` and :meth:`finish`): on exit everything queued is delivered and the heartbeats stop, so that the
    caller can send the final message knowing that no token or heartbeat can follow it.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sink: Sink, *, cancel: threading.Event,
                 heartbeat: Callable[[], None] | None = None,
                 heartbeat_interval_s: Callable[[], float] | None = None,
                 backlog: Callable[[], int] | None = None,
                 stall_timeout_s: Callable[[], float] | None = None) -> None:
        self.loop = loop
        self.sink = sink
        self.cancel = cancel
        self.heartbeat = heartbeat
        self.heartbeat_interval_s = heartbeat_interval_s
        self.delivered = 0  # tokens handed to the sink
        self._pending: collections.deque[Token] = collections.deque()
        self._scheduled = False  # a delivery is scheduled on the loop
        self._finished = False
        self._gone = False  # the sink said nobody listens any more
        self._last = time.monotonic()  # of the last delivery or heartbeat
        self._timer: asyncio.TimerHandle | None = None
        self.backlog = backlog
        self.stall_timeout_s = stall_timeout_s
        self.stalled = False  # cancelled because the receiver read nothing for stall_timeout_s
        self.pauses = 0  # times the generation was paused for the receiver
        self._flowing = threading.Event()  # cleared while the generation is paused
        self._flowing.set()
        self._paused_at = 0.0
        self._flow_timer: asyncio.TimerHandle | None = None
        self.writer: Writer | None = None  # set and cleared by the surface, on the loop
        self._lock = threading.Lock()  # a delivery on the loop, or a token handed to the writer

    def __enter__(self) -> TokenPump:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def start(self) -> None:
        """On the loop: arm the heartbeat timer (if there is a heartbeat)."""
        self._last = time.monotonic()
        if self.heartbeat is not None and self.heartbeat_interval_s is not None:
            self._timer = self.loop.call_later(self.heartbeat_interval_s(), self._beat)

    def on_token(self, token: Token) -> None:
        """On the engine thread: queue ``token`` and make sure a delivery is scheduled on the loop; while the
        stream is paused, wait here (the generation's next token waits) until it flows again or is cancelled."""
        if self._finished:
            return
        if self.writer is not None and self._write(token):
            return
        self._pending.append(token)
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody can receive it anyway
                wakeups.call_soon(self.loop, self._deliver)  # with the step's other tokens: one wake-up
        while not self._flowing.wait(FLOW_POLL_S):
            if self.cancel.is_set() or self._finished:
                return

    def _write(self, token: Token) -> bool:
        """On the engine thread: hand ``token`` to the writer, if nothing is queued or being delivered before it
        and the stream flows; True when it was written."""
        with self._lock:
            writer = self.writer
            if writer is None or self._finished or self._gone or self._pending or self._scheduled:
                return False
            if not self._flowing.is_set():
                return False
            try:
                written = writer(token)
            except Exception:
                log.exception("a stream's writer failed on the engine thread: its tokens go through the loop")
                self.writer = None
                return False
            if written:
                self.delivered += 1
                self._last = time.monotonic()
            return written

    @property
    def paused(self) -> bool:
        return not self._flowing.is_set()

    def finish(self) -> None:
        """On the loop: deliver what is queued, stop the heartbeats; later tokens are dropped."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._deliver()
        with self._lock:
            self._finished = True
        self._resume()

    def _deliver(self) -> None:
        """On the loop: every token queued so far, in one call of the sink."""
        with self._lock:
            self._scheduled = False  # before draining: a token queued from now on schedules another delivery
            if self._finished or not self._pending:
                return
            tokens = []
            while self._pending:
                tokens.append(self._pending.popleft())
            if self._gone:
                return
            if not self.sink(tokens):
                self._gone = True
                self.cancel.set()  # nobody is listening any more: stop at the next token
                return
            self.delivered += len(tokens)
        self._last = time.monotonic()
        if self.backlog is not None and not self.paused and self.backlog() > STREAM_HIGH_WATER:
            self._pause()

    def _pause(self) -> None:
        """On the loop: hold the generation until the receiver reads (or cancel it after the stall timeout)."""
        self._flowing.clear()
        self.pauses += 1
        self._paused_at = time.monotonic()
        self._flow_timer = self.loop.call_later(FLOW_POLL_S, self._check_flow)

    def _resume(self) -> None:
        if self._flow_timer is not None:
            self._flow_timer.cancel()
            self._flow_timer = None
        self._flowing.set()

    def _check_flow(self) -> None:
        """On the loop, while paused: resume once the backlog is read down, cancel once stalled too long."""
        assert self.backlog is not None
        self._flow_timer = None
        if self._finished or self._gone or self.cancel.is_set() or self.backlog() < STREAM_LOW_WATER:
            self._resume()
        elif self.stall_timeout_s is not None and time.monotonic() - self._paused_at >= self.stall_timeout_s():
            self.stalled = True
            self.cancel.set()  # the engine thread leaves on_token and the generation stops at its next token
            self._resume()
        else:
            self._flow_timer = self.loop.call_later(FLOW_POLL_S, self._check_flow)

    def _beat(self) -> None:
        """On the loop: a heartbeat if nothing was delivered for the interval; then re-arm."""
        assert self.heartbeat is not None and self.heartbeat_interval_s is not None
        if self._finished:
            return
        interval = self.heartbeat_interval_s()
        now = time.monotonic()
        if now - self._last >= interval:
            self.heartbeat()
            self._last = now
        self._timer = self.loop.call_at(self.loop.time() + interval - (now - self._last), self._beat)
