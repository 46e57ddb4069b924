"""Errors of the rollout server, answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`.

A request that fails validation is a 400 (as vLLM answers, rather than FastAPI's 422) whose message names
the field, so that an OpenAI client raises `BadRequestError` with a message that says what to change.
"""

from __future__ import annotations

import json
import logging
import re

logger = logging.getLogger(__name__)

ERROR_TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
               404: "NotFoundError", 405: "BadRequestError", 408: "BadRequestError", 411: "BadRequestError",
               413: "BadRequestError"}
_UNION_MEMBER = re.compile(r"str|int|float|bool|list|dict|.*\[.*\]")


class ServeError(Exception):
    """An answer other than 200: `status`, a message that says what is wrong, and the request field at fault.

    Args:
        status (`int`): the HTTP status.
        message (`str`): what is wrong and what to change.
        param (`str`, *optional*): the request field at fault.
        close (`bool`, defaults to `False`): close the connection after answering (the body may be unread).
    """

    def __init__(self, status: int, message: str, param: str | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.close = status, message, param, close


def error_body(status: int, message: str, param: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "InternalServerError"), "param": param,
                      "code": status}}


def describe_validation_error(errors: list[dict]) -> tuple[str, str | None]:
    """One message (and the field) for pydantic's validation errors of a request body."""
    first = errors[0]
    # "body" and the union members pydantic tried ("str", "list[int]") are not fields
    loc = [str(part) for part in first.get("loc", ()) if part != "body" and not _UNION_MEMBER.fullmatch(str(part))]
    field = ".".join(loc) or None
    kind = first.get("type", "")
    if kind == "json_invalid":
        return f"the body is not valid JSON: {first.get('ctx', {}).get('error', first.get('msg'))}", None
    if field is None and kind == "value_error":  # a check across fields: its message names them
        return str(first.get("msg", "invalid request")).removeprefix("Value error, "), None
    if field is None or kind in ("model_attributes_type", "dict_type"):
        return "the body must be a JSON object", None
    if kind == "missing":
        return f"'{field}' is required", field
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    return f"'{field}': {msg} (got {json.dumps(first.get('input'), default=repr)[:80]})", field


def install_error_handlers(app) -> None:
    """Answer [`ServeError`], validation errors, unknown routes and unexpected failures as OpenAI errors."""
    from fastapi.exceptions import RequestValidationError
    from starlette.exceptions import HTTPException

    from hf_verl.serve.responses import json_response

    def answer(status: int, message: str, param: str | None = None, close: bool = False):
        headers = {"Connection": "close"} if close else None
        return json_response(error_body(status, message, param), status=status, headers=headers)

    @app.exception_handler(ServeError)
    async def serve_error(request, err: ServeError):
        return answer(err.status, err.message, err.param, err.close)

    @app.exception_handler(RequestValidationError)
    async def invalid(request, err: RequestValidationError):
        message, field = describe_validation_error(list(err.errors()))
        return answer(400, message, field)

    @app.exception_handler(HTTPException)
    async def http_error(request, err: HTTPException):
        message = f"no route {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
        return answer(err.status_code, message)

    @app.exception_handler(Exception)
    async def unexpected(request, err: Exception):
        logger.exception("request %s %s failed", request.method, request.url.path)
        return answer(500, f"{type(err).__name__}: {err}")
