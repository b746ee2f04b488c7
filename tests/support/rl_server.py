"""vLLM's RL control plane over HTTP for an in-process ``LLM``: the routes of vLLM's own API server
(in dev mode: ``/init_weight_transfer_engine``, ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``), so that trainer ranks in other processes drive the engine with vLLM's
own ``HTTPVLLMWeightSyncClient``, as they would a ``vllm serve``, plus ``/reset_prefix_cache``. One
request at a time (the engine is not thread-safe)."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer
from typing import Any


class RLServer:
    """Serve ``llm``'s weight-sync methods on 127.0.0.1 (``url``) from a background thread."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.calls: list[str] = []
        self.errors: list[BaseException] = []  # what the engine raised, as it raised it
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                route = self.path.strip("/")
                try:
                    server.call(route, body)
                    status, reply = 200, {"status": "ok"}
                except Exception as error:  # the trainer's client raises on the status
                    server.errors.append(error)
                    status, reply = 500, {"error": f"{type(error).__name__}: {error}"}
                data = json.dumps(reply).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self._http = HTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._thread = threading.Thread(target=self._http.serve_forever, daemon=True)
        self._thread.start()

    def call(self, route: str, body: dict[str, Any]) -> None:
        self.calls.append(route)
        if route == "init_weight_transfer_engine":
            self.llm.init_weight_transfer_engine({"init_info": body["init_info"]})
        elif route == "start_weight_update":
            self.llm.start_weight_update()
        elif route == "update_weights":
            self.llm.update_weights({"update_info": body["update_info"]})
        elif route == "finish_weight_update":
            self.llm.finish_weight_update()
        elif route == "reset_prefix_cache":
            self.llm.reset_prefix_cache()
        else:
            raise ValueError(f"no route {route!r}")

    def close(self) -> None:
        self._http.shutdown()
        self._http.server_close()
