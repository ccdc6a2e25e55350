"""Start real mock workers for tests and benchmarks (any component's).

- `mock_worker(**config)`: the real HTTP server + engine in this event loop, on a free port of
  127.0.0.1 with free ZMQ ports; yields a `RunningWorker` (url, EngineConfig, server).
- `free_port()`: a port for a server started next, outside the kernel's ephemeral range.
- `refusing_address()`: a 127.0.0.1 address that refuses connections while the block runs.
- `worker_process(*args)`: the same through the CLI (`python -m dynamograph.cli worker ...`) as
  a subprocess; waits until `/v1/engine` answers and terminates it on exit.
- `word_level_tokenizer(directory)`: a small Hugging Face `tokenizer.json` (one token a word) for
  a worker that publishes a tokenizer of its own (`hf:<path>`).

Both default to a high `speedup` so suites stay fast (override with `speedup=...`) and serve
the debug endpoints (`/debug/requests`, `/reset_prefix_cache`), which a worker does not by
default.
"""

import asyncio
import contextlib
import itertools
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

import aiohttp

from dynamograph.protocol.engine import ENGINE_PATH, EngineConfig
from dynamograph.protocol.ports import bind_ports

from .mock import MockConfig, MockEngine
from .server import SERVER_OPTIONS, WorkerServer

TEST_SPEEDUP = 100.0
_names = itertools.count()


@dataclass
class RunningWorker:
    url: str
    config: EngineConfig
    server: WorkerServer | None = None
    process: asyncio.subprocess.Process | None = None

    @property
    def engine(self) -> MockEngine | None:
        return self.server.engine if self.server else None


def free_port(host: str = "127.0.0.1") -> int:
    """A port of `host` nothing listens on, for a server the caller starts next: outside the
    kernel's ephemeral range (`protocol.ports`), so no outgoing connection is given it before
    the server binds. Ports for servers started later are better held in a
    `local.procs.PortPool` until then."""
    (sock,) = bind_ports(1, host)
    with sock:
        return sock.getsockname()[1]


@contextmanager
def refusing_address(host: str = "127.0.0.1") -> Iterator[str]:
    """`host:port` where connections are refused for as long as the block runs. The socket
    stays bound without listening: a port that was merely free can be bound by a server started
    later in the same test and then answer. Outside the ephemeral range, as `free_port`: a
    client dialling it is never given it as its own source port (and connected to itself)."""
    (sock,) = bind_ports(1, host)
    with sock:
        yield f"{host}:{sock.getsockname()[1]}"


@asynccontextmanager
async def mock_worker(**overrides: Any) -> AsyncIterator[RunningWorker]:
    """Run a mock worker in-process; keyword arguments are `MockConfig` fields, or
    `WorkerServer` options (`server.SERVER_OPTIONS`)."""
    fields: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "kv_events_port": 0,
        "kv_replay_port": 0,
        "speedup": TEST_SPEEDUP,
        "name": f"mock-{os.getpid()}-{next(_names)}",
        "debug_endpoints": True,  # tests look at /debug/requests and reset caches
    }
    # `WorkerServer` options (the HTTP server's limits); the rest configure
    # the engine.
    server_options = {k: overrides.pop(k) for k in SERVER_OPTIONS if k in overrides}
    fields.update(overrides)
    config = MockConfig(**fields)
    server = WorkerServer(MockEngine(config), host=config.host, port=config.port, **server_options)
    engine_config = await server.start(config.name)
    try:
        yield RunningWorker(url=server.url, config=engine_config, server=server)
    finally:
        await server.stop()


def worker_command(*args: str, port: int, name: str | None = None) -> list[str]:
    return [
        sys.executable, "-m", "dynamograph.cli", "worker",
        "--host", "127.0.0.1", "--port", str(port),
        "--kv-events-port", "0", "--kv-replay-port", "0",
        "--speedup", str(TEST_SPEEDUP),
        "--name", name or f"mock-proc-{os.getpid()}-{next(_names)}",
        "--debug-endpoints",
        *args,
    ]  # fmt: skip


@asynccontextmanager
async def worker_process(
    *args: str, name: str | None = None, startup_timeout: float = 60.0
) -> AsyncIterator[RunningWorker]:
    """Run `dynamograph worker` as a subprocess; later `args` override the defaults above.

    Its stderr goes to a temporary file (a pipe nobody reads would block a chatty worker);
    the tail is quoted when the worker dies before it serves.
    """
    port = free_port()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryFile() as stderr:
        proc = await asyncio.create_subprocess_exec(
            *worker_command(*args, port=port, name=name),
            env=env,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=stderr,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            try:
                config = await wait_for_engine(url, startup_timeout, proc)
            except RuntimeError as exc:
                stderr.seek(0)
                tail = stderr.read()[-2000:].decode(errors="replace")
                raise RuntimeError(f"{exc}: {tail}") from None
            yield RunningWorker(url=url, config=config, process=proc)
        finally:
            await stop_process(proc)


async def stop_process(proc: asyncio.subprocess.Process, grace: float = 10.0) -> None:
    """SIGTERM (a worker drains and exits), then SIGKILL if it is still there after `grace` s."""
    if proc.returncode is not None:
        return
    proc.terminate()
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        proc.kill()
        await proc.wait()


async def wait_for_engine(
    url: str, within: float = 60.0, proc: asyncio.subprocess.Process | None = None
) -> EngineConfig:
    """Poll `GET /v1/engine` until it answers (or the process dies, or `within` s pass)."""
    deadline = asyncio.get_running_loop().time() + within
    async with aiohttp.ClientSession() as http:
        while True:
            if proc is not None and proc.returncode is not None:
                raise RuntimeError(f"worker exited with {proc.returncode}")
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with http.get(url + ENGINE_PATH) as resp:
                    if resp.status == 200:
                        return EngineConfig.model_validate_json(await resp.read())
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"worker at {url} did not come up in {within} s")
            await asyncio.sleep(0.1)


def word_level_tokenizer(directory: str | os.PathLike[str]) -> list[str]:
    """Write a word-level `tokenizer.json` into `directory` (150 words in GPT-2's byte-level
    form, plus <s> and </s>); returns the words, each one token after a space."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    words = [a + b + c for a in "klmnop" for b in "aeiou" for c in "rstvz"]
    vocab = {w: i for i, w in enumerate(["[UNK]", "<s>", "</s>", *(f"Ġ{w}" for w in words)])}
    hf = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens(["<s>", "</s>"])
    hf.save(os.path.join(directory, "tokenizer.json"))
    return words
