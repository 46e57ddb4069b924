"""One JSON POST with retries, for the clients of served roles (a reward model, a reference behind a URL).

Connection errors, timeouts, HTTP 429 and 5xx are retried with exponential backoff; any other 4xx and an answer
that is not JSON fail at once. Every failure raises the caller's error class with a message that names the role
and the URL, and the last attempt's cause.
"""

from __future__ import annotations

import json
import logging
import time
import urllib.error
import urllib.request
from typing import Any

logger = logging.getLogger(__name__)


def post_json(url: str, body: dict, *, who: str, error: type[Exception], token: str | None = None,
              timeout_s: float = 60.0, max_retries: int = 3, backoff_s: float = 0.5, hint: str = "") -> Any:
    """POST `body` as JSON to `url` and return the decoded answer.

    Args:
        url (`str`): the endpoint.
        body (`dict`): the request.
        who (`str`): how messages name the server, e.g. "reward model at http://host/classify".
        error (`type[Exception]`): the exception class raised on failure.
        token (`str`, *optional*): sent as `Authorization: Bearer <token>`.
        timeout_s (`float`): seconds to wait for one answer.
        max_retries (`int`): retries after the first attempt (connection errors, timeouts, 429, 5xx).
        backoff_s (`float`): the first wait between attempts, doubled each time.
        hint (`str`): what to do, appended to the unreachable message.

    Raises:
        error: a refused request (4xx other than 429), an answer that is not JSON, or every attempt failed.
    """
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    last = ""
    for attempt in range(max_retries + 1):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        request = urllib.request.Request(url, data=data, headers=headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as err:
            detail = err.read()[:300].decode(errors="replace")
            if err.code != 429 and err.code < 500:
                raise error(f"{who} refused the request: HTTP {err.code} {detail}") from None
            last = f"HTTP {err.code} {detail}"
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as err:
            last = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
        else:
            try:
                return json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise error(f"{who} answered garbage (not JSON): {raw[:200]!r}") from None
        logger.warning("%s: attempt %d of %d failed (%s)", who, attempt + 1, max_retries + 1, last)
    raise error(f"{who} is unreachable after {max_retries + 1} attempts (timeout {timeout_s} s each): {last}."
                + (f" {hint}" if hint else ""))
