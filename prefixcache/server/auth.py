"""API keys: each key names a tenant, its labels, and whether it may administer the whole cache.

`--api-keys FILE` is JSON: {"sk-key": {"tenant": "acme", "labels": ["finance"], "admin": false, "rpm": 60,
"tpm": 100000}, ...}; `rpm` and `tpm` (requests and prompt tokens per minute, server/limits.py) are optional, and
a tenant's: the lowest its keys give. Without a key file the server has one tenant, "local", and no authentication.
Keys are held only as SHA-256 digests and compared in constant time; the file is read again on SIGHUP. No key is
ever logged.
"""
import hashlib
import hmac
import json
import logging
from dataclasses import replace

from prefixcache.cache.scope import LOCAL_TENANT, SHARED_TENANT, validate_labels
from prefixcache.server.errors import ApiError
from prefixcache.server.oidc import TENANT_PREFIX, OidcVerifier
from prefixcache.server.principal import LOCAL, Principal

log = logging.getLogger("prefixcache.auth")


class Keys:
    def __init__(self, path: str):
        self.path = path
        self.entries = _per_tenant(_read(path))

    def lookup(self, key: str) -> Principal | None:
        """The key's principal. Every stored digest is compared, in constant time, so the time taken tells
        nothing about which keys exist or how much of one matched."""
        digest, found = _digest(key), None
        for stored, p in self.entries:
            if hmac.compare_digest(stored, digest):
                found = p
        return found

    def shares(self) -> dict[str, float]:
        """Tenant -> guaranteed fraction of the KV cache, for the tenants whose keys set `cache_share`."""
        return _shares(self.entries)

    def reload(self) -> None:
        """Read the file again (on SIGHUP); a file that does not parse leaves the current keys in force."""
        try:
            self.entries = _per_tenant(_read(self.path))
        except (OSError, ValueError, KeyError) as e:
            log.error("API keys not reloaded from %s: %s", self.path, type(e).__name__)
            return
        log.info("API keys reloaded: %d keys", len(self.entries))


def client_salt(cache_salt: str | None, prompt_cache_key: str | None) -> str:
    """The client's part of its cache scope. It is added to the scope the key gives, so it can only narrow it."""
    return "\x1f".join(s for s in (cache_salt, prompt_cache_key) if s)


def authenticate(keys: Keys | None, headers, oidc: OidcVerifier | None = None) -> Principal:
    """The caller: with neither keys nor --auth-oidc, the one local tenant; else from its credential (a bearer
    token or x-api-key): an API key of the keys file, or else, with OIDC, an identity token (a JWT: three
    dot-separated parts)."""
    if keys is None and oidc is None:
        return LOCAL
    auth = headers.get("authorization", "")
    key = auth[7:].strip() if auth.lower().startswith("bearer ") else headers.get("x-api-key", "")
    principal = keys.lookup(key) if keys else None
    if principal is None and oidc and key.count(".") == 2:
        return oidc.principal(key)
    if principal is None:
        raise ApiError(401, "invalid API key" if key else "missing API key", code="invalid_api_key")
    return principal


def _read(path: str) -> list[tuple[bytes, Principal]]:
    with open(path) as f:
        raw = json.load(f)
    entries = [(_digest(key), Principal(v["tenant"], _labels(path, v), bool(v.get("admin", False)), v.get("rpm"),
                                        v.get("tpm"), v.get("cache_share"))) for key, v in raw.items()]
    reserved = {p.tenant for _, p in entries} & {LOCAL_TENANT, SHARED_TENANT}
    if reserved:
        raise ValueError(f"{path}: the tenant names {LOCAL_TENANT!r} and {SHARED_TENANT!r} are reserved "
                         f"(the keyless server's tenant and the shared scope); rename {sorted(reserved)[0]!r}")
    if oidc := sorted(p.tenant for _, p in entries if p.tenant.startswith(TENANT_PREFIX)):
        raise ValueError(f"{path}: tenant names starting {TENANT_PREFIX!r} are identity tokens' (server/oidc.py); "
                         f"rename {oidc[0]!r}")
    shares = _shares(entries)
    if not all(0 < s <= 1 for s in shares.values()) or sum(shares.values()) > 1:
        raise ValueError(f"{path}: cache_share must be in (0, 1] and add up to at most 1 over tenants")
    return entries


def _labels(path: str, entry: dict) -> tuple[str, ...]:
    try:
        return validate_labels(entry.get("labels", []))
    except ValueError as e:  # named by its tenant: no key is ever logged
        raise ValueError(f"{path}: a key of tenant {entry['tenant']!r}: {e}") from None


def _shares(entries: list[tuple[bytes, Principal]]) -> dict[str, float]:
    """Each tenant's cache share: the largest its keys give."""
    shares: dict[str, float] = {}
    for _, p in entries:
        if p.cache_share is not None:
            shares[p.tenant] = max(shares.get(p.tenant, 0.0), float(p.cache_share))
    return shares


def _per_tenant(entries: list[tuple[bytes, Principal]]) -> list[tuple[bytes, Principal]]:
    """Rate limits are a tenant's, not a key's: each key of a tenant gets the lowest `rpm` and `tpm` that any of the
    tenant's keys sets (a key without one is limited by its tenant's others)."""
    lowest: dict[tuple[str, str], float] = {}
    for _, p in entries:
        for kind in ("rpm", "tpm"):
            if (limit := getattr(p, kind)) is not None:
                lowest[p.tenant, kind] = min(limit, lowest.get((p.tenant, kind), limit))
    return [(d, replace(p, rpm=lowest.get((p.tenant, "rpm")), tpm=lowest.get((p.tenant, "tpm")))) for d, p in entries]


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
