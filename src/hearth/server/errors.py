"""Request errors and their bodies: OpenAI's and Anthropic's shapes, never a traceback."""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError

from hearth.server.schemas import UNSUPPORTED_FIELDS, FieldRefused

# A request body: room for the largest media file (MAX_MEDIA_BYTES) as base64 (4/3 as many
# bytes), beside its text.
MAX_BODY_BYTES = 32 * 2**20
ModelT = TypeVar("ModelT", bound=BaseModel)

# Anthropic names its error types after the status; OpenAI's bodies use invalid_request_error.
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "api_error",
}


class RequestError(Exception):
    """A request Hearth refuses: the status, one line for the user, the field at fault and,
    for OpenAI bodies, a machine-readable code."""

    def __init__(
        self, message: str, param: str | None = None, status: int = 400, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status = status
        self.code = code


def openai_error(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    kind = "invalid_request_error" if status < 500 else "server_error"
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


def anthropic_error(status: int, message: str) -> JSONResponse:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    body = {"type": "error", "error": {"type": kind, "message": message}}
    return JSONResponse(body, status_code=status)


def is_anthropic_path(path: str) -> bool:
    return path.startswith("/v1/messages")


def error_response(request: Request, error: RequestError) -> JSONResponse:
    """The error body in the shape the endpoint's own API uses."""
    if is_anthropic_path(request.url.path):
        return anthropic_error(error.status, error.message)
    return openai_error(error.status, error.message, error.param, error.code)


async def read_json_object(request: Request, limit: int = MAX_BODY_BYTES) -> dict[str, Any]:
    """The request body as a JSON object, refusing oversized, non-UTF-8 and malformed bodies."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise RequestError(f"request body exceeds {limit} bytes", status=413)
    raw = bytearray()
    async for chunk in request.stream():  # counted as it arrives: Content-Length may be absent
        raw += chunk
        if len(raw) > limit:
            raise RequestError(f"request body exceeds {limit} bytes", status=413)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(f"request body is not valid UTF-8: {error.reason}") from None
    try:
        body = json.loads(text, parse_constant=_refuse_non_finite)
    except (json.JSONDecodeError, RecursionError) as error:
        raise RequestError(f"request body is not valid JSON: {error}") from None
    if not isinstance(body, dict):
        raise RequestError("request body must be a JSON object")
    return body


def _refuse_non_finite(name: str) -> None:
    # Python's json accepts NaN and Infinity, which are not JSON.
    raise json.JSONDecodeError(f"{name} is not a JSON value", name, 0)


def parse_request(model: type[ModelT], body: dict[str, Any]) -> ModelT:
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise validation_error(error) from None
    except FieldRefused as error:
        message = f"Invalid value for '{error.param}': {error.message}"
        raise RequestError(message, error.param) from None


# Names pydantic gives the members of a union (`str | list[str]`) in an error's location.
_UNION_MEMBERS = frozenset({"str", "int", "float", "bool", "none", "list", "dict"})
_FIELD_NAME = re.compile(r"[a-z_][a-z0-9_]*")


def _field_path(loc: tuple[int | str, ...]) -> list[int | str]:
    """An error location up to the first union member's name ("stop.list[str].0" -> "stop"):
    the request's own field names and list indices."""
    path: list[int | str] = []
    for part in loc:
        is_field = isinstance(part, int) or (
            _FIELD_NAME.fullmatch(part) is not None and part not in _UNION_MEMBERS
        )
        if not is_field:
            break
        path.append(part)
    return path


def validation_error(error: ValidationError) -> RequestError:
    """The first problem pydantic found, as one line naming the field (e.g. messages.0.role)."""
    first = error.errors(include_url=False)[0]
    param = ".".join(str(part) for part in _field_path(first["loc"])) or None
    kind, message = first["type"], first["msg"]
    if kind == "extra_forbidden" and param in UNSUPPORTED_FIELDS:
        return RequestError(f"'{param}' is not supported by Hearth yet", param)
    if kind == "extra_forbidden":
        return RequestError(f"Unrecognized request argument supplied: {param}", param)
    if kind == "missing":
        return RequestError(f"Missing required parameter: '{param}'", param)
    message = message.removeprefix("Value error, ")
    return RequestError(f"Invalid value for '{param}': {message}", param)
