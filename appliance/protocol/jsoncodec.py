"""The JSON codec of the hot paths: MAGN frame payloads, server-sent events and API request bodies.

`msgspec <https://jcristharif.com/msgspec/>`_ does the work (3-15x the standard library's speed on these
payloads: ``benchmarks/codec.py``); the meaning stays the standard library's:

- :func:`dumps` writes what ``json.dumps(value, ensure_ascii=False, separators=(",", ":"))`` writes, as UTF-8
  bytes: the same keys in the same order, strings escaped alike (non-ASCII as is), integers of any size, the same
  digits for every float. Two differences: an exponent is written in its shortest form (``1e16`` and ``1e-7``
  where the standard library writes ``1e+16`` and ``1e-07``: the same numbers), and NaN and the infinities are
  written ``null`` (the standard library wrote ``NaN`` and ``Infinity``, which are not JSON): a caller that must
  refuse them checks first, as :class:`~appliance.protocol.frames.Frame` does. A string holding a lone surrogate
  raises ``UnicodeEncodeError``, as encoding the standard library's text did.
- :func:`loads` returns what ``json.loads`` returns and raises what it raises. msgspec decodes; every text it
  refuses (NaN, Infinity, numbers past the float range, lone surrogates, nesting past its limit, invalid JSON) the
  standard library parses again, with the caller's hooks, so the value or the exception is the standard library's.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import msgspec

LIBRARY = "msgspec"
"""The library that does the work (``benchmarks/codec.py`` names it in its results)."""
_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder()


def dumps(value: Any) -> bytes:
    """Compact UTF-8 JSON of ``value`` (see the module docstring for how it compares with ``json.dumps``).

    Raises ``TypeError`` for a value of no JSON type, ``UnicodeEncodeError`` for a lone surrogate.
    """
    return _ENCODER.encode(value)


def loads(text: str | bytes, *, parse_int: Callable[[str], Any] | None = None,
          parse_constant: Callable[[str], Any] | None = None) -> Any:
    """``json.loads(text, parse_int=parse_int, parse_constant=parse_constant)``'s value, or its exception.

    The hooks run only when msgspec refused the text, so they may refuse but must not convert: ``parse_constant``
    sees ``NaN`` and ``Infinity`` (msgspec refuses them); ``parse_int`` must return ``int(digits)`` for every integer
    it accepts, and what it would refuse the caller must refuse in the value too (an integer of more digits than
    ``parse_int`` allows may come back, built by msgspec, up to the standard library's 4,300 digits).
    """
    try:
        return _DECODER.decode(text)
    except (msgspec.DecodeError, RecursionError):
        return json.loads(text, parse_int=parse_int, parse_constant=parse_constant)


def stdlib_loads(text: str | bytes, *, parse_int: Callable[[str], Any] | None = None,
                 parse_constant: Callable[[str], Any] | None = None) -> Any:
    """The standard library's ``json.loads`` alone, every hook applied: to find which error a value that
    :func:`loads` returned and the caller refused would have raised first."""
    return json.loads(text, parse_int=parse_int, parse_constant=parse_constant)
