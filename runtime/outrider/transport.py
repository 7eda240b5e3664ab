"""Socket factory: every ZeroMQ option Outrider sets lives here."""

from __future__ import annotations

import ipaddress
import logging
import os
import stat
from dataclasses import dataclass
from typing import Optional
from urllib.parse import urlsplit

import zmq

from .errors import OutriderError
from .protocol import Limits

log = logging.getLogger("outrider.transport")

DEFAULT_ADDRESS = os.environ.get("OUTRIDER_ADDRESS", "tcp://127.0.0.1:5555")
# Bounded queues: a slow or absent peer cannot make the server buffer without limit.
SERVER_HWM = 10_000
# A connection's complete messages that libzmq has read but the I/O loop has not: past this,
# libzmq stops reading that connection, so a client that sends faster than the server reads
# backs up in its own process and the kernel's socket buffer (flow control), not in the server's
# memory. Measured: pipelining 20,000 small requests is as fast at 16 as at 10,000.
SERVER_RCVHWM = 16
CLIENT_HWM = 1_000


@dataclass(frozen=True)
class CurveServerKeys:
    """Server key pair plus the folder of client public keys allowed to connect.

    `allow_any=True` (and no folder) admits every client key: traffic is encrypted, but anyone who
    can reach the address and knows the server's public key may send requests.
    """

    secret_key_file: str
    allowed_clients_dir: Optional[str] = None
    allow_any: bool = False


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
    sock.setsockopt(zmq.RCVHWM, SERVER_RCVHWM)
    # The application checks limits.max_message_bytes and answers with an error; ZeroMQ's own cap
    # (per frame) sits above it and only drops peers that send absurd frames.
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes + (1 << 20))
    sock.setsockopt(zmq.LINGER, 2000)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        try:
            public, secret = load_secret_key(curve.secret_key_file)
        except OutriderError:
            sock.close(0)
            raise
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

    location = _allow_location(curve)
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=location)
    return auth


def _allow_location(curve: CurveServerKeys) -> str:
    """The allow folder, checked; or zmq's allow-any marker when (and only when) asked for by name."""
    from zmq.auth import CURVE_ALLOW_ANY

    folder = curve.allowed_clients_dir
    if curve.allow_any:
        if folder:
            raise OutriderError("give either an allow folder of client keys or allow-any, not both", code="usage")
        log.warning(
            "CURVE: every client key is admitted (--curve-allow-any): traffic is encrypted, but anyone who can "
            "reach this address and knows the server's public key can send requests"
        )
        return CURVE_ALLOW_ANY
    if not folder:
        raise OutriderError("CURVE needs a folder of allowed client public keys (--curve-allow DIR)", code="usage")
    if folder == CURVE_ALLOW_ANY:
        raise OutriderError(
            "--curve-allow '*' would admit every client key; say --curve-allow-any (instead of --curve-allow) "
            "if that is what you mean",
            code="usage",
        )
    try:
        info = os.stat(folder)
    except OSError as exc:
        raise OutriderError(f"allowed client keys folder {folder}: {exc.strerror}", code="bad_key") from None
    if not stat.S_ISDIR(info.st_mode):
        raise OutriderError(f"allowed client keys folder {folder} is not a directory", code="bad_key")
    if info.st_mode & 0o022:
        raise OutriderError(
            f"allowed client keys folder {folder} has mode {stat.S_IMODE(info.st_mode):04o}: others can add keys to it; "
            f"chmod go-w {folder}",
            code="bad_key",
        )
    return folder


def check_private_file(path: str, what: str = "secret key file") -> os.stat_result:
    """A file of secrets (a CURVE secret key, the HTTP front's API keys) must be a regular file that
    neither group nor others can access (like ssh); OutriderError (bad_key) says what is wrong."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise OutriderError(f"{what} {path}: {exc.strerror}", code="bad_key") from None
    if not stat.S_ISREG(info.st_mode):
        raise OutriderError(f"{what} {path} is not a regular file", code="bad_key")
    if info.st_mode & 0o077:
        raise OutriderError(
            f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: group or others can access it, "
            f"so it is refused; chmod 600 {path} (and keep it in a directory only its owner can read)",
            code="bad_key",
        )
    return info


def load_secret_key(path: str) -> tuple[bytes, bytes]:
    """(public, secret) from a CURVE certificate file that only its owner can read."""
    from zmq.auth import load_certificate

    check_private_file(path)
    try:
        public, secret = load_certificate(path)
    except (OSError, ValueError) as exc:
        raise OutriderError(f"secret key file {path} is not a CURVE certificate: {exc}", code="bad_key") from None
    if secret is None:
        raise OutriderError(f"{path} holds no secret key (is it the public .key file?)", code="bad_key")
    return public, secret


def load_public_key(path: str) -> bytes:
    from zmq.auth import load_certificate

    try:
        return load_certificate(path)[0]
    except (OSError, ValueError) as exc:
        raise OutriderError(f"public key file {path}: {exc}", code="bad_key") from None


def client_socket(
    ctx: zmq.Context, address: str, curve: Optional[CurveClientKeys] = None, kind: int = zmq.DEALER
) -> zmq.Socket:
    """The DEALER a client connects with."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.SNDHWM, CLIENT_HWM)
    sock.setsockopt(zmq.RCVHWM, CLIENT_HWM)
    sock.setsockopt(zmq.LINGER, 0)
    if address.startswith("ipc://"):
        # A local socket that is not there yet (a server starting) costs nothing to retry: every
        # 10 ms instead of libzmq's 100, so a client waiting for a start sees it when it happens.
        sock.setsockopt(zmq.RECONNECT_IVL, 10)
    if address.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    if curve is not None:
        try:
            server_public = load_public_key(curve.server_public_key_file)
            public, secret = load_secret_key(curve.client_secret_key_file)
        except OutriderError:
            sock.close(0)
            raise
        sock.curve_serverkey = server_public
        sock.curve_publickey = public
        sock.curve_secretkey = secret
    sock.connect(address)
    return sock


def make_keys(directory: str, name: str) -> tuple[str, str]:
    """Create NAME.key (public, 0644) and NAME.key_secret (0600) in `directory` (zmq.auth's format).

    A new directory is made 0700; an existing one must not be open to group or others. Neither
    file may exist already: a secret key is never overwritten.
    """
    import datetime

    if not name or os.sep in name or name in (".", ".."):
        raise OutriderError(f"key name {name!r} must be a plain file name", code="usage")
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        info = os.stat(directory)
    except OSError as exc:
        raise OutriderError(f"cannot create key directory {directory}: {exc.strerror}", code="bad_key") from None
    if info.st_mode & 0o077:
        raise OutriderError(
            f"key directory {directory} has mode {stat.S_IMODE(info.st_mode):04o}: group or others can look into it; "
            f"give a new directory (it is made 0700) or chmod 700 {directory}",
            code="bad_key",
        )
    public_key, secret_key = zmq.curve_keypair()
    base = os.path.join(directory, name)
    public_file, secret_file = base + ".key", base + ".key_secret"
    now = datetime.datetime.now().isoformat(timespec="seconds")
    curve = f'curve\n    public-key = "{public_key.decode()}"\n'
    _write_new(secret_file, 0o600, f"#   ZeroMQ CURVE **Secret** Certificate, made by outrider keygen {now}\n"
               "#   DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its permissions.\n\nmetadata\n"
               + curve + f'    secret-key = "{secret_key.decode()}"\n')
    _write_new(public_file, 0o644, f"#   ZeroMQ CURVE Public Certificate, made by outrider keygen {now}\n"
               "#   Copy it into the server's --curve-allow folder (client keys) or to clients (server key).\n\n"
               "metadata\n" + curve)
    return public_file, secret_file


def _write_new(path: str, mode: int, text: str) -> None:
    """Write a file that must not exist yet, created with `mode` (never wider, whatever the umask)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    except FileExistsError:
        raise OutriderError(f"{path} already exists; remove it or choose another --name", code="bad_key") from None
    except OSError as exc:
        raise OutriderError(f"cannot write {path}: {exc.strerror}", code="bad_key") from None
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        os.fchmod(f.fileno(), mode)
        f.write(text)


# pyzmq's send_multipart/recv_multipart combine enum flags on every frame, and a NOBLOCK recv on
# an empty socket raises; both cost more than the echo model itself. Plain ints, and a look at
# ZMQ_EVENTS before reading, keep the per-message overhead down.
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_EVENTS = int(zmq.EVENTS)
_POLLIN = int(zmq.POLLIN)


# The Cython send under zmq.Socket.send, whose Python layer only adds DRAFT routing_id/group
# handling (unused here) and costs as much again per frame as the send itself.
_send_frame = zmq.backend.Socket.send


def send_frames(sock: zmq.Socket, frames: list, nonblock: bool = False) -> None:
    """Send a multipart message without copying large frames."""
    flags = _NOBLOCK if nonblock else 0
    more = flags | _SNDMORE
    for frame in frames[:-1]:
        _send_frame(sock, frame, more, copy=False)
    _send_frame(sock, frames[-1], flags, copy=False)


def recv_message(sock: zmq.Socket, max_frames: int) -> Optional[tuple[list, int]]:
    """The next whole message if one is waiting, else None (never blocks, never raises EAGAIN), keeping
    at most `max_frames` frames: (frames, how many more were dropped).

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
