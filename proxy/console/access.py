"""Who may use the console: console tokens (bearer or sign-in form), sessions, CSRF protection,
and the throttle on wrong console credentials.

- `Authorization: Bearer <console token>` works on every console request (scripts, tests). A
  wrong or client token is a 401; it never falls back to a session cookie.
- People sign in at `POST /console/login` (form field or JSON key `token`). The session lives in
  the task store (`console:<sid>`, expiring after `console.session_ttl`), so it survives a restart
  and holds on every replica, and signing out deletes it everywhere at once. The browser holds an
  encrypted, signed cookie (Fernet) with the session id, the operator and the CSRF token; its key
  is derived from the deployment's key (`ConsoleData.cookie_key`). It is HttpOnly,
  SameSite=Strict, scoped to `/console/`, and Secure per `console.secure_cookie` (by default when
  the sign-in came over TLS or a trusted proxy said `X-Forwarded-Proto: https`).
- Mutating requests made with the cookie need the session's CSRF token in `X-CSRF-Token` (the
  page reads it from `GET /console/api/session`, which a cross-site page cannot read) and must
  come from the console's own origin (`Origin` and `Sec-Fetch-Site` checked when sent). The
  sign-in form is checked for the origin too.
- Wrong console tokens (bearer or sign-in) count against `limits.failed_auth` per client address
  (the same counters as client credentials): past it, 429 with `Retry-After`.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import secrets
import warnings
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, cast
from urllib.parse import urlsplit

import structlog
from aiohttp import web
from aiohttp.web_exceptions import NotAppKeyWarning
from aiohttp_session import (
    AbstractStorage,
    Session,
    SessionData,
    get_session,
    new_session,
    session_middleware,
)
from cryptography import fernet
from cryptography.fernet import InvalidToken

from proxy.config import ConsoleConfig, ListenConfig
from proxy.protocol import jsonrpc
from proxy.replicas.node import Replicas
from proxy.runtime.running import RunningRequests
from proxy.tasks.rates import FailedAttempts
from proxy.tasks.service import TaskService
from proxy.tasks.store import StoreUnavailableError

log = structlog.get_logger("proxy.console")
# aiohttp-session keeps its state under plain string keys of the request; aiohttp warns about each.
warnings.filterwarnings("ignore", category=NotAppKeyWarning, module="aiohttp_session")

OPERATOR_KEY = web.RequestKey("console_operator", str)
COOKIE_NAME = "mcp_tasks_proxy_console"
SESSION_PREFIX = "console:"  # store keys of signed-in sessions (the store's small key-value map)
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


class ConsoleData:
    """What the console reads and acts on, opened with the root application (its cleanup context
    puts it under `CONSOLE_KEY`): the task service, the upstream pools by server name, this
    process's requests in flight, the replica side (None without `replicas`), and the session
    cookie's key (32 bytes, the same on every replica and across restarts)."""

    def __init__(
        self,
        tasks: TaskService,
        pools: Mapping[str, Any],
        *,
        running: RunningRequests,
        replicas: Replicas | None,
        cookie_key: bytes,
    ) -> None:
        self.tasks = tasks
        self.pools = pools
        self.running = running
        self.replicas = replicas
        self.fernet = fernet.Fernet(base64.urlsafe_b64encode(cookie_key[:32]))


CONSOLE_KEY = web.AppKey("console_data", ConsoleData)


class _CookieStorage(AbstractStorage):
    """The session cookie: JSON encrypted and signed with the deployment's Fernet key (read from
    `CONSOLE_KEY` per request). A cookie that does not decrypt, or is not even UTF-8, is no session
    (a new, empty one) rather than an error. `secure(request)` says whether to mark it Secure."""

    def __init__(self, *, max_age: int, secure: Callable[[web.Request], bool]) -> None:
        super().__init__(
            cookie_name=COOKIE_NAME, max_age=max_age, path="/console/", httponly=True, samesite="Strict"
        )
        self._secure = secure

    async def load_session(self, request: web.Request) -> Session:
        cookie = self.load_cookie(request)
        if cookie is not None:
            try:
                text = request.config_dict[CONSOLE_KEY].fernet.decrypt(cookie.encode(), ttl=self.max_age)
                data = json.loads(text)
            except (InvalidToken, UnicodeError, ValueError, KeyError):
                data = None
            if isinstance(data, dict) and isinstance(data.get("session"), dict):
                return Session(None, data=cast(SessionData, data), new=False, max_age=self.max_age)
        return Session(None, data=None, new=True, max_age=self.max_age)

    async def save_session(
        self, request: web.Request, response: web.StreamResponse, session: Session
    ) -> None:
        params = self._cookie_params
        self._cookie_params = {**params, "secure": self._secure(request)}
        try:
            if session.empty:
                self.save_cookie(response, "", max_age=session.max_age)
                return
            payload = json.dumps(self._get_session_data(session)).encode()
            token = request.config_dict[CONSOLE_KEY].fernet.encrypt(payload).decode()
            self.save_cookie(response, token, max_age=session.max_age)
        finally:
            self._cookie_params = params


class ConsoleAccess:
    """Checks console tokens against `config.tokens` (constant-time over every known hash), keeps
    signed-in sessions in the task store (`console:<sid>`), and throttles wrong tokens per client
    address with `throttle` (`listen` says which address that is, and whether a request came over
    HTTPS)."""

    def __init__(self, config: ConsoleConfig, *, throttle: FailedAttempts, listen: ListenConfig) -> None:
        self._hashes = config.hashes()
        self._by_prefix = {digest[:16]: name for digest, name in self._hashes.items()}  # a session's token
        self.session_ttl_s = config.session_ttl
        self.throttle = throttle
        self.listen = listen
        self.secure_cookie = config.secure_cookie
        self.storage = _CookieStorage(max_age=max(1, math.ceil(config.session_ttl)), secure=self._secure)

    def _secure(self, request: web.Request) -> bool:
        if self.secure_cookie is not None:
            return self.secure_cookie
        return self.listen.via_https(
            request.remote,
            ",".join(request.headers.getall("X-Forwarded-Proto", [])) or None,
            tls=request.transport is not None and request.transport.get_extra_info("sslcontext") is not None,
        )

    def _address(self, request: web.Request) -> str:
        return self.listen.client_address(request.remote, request.headers.getall("X-Forwarded-For", []))

    async def session_alive(self, request: web.Request, sid: object, operator: str) -> bool:
        """True while the session `sid` of `operator` is signed in: its store entry is there and
        unexpired, and the console token it signed in with is still in the config (rotating a
        token ends its sessions). Raises StoreUnavailableError."""
        if not isinstance(sid, str) or not sid:
            return False
        entry = await _tasks(request).store.session_get(SESSION_PREFIX + sid)
        if entry is None or entry.get("operator") != operator:
            return False
        token = entry.get("token")
        return isinstance(token, str) and self._by_prefix.get(token) == operator

    def operator_for(self, token: str) -> str | None:
        """The operator name of a console token, or None (also for a token UTF-8 cannot carry)."""
        found = self._match(token)
        return None if found is None else found[0]

    def _match(self, token: str) -> tuple[str, str] | None:
        """(operator, the first 16 hex digits of the token's hash) of a console token, or None."""
        raw = _utf8(token)
        if raw is None:
            return None
        digest = hashlib.sha256(raw).hexdigest()
        found = None
        for known, name in self._hashes.items():
            if hmac.compare_digest(digest, known):
                found = (name, known[:16])
        return found

    def middlewares(self) -> list:
        """The console sub-application's middlewares: console-shaped errors, sessions, the access guard."""
        return [_console_errors, session_middleware(self.storage), self._guard()]

    def _guard(self):
        @web.middleware
        async def guard(request: web.Request, handler):
            if request.path in PUBLIC_PATHS or request.path.startswith(STATIC_PREFIX):
                return await handler(request)
            if len(request.headers.getall("Authorization", [])) > 1:  # which counts: never guessed
                return error(401, "authentication required: send one Authorization header")
            header = request.headers.get("Authorization")
            if header is not None:
                refused = await self._throttled(request, header)
                if refused is not None:
                    return refused
                scheme, _, token = header.partition(" ")
                operator = (
                    self.operator_for(token.strip()) if scheme.lower() == "bearer" and token.strip() else None
                )
                if operator is None:
                    self._failed(request, "not a console token")
                    return error(401, "authentication required: that is not a console token")
                self.throttle.remember_good(header)
                request[OPERATOR_KEY] = operator
                return await handler(request)
            session = await get_session(request)
            operator = session.get("operator")
            if not isinstance(operator, str):
                operator = ""
            try:  # session_alive also checks the operator's token is still configured
                alive = await self.session_alive(request, session.get("sid"), operator)
            except StoreUnavailableError:
                return error(503, "sessions cannot be checked: the task store is unavailable")
            if not alive:
                return error(
                    401, "authentication required: sign in, or send Authorization: Bearer <console token>"
                )
            if request.method not in _SAFE_METHODS:
                problem = cross_site(request) or _csrf_problem(request, session.get("csrf"))
                if problem:
                    log.warning(
                        "security_csrf_refused",
                        reason=problem,
                        remote=self._address(request),
                        path=request.path,
                    )
                    return error(403, problem)
            request[OPERATOR_KEY] = operator
            return await handler(request)

        return guard

    async def _throttled(self, request: web.Request, credential: str) -> web.Response | None:
        """Count the attempt (`FailedAttempts.admit`); 429 with Retry-After when the request's
        address is past `limits.failed_auth`, else None."""
        wait_s = await self.throttle.admit(credential, self._address(request), path=request.path)
        if wait_s is None:
            return None
        response = error(429, f"too many wrong console tokens from this address; retry after {wait_s} s")
        response.headers["Retry-After"] = str(wait_s)
        return response

    def _failed(self, request: web.Request, reason: str) -> None:
        log.warning("security_auth_failed", reason=reason, remote=self._address(request), path=request.path)

    async def login(self, request: web.Request) -> web.Response:
        """`POST /console/login` with `token` (form or JSON): a new session (kept in the store);
        401 for a wrong token, 429 past `limits.failed_auth`, 503 when the store cannot keep it."""
        problem = cross_site(request)
        if problem:
            return error(403, problem)
        token = ""
        if request.content_type == "application/json":
            try:
                body = jsonrpc.loads(await request.text())
            except jsonrpc.TooDeepError:
                return error(400, "the body nests JSON too deeply to read")
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
        token = token.strip() if isinstance(token, str) else ""
        if token:
            refused = await self._throttled(request, "Bearer " + token)
            if refused is not None:
                return refused
        found = self._match(token) if token else None
        if found is None:
            if token:
                self._failed(request, "console sign-in with an unknown token")
            return error(401, "unknown console token")
        operator, token_id = found
        self.throttle.remember_good("Bearer " + token)
        sid = secrets.token_urlsafe(16)
        try:
            await _tasks(request).store.session_put(
                SESSION_PREFIX + sid,
                {"operator": operator, "token": token_id},
                int(self.session_ttl_s * 1000),
            )
        except StoreUnavailableError:
            return error(503, "cannot sign in: the task store is unavailable")
        session = await new_session(request)
        session["operator"] = operator
        session["csrf"] = secrets.token_urlsafe(32)
        session["sid"] = sid
        log.info("console_sign_in", operator=operator, remote=self._address(request))
        return web.json_response({"operator": operator, "csrf": session["csrf"]})

    async def logout(self, request: web.Request) -> web.Response:
        """`POST /console/logout`: end the session everywhere (its store entry is deleted, so a copied
        cookie stops working on every replica) and clear the cookie."""
        session = await get_session(request)
        sid = session.get("sid")
        if isinstance(sid, str) and sid:
            try:
                await _tasks(request).store.session_delete(SESSION_PREFIX + sid)
            except StoreUnavailableError:
                return error(503, "cannot sign out: the task store is unavailable")
        session.invalidate()
        return web.json_response({"signedOut": True})

    def signed_in_check(self, request: web.Request) -> Callable[[], Awaitable[bool]] | None:
        """For a long stream: whether the request's session is still signed in (asked again while the
        stream lasts; the store being unreachable counts as yes). None for a bearer request: its token
        was checked, and the config does not change under a running proxy."""
        if request.headers.get("Authorization") is not None:
            return None
        operator = request[OPERATOR_KEY]

        async def check() -> bool:
            session = await get_session(request)
            try:
                return await self.session_alive(request, session.get("sid"), operator)
            except StoreUnavailableError:
                return True

        return check

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


def _tasks(request: web.Request) -> TaskService:
    return request.config_dict[CONSOLE_KEY].tasks
