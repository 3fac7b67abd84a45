"""The stream count of llama.cpp's per-sequence KV state bytes (SPEC E2, split KV streams). Pure.

``llama_state_seq_get_data`` on a context with a plain KV cache writes a header (llama.cpp's state magic and the
sequence's id, 8 bytes), ``n_stream`` (a little-endian u32), then one record per stream of the context:
``cell_count`` (u32) and, when it is not 0, the cells' positions and their K and V rows. A context of one pool has
one stream; a split context one per sequence (``n_seq_max``). One sequence's cells are all in its own stream, so
every record but one is empty (4 zero bytes).

llama.cpp refuses a state whose ``n_stream`` is not its context's, and puts the one record in the stream of the
sequence it loads into, wherever the record sits. So a conversation parked from a split context comes back into one
pool (and the other way round) once :func:`restream` has rewritten the count and the empty records; its cells'
bytes are not touched. It trusts the bytes to be one sequence's state from llama.cpp (it does not parse the record:
llama.cpp checks it as it loads it).
"""

from __future__ import annotations

import struct

U32 = struct.Struct("<I")
HEADER = 8
"""The bytes before ``n_stream``: llama.cpp's sequence state magic and the id of the sequence it was saved from."""
State = bytes | bytearray | memoryview


def stream_count(state: State) -> int:
    """The ``n_stream`` a sequence's state was saved with."""
    if len(state) < HEADER + U32.size:
        raise ValueError(f"a KV state has at least {HEADER + U32.size} bytes, got {len(state)}")
    return U32.unpack_from(state, HEADER)[0]


def restream(state: State, n_stream: int) -> State:
    """``state`` (one sequence's) for a context of ``n_stream`` streams: ``state`` itself when it has that many;
    else a new buffer with its one record first and empty ones after it. ``ValueError`` when the bytes are not one
    sequence's state (no record, or two streams holding cells)."""
    if n_stream < 1:
        raise ValueError(f"n_stream must be at least 1, got {n_stream}")
    have = stream_count(state)
    if have == n_stream:
        return state
    view = memoryview(state).cast("B")
    first = HEADER + U32.size  # the first record
    if have < 1 or len(view) < first + U32.size * have:
        raise ValueError(f"a KV state of {len(view)} bytes cannot hold {have} stream records")
    lead = 0
    while lead < have - 1 and U32.unpack_from(view, first + U32.size * lead)[0] == 0:
        lead += 1
    start = first + U32.size * lead
    end = len(view) - U32.size * (have - 1 - lead)
    if end < start + U32.size or any(view[end:]):
        raise ValueError("the KV state holds cells in more than one stream")
    restreamed = bytearray(view[:HEADER])
    restreamed += U32.pack(n_stream)
    restreamed += view[start:end]
    restreamed += bytes(U32.size * (n_stream - 1))
    return restreamed
