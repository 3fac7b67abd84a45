"""Execution plans S/M/L (issue #12 E3): the llama.cpp batch parameters of a live context, chosen by the P90
input length of the model's load profile (S < 128 tokens, M 128-512, L > 512; ``engine.plan_boundaries``), or
larger where bursts of prompts evaluated together need a larger micro-batch
(:func:`~appliance.engine.tuning.burst_plan`: several prompts in one graph are faster than in several, unlike one
prompt, whose time is the same at every ``n_ubatch`` below).

Measured with ``benchmarks/plans.py`` (07:00-07:30 UTC, this 2-core box heavily shared: load average 4-7 during
the run; 12 layers x 768 f16, 2 threads, 4 sequences, ``n_ctx`` 2048, ``n_batch`` 512; TTFT = one prompt alone to
its first token, median of 3 interleaved rounds; memory = VmRSS growth of the context and llama.cpp's own buffer
sizes; JSON in ``benchmarks/results/plans.json``):

=====================  ======  ======  ======  ======  ======  ========  ========  =======
TTFT ms at tokens        32     100     300     800    1500    compute   KV        RSS
=====================  ======  ======  ======  ======  ======  ========  ========  =======
n_ubatch 128             62     135     418    1255    2672    15.6 MiB  72 MiB    81 MiB
n_ubatch 256             53     137     418    1211    2599    31.2 MiB  72 MiB    103 MiB
n_ubatch 512             53     138     451    1296    2837    62.5 MiB  72 MiB    130 MiB
=====================  ======  ======  ======  ======  ======  ========  ========  =======

* ``n_ubatch`` is what matters, and only for memory once it is 128 or more: from 128 to 512 every length's TTFT is
  the same within the noise (2 CPU threads are saturated by a 128-row matmul of a 768-wide model), while
  llama.cpp's compute buffer grows linearly with ``n_ubatch`` x ``n_ctx`` (3.9 / 7.8 / 15.6 / 31.2 / 62.5 MiB at
  32 / 64 / 128 / 256 / 512 without flash attention: at 512 it is 87 % of the f16 KV cache itself). Below 128 a
  long prompt is many small graphs: 32 and 64 were several times slower on this loaded box (1500 tokens: 17.5 s
  and 3.0 s at 32 and 64 against 2.7 s at 128; the per-graph cost is where a shared box hurts most, two threads
  waiting for each other at every barrier). A short prompt fits one micro-batch whatever ``n_ubatch`` >= its
  length, so S needs no more than its prompts: 128.
* ``n_batch`` stays 512: it only bounds one ``llama_decode`` (a solo prefill runs in chunks of it); a larger one
  costs the batch's host arrays, nothing measurable.
* ``prefill_limit``: a 448-token prompt joining a stream made it wait 690 ms with no limit, 210 / 112 / 61 ms at
  128 / 64 / 32, for the newcomer's first token at 705 / 719 / 788 ms instead of 692 (``batched`` module). A larger
  limit saves the newcomer about 2 % and doubles every running stream's stall, so every plan keeps 64, today's
  figure.
* Flash attention is NOT part of a plan: it is ``engine.flash_attention`` (default ``auto``: on wherever llama.cpp
  can run it, :mod:`appliance.engine.flash`), the same for every plan. It shrinks the compute buffer (20.4 MiB at
  ``n_ubatch`` 512 instead of 62.5) and on an idle box gave +39 % decode tokens/s with 4 sequences
  (``benchmarks/concurrency.py``); ``false`` keeps a sequence's text byte-equal to its solo run. On this loaded
  run it measured slower (1500-token TTFT 9.9 s against 2.8 s; decode beside 1500 cells 29 against 162
  tokens/s): noise-dominated (``benchmarks/flash_attention.py`` measures it side by side).
* The KV cache type is NOT part of a plan either: it is the model's ``cache_type`` setting. q8_0 halves the KV
  cache (38.25 MiB against 72 for 2048 cells) but llama.cpp refuses a quantized V cache without flash attention
  ("llama_init_from_model: quantized V cache requires flash_attn to be enabled": the context is not created), so
  it is refused with ``engine.flash_attention: false`` (``auto`` turns flash attention on for it).

So: S = ``n_ubatch`` 128 (short prompts lose nothing, compute buffer 15.6 MiB instead of 62.5), M = 256 (prompts up
to 512 tokens in two micro-batches at most, 31 MiB), L = 512 (today's engine: a long prompt in the fewest graphs;
on a box with more cores or a GPU that is where larger micro-batches pay), ``n_batch`` 512 and ``prefill_limit``
64 for all three. :func:`fixed_plan` is the untuned engine (``engine.adaptive: false``).
"""

from __future__ import annotations

from dataclasses import dataclass

FIXED_PREFILL_LIMIT = 64
"""``prefill_limit`` of every plan: a 448-token prompt joining a stream stalls it 112 ms per step (see above)."""
MAX_BATCH = 512
"""The largest ``n_batch`` of any plan."""


@dataclass(frozen=True)
class Plan:
    """The llama.cpp batch parameters of a live context: ``n_batch`` (most tokens one ``llama_decode`` takes),
    ``n_ubatch`` (most tokens one compute graph runs: a longer batch runs as several), ``prefill_limit`` (most
    tokens of one prompt a step adds beside running streams; None: up to ``n_batch``)."""

    name: str
    n_batch: int
    n_ubatch: int
    prefill_limit: int | None

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("name must not be empty")
        if self.n_batch < 1:
            raise ValueError(f"n_batch must be at least 1, not {self.n_batch}")
        if not 1 <= self.n_ubatch <= self.n_batch:
            raise ValueError(f"n_ubatch must be from 1 to n_batch ({self.n_batch}), not {self.n_ubatch}")
        if self.prefill_limit is not None and self.prefill_limit < 1:
            raise ValueError(f"prefill_limit must be at least 1 or None, not {self.prefill_limit}")


PLANS: dict[str, Plan] = {  # the figures behind them: the module docstring
    "S": Plan("S", MAX_BATCH, 128, FIXED_PREFILL_LIMIT),
    "M": Plan("M", MAX_BATCH, 256, FIXED_PREFILL_LIMIT),
    "L": Plan("L", MAX_BATCH, 512, FIXED_PREFILL_LIMIT),
}


def _check_shape(n_ctx: int, live_slots: int) -> None:
    if n_ctx < 1:
        raise ValueError(f"n_ctx must be at least 1, not {n_ctx}")
    if live_slots < 1:
        raise ValueError(f"live_slots must be at least 1, not {live_slots}")


def fixed_plan(n_ctx: int, live_slots: int) -> Plan:
    """What the engine does without tuning (``engine.adaptive: false``): one step is one micro-batch of up to 512
    tokens (``n_batch`` = ``n_ubatch``, at most ``n_ctx`` but one token of every live sequence), prompts joining
    running streams in chunks of :data:`FIXED_PREFILL_LIMIT`."""
    _check_shape(n_ctx, live_slots)
    size = max(live_slots, min(MAX_BATCH, n_ctx))
    return Plan("fixed", size, size, FIXED_PREFILL_LIMIT)


def plan_for(name: str, n_ctx: int, live_slots: int) -> Plan:
    """:data:`PLANS` ``[name]`` for a context of ``n_ctx`` cells and ``live_slots`` sequences: ``n_batch`` and
    ``n_ubatch`` at most ``n_ctx`` (llama.cpp clamps them so) but at least ``live_slots`` (one decode step holds a
    token of every live sequence)."""
    if name not in PLANS:
        raise ValueError(f"unknown plan {name!r}: one of {', '.join(PLANS)}")
    _check_shape(n_ctx, live_slots)
    plan = PLANS[name]
    n_batch = max(live_slots, min(plan.n_batch, n_ctx))
    n_ubatch = max(live_slots, min(plan.n_ubatch, n_ctx))
    return Plan(name, n_batch, n_ubatch, plan.prefill_limit)
