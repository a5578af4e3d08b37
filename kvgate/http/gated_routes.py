"""The gated routes (POST /v1/completions, /v1/chat/completions and vLLM's other generation routes,
kvgate/vllm_routes.py) as a bare ASGI handler.

Every request to them pays for whatever sits between the socket and the gate, so they skip
FastAPI and Starlette entirely (routing, middleware, Request objects: about a third of kvgate's
CPU per request when they went through them). The flow: read the raw body (forwarded byte for
byte), evaluate it, wait for the gate, then hand the upstream response to a Relay, which
releases the ticket exactly once. A request the backend refused before anything was sent waits
for the gate again, with the deadline it arrived with.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import time
from dataclasses import dataclass

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from kvgate.composition import Runtime
from kvgate.errors import BackendBusy, BackendDown, ClientGone, InvalidField, KvgateError
from kvgate.gate.gate import Ticket
from kvgate.gate.observer import Decision
from kvgate.gate.tenants import TenantTurns
from kvgate.http.asgi import answer_refusal, disconnect_future, header, read_body, request_target
from kvgate.http.choice_watch import ChoiceWatch
from kvgate.http.errors import error_response
from kvgate.http.proxy import Relay, forward_headers, open_while_client_waits
from kvgate.pipeline import Evaluation
from kvgate.vllm_routes import ROUTE_PATHS, Route

log = logging.getLogger("kvgate.proxy")

GATED_PATHS: dict[str, Route] = ROUTE_PATHS
# Routes whose answers kvgate/http/output_tokens.py reads (OpenAI's usage block and one stream event per
# token; /inference/v1/generate answers in the same shape); the others (Responses and Anthropic
# events, pooling) teach the output lengths nothing.
OUTPUT_COUNTED: frozenset[Route] = frozenset({"completions", "chat", "invocations", "generate"})


_ID_KEY = os.urandom(32)
_id_counter = itertools.count()


# A client's request id is kept if it is at most this long and printable ASCII: it is written on
# every decision line and in headers to the backend and back (a 60,000-byte one added 115 MiB of
# log over 2,000 requests). 128 holds a UUID, a W3C traceparent or an AWS trace id with room.
MAX_REQUEST_ID_CHARS = 128


def request_id_of(scope: Scope) -> str:
    """The client's x-request-id when usable (non-empty, at most MAX_REQUEST_ID_CHARS printable
    ASCII characters, no spaces), else kvgate's own: 32 hex digits unique to this process's
    requests and unguessable from the ones seen before: a counter keyed-hashed with a per-process
    secret (BLAKE2b, about a microsecond; uuid4 read the kernel's random source on every request)."""
    sent = header(scope, b"x-request-id")
    if sent and len(sent) <= MAX_REQUEST_ID_CHARS and sent.isascii() and sent.isprintable() and " " not in sent:
        return sent
    return hashlib.blake2b(next(_id_counter).to_bytes(8, "little"), key=_ID_KEY, digest_size=16).hexdigest()


def tenant_of(scope: Scope, tenant_header: bytes | None) -> tuple[str, bool]:
    """The tenant and whether it is vouched for: the trusted gateway's tenant header if one is
    configured and set (vouched), else a digest of the API key (never the key itself), which
    nobody has checked (kvgate/gate/tenants.py)."""
    tenant = header(scope, tenant_header) if tenant_header else None
    if tenant:
        return tenant, True
    auth = header(scope, b"authorization")
    return (hashlib.sha256(auth.encode()).hexdigest()[:12] if auth else "anonymous"), False


def header_priority(scope: Scope, priority_header: bytes | None) -> int | None:
    """The trusted gateway's priority header, if one is configured and set; a 400 if it is not
    an integer."""
    value = header(scope, priority_header) if priority_header else None
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        name = priority_header.decode("latin-1")  # type: ignore[union-attr]
        raise InvalidField(f"{name} must be an integer.", name) from None


# Not frozen, these three: a frozen dataclass is built through object.__setattr__, a field at a
# time (2.7 us for seven fields against 0.45 us, slots alone, on the 2-core machine), and each is
# made once a request and only read after.
@dataclass(slots=True)
class Caller:
    """Who sent a request, read from its headers before its body is tokenized."""

    tenant: str
    vouched: bool  # named by the trusted gateway's tenant header
    priority: int | None  # the trusted gateway's priority header

    def queue_priority(self, body_priority: int, trust_body: bool) -> int:
        """Only trusted sources order the queue: the gateway's header if configured, the body's
        field if the operator trusts it, else 0 for everyone."""
        if self.priority is not None:
            return self.priority
        return body_priority if trust_body else 0


@dataclass(slots=True)
class Evaluated:
    """A request read and evaluated, ready to wait for the gate (again, if its first try found
    the backend gone)."""

    body: bytes
    evaluation: Evaluation
    priority: int
    count_output: bool  # kvgate/http/output_tokens.py can read its answer
    arrived_at: float  # when it reached kvgate's HTTP edge (the gate's clock), before its body was read
    deadline: float  # when it must have been admitted: --max-queue-wait from its arrival
    turn: str  # the tenant turn it waits for in the queue (kvgate/gate/tenants.py)
    route: Route


@dataclass(slots=True)
class Admitted:
    """A request the gate let through: what the upstream exchange needs."""

    ticket: Ticket
    body: bytes
    headers: dict[str, str]  # the ones kvgate adds to the response
    stream: bool
    count_output: bool
    route: Route


class GatedRoutes:
    """Admission for one kvgate: `await routes(route, scope, receive, send)` per request."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        settings = rt.settings
        self._tenant_header = settings.tenant_header.lower().encode("latin-1") if settings.tenant_header else None
        self._priority_header = settings.priority_header.lower().encode("latin-1") if settings.priority_header else None
        self._turns = TenantTurns(settings.max_tenants)

    async def __call__(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        started = time.perf_counter()
        arrived_at = self.rt.gate.now()
        request_id = request_id_of(scope)
        response: Response | None = None
        try:
            evaluated = await self._evaluate(route, scope, receive, request_id, arrived_at)
        except KvgateError as error:
            response = answer_refusal(scope, error_response(error, {"x-request-id": request_id}))
        else:
            deadline = evaluated.deadline
            while response is None:  # None: the backend refused the connection, nothing was sent
                try:
                    admitted = await self._admit(evaluated, scope, receive, started, request_id, deadline)
                except KvgateError as error:
                    response = error_response(error, {"x-request-id": request_id})
                else:
                    response = await self._forward(admitted, scope, receive, request_id)
        await response(scope, receive, send)

    async def _evaluate(
        self, route: Route, scope: Scope, receive: Receive, request_id: str, arrived_at: float
    ) -> Evaluated:
        """Read and evaluate the request; a KvgateError if it is refused or the client left.

        Refusals before the gate (body, parse, prediction) are reported to the gate's observers
        here; the gate reports its own (queue full, timeout, backend down, left the queue). While
        the backend kvgate tokenizes through is down, the request waits in the queue for it (until
        its deadline, as an evaluated request would) and is evaluated once it is back."""
        rt = self.rt
        try:
            settings = rt.settings
            raw = await read_body(
                scope, receive, settings.max_body_bytes, settings.client_body_timeout, settings.client_body_deadline
            )
            caller = Caller(*tenant_of(scope, self._tenant_header), header_priority(scope, self._priority_header))
        except ClientGone:
            rt.gate.observers.decided(Decision("abandon", ClientGone.code, request_id, stage="request_body"))
            raise
        except KvgateError as error:
            rt.gate.observers.decided(Decision("reject", error.code, request_id, error=error))
            raise
        deadline = rt.gate.deadline(arrived_at)  # from its arrival: reading the body counts too
        while True:
            try:
                evaluation = await rt.pipeline.evaluate(route, raw, deadline)
                break
            except BackendDown:
                await rt.gate.wait_for_backend(deadline, lambda: disconnect_future(receive), request_id)
            except KvgateError as error:
                rt.gate.observers.decided(Decision("reject", error.code, request_id, error=error))
                raise
        prediction = evaluation.prediction
        rt.metrics.predicted_transient.observe(prediction.transient_peak_bytes)
        rt.metrics.predicted_kv_blocks.observe(prediction.demand.kv_blocks)
        rt.traffic.evaluated(route, prediction)
        priority = caller.queue_priority(evaluation.request.priority, rt.settings.trust_request_priority)
        turn = self._turns.turn(caller.tenant, caller.vouched)  # taken only by a request that will queue
        return Evaluated(raw, evaluation, priority, route in OUTPUT_COUNTED, arrived_at, deadline, turn, route)

    async def _admit(
        self, evaluated: Evaluated, scope: Scope, receive: Receive, started: float, request_id: str, deadline: float
    ) -> Admitted:
        """Wait for the gate until `deadline`; a KvgateError if refused or the client left."""
        rt = self.rt
        prediction = evaluated.evaluation.prediction
        ticket = await rt.gate.acquire(
            prediction.demand,
            evaluated.priority,
            evaluated.turn,
            lambda: disconnect_future(receive),
            basis=prediction,
            request_id=request_id,
            deadline=deadline,
            arrived_at=evaluated.arrived_at,
        )
        rt.metrics.added_latency.observe(time.perf_counter() - started - ticket.line_wait_s)
        demand = ticket.reservation.demand  # refreshed if it waited
        kv_blocks, transient_bytes = demand.kv_blocks, demand.transient_bytes
        headers = {
            "x-request-id": request_id,
            "x-kvgate-kv-blocks": str(kv_blocks),
            "x-kvgate-transient-bytes": str(transient_bytes),
            "x-kvgate-queue-wait": f"{ticket.queue_wait_s:.4f}",
        }
        return Admitted(
            ticket,
            evaluated.body,
            headers,
            evaluated.evaluation.request.stream,
            evaluated.count_output,
            evaluated.route,
        )

    async def _forward(self, admitted: Admitted, scope: Scope, receive: Receive, request_id: str) -> Response | None:
        """Open the upstream exchange; from here on the Relay owns the ticket. A non-streaming
        request is watched for its client leaving until the head arrives (with the answer).

        None when nothing reached the backend: the caller puts the request back in the queue.
        A refused connection marks the backend down in the view the budget and /readyz share, and
        the request waits there until its deadline for the backend to come back; a connection not
        had in time (BackendBusy: the backend's accept queue full under a burst, or every pooled
        connection busy) is backpressure, so the request goes back through the gate at once,
        while the backend's /metrics and /health judge whether it is alive. Sending it again is safe: vLLM never saw it. Once bytes were
        sent, a failure is answered, never retried."""
        ticket = admitted.ticket
        target, headers = (
            request_target(scope),
            forward_headers(scope["headers"], request_id, scope.get("client"), scope.get("scheme", "http")),
        )
        # Its answer comes whole, or its first token is one of several engine requests' (prompts x
        # n): vLLM's count of first tokens ends its prefill (kvgate/gate/plain_prefills.py)
        if not admitted.stream or ticket.reservation.demand.sequences > 1:
            ticket.mark_plain()
        try:
            if admitted.stream:  # vLLM sends a stream's head at once: the Relay watches from there
                upstream = await self.rt.backend.open("POST", target, headers, admitted.body)
            else:
                opened = await open_while_client_waits(self.rt.backend, receive, "POST", target, headers, admitted.body)
                if opened is None:
                    ticket.release("disconnected")
                    self.rt.gate.observers.decided(
                        Decision("abandon", ClientGone.code, request_id, stage="awaiting_response")
                    )
                    return error_response(ClientGone())
                upstream = opened
        except BackendDown as error:
            ticket.release("requeued")
            self.rt.metrics.upstream_errors.labels(error.code).inc()
            # A connection not had in time (BackendBusy) is backpressure: retried, not an outage.
            if not isinstance(error, BackendBusy) and self.rt.budget.set_backend("down", error.message):
                log.warning("backend down (%s): holding new admissions in the queue", error.message)
            return None
        except KvgateError as error:
            ticket.release("upstream_error")
            self.rt.metrics.upstream_errors.labels(error.code).inc()
            return error_response(error, {"x-request-id": request_id})
        except BaseException:  # cancelled, or a bug: the reservation must not outlive the request
            ticket.release("upstream_error")
            raise
        on_first = ticket.end_prefill if admitted.stream else (lambda: None)
        sequences = ticket.reservation.demand.sequences
        # a stream of several engine requests ends its prefill once each choice showed a token; not
        # with `echo` anywhere in the body (a chat echo shows every choice at once)
        choices = (
            ChoiceWatch(sequences, ticket.end_every_prefill)
            if admitted.stream and sequences > 1 and b'"echo"' not in admitted.body
            else None
        )

        def on_end(outcome: str, output_tokens: int | None) -> None:
            ticket.release(outcome, output_tokens)
            self.rt.traffic.finished(admitted.route, outcome, output_tokens)
            if outcome == "disconnected":  # every release as `disconnected` is a client that left
                self.rt.gate.observers.decided(Decision("abandon", ClientGone.code, request_id, stage="response_body"))

        return Relay(
            upstream,
            admitted.headers,
            on_first,
            on_end,
            count_output=admitted.count_output,
            stall_timeout_s=self.rt.settings.stream_stall_timeout,
            choices=choices,
        )
