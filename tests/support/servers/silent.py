"""A server that accepts connections and never answers: a hung host or a wrong port that happens
to listen. Counts the connections it accepted (how tests see that a client did not retry), holds
them open until it stops, bound to 127.0.0.1 on a free port."""

from __future__ import annotations

import socket
import threading


class SilentServer:
    """Accepts on ``url`` and sends nothing; :attr:`accepted` counts connections."""

    def __init__(self) -> None:
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self.accepted = 0
        self._open: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="silent-server", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.accepted += 1
            self._open.append(conn)  # held, never read from or answered

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()
        for conn in self._open:
            conn.close()
        self._sock.close()

    def __enter__(self) -> SilentServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def closed_port_url() -> str:
    """A URL on a port of 127.0.0.1 that nothing listens on (bound once, released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"
