"""Clients for other programs: MAGN (blocking and asyncio) and the line protocol."""

from appliance.client.aio import AsyncMagnClient, AsyncTokenStream
from appliance.client.blocking import Completion, MagnClient, TokenStream

__all__ = ["AsyncMagnClient", "AsyncTokenStream", "Completion", "MagnClient", "TokenStream"]
