"""What a prompt may write to the cache, and for how long: breakpoints, TTLs and the minimum cacheable length."""
from dataclasses import dataclass

TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


@dataclass(frozen=True)
class Breakpoint:
    """Cache the prompt prefix that ends at token `position`, for `ttl` ("5m" or "1h")."""

    position: int
    ttl: str = "5m"

    def __post_init__(self):
        if self.ttl not in TTL_SECONDS:
            raise ValueError(f"ttl must be one of {sorted(TTL_SECONDS)}, got {self.ttl!r}")


@dataclass(frozen=True)
class WritePolicy:
    """One request's cache-write rules. Without breakpoints the whole prompt (and the reply) is cached if the prompt
    reaches the minimum length; with breakpoints, the prefix up to the last breakpoint that reaches it. A declared
    shared prefix is always cacheable."""

    breakpoints: tuple[Breakpoint, ...]
    num_prompt: int
    shared_len: int
    min_tokens: int
    default_ttl: float | None

    def limit(self, num_tokens: int) -> int:
        """Tokens (of num_tokens known so far) that may be written."""
        if self.breakpoints:
            ok = [b.position for b in self.breakpoints if b.position >= self.min_tokens]
            return max(ok, default=self.shared_len)
        return num_tokens if self.num_prompt >= self.min_tokens else self.shared_len

    def ttl(self, end: int) -> tuple[float | None, str]:
        """(seconds or None, label) for a block ending at token `end`: the first breakpoint at or after it."""
        for b in self.breakpoints:
            if b.position >= end:
                return TTL_SECONDS[b.ttl], b.ttl
        return self.default_ttl, "auto"

    def partial_points(self, limit: int, num_computed: int, final: bool, block_size: int) -> list[int]:
        """Positions inside a block where a partial block is worth publishing: breakpoints, the end of the shared
        prefix, and (for a finished request without breakpoints) its end."""
        points = [b.position for b in self.breakpoints if b.position <= limit]
        if self.shared_len:
            points.append(self.shared_len)
        if final and not self.breakpoints and limit >= num_computed:
            points.append(num_computed)
        return [p for p in points if p % block_size and p <= limit]
