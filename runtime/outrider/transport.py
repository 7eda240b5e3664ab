"""Socket factory: every ZeroMQ option Outrider sets lives here."""

from __future__ import annotations

import ipaddress
import os
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

import zmq

from .errors import OutriderError
from .protocol import Limits

DEFAULT_ADDRESS = os.environ.get("OUTRIDER_ADDRESS", "tcp://127.0.0.1:5555")
# Bounded queues: a slow or absent peer cannot make the server buffer without limit.
SERVER_HWM = 10_000
CLIENT_HWM = 1_000


@dataclass(frozen=True)
class CurveServerKeys:
    """Server key pair plus the folder of client public keys allowed to connect."""

    secret_key_file: str
    allowed_clients_dir: str


@dataclass(frozen=True)
class CurveClientKeys:
    server_public_key_file: str
    client_secret_key_file: str


def is_local_address(address: str) -> bool:
    """ipc:// and inproc:// are local; tcp:// is local only on a loopback host."""
    scheme, _, rest = address.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    if scheme != "tcp":
        return False
    host = urlsplit("//" + rest).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name, or a hostname: treat as exposed


def server_socket(
    ctx: zmq.Context, address: str, limits: Limits, curve: Optional[CurveServerKeys] = None
) -> zmq.Socket:
    """The ROUTER the server binds. A non-loopback TCP bind without CURVE is refused."""
    if not is_local_address(address) and curve is None:
        raise OutriderError(
            f"refusing to bind {address} without encryption: it is not a loopback or ipc address. "
            "Give --curve-secret-key and --curve-allow (make keys with `outrider keygen DIR`), "
            "or bind tcp://127.0.0.1:PORT or ipc://PATH.",
            code="insecure_bind",
        )
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # sending to a vanished client errors instead of vanishing
    sock.setsockopt(zmq.SNDHWM, SERVER_HWM)
    sock.setsockopt(zmq.RCVHWM, SERVER_HWM)
    # The application checks limits.max_message_bytes and answers with an error; ZeroMQ's own cap
    # (per frame) sits above it and only drops peers that send absurd frames.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + (1 << 20))
    sock.setsockopt(zmq.LINGER, 2000)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        from zmq.auth import load_certificate

        public, secret = load_certificate(curve.secret_key_file)
        if secret is None:
            raise OutriderError(f"{curve.secret_key_file} holds no secret key", code="bad_key")
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        sock.close(0)
        raise OutriderError(f"cannot bind {address}: {exc}", code="bind_failed") from None
    return sock


def start_authenticator(ctx: zmq.Context, curve: CurveServerKeys):
    """ZAP handler that admits only the client public keys found in the allow folder."""
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=curve.allowed_clients_dir)
    return auth


def client_socket(
    ctx: zmq.Context, address: str, curve: Optional[CurveClientKeys] = None, kind: int = zmq.DEALER
) -> zmq.Socket:
    """The DEALER a client connects with."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, CLIENT_HWM)
    sock.setsockopt(zmq.RCVHWM, CLIENT_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        from zmq.auth import load_certificate

        server_public, _ = load_certificate(curve.server_public_key_file)
        public, secret = load_certificate(curve.client_secret_key_file)
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.connect(address)
    return sock


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """Create NAME.key (public) and NAME.key_secret in `directory` (zmq.auth's format)."""
    from zmq.auth import create_certificates

    os.makedirs(directory, exist_ok=True)
    return create_certificates(directory, name)


# pyzmq's send_multipart/recv_multipart combine enum flags on every frame, and a NOBLOCK recv on
# an empty socket raises; both cost more than the echo model itself. Plain ints, and a look at
# ZMQ_EVENTS before reading, keep the per-message overhead down.
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list, nonblock: bool = False) -> None:
    """Send a multipart message without copying large frames."""
    flags = _NOBLOCK if nonblock else 0
    last = len(frames) - 1
    for index, frame in enumerate(frames):
        sock.send(frame, flags | _SNDMORE if index < last else flags, copy=False)


def recv_ready(sock: zmq.Socket) -> Optional[list]:
    """The next whole message if one is waiting, else None (never blocks, never raises EAGAIN)."""
    if not sock.getsockopt(_EVENTS) & _POLLIN:
        return None
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    while frame.more:  # a Frame attribute: no getsockopt(RCVMORE) round through pyzmq's enums
        frame = sock.recv(_NOBLOCK, copy=False)
        frames.append(frame)
    return frames


def recv_message(sock: zmq.Socket, max_frames: int) -> Optional[tuple[list, int]]:
    """Like `recv_ready`, but keeps at most `max_frames` frames: (frames, how many more were dropped).

    ZeroMQ delivers a multipart message only once every frame has arrived, so reading the rest
    never blocks; dropping them keeps a message of a million empty frames from becoming a
    million Python objects (it still costs one recv each).
    """
    if not sock.getsockopt(_EVENTS) & _POLLIN:
        return None
    frame = sock.recv(_NOBLOCK, copy=False)
    frames = [frame]
    dropped = 0
    while frame.more:
        frame = sock.recv(_NOBLOCK, copy=False)
        if len(frames) < max_frames:
            frames.append(frame)
        else:
            dropped += 1
    return frames, dropped


def recv_blocking(sock: zmq.Socket) -> Optional[list]:
    """Wait (up to the socket's ZMQ_RCVTIMEO) for a whole message; None on timeout.

    One blocking recv costs one call; poll-then-recv costs a Poller object and several.
    """
    try:
        frame = sock.recv(0, copy=False)
    except zmq.Again:
        return None
    frames = [frame]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame)
    return frames
