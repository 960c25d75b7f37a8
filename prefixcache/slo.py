"""Latency objectives, as vLLM's serving benchmark states them (`--goodput ttft:MS tpot:MS e2el:MS`): a request
meets them when it meets every one given, and goodput is the rate of such requests. TPOT is the time per output
token after the first: (e2e - ttft) / (output tokens - 1), 0 for a single token. The bench reports goodput and
each objective's attainment; the server, given objectives, counts met and missed requests on /metrics."""
from dataclasses import dataclass, fields

NAMES = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class Objectives:
    """Seconds; None: no objective on that figure."""

    ttft: float | None = None
    tpot: float | None = None
    e2el: float | None = None

    @classmethod
    def parse(cls, items: list[str]) -> "Objectives":
        """From vLLM's `NAME:MILLISECONDS` items; a ValueError says which item is wrong."""
        given: dict[str, float] = {}
        for item in items:
            name, colon, ms = item.partition(":")
            if not colon or name not in NAMES:
                raise ValueError(f"objective {item!r}: give NAME:MS, the name one of {', '.join(NAMES)}")
            if name in given:
                raise ValueError(f"objective {name} is given twice")
            given[name] = positive_ms(ms, item)
        if not given:
            raise ValueError("give at least one objective, as NAME:MS")
        return cls(**given)

    def given(self) -> dict[str, float]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def met(self, ttft: float, e2el: float, output_tokens: int) -> dict[str, bool]:
        """Each given objective: whether a finished request with these figures meets it."""
        figures = {"ttft": ttft, "tpot": tpot(e2el, ttft, output_tokens), "e2el": e2el}
        return {name: figures[name] <= limit for name, limit in self.given().items()}


def positive_ms(text: str, what: str) -> float:
    """Milliseconds as seconds; a ValueError unless a positive finite number."""
    try:
        ms = float(text)
    except ValueError:
        raise ValueError(f"objective {what!r}: {text!r} is not a number of milliseconds") from None
    if not 0 < ms < float("inf"):
        raise ValueError(f"objective {what!r}: milliseconds must be a positive number, got {text}")
    return ms / 1000


def tpot(e2el: float, ttft: float, output_tokens: int) -> float:
    return (e2el - ttft) / (output_tokens - 1) if output_tokens > 1 else 0.0
