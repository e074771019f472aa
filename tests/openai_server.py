"""A small OpenAI-compatible server for tests, with faults injected on chosen requests.

It streams `/v1/chat/completions` and `/v1/completions` as OpenAI does (SSE chunks,
a usage chunk when `stream_options.include_usage`, then `[DONE]`) and lists
`/v1/models`.  A prompt (the raw text, or the last message) may carry one marker,
`[[FAULT]]` or `[[FAULT*N]]` (the first N attempts of that prompt fail, then it is
answered; without N every attempt fails):

    429       HTTP 429                 500   HTTP 500
    hang      no answer (the client times out)
    drop      the connection closed mid-stream
    badjson   a chunk of broken JSON   trunc  the stream ends without [DONE]
    slow      a 0.05 s pause between chunks (no failure)
    nousage   no usage chunk, whatever stream_options asks (no failure)

`attempts` counts the requests each prompt got; `auth` the Authorization headers seen;
`bodies` the request bodies, in the order they came.

`tokenize="vllm"` adds vLLM's `POST /tokenize` (`{"model", "prompt" | "messages"}`),
`tokenize="llama.cpp"` llama-server's (`{"content"}`, and `POST /apply-template`): one
token per word, as `usage` counts (the last message's words, for a conversation); a
text holding `[[badtok]]` is refused (HTTP 400), one holding `[[tok500]]` answered with
HTTP 500, and `tokenize_500=N` answers the first N /tokenize calls with HTTP 500.  `tokenized` counts the texts /tokenize answered.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time
from collections import Counter

from aiohttp import web

MARKER = re.compile(r"\[\[(429|500|hang|drop|badjson|trunc|slow|nousage)(?:\*(\d+))?\]\]")


def answer_for(text: str) -> list[str]:
    """The pieces the server streams for a prompt: deterministic, four tokens."""
    return ["ok", " ", f"{len(text)}", "."]


class FaultServer:
    def __init__(self, model: str = "test-model", api_key: str | None = None, hang_s: float = 30.0,
                 port: int | None = None, tokenize: str | None = None, tokenize_500: int = 0,
                 also_serves: tuple[str, ...] = ()):
        """`port`: listen there (a server restarted where the last one was); default a free one;
        `also_serves`: more names /models lists (LoRA adapters, as vLLM's server lists them)."""
        self.model, self.api_key, self.hang_s = model, api_key, hang_s
        self.also_serves = also_serves
        self.tokenize, self.tokenize_500 = tokenize, tokenize_500
        self.tokenized: Counter[str] = Counter()
        self.attempts: Counter[str] = Counter()
        self.answered = 0
        self.auth: list[str | None] = []
        self.bodies: list[dict] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.port = port
        if port is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                self.port = s.getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    # -- lifecycle
    def start(self) -> "FaultServer":
        ready = threading.Event()

        def main():
            self._loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self._loop)
            app = web.Application()
            app.router.add_get("/v1/models", self._models)
            app.router.add_post("/v1/chat/completions", self._complete)
            app.router.add_post("/v1/completions", self._complete)
            if self.tokenize:
                app.router.add_post("/tokenize", self._tokenize)
                if self.tokenize == "llama.cpp":
                    app.router.add_post("/apply-template", self._apply_template)
            self._runner = web.AppRunner(app, shutdown_timeout=0.5)
            self._loop.run_until_complete(self._runner.setup())
            self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
            ready.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=main, daemon=True, name="fault-server")
        self._thread.start()
        if not ready.wait(10):
            raise RuntimeError("the fault server did not start")
        return self

    def stop(self) -> None:
        if self._loop is None:
            return
        fut = asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop)
        try:
            fut.result(10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)
            self._loop = None

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # -- handlers
    def _authorized(self, request: web.Request) -> bool:
        got = request.headers.get("Authorization")
        self.auth.append(got)
        return self.api_key is None or got == f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": m, "object": "model"}
                                                             for m in (self.model, *self.also_serves)]})

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        if self.tokenize == "vllm":
            if body.get("model") != self.model or not ("prompt" in body or "messages" in body):
                return web.json_response({"error": {"message": "bad request"}}, status=400)
            text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
        elif "content" not in body:
            return web.json_response({"error": {"message": "content missing"}}, status=400)
        else:
            text = re.sub(r"^<\|\w+\|>", "", body["content"].rsplit("\n", 1)[-1])  # an applied template's last message
        if "[[badtok]]" in text:
            return web.json_response({"error": {"message": "cannot tokenize"}}, status=400)
        if self.tokenize_500 > 0 or "[[tok500]]" in text:
            self.tokenize_500 = max(0, self.tokenize_500 - 1)
            return web.json_response({"error": {"message": "boom"}}, status=500)
        self.tokenized[text] += 1
        tokens = [1000 + len(w) for w in text.split()]
        return web.json_response({"count": len(tokens), "tokens": tokens, "max_model_len": 2048})

    async def _apply_template(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return web.json_response({"prompt": "\n".join(f"<|{m['role']}|>{m['content']}" for m in body["messages"])})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad key"}}, status=401)
        body = await request.json()
        self.bodies.append(body)
        chat = request.path.endswith("/chat/completions")
        text = body["messages"][-1]["content"] if chat else body["prompt"]
        if body.get("model") != self.model:
            return web.json_response({"error": {"message": f"model {body.get('model')} not found"}}, status=404)
        self.attempts[text] += 1
        n = self.attempts[text]
        m = MARKER.search(text)
        fault = m.group(1) if m and (m.group(2) is None or n <= int(m.group(2))) else None
        if fault == "429":
            return web.json_response({"error": {"message": "slow down"}}, status=429, headers={"Retry-After": "0"})
        if fault == "500":
            return web.json_response({"error": {"message": "boom"}}, status=500)
        if fault == "hang":
            await asyncio.sleep(self.hang_s)
            return web.json_response({"error": {"message": "too late"}}, status=500)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._stream(request, body, chat, text, fault)
        finally:
            self.in_flight -= 1

    async def _stream(self, request, body, chat, text, fault) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        pieces = answer_for(text)[: body.get("max_tokens", 16)]
        created = int(time.time())

        async def send(obj) -> None:
            await resp.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())

        for i, piece in enumerate(pieces):
            if fault == "drop" and i == 2:
                request.transport.close()  # mid-stream, no end of the chunked body
                return resp
            if fault == "badjson" and i == 2:
                await send('{"choices": [{"delta": {"content": "x"')
            choice = {"index": 0, "delta": {"content": piece}} if chat else {"index": 0, "text": piece}
            choice["finish_reason"] = "length" if i == len(pieces) - 1 else None
            await send({"id": "x", "object": "chat.completion.chunk" if chat else "text_completion",
                        "created": created, "model": self.model, "choices": [choice]})
            if fault == "slow":
                await asyncio.sleep(0.05)
        if fault == "trunc":
            await resp.write_eof()
            return resp
        if (body.get("stream_options") or {}).get("include_usage") and fault != "nousage":
            await send({"id": "x", "choices": [], "usage": {
                "prompt_tokens": len(text.split()), "completion_tokens": len(pieces),
                "total_tokens": len(text.split()) + len(pieces)}})
        await send("[DONE]")
        await resp.write_eof()
        self.answered += 1
        return resp
