"""Route families imported at their first request (:class:`LazyRoutes`): a serving process that is never asked for
the admin page, the Responses or Anthropic API, embeddings or ``/metrics`` never imports their modules (nor jinja2
or prometheus_client), which keeps an idle ``appliance run`` smaller (``benchmarks/idle_memory.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from starlette._utils import get_route_path  # what starlette's own routes match on (the path less any root_path)
from starlette.datastructures import URLPath
from starlette.routing import BaseRoute, Match, NoMatchFound
from starlette.types import Receive, Scope, Send


class LazyRoutes(BaseRoute):
    """The routes ``load`` returns, as if listed in its place in the app, imported at the first request whose path
    is one of ``paths`` or starts with one of ``prefixes``: every path those routes match must be one of them (a
    request for any other path is no match without importing anything). Once loaded, a request matches, is
    handled (405 included) and names its URLs exactly as it would with the routes listed in the app."""

    def __init__(self, load: Callable[[], Sequence[BaseRoute]], *, paths: Sequence[str] = (),
                 prefixes: Sequence[str] = ()) -> None:
        self.load = load
        self.paths = frozenset(paths)
        self.prefixes = tuple(prefixes)
        self._routes: list[BaseRoute] | None = None

    @property
    def loaded(self) -> bool:
        return self._routes is not None

    @property
    def routes(self) -> list[BaseRoute]:
        """The family's routes, loaded on the first call."""
        if self._routes is None:
            self._routes = list(self.load())
        return self._routes

    def owns(self, path: str) -> bool:
        return path in self.paths or path.startswith(self.prefixes)

    def matches(self, scope: Scope) -> tuple[Match, Scope]:
        if scope["type"] != "http" or not self.owns(get_route_path(scope)):
            return Match.NONE, {}
        _, match, child_scope = self.best_match(scope)
        return match, child_scope

    def best_match(self, scope: Scope) -> tuple[BaseRoute | None, Match, Scope]:
        """The route starlette's router would pick among the family's: the first full match, else the first
        partial one (a path whose method is not allowed)."""
        partial: tuple[BaseRoute | None, Match, Scope] = (None, Match.NONE, {})
        for route in self.routes:
            match, child_scope = route.matches(scope)
            if match is Match.FULL:
                return route, match, child_scope
            if match is Match.PARTIAL and partial[0] is None:
                partial = (route, match, child_scope)
        return partial

    async def handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        route, _, child_scope = self.best_match(scope)
        assert route is not None, "handle() follows a match"
        scope["route"] = route  # what the router sets for a route listed in the app
        scope.update(child_scope)
        await route.handle(scope, receive, send)

    def url_path_for(self, name: str, /, **path_params: object) -> URLPath:
        for route in self.routes:
            try:
                return route.url_path_for(name, **path_params)
            except NoMatchFound:
                pass
        raise NoMatchFound(name, path_params)
