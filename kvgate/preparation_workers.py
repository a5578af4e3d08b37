"""Worker processes that prepare large requests (kvgate/preparation.py), watched while they work.

Parsing holds the GIL for the whole of `json.loads` (1.2 s for 450,000 Responses items) and a chat
template is Python: in a thread of kvgate's process either still stops the event loop, and a
request's own template can allocate gigabytes in one operation. In a worker process the event
loop stays free, and the work can be measured as it runs and stopped: kvgate reads the worker's
resident memory every few milliseconds and kills it when the request's preparation passes the
memory it was granted (kvgate/work_budget.py) or its time, then starts a fresh worker. Between
two readings one operation could still allocate gigabytes, so the kernel holds each worker to its
job's grant too (RLIMIT_DATA, `_DataLimit`): an allocation past it fails at once, in the worker,
as a MemoryError (Python) or an abort (Rust's allocator, in the tokenizer), never in kvgate.

Each worker loads the model's tokenizer once (the same one kvgate's process loads) and serves one
request at a time over a pipe.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import multiprocessing
import os
import resource
import signal
import time
from dataclasses import dataclass
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

from kvgate.errors import KvgateError, RequestTooCostly, TokenizationFailed
from kvgate.multimodal import MediaOptions
from kvgate.passthrough_body import check_passthrough_body
from kvgate.preparation import Prepared, prepare
from kvgate.request import RequestLimits
from kvgate.tokens import local_tokenizer
from kvgate.units import MiB
from kvgate.vllm_routes import Route
from kvgate.work_budget import Grant, charging
from kvgate.work_budget import libc as glibc

log = logging.getLogger("kvgate.preparation")

_RSS_POLL_S = 0.005
WORKER_NICENESS = 10
_START_S = 120.0  # a worker loads transformers and the tokenizer: seconds, minutes on a starved CPU
# Room in a worker's data limit above what its job was granted: what counts as data before it is
# resident (thread stacks, the parts of malloc's arenas made writable) and the job's own pipe
# buffers. The grant bounds resident memory, which kvgate also watches.
DATA_LIMIT_SLACK = 64 * MiB
_WARM_UP_TEXTS = 256  # enough that every thread of the tokenizer's pool takes a share


@dataclass(frozen=True)
class Job:
    route: Route
    trust_request_chat_template: bool
    limits: RequestLimits
    content_format_namespace_aliases: bool


@dataclass(frozen=True)
class PassthroughJob:
    """A pass-through body's bounds (kvgate/passthrough_body.py): its parse holds the GIL as a
    gated body's does (499,998 ids to /detokenize, 160,000 messages to /tokenize: 0.2-0.5 s)."""

    method: str
    path: str
    content_type: str | None
    max_model_len: int | None


# ------------------------------------------------------------------ in the worker process


def _serve(conn: Connection, model_dir: str, template_seconds: float, media: MediaOptions | None, ceiling: int) -> None:
    """The worker's loop: load the tokenizer, then prepare jobs until the pipe closes. It runs
    at a lower priority than kvgate's event loop, which must answer while it works."""
    os.nice(WORKER_NICENESS)
    # No segment cache here: the large requests a worker prepares rarely repeat, and a cache that
    # grows over the worker's life would eat into the memory limit each job is held to.
    tokenizer = local_tokenizer(model_dir, template_seconds, media, segment_cache=False)
    loop = asyncio.new_event_loop()
    # A batch first, before the limit: the tokenizer's threads take their malloc arenas on their
    # first encode (21 MiB of VmData with 2 cores here), which grows with the host's cores and
    # belongs to the worker, not to the first request it prepares.
    loop.run_until_complete(tokenizer.encode_prompts(["warm up the tokenizer's threads"] * _WARM_UP_TEXTS))
    gc.collect()
    gc.freeze()
    limit = _DataLimit(ceiling)
    conn.send(("ready",))
    libc = glibc()
    while True:
        try:
            job: Job | PassthroughJob
            job, granted = conn.recv()
            raw = conn.recv_bytes()  # sent apart: no pickle copies the body
        except (EOFError, OSError):
            return  # kvgate is gone
        limit.hold(granted)
        try:
            with charging(partial(_ask_for_more, conn, limit)):
                if isinstance(job, PassthroughJob):
                    check_passthrough_body(job.method, job.path, job.content_type, raw, job.max_model_len)
                    prepared = None
                else:
                    prepared = loop.run_until_complete(
                        prepare(
                            job.route,
                            raw,
                            tokenizer,
                            trust_request_chat_template=job.trust_request_chat_template,
                            limits=job.limits,
                            content_format_namespace_aliases=job.content_format_namespace_aliases,
                        )
                    )
            reply: tuple[Any, ...] = ("ok", prepared)
        except KvgateError as error:
            reply = ("error", type(error), error.args, error.__dict__)
        except MemoryError:  # the kernel refused an allocation past the job's grant
            too_costly = RequestTooCostly(limit.granted, ceiling, "took more than")
            reply = ("error", RequestTooCostly, too_costly.args, too_costly.__dict__)
        finally:
            limit.release()
        del job, raw
        conn.send(reply)
        del reply
        gc.collect()
        if libc is not None:
            libc.malloc_trim(0)  # give the request's memory back to the system, not to the next one


class _DataLimit:
    """The kernel's hold on this worker's memory (RLIMIT_DATA: its private writable mappings,
    which malloc, Python's allocator and Rust's all draw from). While a job runs the limit is what
    the worker held before it, plus the job's grant as it grows, plus DATA_LIMIT_SLACK; between
    jobs, and as its hard limit, the start-up heap plus all of kvgate's request-work budget
    (`ceiling`), more than any one job can be granted."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = _data_bytes() + ceiling + DATA_LIMIT_SLACK
        self.granted = 0
        self._limit = self.ceiling
        resource.setrlimit(resource.RLIMIT_DATA, (self.ceiling, self.ceiling))

    def hold(self, granted: int) -> None:
        """A job starts with `granted` bytes of the budget."""
        self.granted = granted
        self._limit = _data_bytes() + granted + DATA_LIMIT_SLACK
        self._set(self._limit)

    def grow(self, cost: int) -> None:
        """The job was granted `cost` more bytes."""
        self.granted += cost
        self._limit += cost
        self._set(self._limit)

    def release(self) -> None:
        self._set(self.ceiling)

    def _set(self, limit: int) -> None:
        resource.setrlimit(resource.RLIMIT_DATA, (min(limit, self.ceiling), self.ceiling))


def _data_bytes() -> int:
    """This process's private writable memory (VmData), what RLIMIT_DATA counts."""
    return status_bytes(os.getpid(), b"VmData:") or 0


async def _ask_for_more(conn: Connection, limit: _DataLimit, cost: int) -> None:
    """A stage's memory, asked of kvgate's budget before the stage runs (the job waits)."""
    conn.send(("grow", cost))
    reply = conn.recv()
    if reply[0] != "granted":
        raise _rebuilt(*reply[1:])
    limit.grow(cost)


# ------------------------------------------------------------------ in kvgate's process


def _rebuilt(cls: type[KvgateError], args: tuple[Any, ...], attributes: dict[str, Any]) -> KvgateError:
    """A domain error sent over the pipe (their constructors take their numbers, not `args`)."""
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(attributes)
    return error


def status_bytes(pid: int, field: bytes) -> int | None:
    """A size from /proc/<pid>/status (VmRSS:, VmData:), None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status", "rb") as status:
            for line in status:
                if line.startswith(field):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _rss_bytes(pid: int) -> int | None:
    return status_bytes(pid, b"VmRSS:")


class _Worker:
    def __init__(
        self, context: Any, model_dir: str, template_seconds: float, media: MediaOptions | None, ceiling: int
    ) -> None:
        self._conn, child = multiprocessing.Pipe()
        self.process = context.Process(
            target=_serve,
            args=(child, model_dir, template_seconds, media, ceiling),
            name="kvgate-prepare",
            daemon=True,
        )
        self.process.start()
        child.close()
        self.pid: int = self.process.pid
        self._ready = False
        self._killed = False

    def _send(self, job: Job | PassthroughJob, granted: int, raw: bytes) -> None:
        self._conn.send((job, granted))
        self._conn.send_bytes(raw)

    async def run(self, job: Job | PassthroughJob, raw: bytes, grant: Grant, seconds: float) -> Prepared | None:
        """The job's result (None for a PassthroughJob that passed); the worker is killed (and the caller must replace it) when the job
        passes the memory of its grant over what the worker held before it, or `seconds`."""
        if not self._ready:
            await self._receive(_START_S, None)
            self._ready = True
        # The worker's own copy of the body, received after `base` is read: beside what parsing it
        # costs (work_budget.preparation_cost, measured where the body was already held). Without it
        # a 12 MiB data URL passed its grant by up to 12 % in half the tries (test_multimodal_http).
        await grant.grow(len(raw))
        base = _rss_bytes(self.pid) or 0
        await asyncio.to_thread(self._send, job, grant.bytes, raw)
        deadline = time.monotonic() + seconds
        while True:
            reply = await self._receive(deadline - time.monotonic(), (base, grant))
            if reply[0] == "ok":
                prepared: Prepared | None = reply[1]
                return prepared
            if reply[0] == "error":
                raise _rebuilt(*reply[1:])
            waiting_since = time.monotonic()
            try:  # ("grow", bytes): the next stage's memory; the time waiting for it is not the job's
                await grant.grow(reply[1])
            except KvgateError as error:
                self._conn.send(("refused", type(error), error.args, error.__dict__))
            else:
                self._conn.send(("granted",))
            finally:
                deadline += time.monotonic() - waiting_since

    async def _receive(self, seconds: float, memory: tuple[int, Grant] | None) -> tuple[Any, ...]:
        """The worker's next message, watching its memory (over `base`, within the grant) and
        its time meanwhile."""
        deadline = time.monotonic() + seconds
        while not self._conn.poll():
            await asyncio.sleep(_RSS_POLL_S)
            if memory is not None:
                rss, (base, grant) = _rss_bytes(self.pid), memory
                if rss is not None and rss - base > grant.bytes:
                    self.kill()
                    raise RequestTooCostly(rss - base, grant.bytes, "took more than")
            if time.monotonic() > deadline and not self._conn.poll():
                self.kill()
                raise TokenizationFailed(f"preparing the request took longer than {seconds:g} s")
        try:
            message: tuple[Any, ...] = await asyncio.to_thread(self._conn.recv)
        except (EOFError, OSError):
            await asyncio.to_thread(self.process.join, 5)
            aborted = self.process.exitcode == -signal.SIGABRT
            self.kill()
            if aborted and memory is not None:  # Rust's allocator aborts where the kernel's limit refuses
                raise RequestTooCostly(memory[1].bytes, memory[1].capacity, "took more than") from None
            raise TokenizationFailed("the worker preparing the request stopped") from None
        return message

    @property
    def alive(self) -> bool:
        return not self._killed and bool(self.process.is_alive())

    def kill(self) -> None:
        """Stop the worker; its exit is waited for apart (reap), off the event loop: the kernel
        takes 70-150 ms to free a worker of 700 MiB on a busy 2-core machine."""
        if self._killed:
            return
        self._killed = True
        with contextlib.suppress(OSError):
            self.process.kill()
        self._conn.close()

    def reap(self) -> None:
        """Wait for a stopped worker's exit and close its process object (its sentinel fd, else
        one leaks per replaced worker)."""
        self.process.join(timeout=5)
        if not self.process.is_alive():
            self.process.close()


class PreparationWorkers:
    """`count` worker processes; `await run(job, raw, grant, seconds)` prepares a job in the next
    free one. `ceiling`: the work budget's capacity, the most any job can be granted."""

    def __init__(
        self,
        model_dir: str | Path,
        template_seconds: float,
        count: int,
        ceiling: int,
        media: MediaOptions | None = None,
    ) -> None:
        # spawn: kvgate's process has threads and an event loop a fork would copy mid-flight.
        self._context = multiprocessing.get_context("spawn")
        self._model_dir = str(model_dir)
        self._template_seconds = template_seconds
        self._media = media
        self._ceiling = ceiling
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: list[_Worker] = []
        for _ in range(count):
            self._idle.put_nowait(self._start())

    def _start(self) -> _Worker:
        worker = _Worker(self._context, self._model_dir, self._template_seconds, self._media, self._ceiling)
        self._all.append(worker)
        return worker

    async def run(self, job: Job | PassthroughJob, raw: bytes, grant: Grant, seconds: float) -> Prepared | None:
        worker = await self._idle.get()
        why = "cancelled"
        try:
            return await worker.run(job, raw, grant, seconds)
        except KvgateError as error:
            why = error.message
            raise
        except BaseException:  # cancelled mid-job: its reply would reach the next one
            worker.kill()
            raise
        finally:
            if not worker.alive:
                log.warning("a preparation worker was stopped (pid %s: %s): starting another", worker.pid, why)
                worker.kill()  # at most closes the pipe of one that died on its own
                asyncio.get_running_loop().run_in_executor(None, worker.reap)
                self._all.remove(worker)
                worker = self._start()
            self._idle.put_nowait(worker)

    def close(self) -> None:
        for worker in self._all:
            worker.kill()
        for worker in self._all:
            worker.reap()
        self._all.clear()
