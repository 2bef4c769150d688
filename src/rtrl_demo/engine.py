"""The demo's model server: its tiny GPT-2 served over the OpenAI completions API, as vLLM
serves a model, with dynamic batching.

The capture sidecar (``rtrl-capture``) sits in front of this server exactly as it sits in
front of vLLM, so the fields it reads are vLLM 0.32's (``vllm/entrypoints/openai/completion/
protocol.py``): ``POST /v1/completions`` with token-id prompts (the demo's model has no
tokenizer), ``logprobs`` (``choices[].logprobs.token_logprobs``, the sampled token's raw
log-prob), ``return_token_ids`` (``choices[].prompt_token_ids`` and ``choices[].token_ids``),
``seed``, ``ignore_eos``, ``max_tokens``; ``GET /v1/models`` (``root``: the checkpoint the
server loaded, which the sidecar checks against ``RTRL_MODEL_URI``) and ``GET /health``.

LoRA adapters are loaded and listed as vLLM does with ``--enable-lora``
(:mod:`rtrl_demo.lora`); a request whose ``model`` names one is sampled from the base with
that adapter merged, so its log-probs are the adapted model's, as the capture records them;
a batch is sampled one model at a time.

Only what the demo's model can do is accepted: temperature 1 from the full distribution
(top-p 1, top-k 0 or -1), one completion per prompt, no streaming, no echo. Anything else
is a 400 naming the field, as vLLM answers a request it cannot serve, rather than a
completion sampled some other way than the request says (the log-probs would then lie).

Requests that arrive while a batch runs wait for the next one, which takes them all
(dynamic batching): a tick's users are served in a few forward passes per batch, not one
per request. Every request samples with a generator of its own, seeded by its ``seed``, so
a seeded request's log-probs differ with its batch only in their last float32 bits (another
batch shape sums in another order), as vLLM's do unless it runs batch-invariant kernels, and
its tokens only where such a bit moves a draw across a boundary: rarely, but enough that two
runs of the demo need not train the same checkpoints.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from . import sim
from .lora import LoraAdapters, error

MAX_BATCH = 512
DEFAULT_MAX_TOKENS = 16


class RequestError(ValueError):
    """A request the server refuses: ``param`` names the field."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


@dataclass
class Row:
    """One prompt to complete and how."""

    prompt: list[int]
    max_tokens: int
    ignore_eos: bool
    seed: int
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def _int(body: dict[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(name, f"expected an integer, got {value!r}")
    if value < low:
        raise RequestError(name, f"must be >= {low}, got {value}")
    return value


def _number(body: dict[str, Any], name: str, allowed: tuple[float, ...]) -> None:
    value = body.get(name)
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or value not in allowed:
        raise RequestError(
            name, f"this server samples only with {name} in {allowed}, got {value!r}"
        )


def parse_request(body: object, vocab: int) -> list[Row]:
    """The rows of a completions request, or :class:`RequestError`."""
    if not isinstance(body, dict):
        raise RequestError("body", "expected a JSON object")
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, list) for p in prompt):
        prompts = prompt
    elif isinstance(prompt, list):
        prompts = [prompt]
    else:
        raise RequestError("prompt", "expected token ids (the demo's model has no tokenizer)")
    for p in prompts:
        if not p or not all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            raise RequestError("prompt", "expected a non-empty list of token ids")
        if not all(0 <= t < vocab for t in p):
            raise RequestError("prompt", f"token ids must be in [0, {vocab})")
    for name in ("stream", "echo", "use_beam_search"):
        if body.get(name):
            raise RequestError(name, "not supported by the demo's model server")
    if _int(body, "n", 1, 1) != 1 or _int(body, "best_of", 1, 1) != 1:
        raise RequestError("n", "one completion per prompt")
    _number(body, "temperature", (1.0,))
    _number(body, "top_p", (1.0,))
    _number(body, "top_k", (0, -1))
    logprobs = _int(body, "logprobs", None, 0)
    if logprobs not in (None, 0):
        raise RequestError("logprobs", "only the sampled token's log-prob (0) is served")
    max_tokens = _int(body, "max_tokens", DEFAULT_MAX_TOKENS, 1)
    assert max_tokens is not None
    seed = _int(body, "seed", None, 0)
    ignore_eos = bool(body.get("ignore_eos", False))
    return [
        Row(
            list(p),
            max_tokens,
            ignore_eos,
            # an unseeded request gets a seed of its own, so no two share a generator
            seed if seed is not None else secrets.randbits(63),
        )
        for p in prompts
    ]


def sample(model: Any, rows: list[Row]) -> None:
    """Complete ``rows`` in place: each samples at temperature 1 with its own generator
    until EOS (unless ``ignore_eos``) or ``max_tokens``, keeping each sampled token's
    log-prob (raw: the model's log-softmax, what vLLM's ``raw_logprobs`` returns)."""
    import torch

    by_len: dict[int, list[Row]] = {}
    for row in rows:
        by_len.setdefault(len(row.prompt), []).append(row)
    with torch.no_grad():
        for _, group in sorted(by_len.items()):
            # prompts of one length together: no padding, no attention mask to get wrong
            ids = torch.tensor([r.prompt for r in group])
            gens = [torch.Generator().manual_seed(r.seed) for r in group]
            live = list(range(len(group)))
            for _ in range(max(r.max_tokens for r in group)):
                # no KV cache: a few tokens of a tiny model, recomputed, cost less than
                # transformers' cache bookkeeping
                logits = model(input_ids=ids[live], use_cache=False).logits[:, -1].float()
                logp = torch.log_softmax(logits, dim=-1)
                probs = logp.exp()
                nxt = []
                for j, i in enumerate(live):
                    tok = int(torch.multinomial(probs[j], 1, generator=gens[i])[0])
                    row = group[i]
                    row.tokens.append(tok)
                    row.logprobs.append(float(logp[j, tok]))
                    nxt.append(tok)
                column = torch.zeros((len(group), 1), dtype=ids.dtype)
                column[live, 0] = torch.tensor(nxt, dtype=ids.dtype)
                ids = torch.cat([ids, column], dim=1)
                still = []
                for i in live:
                    row = group[i]
                    if row.tokens[-1] == sim.EOS and not row.ignore_eos:
                        row.finish_reason = "stop"
                    elif len(row.tokens) < row.max_tokens:
                        still.append(i)
                live = still
                if not live:
                    break


def response(rows: list[Row], model_name: str) -> dict[str, Any]:
    """vLLM's completion response for ``rows`` (``return_token_ids`` fields included; the
    text of a token is ``token_id:<id>``, as vLLM spells tokens it cannot detokenize)."""
    choices = []
    for index, row in enumerate(rows):
        words = [f"token_id:{t}" for t in row.tokens]
        offsets, at = [], 0
        for word in words:
            offsets.append(at)
            at += len(word)
        choices.append(
            {
                "index": index,
                "text": "".join(words),
                "logprobs": {
                    "text_offset": offsets,
                    "token_logprobs": row.logprobs,
                    "tokens": words,
                    "top_logprobs": [{w: lp} for w, lp in zip(words, row.logprobs, strict=True)],
                },
                "finish_reason": row.finish_reason,
                "stop_reason": None,
                "prompt_token_ids": row.prompt,
                "token_ids": row.tokens,
                "prompt_logprobs": None,
            }
        )
    prompt_tokens = sum(len(r.prompt) for r in rows)
    completion_tokens = sum(len(r.tokens) for r in rows)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens,
            "prompt_tokens_details": None,
        },
    }


def _strip_fields(doc: dict[str, Any], body: dict[str, Any]) -> dict[str, Any]:
    """What vLLM leaves out unless asked: log-probs without ``logprobs``, token ids
    without ``return_token_ids``."""
    for choice in doc["choices"]:
        if body.get("logprobs") is None:
            choice["logprobs"] = None
        if not body.get("return_token_ids"):
            choice["token_ids"] = None
            choice["prompt_token_ids"] = None
    return doc


class ModelServer:
    """One checkpoint served on one port (and the LoRA adapters loaded on it), its batches
    sampled on a worker thread."""

    def __init__(self, model: Any, model_uri: str, name: str) -> None:
        self.model = model
        self.model_uri = model_uri
        self.name = name
        self.vocab = int(model.config.vocab_size)
        self.queue: asyncio.Queue[tuple[list[Row], str, asyncio.Future[None]]] | None = None
        self.batches = 0
        self.requests = 0
        self._batching: asyncio.Task[None] | None = None
        self.adapters = LoraAdapters(model, name)
        # requests served per model name (the base's and each adapter's)
        self.served: dict[str, int] = {}

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/load_lora_adapter", self.adapters.load)
        app.router.add_post("/v1/unload_lora_adapter", self.adapters.unload)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, _app: web.Application) -> None:
        self.queue = asyncio.Queue()
        self._batching = asyncio.create_task(self._batcher())

    async def _stop(self, _app: web.Application) -> None:
        if self._batching is not None:
            self._batching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._batching

    async def _health(self, _request: web.Request) -> web.Response:
        return web.Response(text="")

    async def _models(self, _request: web.Request) -> web.Response:
        model = {"id": self.name, "object": "model", "created": int(time.time()),
                 "owned_by": "rtrl-demo", "root": self.model_uri, "parent": None,
                 "max_model_len": int(self.model.config.n_positions)}  # fmt: skip
        loras = self.adapters.listed(int(self.model.config.n_positions))
        return web.json_response({"object": "list", "data": [model, *loras]})

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return error(400, "the body is not JSON", "body")
        named = body.get("model") if isinstance(body, dict) else None
        model = self.name if named is None else named
        if model != self.name and model not in self.adapters:
            return error(404, f"The model `{named}` does not exist.", "model")
        try:
            rows = parse_request(body, self.vocab)
        except RequestError as exc:
            return error(400, str(exc), exc.param)
        assert self.queue is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        await self.queue.put((rows, model, done))
        await done
        self.requests += 1
        self.served[model] = self.served.get(model, 0) + 1
        return web.json_response(_strip_fields(response(rows, model), body))

    def _model_of(self, name: str) -> Any:
        """The base, or the adapter's merged model (an adapter unloaded while its request
        waited: the request fails, as one to an unknown model would)."""
        if name == self.name:
            return self.model
        held = self.adapters.model(name)
        if held is None:
            raise RuntimeError(f"the lora adapter '{name}' was unloaded")
        return held

    async def _batcher(self) -> None:
        """Take every request waiting (up to :data:`MAX_BATCH` rows), sample them in one
        batch on a thread (torch releases the GIL), answer them, repeat."""
        assert self.queue is not None
        while True:
            waiting = [await self.queue.get()]
            size = len(waiting[0][0])
            while not self.queue.empty() and size < MAX_BATCH:
                item = self.queue.get_nowait()
                waiting.append(item)
                size += len(item[0])
            by_model: dict[str, list[tuple[list[Row], str, asyncio.Future[None]]]] = {}
            for item in waiting:
                by_model.setdefault(item[1], []).append(item)
            for name, items in by_model.items():
                rows = [row for item in items for row in item[0]]
                try:
                    await asyncio.to_thread(sample, self._model_of(name), rows)
                except Exception as exc:  # answer every waiting request, keep serving
                    for _, _, done in items:
                        if not done.done():
                            done.set_exception(exc)
                    continue
                for _, _, done in items:
                    if not done.done():
                        done.set_result(None)
            self.batches += 1


class ServerThread:
    """An asyncio loop on a thread of its own, holding the model servers of a process (the
    demo's serving fleet keeps one per checkpoint it serves)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.runners: dict[int, web.AppRunner] = {}

    def start(self, server: ModelServer, port: int, host: str = "127.0.0.1") -> int:
        """Serve ``server`` on ``host:port``; return the port."""

        async def up() -> web.AppRunner:
            runner = web.AppRunner(server.app(), access_log=None)
            await runner.setup()
            await web.TCPSite(runner, host, port).start()
            return runner

        self.runners[port] = asyncio.run_coroutine_threadsafe(up(), self.loop).result(timeout=60)
        return port

    def stop(self, port: int) -> None:
        runner = self.runners.pop(port, None)
        if runner is not None:
            asyncio.run_coroutine_threadsafe(runner.cleanup(), self.loop).result(timeout=60)

    def close(self) -> None:
        for port in list(self.runners):
            self.stop(port)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()
