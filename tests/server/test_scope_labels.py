"""Labels are part of the scope as a set of strings, never as a joined text: the label "finance,legal" and the two
labels "finance" and "legal" of one tenant never read each other's entries, and one's purge leaves the other's. Labels
a scope cannot hold are refused where they enter: in the API keys file (startup, SIGHUP) and in identity tokens."""
import json

import httpx
import pytest
from server_fixtures import _start
from test_oidc import AUDIENCE, ISSUER, RSA_KEY, jwk, token

from prefixcache.cache.scope import MAX_LABEL_LENGTH, MAX_LABELS
from prefixcache.config import Config
from prefixcache.server.auth import Keys
from prefixcache.server.config import ServeConfig
from prefixcache.server.errors import ApiError
from prefixcache.server.oidc import OidcConfig, OidcVerifier

KEYS = {"sk-joined": {"tenant": "acme", "labels": ["finance,legal"]},
        "sk-pair": {"tenant": "acme", "labels": ["finance", "legal"]}}


@pytest.fixture(scope="module")
def srv(tiny_model, tmp_path_factory):
    d = tmp_path_factory.mktemp("labels")
    (d / "keys.json").write_text(json.dumps(KEYS))
    return _start("labels", ServeConfig(Config(model=tiny_model, min_cache_tokens=0), api_keys=str(d / "keys.json")))


def cached(srv, key: str, prompt: str) -> tuple[int, int]:
    """(cached tokens, prompt tokens) of one request."""
    r = httpx.post(f"{srv.url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=60,
                   json={"model": "default", "prompt": prompt, "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens_details"]["cached_tokens"], usage["prompt_tokens"]


def hit(srv, key: str, prompt: str) -> bool:
    """Whether every full block of the prompt was served from the cache."""
    n, prompt_tokens = cached(srv, key, prompt)
    return n >= prompt_tokens - 16


def ledger(tag: str) -> str:
    return f"{tag} quarterly figures, internal: " + " ".join(f"line {i} of the ledger" for i in range(40))


def test_a_joined_label_and_its_parts_never_share_an_entry(srv):
    prompt = ledger("Shared")
    cached(srv, "sk-joined", prompt)
    assert hit(srv, "sk-joined", prompt)
    assert cached(srv, "sk-pair", prompt)[0] == 0
    assert hit(srv, "sk-pair", prompt) and hit(srv, "sk-joined", prompt)


def test_a_purge_of_one_label_set_leaves_the_others_entries(srv):
    mine, theirs = ledger("Purged"), ledger("Kept")
    cached(srv, "sk-joined", mine)  # the joined label's scope is created first
    cached(srv, "sk-pair", theirs)
    r = httpx.delete(f"{srv.url}/v1/cache", headers={"Authorization": "Bearer sk-joined"})
    assert r.status_code == 200 and r.json()["purged_blocks"] > 0
    assert hit(srv, "sk-pair", theirs)
    assert cached(srv, "sk-joined", mine)[0] == 0


@pytest.mark.parametrize("labels, problem", [
    (["fin\x00ance"], "non-printable"), (["finance\r\nlegal"], "non-printable"), ("finance", "a list of"),
    ([f"g{i}" for i in range(MAX_LABELS + 1)], "at most 16"), (["x" * (MAX_LABEL_LENGTH + 1)], "at most 128"),
])
def test_a_keys_file_with_a_bad_label_is_refused_naming_file_and_tenant(tmp_path, labels, problem):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({**KEYS, "sk-bad": {"tenant": "globex", "labels": labels}}))
    with pytest.raises(ValueError, match=problem) as e:
        Keys(str(path))
    assert str(path) in str(e.value) and "'globex'" in str(e.value) and "sk-bad" not in str(e.value)
    path.write_text(json.dumps(KEYS))
    keys = Keys(str(path))
    path.write_text(json.dumps({**KEYS, "sk-bad": {"tenant": "globex", "labels": labels}}))
    keys.reload()  # on SIGHUP: the keys in force stay
    assert keys.lookup("sk-pair").labels == ("finance", "legal") and keys.lookup("sk-bad") is None


@pytest.fixture
def verifier(tmp_path) -> OidcVerifier:
    """Tokens' group claims taken as labels as they are (no `labels` mapping)."""
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [jwk(RSA_KEY, "rsa-1", "RS256")]}))
    path = tmp_path / "oidc.json"
    path.write_text(json.dumps({"issuer": ISSUER, "audience": AUDIENCE, "jwks": str(tmp_path / "jwks.json")}))
    return OidcVerifier(OidcConfig.read(str(path)), str(path))


@pytest.mark.parametrize("groups, problem", [
    (["finance", "le\x1bgal"], "non-printable"), ([f"group-{i}" for i in range(MAX_LABELS + 1)], "at most 16"),
    (["finance", "y" * (MAX_LABEL_LENGTH + 1)], "at most 128"),
])
def test_a_token_with_labels_a_scope_cannot_hold_gets_401(verifier, groups, problem):
    with pytest.raises(ApiError) as e:
        verifier.principal(token(groups=groups))
    assert e.value.status == 401 and e.value.code == "invalid_token" and problem in e.value.message
    assert verifier.principal(token(groups=["finance,legal"])).labels == ("finance,legal",)
    assert verifier.principal(token(groups=[f"group-{i}" for i in range(MAX_LABELS)] * 2)).labels[0] == "group-0"


def test_an_oidc_labels_mapping_to_a_bad_label_fails_startup(tmp_path):
    (tmp_path / "jwks.json").write_text(json.dumps({"keys": [jwk(RSA_KEY, "rsa-1", "RS256")]}))
    path = tmp_path / "oidc.json"
    path.write_text(json.dumps({"issuer": ISSUER, "audience": AUDIENCE, "jwks": str(tmp_path / "jwks.json"),
                                "labels": {"grp-1": "fin\tance"}}))
    with pytest.raises(ValueError, match=f"{path}: labels: .*non-printable"):
        OidcConfig.read(str(path))
