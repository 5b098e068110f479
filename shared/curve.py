"""ZeroMQ CURVE keys for the link between the planes: generation, loading, and socket setup.

A key folder (`pagedserve keygen DIR`) holds two key pairs in ZeroMQ's certificate format:

    server.key          the data plane's public key       (the control plane needs it)
    server.key_secret   the data plane's key pair         (only the data plane)
    client.key          the control plane's public key    (the data plane authorizes it)
    client.key_secret   the control plane's key pair      (only the control plane)

With CURVE the link is encrypted, and the data plane's ZAP handler accepts only the client
public key found in client.key: a peer without the client secret key gets no handshake, so
none of its frames (plans included) ever reaches the worker.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from urllib.parse import urlsplit

SERVER, CLIENT = "server", "client"
log = logging.getLogger("pagedserve.curve")


class CurveKeyError(ValueError):
    """A key folder that is missing or incomplete; the message says which file."""


@dataclass
class ServerKeys:
    public: bytes
    secret: bytes
    authorized_clients: frozenset[bytes]   # z85 public keys of control planes allowed in


@dataclass
class ClientKeys:
    public: bytes
    secret: bytes
    server_public: bytes


def keygen(folder: str) -> list[str]:
    """Writes new server and client key pairs into `folder` (created, mode 0700); returns the files."""
    import zmq.auth
    os.makedirs(folder, mode=0o700, exist_ok=True)
    written = []
    for name in (SERVER, CLIENT):
        for suffix in (".key", ".key_secret"):
            path = os.path.join(folder, name + suffix)
            if os.path.exists(path):
                raise CurveKeyError(f"{path} exists already: remove it or choose another folder")
    for name in (SERVER, CLIENT):
        public_file, secret_file = zmq.auth.create_certificates(folder, name)
        os.chmod(secret_file, 0o600)
        written += [public_file, secret_file]
    return written


def _load(folder: str, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    import zmq.auth
    path = os.path.join(folder, name + (".key_secret" if secret else ".key"))
    if not os.path.isfile(path):
        raise CurveKeyError(f"missing {path}: create the key folder with 'pagedserve keygen {folder}'")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (ValueError, OSError) as exc:
        raise CurveKeyError(f"{path} is not a ZeroMQ certificate: {exc}") from None
    if secret and not secret_key:
        raise CurveKeyError(f"{path} holds no secret key")
    return public, secret_key


def load_server_keys(folder: str) -> ServerKeys:
    public, secret = _load(folder, SERVER, secret=True)
    client_public, _ = _load(folder, CLIENT, secret=False)
    return ServerKeys(public, secret, frozenset({client_public}))


def load_client_keys(folder: str) -> ClientKeys:
    public, secret = _load(folder, CLIENT, secret=True)
    server_public, _ = _load(folder, SERVER, secret=False)
    return ClientKeys(public, secret, server_public)


class _AllowList:
    """ZAP credentials provider: lets in only the listed client public keys."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain, key: bytes) -> bool:
        allowed = key in self.keys
        if not allowed:
            log.warning("refused a CURVE client with an unknown public key %s", key.decode(errors="replace"))
        return allowed


def secure_server(ctx, sock, keys: ServerKeys):
    """Makes `sock` (not yet bound) a CURVE server that admits only authorized clients. Returns the
    authenticator thread, which must live as long as the socket (stop() it after closing)."""
    import zmq
    from zmq.auth.thread import ThreadAuthenticator
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve_callback("*", _AllowList(keys.authorized_clients))
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    return auth


def secure_client(sock, keys: ClientKeys) -> None:
    """Makes `sock` (not yet connected) a CURVE client of the data plane whose public key it holds."""
    import zmq
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)


def is_loopback(address: str) -> bool:
    """True for addresses no other machine can reach: ipc://, inproc://, tcp on 127.0.0.0/8 or ::1."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit("//" + rest).hostname or ""
    return host == "localhost" or host == "::1" or host.startswith("127.")
