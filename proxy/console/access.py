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
import math
import os
import secrets
import time
import warnings
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from aiohttp.web_exceptions import NotAppKeyWarning
from aiohttp_session import Session, get_session, new_session, session_middleware
from aiohttp_session.cookie_storage import EncryptedCookieStorage

from proxy.config import ConsoleConfig

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
    return web.json_response(
        {"error": {"status": status, "message": message, **extra}}, status=status, headers=headers
    )


def _utf8(text: str) -> bytes | None:
    """`text` as UTF-8, or None when it cannot be (lone surrogates, undecodable header bytes)."""
    try:
        return text.encode()
    except UnicodeEncodeError:
        return None


class _CookieStorage(EncryptedCookieStorage):
    """aiohttp-session's encrypted cookie, where a cookie that is not even UTF-8 is no session
    (a new, empty one) rather than an error."""

    async def load_session(self, request: web.Request) -> Session:
        try:
            return await super().load_session(request)
        except UnicodeError:
            return Session(None, data=None, new=True, max_age=self.max_age)


MAX_SESSIONS = 10_000  # signed-in sessions remembered (the oldest is signed out beyond that)


class ConsoleAccess:
    """Checks console tokens against `console.tokens` (constant-time over every known hash), and
    keeps the ids of the sessions signed in since start-up, so signing out revokes a session at once."""

    def __init__(self, config: ConsoleConfig) -> None:
        self._hashes = config.hashes()
        self.session_ttl_s = config.session_ttl
        self.storage = _CookieStorage(
            os.urandom(32),
            cookie_name=COOKIE_NAME,
            max_age=max(1, math.ceil(config.session_ttl)),
            path="/console/",
            httponly=True,
            samesite="Strict",
        )
        self._sessions: dict[str, float] = {}  # session id → expiry (time.monotonic(), s)

    def session_alive(self, sid: object) -> bool:
        """True while the session `sid` is signed in and within `session_ttl`."""
        expiry = self._sessions.get(sid) if isinstance(sid, str) else None
        if expiry is None or expiry < time.monotonic():
            if isinstance(sid, str):
                self._sessions.pop(sid, None)
            return False
        return True

    def operator_for(self, token: str) -> str | None:
        """The operator name of a console token, or None (also for a token UTF-8 cannot carry)."""
        raw = _utf8(token)
        if raw is None:
            return None
        digest = hashlib.sha256(raw).hexdigest()
        found = None
        for known, name in self._hashes.items():
            if hmac.compare_digest(digest, known):
                found = name
        return found

    def middlewares(self) -> list:
        """The console sub-application's middlewares: console-shaped errors, sessions, the access guard."""
        return [_console_errors, session_middleware(self.storage), self._guard()]

    def _guard(self):
        @web.middleware
        async def guard(request: web.Request, handler):
            if request.path in PUBLIC_PATHS or request.path.startswith(STATIC_PREFIX):
                return await handler(request)
            header = request.headers.get("Authorization")
            if header is not None:
                scheme, _, token = header.partition(" ")
                operator = (
                    self.operator_for(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
                )
                if operator is None:
                    log.warning(
                        "security_auth_failed",
                        reason="not a console token",
                        remote=request.remote,
                        path=request.path,
                    )
                    return error(401, "authentication required: that is not a console token")
                request[OPERATOR_KEY] = operator
                return await handler(request)
            session = await get_session(request)
            operator = session.get("operator")
            if (
                not isinstance(operator, str)
                or operator not in self._hashes.values()
                or not self.session_alive(session.get("sid"))
            ):
                return error(
                    401, "authentication required: sign in, or send Authorization: Bearer <console token>"
                )
            if request.method not in _SAFE_METHODS:
                problem = cross_site(request) or _csrf_problem(request, session.get("csrf"))
                if problem:
                    log.warning(
                        "security_csrf_refused", reason=problem, remote=request.remote, path=request.path
                    )
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
            except (ValueError, LookupError):  # not JSON, or an unknown charset
                return error(400, "the body is not JSON")
            token = body.get("token", "") if isinstance(body, dict) else ""
        else:
            try:
                form = await request.post()
            except (ValueError, LookupError):
                return error(400, "the body is not a form")
            value = form.get("token", "")
            token = value if isinstance(value, str) else ""
        operator = self.operator_for(token.strip()) if isinstance(token, str) and token.strip() else None
        if operator is None:
            log.warning(
                "security_auth_failed",
                reason="console sign-in with an unknown token",
                remote=request.remote,
                path=request.path,
            )
            return error(401, "unknown console token")
        session = await new_session(request)
        session["operator"] = operator
        session["csrf"] = secrets.token_urlsafe(32)
        session["sid"] = sid = secrets.token_urlsafe(16)
        self._sessions[sid] = time.monotonic() + self.session_ttl_s
        if len(self._sessions) > MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        log.info("console_sign_in", operator=operator, remote=request.remote)
        return web.json_response({"operator": operator, "csrf": session["csrf"]})

    async def logout(self, request: web.Request) -> web.Response:
        """`POST /console/logout`: end the session (the cookie is cleared)."""
        session = await get_session(request)
        self._sessions.pop(str(session.get("sid")), None)  # revoked now, even if the cookie was copied
        session.invalidate()
        return web.json_response({"signedOut": True})

    @staticmethod
    async def csrf_token(request: web.Request) -> str | None:
        """The CSRF token of the request's session (None for bearer requests)."""
        if request.headers.get("Authorization") is not None:
            return None
        value = (await get_session(request)).get("csrf")
        return value if isinstance(value, str) else None


@web.middleware
async def _console_errors(request: web.Request, handler):
    """aiohttp's own refusals under /console/ (404, 405, 413…) in the console's error shape."""
    try:
        return await handler(request)
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return error(exc.status, f"{exc.status} {exc.reason}: {request.method} {request.path}")


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
    sent = _utf8(request.headers.get(CSRF_HEADER, "")) or b""
    if not isinstance(expected, str) or not sent or not hmac.compare_digest(sent, expected.encode()):
        return f"missing or wrong {CSRF_HEADER} header (read it from GET /console/api/session)"
    return None
