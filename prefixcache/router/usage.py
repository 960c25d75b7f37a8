"""The cached prompt tokens a replica reports in a response: OpenAI's `usage.prompt_tokens_details.cached_tokens`
or Anthropic's `usage.cache_read_input_tokens`, from a JSON body or from the data lines of an SSE stream."""
import json


def cached_tokens(event: dict) -> int | None:
    """From a response body or one streamed event (Anthropic's message_start carries it under `message`)."""
    usage = event.get("usage") or (event.get("message") or {}).get("usage")
    if not isinstance(usage, dict):
        return None
    details = usage.get("prompt_tokens_details") or {}
    value = details.get("cached_tokens", usage.get("cache_read_input_tokens"))
    return value if isinstance(value, int) else None


class SseUsage:
    """Reads an SSE stream as it passes, chunk by chunk (chunks may split lines), and keeps the last cached-token
    figure reported: OpenAI sends it once, in the final usage chunk; Anthropic in message_start and, cumulative,
    in message_delta."""

    def __init__(self):
        self.pending = b""
        self.cached: int | None = None

    def feed(self, chunk: bytes) -> None:
        *lines, self.pending = (self.pending + chunk).split(b"\n")
        for line in lines:
            if line.startswith(b"data:") and b"cache" in line:  # parse only the few lines that can carry it
                try:
                    event = json.loads(line[5:])
                except ValueError:
                    continue
                if isinstance(event, dict) and (n := cached_tokens(event)) is not None:
                    self.cached = n
