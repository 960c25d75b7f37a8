"""Tenants and labels from identity tokens (--auth-oidc): bearer JWTs signed with locally generated RSA and EC keys,
verified against a JWKS file or URL. A valid token gets its tenant's and groups' scope; an expired one, another
audience, another issuer, `alg: none`, a key the set does not hold and a tampered payload each get a 401 in the
API's own format; API keys keep working beside tokens; a rotated key set is fetched again; a bad config names its
key."""
import base64
import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import anthropic
import httpx
import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from server_fixtures import _start

from prefixcache.config import Config
from prefixcache.server import auth
from prefixcache.server.config import ServeConfig
from prefixcache.server.oidc import OidcConfig, OidcVerifier

ISSUER, AUDIENCE = "https://login.example.test/tid-acme/v2.0", "api://prefixcache"
RSA_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
EC_KEY = ec.generate_private_key(ec.SECP256R1())
OTHER_KEY = rsa.generate_private_key(public_exponent=65537, key_size=2048)
LABELS = {"grp-finance-0001": "finance", "grp-eng-0002": "eng", "role-admin": "prefixcache-admin"}


def jwk(key, kid: str, alg: str) -> dict:
    algorithm = jwt.algorithms.RSAAlgorithm if alg.startswith("RS") else jwt.algorithms.ECAlgorithm
    return {**json.loads(algorithm.to_jwk(key.public_key())), "kid": kid, "alg": alg, "use": "sig"}


def token(key=RSA_KEY, kid="rsa-1", alg="RS256", **claims) -> str:
    now = int(time.time())
    body = {"iss": ISSUER, "aud": AUDIENCE, "tid": "acme", "sub": "user-1", "iat": now, "nbf": now - 5,
            "exp": now + 600, "groups": ["grp-finance-0001"], **claims}
    return jwt.encode({k: v for k, v in body.items() if v is not None}, key, algorithm=alg, headers={"kid": kid})


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("oidc")
    (d / "jwks.json").write_text(json.dumps({"keys": [jwk(RSA_KEY, "rsa-1", "RS256"), jwk(EC_KEY, "ec-1", "ES256")]}))
    (d / "oidc.json").write_text(json.dumps({"issuer": ISSUER, "audience": AUDIENCE, "jwks": str(d / "jwks.json"),
                                             "labels": LABELS, "admin_label": "prefixcache-admin",
                                             "limits": {"metered": {"rpm": 2}, "*": {"rpm": 1000}}}))
    (d / "keys.json").write_text(json.dumps({"sk-globex": {"tenant": "globex"}, "sk.dotted.key": {"tenant": "d"}}))
    return _start("oidc", ServeConfig(Config(model=tiny_model, min_cache_tokens=0), api_keys=str(d / "keys.json"),
                                      auth_oidc=str(d / "oidc.json")))


def complete(srv, credential: str, prompt: str = "Hello there", **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {credential}"}, timeout=60,
                      json={"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0, **kw})


def tampered(t: str) -> str:
    head, body, sig = t.split(".")
    claims = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    claims["tid"] = "globex"  # another tenant's cache, if the signature were not checked
    return ".".join([head, base64.urlsafe_b64encode(json.dumps(claims).encode()).rstrip(b"=").decode(), sig])


def unsigned() -> str:
    return jwt.encode(jwt.decode(token(), options={"verify_signature": False}), None, algorithm="none")


def test_rsa_and_ec_tokens_get_their_tenants_scope(srv):
    for t in (token(), token(EC_KEY, "ec-1", "ES256")):
        r = complete(srv, t)
        assert r.status_code == 200, r.text
    assert complete(srv, "sk-globex").status_code == 200  # API keys beside tokens
    assert complete(srv, "sk.dotted.key").status_code == 200  # a key is looked up first, though it looks like a JWT
    usage = httpx.get(f"{srv.url}/v1/cache/usage", headers={"Authorization": f"Bearer {token()}"})
    assert usage.status_code == 403  # a tenant's token is no admin's
    admin = token(groups=[], roles=["role-admin"])
    assert httpx.get(f"{srv.url}/v1/cache/usage", headers={"Authorization": f"Bearer {admin}"}).status_code == 200


@pytest.mark.parametrize("credential, why", [
    (lambda: token(exp=int(time.time()) - 300), "expired"),
    (lambda: token(aud="api://someone-else"), "Audience doesn't match"),
    (lambda: token(iss="https://evil.example.test/v2.0"), "Invalid issuer"),
    (lambda: token(nbf=int(time.time()) + 600), "not yet valid"),
    (unsigned, "algorithm 'none' is not accepted"),
    (lambda: token(OTHER_KEY, "rsa-9"), "not in the key set"),
    (lambda: token(OTHER_KEY, "rsa-1"), "Signature verification failed"),
    (lambda: tampered(token()), "Signature verification failed"),
    (lambda: token(tid=None), "no usable 'tid' claim"),
    (lambda: token(tid="*shared*"), "no usable 'tid' claim"),
])
def test_bad_tokens_get_401_in_each_apis_format(srv, credential, why):
    t = credential()
    r = complete(srv, t)
    assert r.status_code == 401 and why in r.json()["error"]["message"], r.text
    assert r.json()["error"]["code"] == "invalid_token"
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=srv.url, api_key=t, max_retries=0).messages.create(
            model="default", max_tokens=1, messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"


def test_one_tenants_users_share_only_what_their_groups_allow(srv):
    """Two users of one tenant: the same long prompt hits for the user with the same groups, never for the user
    whose groups differ (labels are part of the scope, exactly as a keys file's)."""
    prompt = "Quarterly figures, internal: " + " ".join(f"line {i} of the ledger" for i in range(60))
    finance, again = token(sub="user-1"), token(sub="user-2")
    eng = token(sub="user-3", groups=["grp-eng-0002"])
    first = complete(srv, finance, prompt).json()["usage"]
    assert complete(srv, eng, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    hit = complete(srv, again, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit >= first["prompt_tokens"] - 16


def test_a_token_naming_a_keys_file_tenant_is_another_tenant(srv):
    """The keys file's tenant globex and a token whose tenant claim is "globex": their entries are apart, and the
    token's purge leaves the keys file tenant's entries."""
    prompt = "Globex board minutes: " + " ".join(f"item {i} resolved" for i in range(60))
    claims = token(tid="globex", groups=[])
    first = complete(srv, "sk-globex", prompt).json()["usage"]
    assert complete(srv, claims, prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    purge = httpx.delete(f"{srv.url}/v1/cache", headers={"Authorization": f"Bearer {claims}"})
    assert purge.status_code == 200, purge.text
    hit = complete(srv, "sk-globex", prompt).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert hit >= first["prompt_tokens"] - 16


def test_a_keys_file_may_not_name_an_identity_tokens_tenant(tmp_path):
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"sk-x": {"tenant": "oidc:acme"}}))
    with pytest.raises(ValueError, match="tenant names starting 'oidc:' are identity tokens'"):
        auth.Keys(str(keys))


class Keys(BaseHTTPRequestHandler):
    jwks: dict = {}
    fetches = 0

    def do_GET(self):
        Keys.fetches += 1
        body = json.dumps(Keys.jwks).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_tenant_from_identity_tokens_gets_its_configured_rate_limit(srv):
    """`limits` in the OIDC config: tenant metered has 2 requests a minute, whichever user's token it comes with;
    another tenant has the "*" entry's."""
    codes = [complete(srv, token(tid="metered", sub=f"user-{i}")).status_code for i in range(3)]
    assert codes == [200, 200, 429]
    assert complete(srv, token(tid="other")).status_code == 200


def test_a_rotated_key_set_is_fetched_again(tmp_path):
    """A JWKS URL (plain http only on loopback): its set is cached, and fetched again for a kid it lacks."""
    Keys.jwks = {"keys": [jwk(RSA_KEY, "rsa-1", "RS256")]}
    http = ThreadingHTTPServer(("127.0.0.1", 0), Keys)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        cfg = tmp_path / "oidc.json"
        cfg.write_text(json.dumps({"issuer": ISSUER, "audience": AUDIENCE,
                                   "jwks": f"http://127.0.0.1:{http.server_port}/keys", "jwks_refetch_seconds": 0}))
        verifier = OidcVerifier(OidcConfig.read(str(cfg)), str(cfg))
        assert verifier.principal(token()).tenant == "oidc:acme" and verifier.principal(token()).labels == (
            "grp-finance-0001",)  # no labels mapping: the claim values as they are
        fetched = Keys.fetches
        verifier.principal(token())
        assert Keys.fetches == fetched  # cached
        Keys.jwks = {"keys": [jwk(RSA_KEY, "rsa-1", "RS256"), jwk(OTHER_KEY, "rsa-2", "RS256")]}  # rotation
        assert verifier.principal(token(OTHER_KEY, "rsa-2")).tenant == "oidc:acme"
        assert Keys.fetches == fetched + 1
    finally:
        http.shutdown()


@pytest.mark.parametrize("change, key", [
    ({"issuer": None}, "issuer is required"), ({"audience": 7}, "audience must be"),
    ({"jwks": "ftp://keys.example.test/jwks"}, "jwks must be a file or an https URL"),
    ({"jwks": "http://keys.example.test/jwks"}, "jwks must be a file or an https URL"),
    ({"jwks": "/nonexistent/jwks.json"}, "jwks: cannot read"), ({"algorithms": ["HS256"]}, "algorithms must be"),
    ({"labels": ["finance"]}, "labels must be"), ({"tenant_claim": ""}, "tenant_claim must be"),
    ({"leeway_seconds": -1}, "leeway_seconds must be"), ({"limits": {"a": {"rpm": 0}}}, "limits must be"),
    ({"limits": {"a": {"rpd": 5}}}, "limits must be"), ({"group_claim": "groups"}, "unknown key 'group_claim'"),
    ({"admin_label": "admin"}, "admin_label must be one of the values of `labels`"),
    ({"admin_label": "admin", "labels": {"grp-1": "finance"}}, "admin_label must be one of the values"),
])
def test_a_bad_config_names_its_key(tmp_path, change, key):
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [jwk(RSA_KEY, "rsa-1", "RS256")]}))
    raw = {k: v for k, v in {"issuer": ISSUER, "audience": AUDIENCE, "jwks": str(jwks), **change}.items()
           if v is not None}
    path = tmp_path / "oidc.json"
    path.write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=key):
        OidcVerifier(OidcConfig.read(str(path)), str(path))


def test_toml_config(tmp_path):
    jwks = tmp_path / "jwks.json"
    jwks.write_text(json.dumps({"keys": [jwk(EC_KEY, "ec-1", "ES256")]}))
    path = tmp_path / "oidc.toml"
    path.write_text(f'issuer = "{ISSUER}"\naudience = ["{AUDIENCE}", "other"]\njwks = "{jwks}"\n'
                    'label_claims = ["roles"]\n')
    verifier = OidcVerifier(OidcConfig.read(str(path)), str(path))
    assert verifier.principal(token(EC_KEY, "ec-1", "ES256", roles=["reader"])).labels == ("reader",)
