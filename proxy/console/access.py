"""Who may use the console: console tokens (bearer or sign-in form), sessions, CSRF protection.

- `Authorization: Bearer <console token>` works on every console request (scripts, tests). A
  wrong or client token is a 401; it never falls back to a session cookie.
- People sign in at `POST /console/login` (form field or JSON key `token`); the session is an
  encrypted, signed cookie (aiohttp-session's `EncryptedCookieStorage`, Fernet) that is
  HttpOnly, SameSite=Strict, scoped to `/console/` and valid for `console.session_ttl`. Its key is
  made at start-up, so a restart signs everyone out.
- Mutating requests made with the cookie need the session's CSRF token in `X-CSRF-Token` (the
  page reads it from `GET /console/api/session`, which a cross-site page cannot read) and must
  come from the console's own origin (`Origin` and `Sec-Fetch-Site` checked when sent). The
  sign-in form is checked for the origin too.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import warnings
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from aiohttp.web_exceptions import NotAppKeyWarning
from aiohttp_session import get_session, new_session, session_middleware
from aiohttp_session.cookie_storage import EncryptedCookieStorage

from ..config import ConsoleConfig

log = structlog.get_logger("proxy.console")
# aiohttp-session keeps its state under plain string keys of the request; aiohttp warns about each.
warnings.filterwarnings("ignore", category=NotAppKeyWarning, module="aiohttp_session")

OPERATOR_KEY = web.RequestKey("console_operator", str)
COOKIE_NAME = "mcp_tasks_proxy_console"
CSRF_HEADER = "X-CSRF-Token"
_SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
PUBLIC_PATHS = frozenset({"/console/", "/console/login"})
STATIC_PREFIX = "/console/static/"


def error(status: int, message: str, **extra: object) -> web.Response:
    """A console error: `{"error": {"status": N, "message": "..."}}` with HTTP status `status` (4xx/5xx)."""
    headers = {"WWW-Authenticate": 'Bearer realm="mcp-tasks-proxy console"'} if status == 401 else None
    return web.json_response({"error": {"status": status, "message": message, **extra}}, status=status, headers=headers)


class ConsoleAccess:
    """Checks console tokens against `console.tokens` (constant-time over every known hash)."""

    def __init__(self, config: ConsoleConfig) -> None:
        self._hashes = config.hashes()
        self.storage = EncryptedCookieStorage(
            os.urandom(32), cookie_name=COOKIE_NAME, max_age=int(config.session_ttl), path="/console/", httponly=True, samesite="Strict"
        )

    def operator_for(self, token: str) -> str | None:
        """The operator name of a console token, or None."""
        digest = hashlib.sha256(token.encode()).hexdigest()
        found = None
        for known, name in self._hashes.items():
            if hmac.compare_digest(digest, known):
                found = name
        return found

    def middlewares(self) -> list:
        """The console sub-application's middlewares: sessions, then the access guard."""
        return [session_middleware(self.storage), self._guard()]

    def _guard(self):
        @web.middleware
        async def guard(request: web.Request, handler):
            if request.path in PUBLIC_PATHS or request.path.startswith(STATIC_PREFIX):
                return await handler(request)
            header = request.headers.get("Authorization")
            if header is not None:
                scheme, _, token = header.partition(" ")
                operator = self.operator_for(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
                if operator is None:
                    log.warning("security_auth_failed", reason="not a console token", remote=request.remote, path=request.path)
                    return error(401, "authentication required: that is not a console token")
                request[OPERATOR_KEY] = operator
                return await handler(request)
            session = await get_session(request)
            operator = session.get("operator")
            if not isinstance(operator, str) or operator not in self._hashes.values():
                return error(401, "authentication required: sign in, or send Authorization: Bearer <console token>")
            if request.method not in _SAFE_METHODS:
                problem = cross_site(request) or _csrf_problem(request, session.get("csrf"))
                if problem:
                    log.warning("security_csrf_refused", reason=problem, remote=request.remote, path=request.path)
                    return error(403, problem)
            request[OPERATOR_KEY] = operator
            return await handler(request)

        return guard

    async def login(self, request: web.Request) -> web.Response:
        """`POST /console/login` with `token` (form or JSON): a new session; 401 for a wrong token."""
        problem = cross_site(request)
        if problem:
            return error(403, problem)
        token = ""
        if request.content_type == "application/json":
            try:
                body = await request.json()
            except ValueError:
                return error(400, "the body is not JSON")
            token = body.get("token", "") if isinstance(body, dict) else ""
        else:
            try:
                form = await request.post()
            except ValueError:
                return error(400, "the body is not a form")
            value = form.get("token", "")
            token = value if isinstance(value, str) else ""
        operator = self.operator_for(token.strip()) if isinstance(token, str) and token.strip() else None
        if operator is None:
            log.warning("security_auth_failed", reason="console sign-in with an unknown token", remote=request.remote, path=request.path)
            return error(401, "unknown console token")
        session = await new_session(request)
        session["operator"] = operator
        session["csrf"] = secrets.token_urlsafe(32)
        log.info("console_sign_in", operator=operator, remote=request.remote)
        return web.json_response({"operator": operator, "csrf": session["csrf"]})

    async def logout(self, request: web.Request) -> web.Response:
        """`POST /console/logout`: end the session (the cookie is cleared)."""
        session = await get_session(request)
        session.invalidate()
        return web.json_response({"signedOut": True})

    @staticmethod
    async def csrf_token(request: web.Request) -> str | None:
        """The CSRF token of the request's session (None for bearer requests)."""
        if request.headers.get("Authorization") is not None:
            return None
        value = (await get_session(request)).get("csrf")
        return value if isinstance(value, str) else None


def cross_site(request: web.Request) -> str | None:
    """Why a state-changing browser request is not from the console's own origin, or None."""
    fetch_site = request.headers.get("Sec-Fetch-Site")
    if fetch_site is not None and fetch_site not in ("same-origin", "none"):
        return f"cross-site request refused (Sec-Fetch-Site: {fetch_site[:40]})"
    origin = request.headers.get("Origin")
    if origin is not None:
        try:
            netloc = urlsplit(origin).netloc.lower()
        except ValueError:
            netloc = ""
        if netloc != request.host.lower():
            return "cross-origin request refused (Origin does not match Host)"
    return None


def _csrf_problem(request: web.Request, expected: object) -> str | None:
    sent = request.headers.get(CSRF_HEADER, "")
    if not isinstance(expected, str) or not sent or not hmac.compare_digest(sent.encode(), expected.encode()):
        return f"missing or wrong {CSRF_HEADER} header (read it from GET /console/api/session)"
    return None
