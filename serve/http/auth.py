"""API keys and tenants (`--api-key`, `--api-keys-file`, `--admin-key`).

Without keys the server is single-tenant: every client shares its sessions and its prefix cache
(it says so at start). With keys, every `/v1/` request needs `Authorization: Bearer KEY`, or
Anthropic's `x-api-key: KEY` (401 otherwise, in OpenAI's error shape; Anthropic's on its routes)
and runs as the key's tenant: a tenant's sessions are its own (another tenant naming the same
session id names a session of its own: it cannot read, continue or delete the first), its
lineages are its own, and its turns share the radix cache with its own sessions only (the engine
session's `salt`), so its usage reveals nothing of what another tenant cached. A request's
`cache_salt` (as vLLM's) splits a tenant's cache further. `POST /v1/snapshot` needs an admin
key (403 with a tenant's; refused while none is set). `/health` and `/metrics` stay open, as in
vLLM.

A key from `--api-key` names the tenant `key-` + the first 12 hex digits of its SHA-256 (stable
across restarts, so snapshots find their sessions' owners again); a keys file has one key a
line, `KEY` or `TENANT KEY`, blank lines and `#` comments ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import re
from collections.abc import Iterable
from pathlib import Path

from serve.http.errors import APIError

TENANT = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KEY = re.compile(r"^[!-~]{8,512}$")  # visible ASCII, as a header carries it


def _digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Tenants:
    """Who a request's key says it is. `keys`: key -> tenant; `admin`: the admin keys."""

    def __init__(self, keys: dict[str, str] | None = None, admin: Iterable[str] = ()):
        self._tenant = {_digest(k): t for k, t in (keys or {}).items()}
        self._admin = [_digest(k) for k in admin]
        for k in [*(keys or {}), *admin]:
            if not _KEY.match(k):
                raise ValueError("an API key is 8 to 512 visible ASCII characters, no spaces")

    @classmethod
    def from_args(cls, api_keys=(), keys_file: str | None = None, admin_keys=()) -> Tenants:
        keys = {k: f"key-{_digest(k)[:12]}" for k in api_keys}
        if keys_file is not None:
            keys |= _read_keys(Path(keys_file))
        if admin_keys and not keys:
            raise ValueError("--admin-key needs tenants' keys too (--api-key or --api-keys-file)")
        return cls(keys, admin_keys)

    @property
    def single(self) -> bool:
        """No keys: one tenant, "", and no checks."""
        return not self._tenant

    def tenant(self, authorization: str | None, api_key: str | None = None) -> str:
        """The tenant of an `Authorization` header's bearer key, else of an `x-api-key`
        header's key (Anthropic's; an admin key is a tenant of its own, "admin"); 401 without
        a known key."""
        if self.single:
            return ""
        key = _bearer(authorization) if authorization is not None or api_key is None else api_key
        digest = _digest(key.strip())
        if any(hmac.compare_digest(digest, a) for a in self._admin):
            return "admin"
        tenant = self._tenant.get(digest)
        if tenant is None:
            raise APIError(401, "invalid API key", None, "authentication_error", "invalid_api_key")
        return tenant

    def check_admin(self, authorization: str | None) -> None:
        """403 unless the header carries an admin key (nothing to check when single-tenant)."""
        if self.single:
            return
        if not self._admin:
            why = "admin routes are closed: this server was started without --admin-key"
            raise APIError(403, why, None, "permission_error", "admin_required")
        if self.tenant(authorization) != "admin":
            raise APIError(403, "this route needs an admin key", None, "permission_error",
                           "admin_required")  # fmt: skip


def _bearer(authorization: str | None) -> str:
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        why = "missing API key: send Authorization: Bearer KEY (or x-api-key: KEY)"
        raise APIError(401, why, None, "authentication_error", "invalid_api_key")
    return key.strip()


def _read_keys(path: Path) -> dict[str, str]:
    keys: dict[str, str] = {}
    for n, line in enumerate(path.read_text().splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2 or (len(words) == 2 and not TENANT.match(words[0])):
            raise ValueError(f"{path}:{n}: expected KEY or TENANT KEY (TENANT: {TENANT.pattern})")
        key = words[-1]
        keys[key] = words[0] if len(words) == 2 else f"key-{_digest(key)[:12]}"
    return keys


class Authenticate:
    """ASGI middleware: every `/v1/` request names its tenant with its key (`Authorization:
    Bearer`, or `x-api-key`; 401 otherwise); the tenant goes to the route as
    `request.state.tenant` ("" when single-tenant)."""

    def __init__(self, app, tenants: Tenants):
        self.app, self.tenants = app, tenants

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            state = scope.setdefault("state", {})
            state["tenant"] = ""
            if scope["path"].startswith("/v1/"):
                headers = dict(scope.get("headers") or [])
                auth, key = (headers.get(k) for k in (b"authorization", b"x-api-key"))
                try:
                    state["tenant"] = self.tenants.tenant(
                        None if auth is None else auth.decode("latin-1"),
                        None if key is None else key.decode("latin-1"),
                    )
                except APIError as e:
                    return await e.response(scope["path"])(scope, receive, send)
        return await self.app(scope, receive, send)


class SaltChanged(ValueError):
    """A turn names a session opened with another `cache_salt` (400, naming the field)."""

    param = "cache_salt"

    def __init__(self):
        super().__init__("cache_salt differs from the one the session was opened with")


def salt(tenant: str, cache_salt: str | None) -> str:
    """The engine session's salt for a tenant's turn: whose radix cache it shares."""
    return "" if not (tenant or cache_salt) else f"{tenant}/{cache_salt or ''}"


def scoped(tenant: str, name: str | None) -> str | None:
    """The key the server keeps a tenant's session name under (a name has no spaces)."""
    return name if name is None or not tenant else f"{tenant} {name}"


@dataclasses.dataclass(frozen=True)
class Caller:
    """Who asks (the key's tenant) and the session it names (None: a
    session of its own for this turn)."""

    tenant: str
    name: str | None

    @property
    def key(self) -> str | None:
        """The session's key in `HttpSessions` (its name within the tenant's)."""
        return scoped(self.tenant, self.name)
