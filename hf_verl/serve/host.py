"""The HTTP host under hf_verl's servers: a listening socket and uvicorn in this process, with the start, serve,
address and shutdown that the rollout server and the classification server share.

A subclass provides `_build_app()` (its FastAPI app), `_banner()` (the line logged when it serves in the
foreground) and, when it holds more than the socket, `_release()`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time

logger = logging.getLogger(__name__)


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on (host, port); port 0 picks a free one.

    Raises:
        OSError: the address cannot be bound (the message names it and what to do).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as err:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port} ({err}); pick another --port or stop what holds it") from None
    sock.listen(2048)
    return sock


class UvicornHost:
    """Serves `self._build_app()` with uvicorn on a socket bound by :meth:`_listen`."""

    _thread_name = "hf-verl-serve"
    _what = "server"

    def _listen(self, host: str, port: int) -> None:
        import uvicorn

        self._socket = bind(host, port)
        self._thread: threading.Thread | None = None
        config = uvicorn.Config(self._build_app(), lifespan="off", log_config=None, access_log=False,
                                server_header=False, timeout_graceful_shutdown=5)
        self._uvicorn = uvicorn.Server(config)

    def _build_app(self):
        raise NotImplementedError

    def _banner(self) -> str:
        return f"hf-verl {self._what} on {self.address}"

    @property
    def address(self) -> str:
        """`http://host:port` of the listening socket."""
        host, port = self._socket.getsockname()[:2]
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self):
        """Serve in a background thread (tests, notebooks); returns once the server accepts requests.

        Raises:
            RuntimeError: the server did not start within 60 s.
        """
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name=self._thread_name, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the {self._what} on {self.address} did not start (see the log above)")
            time.sleep(0.01)
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until interrupted (SIGINT / SIGTERM)."""
        logger.info("%s", self._banner())
        try:
            self._uvicorn.run(sockets=[self._socket])
        finally:
            self._release()

    def shutdown(self) -> None:
        """Stop serving and release the port (safe to call twice)."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
        self._release()

    def _release(self) -> None:
        self._socket.close()
