"""The whole REST API in this process, for client tests that need no second process: the real engine
and the real model runner (a tiny random Llama with SmolLM2's tokenizer) behind the real aiohttp app,
served on a loopback port from a background thread, so that synchronous clients (openai, LangChain,
litellm) can talk to it."""
from __future__ import annotations

import asyncio
import threading

import torch
from aiohttp import web

from control_plane.api import make_app
from control_plane.engine import Engine
from data_plane import attention
from data_plane.model_runner import ModelRunner
from shared.config import ControlPlaneConfig, DataPlaneConfig
from tests.helpers import tiny_llama
from tests.runner_link import RunnerLink
from tests.servers import free_port

MODEL_NAME = "tiny-chat"


class InProcessServer:
    def __init__(self, tokenizer, max_model_len: int = 512, num_blocks: int = 256, **cp_overrides):
        self.tokenizer = tokenizer
        model = tiny_llama(attn=attention.register(), seed=0, vocab_size=len(tokenizer), hidden=64,
                           max_pos=max_model_len)
        # a swap pool as large as the device pool: the default 2 GiB would be ~10^5 tiny blocks to keep
        dp = DataPlaneConfig(model=MODEL_NAME, listen="inproc://x", block_size=16, kv_cache_blocks=num_blocks,
                             swap_blocks=num_blocks)
        self.runner = ModelRunner(model, dp, torch.device("cpu"))
        self.cp = ControlPlaneConfig(model=MODEL_NAME, max_num_batched_tokens=512, **cp_overrides)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.engine: Engine | None = None

    def _serve(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.loop.run_until_complete(self._start())
        self._ready.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        self.engine = Engine(self.cp, RunnerLink(self.runner), self.runner.handshake(), self.tokenizer)
        self._runner = web.AppRunner(make_app(self.engine), access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()
        self._engine_task = asyncio.create_task(self.engine.run())

    def start(self) -> "InProcessServer":
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the in-process server did not start")
        return self

    def stop(self) -> None:
        async def shutdown():
            await self.engine.stop()
            await self._runner.cleanup()
            self._engine_task.cancel()
        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
