"""API keys: each key names a tenant, its labels, and whether it may administer the whole cache.

`--api-keys FILE` is JSON: {"sk-key": {"tenant": "acme", "labels": ["finance"], "admin": false}, ...}.
Without a key file the server has one tenant, "local", and no authentication.
"""
import json
from dataclasses import dataclass

from fastapi import Request

from prefixcache.server.errors import ApiError


@dataclass(frozen=True)
class Principal:
    tenant: str
    labels: tuple[str, ...] = ()
    admin: bool = False


LOCAL = Principal("local", admin=True)


def load_keys(path: str) -> dict[str, Principal]:
    with open(path) as f:
        raw = json.load(f)
    return {key: Principal(v["tenant"], tuple(sorted(v.get("labels", []))), bool(v.get("admin", False)))
            for key, v in raw.items()}


def principal(request: Request) -> Principal:
    """FastAPI dependency: the caller, from its API key (resolved before the body is validated, so a bad key is
    a 401 whatever the body)."""
    return authenticate(request.app.state.server.keys, request.headers)


def client_salt(cache_salt: str | None, prompt_cache_key: str | None) -> str:
    """The client's part of its cache scope. It is added to the scope the key gives, so it can only narrow it."""
    return "\x1f".join(s for s in (cache_salt, prompt_cache_key) if s)


def authenticate(keys: dict[str, Principal] | None, headers) -> Principal:
    if keys is None:
        return LOCAL
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
    principal = keys.get(key)
    if principal is None:
        raise ApiError(401, "invalid API key" if key else "missing API key", code="invalid_api_key")
    return principal
