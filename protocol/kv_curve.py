"""Optional ZMQ CURVE security for the KV-event stream (off by default; docs/security.md).

The KV events carry every prompt's token ids. Where NetworkPolicy does not keep other pods away
from the workers' event and replay ports, CURVE encrypts the stream and admits only subscribers
holding the graph's client key. One key folder serves a whole graph, laid out as pyzmq's
`zmq.auth.create_certificates` writes it (a mounted Secret works as is):

- `server.key_secret`: the key pair of every worker's PUB and replay ROUTER sockets (workers);
- `server.key`: its public half (subscribers check the worker with it);
- `client.key_secret`: the subscribers' key pair (the EPP, a `--mode kv` frontend);
- `client.key`: its public half (workers admit subscribers holding it; every `*.key` in the
  folder is admitted, so another subscriber key can be added beside it).

Workers read the two `server` files and the public `*.key` files; subscribers read `server.key`
and `client.key_secret`. A subscriber without keys, or with another graph's, completes no
handshake and receives nothing. The folder is `$DYNAMOGRAPH_KV_CURVE_DIR` or a component's
`--kv-curve-dir`; `create_keys(folder)` (`dynamograph kv-curve-keys FOLDER`, this module's
`add_arguments`/`run`) makes one.
"""

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.asyncio import AsyncioAuthenticator

KV_CURVE_ENV = "DYNAMOGRAPH_KV_CURVE_DIR"
SERVER = "server"
CLIENT = "client"


class CurveKeyError(ValueError):
    """The key folder is missing a file or holds an unreadable one."""


def _load(path: Path, *, secret: bool) -> tuple[bytes, bytes | None]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveKeyError(f"KV-event CURVE key {path}: {exc}") from None
    if secret and secret_key is None:
        raise CurveKeyError(f"KV-event CURVE key {path} holds no secret key")
    return public, secret_key


@dataclass(frozen=True)
class CurveKeys:
    """The key folder of a graph's KV-event stream."""

    folder: Path

    @classmethod
    def load(cls, folder: str | Path) -> "CurveKeys":
        """Check that CURVE is available and the folder is usable by both sides' files."""
        if not zmq.has("curve"):
            raise CurveKeyError("this pyzmq/libzmq has no CURVE support")
        keys = cls(Path(folder))
        if not keys.folder.is_dir():
            raise CurveKeyError(f"KV-event CURVE key folder {keys.folder} does not exist")
        return keys

    def serve(self, socket: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Make `socket` (a worker's PUB or replay ROUTER, before it binds) a CURVE server."""
        public, secret = _load(self.folder / f"{SERVER}.key_secret", secret=True)
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True

    def subscribe(self, socket: zmq.Socket) -> None:  # type: ignore[type-arg]
        """Make `socket` (a subscriber's SUB or replay DEALER, before it connects) a CURVE
        client that trusts only the graph's workers."""
        server_public, _ = _load(self.folder / f"{SERVER}.key", secret=False)
        public, secret = _load(self.folder / f"{CLIENT}.key_secret", secret=True)
        socket.curve_serverkey = server_public
        socket.curve_publickey = public
        socket.curve_secretkey = secret

    def admit_subscribers(self, context: zmq.Context) -> AsyncioAuthenticator:  # type: ignore[type-arg]
        """Start ZAP on `context`: its CURVE servers admit only clients whose public key is a
        `*.key` file of the folder. Stop the returned authenticator before the context."""
        _load(self.folder / f"{CLIENT}.key", secret=False)  # fail at start, naming the file
        auth = AsyncioAuthenticator(context)
        auth.start()
        auth.configure_curve(domain="*", location=str(self.folder))
        return auth


def key_files() -> dict[str, str]:
    """A new server and client key pair: file name → content, as `create_keys` writes them."""
    files = {}
    for name in (SERVER, CLIENT):
        public, secret = zmq.curve_keypair()
        lines = ["# ZeroMQ CURVE certificate (dynamograph kv-curve-keys)", "curve"]
        files[f"{name}.key"] = "\n".join([*lines, f'    public-key = "{public.decode()}"', ""])
        files[f"{name}.key_secret"] = "\n".join(
            [
                *lines,
                f'    public-key = "{public.decode()}"',
                f'    secret-key = "{secret.decode()}"',
                "",
            ]
        )
    return files


def create_keys(folder: str | Path) -> Path:
    """Write a new server and client key pair into `folder` (created if need be)."""
    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    for name, content in key_files().items():
        (path / name).touch(mode=0o600 if name.endswith("_secret") else 0o644)
        (path / name).write_text(content)
    return path


def add_kv_curve_argument(parser: argparse.ArgumentParser) -> None:
    """`--kv-curve-dir`, the same for a worker and a subscriber (each reads its side's files)."""
    parser.add_argument(
        "--kv-curve-dir",
        default=os.environ.get(KV_CURVE_ENV) or None,
        metavar="DIR",
        help="CURVE-secure the KV-event stream with the graph's key folder (server.key[_secret], "
        f"client.key[_secret]; docs/security.md) (default: ${KV_CURVE_ENV}; off without one)",
    )


def kv_curve_from_args(args: argparse.Namespace) -> CurveKeys | None:
    """The folder `--kv-curve-dir` names, checked; None when CURVE is off."""
    return CurveKeys.load(args.kv_curve_dir) if args.kv_curve_dir else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("folder", help="where to write server.key[_secret] and client.key[_secret]")


def run(args: argparse.Namespace) -> int:
    """`dynamograph kv-curve-keys FOLDER`: a new key folder for one graph."""
    folder = create_keys(args.folder)
    print(f"KV-event CURVE keys written to {folder}: mount it on the workers and subscribers")
    return 0
