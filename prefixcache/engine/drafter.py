"""Draft tokens for speculative decoding, from what the request and its scope already hold (no draft model).

Two sources, tried in this order:
- prompt lookup: the latest earlier place where the sequence's last n tokens occur (n from MAX_NGRAM down to
  MIN_NGRAM) in its own tokens (prompt, cached prefix included, and output so far) proposes what followed them;
- answer reuse: the same lookup in the recent finished outputs of the request's own CacheScope. A scope's table
  is never read by another scope: acceptance shows in timing, so a shared table would tell one tenant another's
  answers. Each table keeps its scope's last ANSWER_TOKENS output tokens; a tenant keeps TENANT_SCOPES tables (over
  its label sets and salts), the server MAX_SCOPES (cache/tenant_lru.py: no tenant evicts another's below its part).
The engine verifies every draft in one forward and keeps only what the model itself would have produced.
"""
import numpy as np

from prefixcache.cache.scope import CacheScope
from prefixcache.cache.tenant_lru import TenantLru

METHODS = ("off", "prompt", "answers", "both")
MAX_DRAFT = 16  # the cap on num_speculative_tokens
MIN_NGRAM, MAX_NGRAM = 2, 4
ANSWER_TOKENS = 1 << 15
TENANT_SCOPES = 256  # answer tables of one tenant (256 KiB each at most)
MAX_SCOPES = 1024  # ... of all tenants
SEPARATOR = -1  # between answers in a table: no n-gram spans two answers


class Drafter:
    def __init__(self, method: str, num_tokens: int):
        if method not in METHODS:
            raise ValueError(f"speculative={method!r}: choose one of {', '.join(METHODS)}")
        if not 0 <= num_tokens <= MAX_DRAFT:
            raise ValueError(f"num_speculative_tokens must be in [0, {MAX_DRAFT}], got {num_tokens}")
        self.method = method
        self.num_tokens = num_tokens
        self.tables: TenantLru[np.ndarray] = TenantLru(TENANT_SCOPES, MAX_SCOPES)  # each scope's recent answers

    @property
    def enabled(self) -> bool:
        return self.method != "off" and self.num_tokens > 0

    def propose(self, tokens: list[int], scope: CacheScope, k: int) -> list[int]:
        """Up to k tokens that may follow `tokens`."""
        ids = np.asarray(tokens)
        if self.method in ("prompt", "both") and (draft := _lookup(ids, ids, k)):
            return draft
        if self.method in ("answers", "both") and (table := self.tables.get(scope)) is not None:
            return _lookup(table, ids, k)
        return []

    def record(self, scope: CacheScope, tokens: list[int], num_output: int) -> None:
        """Keep a finished request's output, after its last prompt tokens (so a later request can draft from its
        first output token on), for its scope's later requests."""
        if self.method not in ("answers", "both") or not num_output:
            return
        old = self.tables.get(scope)
        answer = tokens[-(num_output + MAX_NGRAM):]
        self.tables.put(scope, np.concatenate([np.empty(0, dtype=np.int64) if old is None else old, answer,
                                               [SEPARATOR]])[-ANSWER_TOKENS:])

    def purge_tenant(self, tenant: str, labels: tuple[str, ...]) -> None:
        self.tables.purge((tenant, labels))


def _lookup(source: np.ndarray, tokens: np.ndarray, k: int) -> list[int]:
    """What followed an occurrence in `source` of the last n tokens of `tokens`, for the largest n that occurs: up
    to k tokens, never past a separator. Of the occurrences, the latest of those followed by the most tokens."""
    ends = np.append(np.flatnonzero(source == SEPARATOR), len(source))
    for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
        if len(tokens) < n or len(source) <= n:
            continue
        # windows with a token after them: in the sequence itself, never its own last n tokens
        windows = np.lib.stride_tricks.sliding_window_view(source[:-1], n)
        starts = np.flatnonzero((windows == tokens[-n:]).all(axis=1)) + n
        room = np.minimum(ends[np.searchsorted(ends, starts)] - starts, k)
        if len(starts) and room.max() > 0:
            start = starts[room == room.max()][-1]
            return source[start: start + room.max()].tolist()
    return []
