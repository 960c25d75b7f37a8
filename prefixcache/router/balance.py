"""The choice of a replica for one request, in the style of SGLang's router: balance load first when it is
clearly uneven, else follow the longest cached prefix when enough of the request is cached, else the least loaded."""
from dataclasses import dataclass
from typing import Sequence

POLICIES = ("cache-aware", "round-robin")


@dataclass(frozen=True)
class Policy:
    kind: str = "cache-aware"  # or "round-robin": every replica in turn, whatever is cached (a baseline)
    min_match_fraction: float = 0.1  # follow a cached prefix only when it covers this share of the request's blocks
    balance_abs_threshold: int = 8  # load is uneven when max - min exceeds this (requests: half a replica's default
    # batch, max_num_seqs 16; SGLang's default, 32, is for GPU batches) ...
    balance_rel_threshold: float = 1.5  # ... and max exceeds this multiple of min


@dataclass(frozen=True)
class Candidate:
    url: str
    load: int  # requests there (Replica.load)
    match: int  # leading blocks of the request cached there


@dataclass(frozen=True)
class Decision:
    replica: Candidate
    reason: str  # "balance" (load was uneven), "cache" (longest match) or "load" (least loaded)


def choose(candidates: Sequence[Candidate], n_keys: int, policy: Policy) -> Decision:
    """Pick one of `candidates` (healthy replicas, non-empty) for a request of `n_keys` full blocks. Ties go to the
    earliest candidate, so a caller that wants ties spread passes the candidates in random order."""
    least = min(candidates, key=lambda c: c.load)
    most = max(c.load for c in candidates)
    if most - least.load > policy.balance_abs_threshold and most > policy.balance_rel_threshold * least.load:
        return Decision(least, "balance")
    best = max(candidates, key=lambda c: (c.match, -c.load))
    if n_keys and best.match and best.match >= policy.min_match_fraction * n_keys:
        return Decision(best, "cache")
    return Decision(least, "load")
