"""HTTPEngineClient: a ``vllm serve``'s weight-sync routes, from a trainer without vLLM installed.

The same four calls as vLLM's ``HTTPVLLMWeightSyncClient`` (``/init_weight_transfer_engine``,
``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``) and ``/reset_prefix_cache``
(KV cached from the old weights must not serve new requests), over the standard library, so a
trainer environment needs neither vLLM nor ``requests``. A ``vllm serve`` has these routes with
``VLLM_SERVER_DEV_MODE=1``.
"""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from hp_dcp_hf.errors import SyncError


class HTTPEngineClient:
    """The control plane of the engine at ``base_url`` (``http://host:port``)."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout_s = timeout_s

    def _post(self, route: str, body: dict[str, Any] | None = None) -> None:
        request = urllib.request.Request(f"{self.base_url}/{route}", data=json.dumps(body or {}).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                response.read()
        except urllib.error.HTTPError as error:
            raise SyncError(f"{self.base_url}/{route} answered {error.code}: "
                            f"{error.read().decode(errors='replace')[:2000]}") from error
        except OSError as error:
            raise SyncError(f"{self.base_url}/{route} failed: {type(error).__name__}: {error}") from error

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._post("init_weight_transfer_engine", {"init_info": init_info})

    def start_weight_update(self) -> None:
        self._post("start_weight_update")

    def update_weights(self, update_info: dict[str, Any]) -> None:
        self._post("update_weights", {"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._post("finish_weight_update", {"weight_version": weight_version} if weight_version else None)

    def reset_prefix_cache(self) -> None:
        self._post("reset_prefix_cache")
