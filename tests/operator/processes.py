"""`dynamograph operator` as a child process, the way a pod runs it, for tests against the
emulator: started with its own environment, stopped with SIGTERM, its log kept in a file."""

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from .emulator import write_kubeconfig

IMAGE = "registry.example/dynamograph:cli"


@contextlib.asynccontextmanager
async def operator_process(
    log: Path, *args: str, env: dict[str, str] | None = None
) -> AsyncIterator[asyncio.subprocess.Process]:
    """Run `dynamograph operator ARGS` (info logs, no liveness port); SIGTERM it on the way out
    (killed after 30 s). The caller checks `proc.returncode` after the block."""
    environ = {
        **os.environ,
        "DYNAMOGRAPH_IMAGE": IMAGE,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "dynamograph.cli.main", "--log-level", "info"]
    argv += ["--log-format", "text", "operator", "--liveness-port", "0", *args]
    with log.open("wb") as out:
        proc = await asyncio.create_subprocess_exec(
            *argv, env=environ, stdout=out, stderr=asyncio.subprocess.STDOUT
        )
        try:
            yield proc
        finally:
            await stop(proc)


async def stop(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.send_signal(signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), 30)
    except TimeoutError:
        proc.kill()
        await proc.wait()


@dataclass(frozen=True)
class ExecCredentials:
    """A kubeconfig whose user authenticates only through an `exec` credential plugin (no token
    in the file). The plugin prints an ExecCredential with whatever token `token_file` holds when
    it runs, and appends a line to `calls` each time."""

    kubeconfig: Path
    token_file: Path
    calls: Path

    def set_token(self, token: str) -> None:
        self.token_file.write_text(token)

    def runs(self) -> int:
        return len(self.calls.read_text().splitlines()) if self.calls.exists() else 0


def exec_credentials(directory: Path, server: str, token: str) -> ExecCredentials:
    directory.mkdir(parents=True, exist_ok=True)
    creds = ExecCredentials(
        directory / "kubeconfig", directory / "token", directory / "plugin-calls"
    )
    creds.set_token(token)
    plugin = directory / "credential-plugin.sh"
    plugin.write_text(
        "#!/bin/sh\n"
        'echo run >> "$2"\n'
        'printf \'{"apiVersion": "client.authentication.k8s.io/v1", '
        '"kind": "ExecCredential", "status": {"token": "%s"}}\' "$(cat "$1")"\n'
    )
    plugin.chmod(0o755)
    exec_config = {
        "apiVersion": "client.authentication.k8s.io/v1",
        "command": str(plugin),
        "args": [str(creds.token_file), str(creds.calls)],
        "interactiveMode": "Never",
    }
    write_kubeconfig(creds.kubeconfig, server, {"exec": exec_config})
    return creds
