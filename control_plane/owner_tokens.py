"""The owner tokens of data planes started elsewhere (--data-plane), kept on disk so that a
control plane started again after a crash (SIGKILL, an OOM kill, a reboot of its host) takes its
data planes over at once: its first HELLO carries the token, and the data plane hands ownership to
it even while the old link still looks up (a frozen or cut-off host's link closes only after the
data plane's 10 s heartbeat).

One file per data-plane address in --state-dir (default $XDG_STATE_HOME/pagedserve, else
~/.local/state/pagedserve): owner-<hash of the address>.json, holding the address and the token,
mode 0600 (a token lets its holder take the data plane over), written whole and renamed into
place. Beside it, owner-<hash>.lock is held with flock(LOCK_EX) for as long as this process
lives; the kernel releases it when the process ends, however it ends. A second control plane
started while the first one runs finds the lock taken: it does not read the token, and so the
data plane refuses it as it refuses any stranger while its owner's link is up; it gives up at
the first refusal (the holder lives), where one without a saved token asks again for a while.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os

log = logging.getLogger("pagedserve.control_plane")


def default_state_dir() -> str:
    base = os.environ.get("XDG_STATE_HOME") or os.path.join(os.path.expanduser("~"), ".local", "state")
    return os.path.join(base, "pagedserve")


class OwnerTokens:
    def __init__(self, state_dir: str | None):
        self.dir = state_dir or default_state_dir()
        self._locks: dict[str, int | None] = {}   # address -> fd of its held lock; None: another process holds it
        self._saved: dict[str, str] = {}
        try:
            os.makedirs(self.dir, mode=0o700, exist_ok=True)
            self.usable = True
        except OSError as exc:
            log.warning("owner tokens are not kept (%s: %s): a restarted control plane takes its data planes "
                        "over only once their old owner's link is gone", self.dir, exc)
            self.usable = False

    def _path(self, address: str, suffix: str) -> str:
        return os.path.join(self.dir, f"owner-{hashlib.sha256(address.encode()).hexdigest()[:16]}{suffix}")

    def _claim(self, address: str) -> bool:
        """Whether this process holds the lock of `address` (taken on first call, kept until exit)."""
        if not self.usable:
            return False
        if address not in self._locks:
            fd = os.open(self._path(address, ".lock"), os.O_RDWR | os.O_CREAT, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                fd = None
                log.warning("another control plane on this host holds %s (the owner token of %s): not using "
                            "it; the data plane serves whichever control plane owns it", self._path(address, ".lock"),
                            address)
            self._locks[address] = fd
        return self._locks[address] is not None

    def held_elsewhere(self, address: str) -> bool:
        """Whether another live process on this host holds the token of `address`."""
        return self.usable and not self._claim(address)

    def load(self, address: str) -> str | None:
        """The token saved for `address`, if this process may use it and one is saved."""
        if not self._claim(address):
            return None
        try:
            with open(self._path(address, ".json")) as f:
                saved = json.load(f)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("ignored the unreadable owner token of %s: %s", address, exc)
            return None
        token = saved.get("token") if isinstance(saved, dict) and saved.get("address") == address else None
        if isinstance(token, str):
            self._saved[address] = token
            log.info("using the owner token saved for %s", address)
            return token
        return None

    def save(self, address: str, token: str) -> None:
        """Keeps `token` for `address` (when this process holds its lock); a failure to write is logged."""
        if not token or self._saved.get(address) == token or not self._claim(address):
            return
        path = self._path(address, ".json")
        tmp = f"{path}.{os.getpid()}.tmp"
        try:
            if os.path.lexists(tmp):   # left by a process that died writing (pids are reused)
                os.unlink(tmp)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump({"address": address, "token": token}, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            dir_fd = os.open(self.dir, os.O_RDONLY)
            try:
                os.fsync(dir_fd)
            finally:
                os.close(dir_fd)
        except OSError as exc:
            if os.path.lexists(tmp):
                os.unlink(tmp)
            log.warning("could not keep the owner token of %s in %s: %s", address, path, exc)
            return
        self._saved[address] = token

    def close(self) -> None:
        for fd in self._locks.values():
            if fd is not None:
                os.close(fd)
        self._locks.clear()
