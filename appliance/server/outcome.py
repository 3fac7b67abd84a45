"""How a generation request ends, decided once for every surface (MAGN, the line protocol, HTTP).

* :func:`generate` runs one request: in an agent's session (``session_id``: its conversation goes on) or stateless on
  a model, and turns a generation that stopped as cancelled into its error (below).
* :func:`cancelled_error`: a generation that stopped as ``"cancelled"`` is ``SHUTTING_DOWN`` while the daemon is
  closing (the daemon cancelled it), else ``CANCELLED`` (the client did); ``details["completion_tokens"]`` is the
  number of tokens generated before it stopped. Those tokens are not in the agent's conversation: the runtime
  rolled it back to what it was before the request (a client that gets CANCELLED did not get a completion, so
  its next DECODE goes on from where its last completed one ended).
* :func:`error_of`: any exception a request raised as the P4 error to send (unexpected ones are logged with their
  traceback and become a plain ``INTERNAL``: not retryable, without the exception's text).
* :func:`embed`: one embeddings request (MAGN's EMBED_REQUEST, ``/v1/embeddings``), recorded like a generation.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence

from appliance.daemon.core import Daemon
from appliance.daemon.model import DecodeResult
from appliance.daemon.requestlog import Outcome, RequestRecord, Surface
from appliance.engine.embedding import Embeddings
from appliance.engine.interface import Generation, PromptText, Sampling, Token
from appliance.errors import ApplianceError, internal

log = logging.getLogger(__name__)


def cancelled_error(generation: Generation, *, closing: bool) -> ApplianceError | None:
    """The error for a generation that stopped as cancelled (None if it did not): SHUTTING_DOWN if the daemon is
    ``closing``, else CANCELLED; ``details = {"completion_tokens": <tokens generated>}``."""
    if generation.stop_reason != "cancelled":
        return None
    details = {"completion_tokens": generation.generated_tokens}
    if closing:
        return ApplianceError("SHUTTING_DOWN", "the appliance is stopping", details)
    return ApplianceError("CANCELLED", "the task was cancelled", details)


def error_of(exc: Exception) -> ApplianceError:
    """``exc`` as a P4 error: an :class:`ApplianceError` as it is, anything else logged and wrapped as INTERNAL."""
    if isinstance(exc, ApplianceError):
        return exc
    log.exception("request failed", exc_info=exc)
    return internal(exc)


async def generate(daemon: Daemon, *, surface: Surface, prompt: PromptText, max_tokens: int, sampling: Sampling,
                   session_id: str | None = None, model: str | None = None,
                   on_token: Callable[[Token], None] | None = None,
                   cancel: threading.Event | None = None, queue: Hashable | None = None,
                   on_result: Callable[[DecodeResult], None] | None = None) -> DecodeResult:
    """Generate ``max_tokens`` at most after ``prompt``: in the agent session ``session_id`` if given, else
    stateless on ``model`` in the engine queue ``queue`` (the caller's connection, so that connections take turns).
    Raises :class:`ApplianceError`, including :func:`cancelled_error`'s. Every request, whatever its end, is one
    record in ``daemon.requests`` (``surface``: who asked). ``on_result`` gets the result as soon as it is known, on
    the loop, before the bookkeeping (:meth:`~appliance.daemon.requests.Requests.complete`; an agent's turn once it
    is committed): a surface that writes its reply there writes it before that bookkeeping and this record."""
    started = time.perf_counter()
    result: DecodeResult | None = None
    failure: ApplianceError | None = None
    try:
        if session_id is not None:
            result = await daemon.decode(session_id, max_tokens, prompt, sampling, on_token, cancel,
                                         on_result=on_result)
        elif model is not None:
            result = await daemon.complete(model, max_tokens, prompt, sampling, on_token, cancel, queue=queue,
                                           on_result=on_result)
        else:
            raise ApplianceError("BAD_REQUEST", "one of model or session_id is required")
        failure = cancelled_error(result.generation, closing=daemon.closing)
        if failure is not None:
            raise failure
        return result
    except ApplianceError as exc:
        failure = exc
        raise
    except asyncio.CancelledError:
        failure = ApplianceError("CANCELLED", "the request was cancelled")
        raise
    finally:
        record = request_record(daemon, surface, session_id, model, result, failure, time.perf_counter() - started)
        if record is not None:
            daemon.requests.add(record)


def outcome_of(failure: ApplianceError | None) -> Outcome:
    """A request's outcome in the request log: ``ok``, ``cancelled`` (its client left, or the stop's grace ran out)
    or ``error``."""
    if failure is None:
        return "ok"
    return "cancelled" if failure.code in ("CANCELLED", "SHUTTING_DOWN") else "error"


def request_record(daemon: Daemon, surface: Surface, session_id: str | None, model: str | None,
                   result: DecodeResult | None, failure: ApplianceError | None,
                   elapsed_s: float) -> RequestRecord | None:
    """The log record of one request (None for a request that named no model and no agent we know)."""
    if result is not None:
        model_name = result.model
    elif session_id is not None and session_id in daemon.agents:
        model_name = daemon.agents[session_id].model.key
    else:
        model_name = model
    if model_name is None:
        return None
    generation = result.generation if result is not None else None
    return RequestRecord(
        at=time.time(), surface=surface, model=model_name, agent=session_id,
        prompt_tokens=generation.prompt_tokens if generation is not None else 0,
        generated_tokens=generation.generated_tokens if generation is not None else 0,
        ttft_s=generation.ttft_s if generation is not None else None,
        elapsed_s=elapsed_s, outcome=outcome_of(failure), error=failure.code if failure is not None else None,
        stop_reason=generation.stop_reason if generation is not None else None,
        plan=result.plan if result is not None else None,
        prompt_evaluated=generation.prompt_evaluated if generation is not None else None,
        generation_s=generation.elapsed_s if generation is not None else None)


async def embed(daemon: Daemon, *, surface: Surface, model: str, inputs: Sequence[str | Sequence[int]],
                dimensions: int | None) -> Embeddings:
    """The embeddings of ``inputs`` from ``model`` (:meth:`~appliance.daemon.core.Daemon.embed`); the request,
    whatever its end, is one record in ``daemon.requests`` (``task="embed"``; ``surface``: who asked)."""
    started = time.perf_counter()
    result: Embeddings | None = None
    failure: ApplianceError | None = None
    try:
        result = await daemon.embed(model, inputs, dimensions)
        return result
    except ApplianceError as exc:
        failure = exc
        raise
    except asyncio.CancelledError:
        failure = ApplianceError("CANCELLED", "the request was cancelled")
        raise
    finally:
        spec = daemon.config.named(model)  # an alias is recorded under its model's name
        daemon.requests.add(RequestRecord(
            at=time.time(), surface=surface, model=model if spec is None else spec.name, agent=None,
            prompt_tokens=result.prompt_tokens if result is not None else 0, generated_tokens=0, ttft_s=None,
            elapsed_s=time.perf_counter() - started, outcome=outcome_of(failure),
            error=failure.code if failure is not None else None, task="embed"))
