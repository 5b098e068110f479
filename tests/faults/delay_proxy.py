"""A TCP proxy that delays what it forwards: each chunk read is written on after DELAY ± JITTER
seconds (uniform, seeded), never before a chunk read ahead of it, so that the byte stream stays
in order as TCP keeps it. It stands in the link where netem would (this kernel has none):

    python -m tests.faults.delay_proxy --listen 10.77.0.1:7000 --to 10.77.0.2:5555 --delay 0.1 --jitter 0.02

Every connection to --listen gets its own connection to --to; a half-close is passed on, and a
reset on either side closes both. With --off it starts passing bytes on at once; SIGUSR1 turns the
delay on, SIGUSR2 off again (a test keeps one link for its whole life and slows it for a while).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import signal
import sys
import time

CHUNK = 65536


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"{text!r} is not HOST:PORT")
    return host, int(port)


class Delayer:
    def __init__(self, delay: float, jitter: float, rng: random.Random, on: bool = True):
        self.delay, self.jitter, self.rng, self.on = delay, jitter, rng, on

    def hold(self) -> float:
        """Seconds the next chunk is held."""
        return max(0.0, self.delay + self.rng.uniform(-self.jitter, self.jitter)) if self.on else 0.0

    async def pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Copies reader to writer, each chunk held back until its release time."""
        queue: asyncio.Queue = asyncio.Queue()
        last = 0.0

        async def release():
            while True:
                at, data = await queue.get()
                wait = at - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if data is None:   # the sender finished: pass its half-close on
                    if writer.can_write_eof():
                        writer.write_eof()
                    break
                writer.write(data)
                await writer.drain()
        sender = asyncio.create_task(release())
        try:
            while True:
                data = await reader.read(CHUNK)
                now = time.monotonic()
                last = max(last, now + self.hold())
                await queue.put((last, data or None))
                if not data:
                    break
            await sender
        except (ConnectionError, asyncio.CancelledError):
            writer.close()   # a reset on one side resets the other
        finally:
            sender.cancel()


async def serve(listen: tuple[str, int], to: tuple[str, int], delayer: Delayer) -> None:
    async def on_client(c_reader, c_writer):
        try:
            u_reader, u_writer = await asyncio.open_connection(*to)
        except OSError:
            c_writer.close()
            return
        await asyncio.gather(delayer.pump(c_reader, u_writer), delayer.pump(u_reader, c_writer),
                             return_exceptions=True)
        u_writer.close()
        c_writer.close()
    server = await asyncio.start_server(on_client, *listen, reuse_address=True)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, lambda: setattr(delayer, "on", True))
    loop.add_signal_handler(signal.SIGUSR2, lambda: setattr(delayer, "on", False))
    print(f"delay proxy {listen[0]}:{listen[1]} -> {to[0]}:{to[1]}, {delayer.delay * 1000:.0f} ms "
          f"± {delayer.jitter * 1000:.0f} ms", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="delay_proxy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--listen", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--to", type=_address, required=True, metavar="HOST:PORT")
    parser.add_argument("--delay", type=float, default=0.1, help="seconds each chunk is held (default 0.1)")
    parser.add_argument("--jitter", type=float, default=0.02, help="± seconds around --delay (default 0.02)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--off", action="store_true", help="start without delay (SIGUSR1 turns it on)")
    args = parser.parse_args(argv)
    if args.delay < 0 or args.jitter < 0:
        parser.error("--delay and --jitter must not be negative")
    asyncio.run(serve(args.listen, args.to, Delayer(args.delay, args.jitter, random.Random(args.seed), not args.off)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
