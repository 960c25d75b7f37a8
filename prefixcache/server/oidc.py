"""Tenants and labels from identity tokens: `--auth-oidc FILE` (JSON, or TOML by its .toml name).

    {"issuer": "https://login.microsoftonline.com/<tenant id>/v2.0",
     "audience": "api://prefixcache",                       # or a list
     "jwks": "https://login.microsoftonline.com/<tenant id>/discovery/v2.0/keys",   # or a JWKS file
     "tenant_claim": "tid",                                 # default
     "label_claims": ["groups", "roles"],                   # default
     "labels": {"<group object id>": "finance"},            # optional: claim values to labels; others dropped
     "admin_label": "prefixcache-admin",                    # optional: the label that makes an admin
     "limits": {"<tenant id>": {"rpm": 60, "tpm": 100000},  # optional: rate limits by tenant, as a keys file's;
                "*": {"rpm": 600}}}                         # "*": every tenant not named

A bearer JWT is verified with PyJWT against the JWKS: signature (asymmetric algorithms only, so never `none` or an
HMAC keyed by a public key), issuer, audience, expiry and not-before (with `leeway_seconds`, default 30). Keys are
looked up by `kid`; a URL's key set is cached (`jwks_cache_seconds`) and fetched again for a `kid` it does not hold
(the provider rotated its keys; at most every `jwks_refetch_seconds`), a file's is read again when it changes.
The tenant is the tenant claim in a namespace of its own, "oidc:<claim>" (so a token whose claim names a keys
file's tenant is another tenant: it never reads or purges that tenant's entries), the labels the label claims' values
(through `labels` when given); they form the cache scope exactly as a keys file's do. `admin_label` needs `labels`
and must be one of its values: without the mapping it would match raw claim values, and a user who may name a group
"admin" would be admin. A token whose labels a scope cannot hold (more than MAX_LABELS, one longer
than MAX_LABEL_LENGTH or not printable: cache/scope.py) is refused with a 401 saying so, never served with some of
its labels dropped or cut: a smaller label set is another scope, one that other users' entries live in, and whose
purge is theirs. A provider that sends many groups needs `labels` to map the ones that matter. API keys work beside
tokens. A tenant's rate limits (server/limits.py) are its entry in `limits`, else the entry "*", else none. A bad
config fails startup with the key that is wrong.
"""
import json
import os
import threading
import tomllib
from dataclasses import dataclass, field, fields
from urllib.parse import urlparse

import jwt

from prefixcache.cache.scope import LOCAL_TENANT, SHARED_TENANT, validate_labels
from prefixcache.server.errors import ApiError
from prefixcache.server.principal import Principal

TENANT_PREFIX = "oidc:"  # identity tokens' tenants; keys files may not name one so (server/auth.py)
ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
LOOPBACK = ("127.0.0.1", "localhost", "::1")  # where a plain-http JWKS URL is allowed (tests, a local proxy)


@dataclass(frozen=True)
class OidcConfig:
    issuer: str
    audience: str | list[str]
    jwks: str  # a JWKS file, or an https URL
    tenant_claim: str = "tid"
    label_claims: list[str] = field(default_factory=lambda: ["groups", "roles"])
    labels: dict[str, str] | None = None
    limits: dict[str, dict[str, float]] = field(default_factory=dict)  # tenant or "*" -> {"rpm": .., "tpm": ..}
    admin_label: str | None = None
    algorithms: list[str] = field(default_factory=lambda: list(ASYMMETRIC))
    leeway_seconds: float = 30.0
    jwks_cache_seconds: float = 300.0  # a URL's key set is fetched again after this long
    jwks_refetch_seconds: float = 30.0  # and for a kid it lacks at most this often (tokens with made-up kids)

    @classmethod
    def read(cls, path: str) -> "OidcConfig":
        """The config file; a ValueError names the file and the key that is wrong."""
        with open(path, "rb") as f:
            raw = tomllib.load(f) if path.endswith(".toml") else json.load(f)
        if not isinstance(raw, dict):
            raise ValueError(f"{path}: the OIDC config must be an object of keys")
        known = {f.name for f in fields(cls)}
        for key in raw:
            if key not in known:
                raise ValueError(f"{path}: unknown key {key!r} (known: {', '.join(sorted(known))})")
        for key in ("issuer", "audience", "jwks"):
            if key not in raw:
                raise ValueError(f"{path}: {key} is required")

        def bad(key: str, what: str) -> ValueError:
            return ValueError(f"{path}: {key} must be {what}, got {raw[key]!r}")

        for key in ("issuer", "jwks", "tenant_claim", "admin_label"):
            if key in raw and not (isinstance(raw[key], str) and raw[key]):
                raise bad(key, "a non-empty string")
        aud = raw["audience"]
        if not (isinstance(aud, str) and aud) and not (isinstance(aud, list) and aud and all(
                isinstance(a, str) and a for a in aud)):
            raise bad("audience", "a string or a list of strings")
        for key in ("label_claims", "algorithms"):
            if key in raw and not (isinstance(raw[key], list) and all(isinstance(v, str) for v in raw[key])):
                raise bad(key, "a list of strings")
        if "labels" in raw and not (isinstance(raw["labels"], dict) and all(
                isinstance(k, str) and isinstance(v, str) and v for k, v in raw["labels"].items())):
            raise bad("labels", "an object of claim values to label names")
        for label in raw.get("labels", {}).values():
            try:
                validate_labels([label])
            except ValueError as e:
                raise ValueError(f"{path}: labels: {e}") from None
        if "limits" in raw and not (isinstance(raw["limits"], dict) and all(
                isinstance(v, dict) and set(v) <= {"rpm", "tpm"} and all(
                    isinstance(n, (int, float)) and not isinstance(n, bool) and n > 0 for n in v.values())
                for v in raw["limits"].values())):
            raise bad("limits", 'an object of tenants (or "*") to {"rpm": n, "tpm": n}, each number above 0')
        for key in ("leeway_seconds", "jwks_cache_seconds", "jwks_refetch_seconds"):
            if key in raw and (isinstance(raw[key], bool) or not isinstance(raw[key], (int, float)) or raw[key] < 0):
                raise bad(key, "a number of seconds, 0 or more")
        if "admin_label" in raw and raw["admin_label"] not in (raw.get("labels") or {}).values():
            raise bad("admin_label", "one of the values of `labels` (claim values map to it; never a raw claim value)")
        cfg = cls(**raw)
        if not cfg.algorithms or set(cfg.algorithms) - set(ASYMMETRIC):
            raise bad("algorithms", f"some of {', '.join(ASYMMETRIC)} (asymmetric only)")
        url = urlparse(cfg.jwks)
        if url.scheme == "http" and url.hostname not in LOOPBACK or url.scheme not in ("", "http", "https"):
            raise bad("jwks", "a file or an https URL")
        return cfg


class OidcVerifier:
    """Bearer tokens to principals, against the config's issuer, audience and key set."""

    def __init__(self, cfg: OidcConfig, path: str):
        self.cfg = cfg
        self.lock = threading.Lock()
        if urlparse(cfg.jwks).scheme:
            self.client = jwt.PyJWKClient(cfg.jwks, cache_jwk_set=True, lifespan=max(cfg.jwks_cache_seconds, 1),
                                          timeout=5, cooldown_duration=cfg.jwks_refetch_seconds)
            try:
                self.client.get_jwk_set()
            except jwt.PyJWKClientError as e:
                raise ValueError(f"{path}: jwks: cannot read {cfg.jwks}: {e}") from None
        else:
            self.client, self.mtime, self.keys = None, None, {}
            try:
                self._read_file()
            except (OSError, ValueError, jwt.PyJWKError) as e:
                raise ValueError(f"{path}: jwks: cannot read {cfg.jwks}: {e}") from None

    def principal(self, token: str) -> Principal:
        """The token's principal; an ApiError 401 says why a token is refused (503: the keys cannot be fetched)."""
        try:
            header = jwt.get_unverified_header(token)
            alg = header.get("alg")
            if alg not in self.cfg.algorithms:
                raise refused(f"the token's algorithm {alg!r} is not accepted")
            key = self._key(header.get("kid"))  # PyJWT refuses a key of another type than the algorithm's
            claims = jwt.decode(token, key.key, algorithms=[alg], audience=self.cfg.audience, issuer=self.cfg.issuer,
                                leeway=self.cfg.leeway_seconds, options={"require": ["exp", "iss", "aud"]})
        except jwt.PyJWKClientConnectionError:
            raise ApiError(503, "the identity provider's signing keys cannot be fetched") from None
        except jwt.PyJWTError as e:
            raise refused(f"invalid token: {e}") from None
        tenant = claims.get(self.cfg.tenant_claim)
        if not isinstance(tenant, str) or not tenant or tenant in (LOCAL_TENANT, SHARED_TENANT):
            raise refused(f"the token has no usable {self.cfg.tenant_claim!r} claim")
        try:
            labels = validate_labels(list(self._labels(claims)))
        except ValueError as e:
            raise refused(f"the token's labels cannot form a cache scope: {e}") from None
        limits = self.cfg.limits.get(tenant, self.cfg.limits.get("*", {}))
        return Principal(TENANT_PREFIX + tenant, labels, admin=self.cfg.admin_label in labels, rpm=limits.get("rpm"),
                         tpm=limits.get("tpm"))

    def _labels(self, claims: dict) -> set[str]:
        values = []
        for claim in self.cfg.label_claims:
            v = claims.get(claim)
            values += [v] if isinstance(v, str) else [x for x in v if isinstance(x, str)] if isinstance(v, list) else []
        mapping = self.cfg.labels
        return {mapping[v] for v in values if v in mapping} if mapping is not None else set(values)

    def _key(self, kid: str | None) -> jwt.PyJWK:
        if self.client:
            return self.client.get_signing_key(kid)  # fetches the set again for a kid it does not hold
        with self.lock:
            if os.stat(self.cfg.jwks).st_mtime_ns != self.mtime:
                self._read_file()
            found = self.keys.get(kid)
        if found is None:
            raise refused("the token's key is not in the key set")
        return found

    def _read_file(self) -> None:
        mtime = os.stat(self.cfg.jwks).st_mtime_ns
        with open(self.cfg.jwks) as f:
            keys = jwt.PyJWKSet.from_dict(json.load(f)).keys
        self.keys, self.mtime = {k.key_id: k for k in keys}, mtime


def refused(message: str) -> ApiError:
    return ApiError(401, message, code="invalid_token")
