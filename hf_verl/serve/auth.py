"""The rollout server's access rules: where it may listen, where its token comes from, how a request proves it.

Weight-changing routes need `Authorization: Bearer <token>`. The token is a secret string the operator
makes (for example `python -c "import secrets; print(secrets.token_urlsafe(32))" > token`) and hands to the
server by file (`--token-file`) or by the `HF_VERL_SERVE_TOKEN` variable, never on the command line, where
other users of the machine could read it. Without a token the weight routes are closed (403), and the server
refuses to listen off the loopback interface.
"""

from __future__ import annotations

import hmac
import ipaddress
import os

from hf_verl.rollout.registry import SERVE_TOKEN_ENV as TOKEN_ENV  # one name for the clients and the server
from hf_verl.serve.errors import ServeError


def is_loopback(host: str) -> bool:
    """Whether `host` (a name or an address) only reaches this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_token(token_file: str | None) -> str | None:
    """The server token: from `token_file`, else the `HF_VERL_SERVE_TOKEN` variable, else None."""
    if token_file:
        with open(token_file) as f:
            token = f.read().strip()
        if not token:
            raise ValueError(f"token file {token_file} is empty.")
        return token
    return os.environ.get(TOKEN_ENV) or None


def check_bearer(token: str | None, header: str | None) -> None:
    """Raise a 403 [`ServeError`] when the server has no token, a 401 when `header` does not carry it."""
    if not token:
        raise ServeError(403, f"weight updates are disabled: start the server with a token ({TOKEN_ENV} or "
                              "--token-file)")
    given = header[7:] if header and header.startswith("Bearer ") else ""
    if not hmac.compare_digest(given.encode(), token.encode()):
        raise ServeError(401, "missing or wrong bearer token")
