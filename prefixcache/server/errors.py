"""ApiError and its two renderings (OpenAI's and Anthropic's error bodies), and request-body validation errors."""
import re

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from prefixcache.server.caps import MAX_STRING

ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                   404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                   500: "api_error", 503: "api_error", 529: "overloaded_error"}
OPENAI_TYPES = {401: "authentication_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}

# pydantic's loc entries for union members
UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none)$|^constrained-|\[|^[A-Z]")


class Strict(BaseModel):
    """Request models refuse fields they do not declare: a field that would change the answer and is not
    implemented must be a 400 naming it, never silently ignored. Informational fields are declared (and ignored).
    No string may be longer than MAX_STRING (server/caps.py)."""

    model_config = ConfigDict(extra="forbid", str_max_length=MAX_STRING)


def api_of(path: str) -> str:
    """Which API a route belongs to: "anthropic" or "openai"."""
    return "anthropic" if path.startswith("/v1/messages") else "openai"


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = {"Retry-After": str(retry_after)} if retry_after is not None else None

    def openai(self) -> JSONResponse:
        return JSONResponse(self.openai_body(), self.status, self.headers)

    def anthropic(self) -> JSONResponse:
        return JSONResponse(self.anthropic_body(), self.status, self.headers)

    def openai_body(self) -> dict:
        kind = OPENAI_TYPES.get(self.status, "invalid_request_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict:
        return {"type": "error", "error": {"type": ANTHROPIC_TYPES.get(self.status, "invalid_request_error"),
                                           "message": self.message}}


def invalid(errors: list[dict]) -> ApiError:
    """A request body that failed validation (pydantic's errors, as FastAPI collects them) as a 400 naming the
    first bad field."""
    if any(e["type"] == "json_invalid" for e in errors):
        return ApiError(400, "request body is not valid JSON")
    # in a union, the branch that got furthest, and one whose value had the right type (its error is the point)
    err = max(errors, key=lambda x: (len(x["loc"]), not x["type"].endswith("_type")))
    param = ".".join(str(p) for p in err["loc"][1:] if not UNION_TAG.search(str(p)))  # loc[0] is "body"
    if not param:
        return ApiError(400, f"request body: {err['msg']}")
    if err["type"] == "extra_forbidden":
        return ApiError(400, f"{param}: this server does not support this field", param=param,
                        code="unsupported_field")
    return ApiError(400, f"{param}: {err['msg']}", param=param)
