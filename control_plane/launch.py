"""Bringing data planes up for a control plane: spawning them as child processes (watched,
restarted, stopped), and connecting to one and waiting for its handshake."""
from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import tempfile
import uuid

from shared import config as C

log = logging.getLogger("pagedserve.control_plane")
HANDSHAKE_TIMEOUT = 600.0  # the data plane loads the model before it answers


def load_tokenizer(model: str):
    from transformers import AutoTokenizer
    folder, gguf_file = C.split_model_path(model)
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)


def local_address(suffix: str = "") -> str:
    """A fresh ipc:// address for a data plane on this machine."""
    return f"ipc://{tempfile.gettempdir()}/pagedserve-{uuid.uuid4().hex[:12]}{suffix}.sock"


class SpawnedDataPlane:
    """A data-plane process this control plane owns: started, watched, restarted, stopped."""

    def __init__(self, config: C.DataPlaneConfig):
        self.cmd = [sys.executable, "-m", "data_plane", *C.data_plane_argv(config)]
        self.address = config.listen
        self.proc = self._start()

    def _start(self) -> subprocess.Popen:
        log.info("starting the data plane: %s", " ".join(self.cmd))
        # its own session: a Ctrl-C in the terminal reaches only us, and we stop it in order
        return subprocess.Popen(self.cmd, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    async def restart(self) -> None:
        """Kills it if it still runs (hung, or stopped: SIGKILL ends both) and starts a new one."""
        if self.alive():
            self.proc.kill()
        await asyncio.get_running_loop().run_in_executor(None, self.proc.wait)
        log.warning("the data plane exited with code %s; restarting it", self.proc.returncode)
        self.proc = self._start()

    def stop(self, timeout: float = 10.0) -> None:
        """Waits for it to exit (after SHUTDOWN), then asks with SIGTERM, then kills it."""
        for ask in (None, self.proc.terminate, self.proc.kill):
            if ask is not None:
                log.warning("the data plane did not exit; sending %s", ask.__name__)
                ask()
            try:
                self.proc.wait(timeout=timeout)
                break
            except subprocess.TimeoutExpired:
                pass
        remove_ipc_file(self.address)


def remove_ipc_file(address: str) -> None:
    """Deletes the socket file of an ipc:// address whose process has exited (one killed, or one
    whose socket was not closed, leaves it behind)."""
    if address.startswith("ipc://"):
        try:
            os.unlink(address[len("ipc://"):])
        except FileNotFoundError:
            pass


def spawn(args, num: int) -> tuple[list[str], list[SpawnedDataPlane]]:
    """Starts `num` data planes on ipc addresses; a metrics port P becomes P, P+1, ..."""
    addresses, children = [], []
    for i in range(num):
        address = local_address(f"-r{i}" if num > 1 else "")
        config = C.data_plane_config(args, address)
        if config.metrics_port:
            config.metrics_port += i
        addresses.append(address)
        children.append(SpawnedDataPlane(config))
    return addresses, children


async def connect(cp: C.ControlPlaneConfig, address: str, child: SpawnedDataPlane | None, stop: asyncio.Event,
                  tokens=None):
    """(client, handshake) once the data plane at `address` answers; (None, None) if `stop` is set
    first. Raises SystemExit if `child`, the process meant to answer, exits before it does.
    `tokens`: where owner tokens are kept (control_plane/owner_tokens.py), or None."""
    from control_plane.dp_client import DataPlaneClient, DataPlaneRefused
    client = DataPlaneClient(address, cp.curve_keys, tokens)
    task = asyncio.ensure_future(client.handshake(HANDSHAKE_TIMEOUT))
    try:
        while not task.done():
            await asyncio.wait([task], timeout=1.0)
            if child is not None and not child.alive():
                task.cancel()
                raise SystemExit(f"the data plane at {address} exited with code {child.proc.returncode} "
                                 "before the handshake")
            if stop.is_set():
                task.cancel()
                if child is not None:   # one started elsewhere is left running (server.py)
                    await client.shutdown()
                client.close()
                return None, None
    except asyncio.CancelledError:   # given up on (connect_replicas): the handshake stops with it
        task.cancel()
        client.close()
        raise
    try:
        hs = task.result()
    except DataPlaneRefused as exc:   # another control plane owns it: it keeps it, we leave
        client.close()
        log.error("%s", exc)
        raise SystemExit(f"pagedserve: {exc}") from None
    if child is not None:
        client.alive_check = child.alive
    return client, hs


async def connect_replicas(cp: C.ControlPlaneConfig, addresses: list[str], children: list, stop: asyncio.Event,
                           tokens=None):
    """connect() for every replica. Spawned data planes are all waited for. Data planes started
    elsewhere are waited for until the first answers, and then --step-timeout more: a replica still
    silent then is (None, None) here, and its engine connects while the others serve."""
    tasks = [asyncio.ensure_future(connect(cp, a, c, stop, tokens)) for a, c in zip(addresses, children)]
    try:
        if any(c is not None for c in children) or len(tasks) == 1:
            return await asyncio.gather(*tasks)
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            task.result()   # a refusal (SystemExit) ends the start here
        if pending and not stop.is_set():
            await asyncio.wait(pending, timeout=cp.step_timeout)
        for task in tasks:
            if task.done():
                task.result()
        late = [a for a, t in zip(addresses, tasks) if not t.done()]
        if late:
            log.warning("no handshake from %s within %.0fs of the first replica's; serving without %s until %s",
                        ", ".join(late), cp.step_timeout, "them" if len(late) > 1 else "it",
                        "they answer" if len(late) > 1 else "it answers")
        return [t.result() if t.done() else (None, None) for t in tasks]
    finally:
        for task in tasks:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
