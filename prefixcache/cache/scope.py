"""CacheScope: everything that changes a prefix's meaning or who may read it. Its hash roots every cache key."""
from dataclasses import dataclass, replace
from functools import cached_property

import msgspec
import xxhash

SHARED_TENANT = "*shared*"
LOCAL_TENANT = "local"  # the one tenant of a server without API keys
PUBLIC_OWNERS = {(SHARED_TENANT, ()), (LOCAL_TENANT, ())}  # owners whose entries any request of the server may read
MAX_LABELS = 16  # distinct labels of one API key or identity token
MAX_LABEL_LENGTH = 128  # characters of one label


def validate_labels(labels) -> tuple[str, ...]:
    """Labels as a scope holds them (distinct, sorted). A ValueError says what is wrong: not a list of non-empty
    strings, more than MAX_LABELS, one longer than MAX_LABEL_LENGTH, or one with a character that is not printable
    (a control character, a line break, an invisible one)."""
    if not isinstance(labels, (list, tuple)) or not all(isinstance(x, str) and x for x in labels):
        raise ValueError(f"labels must be a list of non-empty strings, got {labels!r}")
    distinct = sorted(set(labels))
    if len(distinct) > MAX_LABELS:
        raise ValueError(f"{len(distinct)} labels, at most {MAX_LABELS}")
    for label in distinct:
        if len(label) > MAX_LABEL_LENGTH:
            raise ValueError(f"label {label[:32]!r}... has {len(label)} characters, at most {MAX_LABEL_LENGTH}")
        if not label.isprintable():
            raise ValueError(f"label {label!r} has a control or other non-printable character")
    return tuple(distinct)


@dataclass(frozen=True)
class CacheScope:
    tenant: str = LOCAL_TENANT
    labels: tuple[str, ...] = ()  # permission set, security tier, ...
    fingerprint: str = ""  # the weights and the arithmetic that runs them (Engine.fingerprint); the engine fills it in
    adapter: str = ""
    tool_config: str = ""  # hash of the tool definitions
    policy: str = ""  # policy or template version
    salt: str = ""  # client-supplied: only ever narrows a scope

    def __post_init__(self):
        object.__setattr__(self, "labels", tuple(sorted(set(self.labels))))

    @cached_property
    def key(self) -> bytes:
        """The hash of every field in msgpack, where each string and the labels' array carry their lengths: no two
        scopes encode alike, whatever characters their fields hold."""
        return xxhash.xxh3_128_digest(msgspec.msgpack.encode((self.tenant, self.labels, self.fingerprint, self.adapter,
                                                               self.tool_config, self.policy, self.salt)))

    @property
    def owner(self) -> tuple[str, tuple[str, ...]]:
        """Whose entries a scope's are, for purges: its tenant and labels, whatever the salt or other fields."""
        return self.tenant, self.labels

    @cached_property
    def shared(self) -> "CacheScope":
        """The operator-declared scope shared across tenants, labels and salts (never across weights)."""
        return replace(self, tenant=SHARED_TENANT, labels=(), salt="")
