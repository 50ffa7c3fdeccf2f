"""The web UI: sign-in and sign-out, the usage dashboard (``/dashboard``) and the admin console (``/admin``).

Pages are Jinja2 templates from ``tessera/_web`` (package data: a symlink to the checkout's ``web/``); their
JavaScript calls the public HTTP API with the session cookie (``api/deps.py`` accepts it beside Bearer keys).
A sign-in exchanges an API key for a server-side session in Redis; the browser holds only a signed, HttpOnly,
SameSite=Strict cookie naming it, so the key never reaches page script or storage.
"""

from __future__ import annotations

import hashlib
import json
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from typing import Annotated, Any, get_args

from fastapi import APIRouter, FastAPI, Form, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates
from itsdangerous import BadSignature, URLSafeTimedSerializer
from pydantic import BaseModel, Field
from redis import Redis
from redis.exceptions import RedisError
from sqlalchemy.orm import Session

import billing
from tessera import PACKAGE_DATA, deployments
from tessera.api.admin_schemas import Quotas
from tessera.api.deps import CSRF_COOKIE, SESSION_COOKIE, WebSession, same_token, session_key
from tessera.auth import verify_key
from tessera.errors import APIError
from tessera.models import SCOPE_ADMIN, SCOPE_INFERENCE, ApiKey

WEB_DIR = (PACKAGE_DATA / "_web").resolve()
SESSION_TTL_S = 8 * 3600
SESSION_KEY_PREFIX = "tessera:web:session:"

# No inline script or style anywhere: every script and stylesheet is a file under /static.
CONTENT_SECURITY_POLICY = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "font-src 'self'; object-src 'none'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'"
)
PAGE_HEADERS = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "same-origin",
    "Cache-Control": "no-store",
}
BAD_KEY = (
    "That key was not accepted. Paste the whole key, starting with 'tsk_', of a key that is not revoked "
    "or expired; ask your administrator for a new one if it was."
)
EXPIRED_FORM = "The sign-in form expired. It has been reloaded: sign in again."
PAGES = {"/dashboard", "/admin"}

templates = Jinja2Templates(directory=str(WEB_DIR / "templates"))
router = APIRouter(tags=["web"])


class WebSessions:
    """Server-side sessions in Redis, expiring after ``ttl_s``. The cookie carries the session id signed with
    a key derived from the server secret; Redis holds only the id's SHA-256, so a Redis dump names no live
    session. A session stores the key's prefix, never the key: each request re-reads the key, so revoking
    it, or suspending its tenant, ends the session at once."""

    def __init__(self, redis: Redis, secret: bytes, ttl_s: int = SESSION_TTL_S):
        self.redis = redis
        self.ttl_s = ttl_s
        self._signer = URLSafeTimedSerializer(secret, salt="tessera-web-session")

    def create(self, key: ApiKey) -> tuple[str, WebSession]:
        """A new session for ``key``: the cookie value and the session (with its CSRF token)."""
        session_id = secrets.token_urlsafe(32)
        session = WebSession(key_prefix=key.prefix, tenant_id=key.tenant_id, csrf=secrets.token_urlsafe(32))
        with _store_errors():
            self.redis.set(self._name(session_id), json.dumps(session.__dict__), ex=self.ttl_s)
        return self._signer.dumps(session_id), session

    def load(self, cookie: str) -> WebSession | None:
        """The session a cookie names; None for a forged, expired or signed-out one (503 without Redis)."""
        session_id = self._session_id(cookie)
        if session_id is None:
            return None
        with _store_errors():
            raw = self.redis.get(self._name(session_id))
        if raw is None:
            return None
        return WebSession(**json.loads(raw))

    def drop(self, cookie: str) -> None:
        session_id = self._session_id(cookie)
        if session_id is not None:
            with _store_errors():
                self.redis.delete(self._name(session_id))

    def _session_id(self, cookie: str) -> str | None:
        try:
            return self._signer.loads(cookie, max_age=self.ttl_s)
        except BadSignature:  # also SignatureExpired
            return None

    @staticmethod
    def _name(session_id: str) -> str:
        return SESSION_KEY_PREFIX + hashlib.sha256(session_id.encode()).hexdigest()


@contextmanager
def _store_errors() -> Iterator[None]:
    try:
        yield
    except RedisError:
        raise APIError(
            503,
            "web sign-in is unavailable: the session store (Redis) cannot be reached; try again shortly",
            "session_store_unavailable",
        ) from None


def install(app: FastAPI, redis: Redis) -> None:
    """Serve the web UI from ``app``: static files, pages, and the sessions its routes and ``deps`` share."""
    settings = app.state.settings
    app.state.web_sessions = WebSessions(redis, settings.derive_key("web-session"))
    app.mount("/static", StaticFiles(directory=str(WEB_DIR / "static")), name="static")
    app.include_router(router)


# --- forms -----------------------------------------------------------------------------------------------


class SignInForm(BaseModel):
    api_key: str = Field("", max_length=300, description="a Tessera API key (tsk_...)")
    csrf_token: str = Field("", max_length=100, description="the token the sign-in page put in the form")
    next: str = Field("", max_length=100, description="the page to open after signing in")


class SignOutForm(BaseModel):
    csrf_token: str = Field("", max_length=100)


# --- pages -----------------------------------------------------------------------------------------------


def _page(request: Request, template: str, status: int = 200, **context: Any) -> HTMLResponse:
    response = templates.TemplateResponse(request, template, context, status_code=status)
    response.headers.update(PAGE_HEADERS)
    return response


def _signin_page(
    request: Request, *, message: str | None = None, status: int = 200, next_page: str = ""
) -> HTMLResponse:
    # The sign-in form's own CSRF token (double submit): a cookie and a hidden field that must match.
    token = request.cookies.get(CSRF_COOKIE) or secrets.token_urlsafe(32)
    response = _page(
        request, "signin.html", status, csrf_token=token, message=message, next_page=_safe_next(next_page)
    )
    _set_cookie(request, response, CSRF_COOKIE, token, http_only=False)
    return response


def _safe_next(value: str) -> str:
    """Only our own pages: a redirect target from a query string must not send the user elsewhere."""
    return value if value in PAGES else ""


def _set_cookie(request: Request, response: Response, name: str, value: str, *, http_only: bool) -> None:
    response.set_cookie(
        name,
        value,
        max_age=SESSION_TTL_S,
        path="/",
        httponly=http_only,
        samesite="strict",
        secure=request.url.scheme == "https",
    )


def _current(request: Request) -> tuple[WebSession, ApiKey] | None:
    with request.app.state.sessions() as session:
        return session_key(request, session)


def _context(web: WebSession, key: ApiKey) -> dict[str, Any]:
    return {
        "csrf_token": web.csrf,
        "tenant": key.tenant.name,
        "key_prefix": f"tsk_{key.prefix}",
        "key_id": key.id,
        "is_admin": key.has_scope(SCOPE_ADMIN),
        "can_use": key.has_scope(SCOPE_INFERENCE),
    }


@router.get("/signin", response_class=HTMLResponse, include_in_schema=False)
def signin_page(request: Request, next: str = "") -> HTMLResponse:
    return _signin_page(request, next_page=next)


@router.post(
    "/signin",
    response_class=HTMLResponse,
    status_code=303,
    responses={401: {"description": "the key was not accepted"}, 403: {"description": "the form expired"}},
)
def signin(request: Request, form: Annotated[SignInForm, Form()]) -> Response:
    """Exchange an API key for a session cookie, then open the dashboard (or the admin console)."""
    cookie_token = request.cookies.get(CSRF_COOKIE, "")
    if not (form.csrf_token and cookie_token and same_token(form.csrf_token, cookie_token)):
        return _signin_page(request, message=EXPIRED_FORM, status=403, next_page=form.next)
    raw = form.api_key.strip()
    if not raw:
        return _signin_page(request, message="Enter your API key.", status=400, next_page=form.next)
    with request.app.state.sessions() as session:
        key = verify_key(session, raw, version=request.app.state.key_version)
    if key is None:
        return _signin_page(request, message=BAD_KEY, status=401, next_page=form.next)
    sessions: WebSessions = request.app.state.web_sessions
    if previous := request.cookies.get(SESSION_COOKIE):
        sessions.drop(previous)  # one session per sign-in: the old cookie stops working
    cookie, web = sessions.create(key)
    target = _safe_next(form.next) or ("/dashboard" if key.has_scope(SCOPE_INFERENCE) else "/admin")
    response = RedirectResponse(target, status_code=303)
    _set_cookie(request, response, SESSION_COOKIE, cookie, http_only=True)
    _set_cookie(request, response, CSRF_COOKIE, web.csrf, http_only=False)
    return response


@router.post(
    "/signout",
    response_class=HTMLResponse,
    status_code=303,
    responses={403: {"description": "the form did not carry the session's token"}},
)
def signout(request: Request, form: Annotated[SignOutForm, Form()]) -> Response:
    """End the session (its token must come with the form) and clear its cookies."""
    cookie = request.cookies.get(SESSION_COOKIE)
    sessions: WebSessions = request.app.state.web_sessions
    web = sessions.load(cookie) if cookie else None
    if web is not None:
        if not (form.csrf_token and same_token(form.csrf_token, web.csrf)):
            return _page(
                request,
                "message.html",
                403,
                title="Not signed out",
                message="The sign-out form did not carry this session's token. Reload the page and try again.",
            )
        sessions.drop(cookie)
    response = RedirectResponse("/signin", status_code=303)
    for name in (SESSION_COOKIE, CSRF_COOKIE):
        response.delete_cookie(name, path="/", samesite="strict", secure=request.url.scheme == "https")
    return response


@router.get("/dashboard", response_class=HTMLResponse, include_in_schema=False)
def dashboard(request: Request) -> Response:
    current = _current(request)
    if current is None:
        return RedirectResponse("/signin?next=/dashboard", status_code=303)
    web, key = current
    if not key.has_scope(SCOPE_INFERENCE):
        return _page(
            request,
            "message.html",
            403,
            title="No usage to show",
            message="This key has no 'inference' scope, so it has no usage of its own. "
            "Sign in with a tenant key to see a tenant's usage.",
            **_context(web, key),
        )
    with request.app.state.sessions() as session:
        prices = _current_prices(session)
    return _page(request, "dashboard.html", page="dashboard", prices=prices, **_context(web, key))


@router.get("/admin", response_class=HTMLResponse, include_in_schema=False)
def admin_console(request: Request) -> Response:
    current = _current(request)
    if current is None:
        return RedirectResponse("/signin?next=/admin", status_code=303)
    web, key = current
    if not key.has_scope(SCOPE_ADMIN):
        return _page(
            request,
            "message.html",
            403,
            title="Admin keys only",
            message=f"You are signed in with a key of tenant '{key.tenant.name}' that has no 'admin' scope. "
            "Sign out and sign in with an admin key to open the admin console.",
            **_context(web, key),
        )
    return _page(
        request,
        "admin.html",
        page="admin",
        choices=_deployment_choices(),
        quota_fields=_quota_fields(),
        **_context(web, key),
    )


def _current_prices(session: Session) -> dict[str, dict[str, int]]:
    """Each model's price in effect now (micro-USD per 1M tokens), for the money the prefix cache saved."""
    book = billing.PriceBook(session)
    now = datetime.now(timezone.utc)
    models = {p.model for p in billing.list_prices(session)}
    prices = {}
    for model in models:
        price = book.at(model, now)
        if price is not None:
            prices[model] = {
                "fresh_input": price.fresh_input_per_mtok,
                "cached_input": price.cached_input_per_mtok,
                "output": price.output_per_mtok,
            }
    return prices


def _quota_fields() -> list[dict[str, str]]:
    """The quotas form's inputs, from the API's own schema, so the form offers every limit the API takes."""
    fields = []
    for name, field in Quotas.model_fields.items():
        label = re.split(r" \(|;", field.description or name.replace("_", " "))[0]
        whole = int in get_args(field.annotation)
        fields.append(
            {"name": name, "label": label[:1].upper() + label[1:], "step": "1" if whole else "0.000001"}
        )
    return fields


def _deployment_choices() -> dict[str, list[str]]:
    """The allowed values of each choice field of a deployment, for the console's selects."""
    fields = deployments.DeploymentConfig.model_fields
    choices = {}
    for name, field in fields.items():
        args = get_args(field.annotation)
        if args and all(isinstance(a, str) for a in args):
            choices[name] = list(args)
    return choices
