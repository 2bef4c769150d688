"""LoRA adapters in the demo's model server, served as vLLM serves them with
``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``: the endpoints the capture sidecar
calls (``POST /v1/load_lora_adapter`` ``{"lora_name", "lora_path"}``, ``POST
/v1/unload_lora_adapter`` ``{"lora_name"}``) with vLLM's answers, and the entries
``/v1/models`` lists after the base (``id``: the adapter's name, ``root``: its path,
``parent``: the base).

Each adapter is merged into a copy of the base (PEFT's ``merge_and_unload``, as
``rtrl_trainer.models`` loads one for the stage and eval steps), so a request naming it is
sampled from the adapted model and its log-probs are that model's: what the capture
records and the stage's fidelity gate checks.
"""

from __future__ import annotations

import asyncio
import copy
import time
import warnings
from typing import Any

from aiohttp import web


def error(status: int, message: str, param: str | None) -> web.Response:
    """vLLM's error body."""
    kind = "BadRequestError" if status == 400 else "NotFoundError"
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return web.json_response(body, status=status)


def merge_adapter(base: Any, path: str) -> Any:
    """The base with the PEFT adapter in ``path`` merged into a copy of its weights (the
    base itself untouched); ValueError when the adapter cannot be put on this base."""
    from peft import PeftModel

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "`is_gradient_checkpointing`", FutureWarning)
        try:
            merged = PeftModel.from_pretrained(copy.deepcopy(base), path).merge_and_unload()
        except (OSError, RuntimeError, KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"the adapter in {path} does not fit the base: {exc}") from None
    return merged.eval()


class LoraAdapters:
    """The adapters loaded on one server's base, by name."""

    def __init__(self, base: Any, base_name: str) -> None:
        self.base = base
        self.base_name = base_name
        self.held: dict[str, tuple[str, Any]] = {}  # name: (its directory, the merged model)

    def __contains__(self, name: object) -> bool:
        return name in self.held

    def model(self, name: str) -> Any | None:
        held = self.held.get(name)
        return None if held is None else held[1]

    def listed(self, max_model_len: int) -> list[dict[str, Any]]:
        """``/v1/models``' entries of the adapters."""
        return [
            {"id": name, "object": "model", "created": int(time.time()), "owned_by": "rtrl-demo",
             "root": path, "parent": self.base_name, "max_model_len": max_model_len}
            for name, (path, _) in sorted(self.held.items())
        ]  # fmt: skip

    async def _body(self, request: web.Request) -> dict[str, Any] | web.Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON", "body")
        if not isinstance(body, dict) or not isinstance(body.get("lora_name"), str):
            return error(400, "lora_name: expected a string", "lora_name")
        return body

    async def load(self, request: web.Request) -> web.Response:
        """vLLM's answers: 200 with a line of text; 400 when the name is loaded already or
        the adapter cannot be loaded."""
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name, path = body["lora_name"], body.get("lora_path")
        if not isinstance(path, str) or not path:
            return error(400, "lora_path: expected a directory", "lora_path")
        if name in self.held or name == self.base_name:
            return error(400, f"The lora adapter '{name}' has already been loaded.", "lora_name")
        try:
            merged = await asyncio.to_thread(merge_adapter, self.base, path)
        except ValueError as exc:
            return error(400, str(exc), "lora_path")
        self.held[name] = (path, merged)
        return web.Response(text=f"Success: LoRA adapter '{name}' added successfully.")

    async def unload(self, request: web.Request) -> web.Response:
        body = await self._body(request)
        if isinstance(body, web.Response):
            return body
        name = body["lora_name"]
        if self.held.pop(name, None) is None:
            return error(404, f"The lora adapter '{name}' cannot be found.", "lora_name")
        return web.Response(text=f"Success: LoRA adapter '{name}' removed successfully.")
