"""The HTTP surface: the Starlette app and its server."""
