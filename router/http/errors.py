"""The OpenAI API's errors: OpenAI's error object from a refusal or failure
of the request path (a gRPC status) or from a body that does not validate.

Every error has OpenAI's four fields, ``message``, ``type``, ``param`` and
``code`` (null where there is nothing to say); ``code`` is one of OpenAI's
codes, never a gRPC status name (docs/openai.md, "Errors").
"""

from __future__ import annotations

import grpc
from fastapi.responses import JSONResponse

from router.service import RequestFailed

# gRPC status -> (HTTP status, OpenAI error type). The gRPC code's name never
# reaches an OpenAI client: ``code`` is one of OpenAI's (OPENAI_CODE) or null.
HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.OUT_OF_RANGE: (400, "invalid_request_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


# HTTP status -> OpenAI's error code, where OpenAI has one for it (NOT_FOUND: an
# unknown model, the only thing the request path finds missing).
OPENAI_CODE = {401: "invalid_api_key", 404: "model_not_found", 429: "rate_limit_exceeded"}


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param=None, code=None) -> None:
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind
        self.param, self.code = param, code

    @classmethod
    def from_failure(cls, e: RequestFailed) -> ApiError:
        status, kind = HTTP_STATUS.get(e.code, (500, "server_error"))
        # The context-length refusal has OpenAI's own code (clients match on it).
        context = status == 400 and "max_model_len" in e.details
        code = "context_length_exceeded" if context else OPENAI_CODE.get(status)
        return cls(status, e.details, kind, None, code)

    def body(self) -> dict:
        """OpenAI's error object: message, type, param, code (all four, always)."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        body = self.body()
        headers = {"Retry-After": "1"} if self.status == 429 else None
        return JSONResponse(body, status_code=self.status, headers=headers)


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "ContentPart"})


def invalid_body(errors) -> ApiError:
    """400 naming the first bad field (``messages.0.role``), as OpenAI's ``param``."""
    first = errors[0] if errors else {}
    # pydantic's loc names union members too ("prompt", "list[int]", 0): keep the field path.
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = ".".join(x for x in loc if x not in _TYPE_NAMES and "[" not in x) or None
    message = f"{param or 'body'}: {first.get('msg', 'invalid request')}"
    return ApiError(400, message, "invalid_request_error", param)
