"""A Python client for megacppd, over the daemon's gRPC API (proto/megacpp/v1/).

The message and service modules are generated from proto/ by the build (protoc with
grpc_python_plugin, into BUILD/python); nothing generated is kept in the source tree. Put
both folders on the path:

    PYTHONPATH=python:build/python python3 -c 'import megacpp_client'

    from megacpp_client import Client
    client = Client("127.0.0.1:50551", token_file="token", tls_ca="daemon.pem")
    job = client.submit({"name": "t", "preset": "tiny", "train_data": "/data/c_train", ...})
    for event in client.watch(job):
        print(event.kind, event.state, event.step)
    receipts = client.receipts(job)      # .steps, .summary, .gates, .kernels
    client.compare(job_a, job_b).verdicts  # {"step_ms": "within noise", ...}

Options mirror the CLI's: the target defaults to $MEGACPP_DAEMON, else 127.0.0.1:50551; the
token file to $MEGACPP_TOKEN_FILE; a TLS CA certificate makes the channel TLS. A failed call
raises MegacppError with the gRPC status code and the daemon's message (which names the field
of a refused spec).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Union

import grpc
from google.protobuf import json_format
from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message

try:
    from megacpp.v1 import jobs_pb2, jobs_pb2_grpc
    from megacpp.v1 import receipts_pb2, receipts_pb2_grpc
    from megacpp.v1 import status_pb2, status_pb2_grpc
except ImportError as error:  # the stubs are a build product, not part of this package
    raise ImportError(
        "megacpp_client needs the Python modules generated from proto/ (package megacpp.v1): "
        "build the target megacpp_python (cmake --build build --target megacpp_python) and put "
        f"BUILD/python on PYTHONPATH ({error})"
    ) from error

__all__ = ["Client", "Event", "Receipts", "Comparison", "MegacppError", "TERMINAL_STATES"]

DEFAULT_TARGET = "127.0.0.1:50551"
# The states a job does not leave (interrupted jobs may be resumed by the daemon).
TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled", "refused"})
# Spec fields holding dataset prefixes (with train_blend[].prefix) and the init checkpoint: read
# against the caller's folder, since the daemon cannot see it.
_PATH_FIELDS = ("train_data", "valid_data", "init_checkpoint")


class MegacppError(RuntimeError):
    """A call the daemon refused or could not answer."""

    def __init__(self, method: str, code: grpc.StatusCode, details: str):
        super().__init__(f"{method}: {details} ({code.name})")
        self.method = method
        self.code = code
        self.details = details


def state_name(state: int) -> str:
    """JOB_STATE_SUCCEEDED -> "succeeded", the names the CLI prints."""
    return jobs_pb2.JobState.Name(state).removeprefix("JOB_STATE_").lower()


def to_dict(message: Message) -> dict:
    """Every field of a message, defaults included, as plain Python values.

    json_format would turn 64-bit integers into strings (the proto3 JSON mapping); here a
    step stays an int. Job states read as state_name() does; *_json fields stay strings.
    """
    out = {}
    for descriptor in message.DESCRIPTOR.fields:
        value = getattr(message, descriptor.name)
        if descriptor.containing_oneof is not None and not message.HasField(descriptor.name):
            continue
        if descriptor.label == FieldDescriptor.LABEL_REPEATED:
            out[descriptor.name] = [_value(descriptor, v) for v in value]
        else:
            out[descriptor.name] = _value(descriptor, value)
    return out


def _value(descriptor: FieldDescriptor, value: Any) -> Any:
    if descriptor.type == FieldDescriptor.TYPE_MESSAGE:
        return to_dict(value)
    if descriptor.type == FieldDescriptor.TYPE_ENUM:
        if descriptor.enum_type.full_name == "megacpp.v1.JobState":
            return state_name(value)
        return descriptor.enum_type.values_by_number[value].name
    return value


@dataclass(frozen=True)
class Event:
    """One WatchJob event. kind is "state" (state_changed), "step" (a training step),
    "eval" (a validation loss), "summary" (the run summary) or "log" (an executor log line)."""

    kind: str
    state: str  # the job's state as of this event
    job: dict
    step: Optional[dict] = None  # step, total_steps, loss, tokens_per_s, step_ms, eta, val_loss
    summary: Optional[dict] = None  # the run summary (parsed summary_json)
    log_line: Optional[str] = None
    message: Optional[jobs_pb2.JobEvent] = field(default=None, repr=False, compare=False)

    @property
    def final(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass
class Receipts:
    """What the store recorded for one job."""

    steps: list  # step receipts (dicts), oldest first
    summary: Optional[dict]  # the run summary, None until the job ended
    gates: list  # gate decisions
    kernels: list  # kernel receipts (cuda jobs)


@dataclass
class Comparison:
    """CompareRuns: per metric (step_ms, tokens_per_s, flops_per_s, loss) both medians, the
    relative delta of B against A, both noise envelopes and the verdict."""

    job_a: str
    job_b: str
    metrics: list

    @property
    def verdicts(self) -> dict:
        return {m["metric"]: m["verdict"] for m in self.metrics}


class Client:
    """A connection to one megacppd."""

    def __init__(
        self,
        target: Optional[str] = None,
        *,
        token: Optional[str] = None,
        token_file: Optional[str] = None,
        tls_ca: Optional[str] = None,
        timeout: float = 30.0,
    ):
        """target: host:port (default $MEGACPP_DAEMON, else 127.0.0.1:50551). token, or
        token_file (default $MEGACPP_TOKEN_FILE): the bearer token. tls_ca: the PEM file of
        the CA (or self-signed certificate) a TLS daemon presents. timeout: seconds per
        unary call; watch() has none, since a job may run for days."""
        self.target = target or os.environ.get("MEGACPP_DAEMON") or DEFAULT_TARGET
        if token is not None and token_file is not None:
            raise ValueError("Client: give token or token_file, not both")
        self._token = token
        self._token_file = token_file
        if token is None and token_file is None:
            self._token_file = os.environ.get("MEGACPP_TOKEN_FILE") or None
        self.timeout = timeout
        if tls_ca:
            with open(tls_ca, "rb") as f:
                credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
            self._channel = grpc.secure_channel(self.target, credentials)
        else:
            self._channel = grpc.insecure_channel(self.target)
        self._jobs = jobs_pb2_grpc.JobServiceStub(self._channel)
        self._receipts = receipts_pb2_grpc.ReceiptServiceStub(self._channel)
        self._status = status_pb2_grpc.StatusServiceStub(self._channel)

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- jobs ---------------------------------------------------------------------------------

    def submit(
        self,
        spec: Union[Mapping, str, bytes, jobs_pb2.JobSpec],
        *,
        base_dir: Optional[str] = None,
        device_kind: Optional[str] = None,
    ) -> str:
        """Submits a job spec (a dict or JSON text in the form of megacpp.v1.JobSpec, as in
        configs/tiny_job.json, or a JobSpec message); returns the job id. Relative dataset
        prefixes are read against base_dir (default the current directory). An unknown
        field raises ValueError naming it; a spec the daemon refuses raises MegacppError
        (INVALID_ARGUMENT naming the field, FAILED_PRECONDITION for a refused gate)."""
        message = self._spec(spec)
        base = os.path.abspath(base_dir or os.getcwd())

        def absolute(path: str) -> str:
            return os.path.normpath(os.path.join(base, path)) if path else path

        for name in _PATH_FIELDS:
            setattr(message, name, absolute(getattr(message, name)))
        for entry in message.train_blend:
            entry.prefix = absolute(entry.prefix)
        if device_kind:
            message.device_kind = device_kind
        response = self._call(self._jobs, "SubmitJob", jobs_pb2.SubmitJobRequest(spec=message))
        return response.job.id

    def submit_file(self, path: str, **options: Any) -> str:
        """Like `megacpp submit FILE`: relative prefixes are read against the file's folder."""
        with open(path, "rb") as f:
            text = f.read()
        options.setdefault("base_dir", os.path.dirname(os.path.abspath(path)))
        return self.submit(text, **options)

    def job(self, job_id: str) -> dict:
        return to_dict(self._call(self._jobs, "GetJob", jobs_pb2.GetJobRequest(id=job_id)))

    def jobs(self, *states: str) -> list:
        """Every job (or those in the given states, e.g. "running"), newest pages followed."""
        request = jobs_pb2.ListJobsRequest(
            states=[jobs_pb2.JobState.Value("JOB_STATE_" + s.upper()) for s in states],
            page_size=1000,
        )
        out = []
        while True:
            response = self._call(self._jobs, "ListJobs", request)
            out.extend(to_dict(j) for j in response.jobs)
            if not response.next_page_token:
                return out
            request.page_token = response.next_page_token

    def cancel(self, job_id: str) -> dict:
        return to_dict(self._call(self._jobs, "CancelJob", jobs_pb2.CancelJobRequest(id=job_id)))

    def watch(self, job_id: str, *, timeout: Optional[float] = None) -> Iterator[Event]:
        """The job's events until it ends (the stream closes after its final state). Leaving
        the loop early cancels the stream. timeout: an overall deadline in seconds, none by
        default."""
        stream = self._jobs.WatchJob(
            jobs_pb2.WatchJobRequest(id=job_id), metadata=self._metadata(), timeout=timeout
        )
        try:
            for message in stream:
                yield _event(message)
        except grpc.RpcError as error:
            raise MegacppError("WatchJob", error.code(), error.details()) from None
        finally:
            stream.cancel()

    def status(self) -> dict:
        return to_dict(self._call(self._status, "GetStatus", status_pb2.GetStatusRequest()))

    # -- receipts -----------------------------------------------------------------------------

    def receipts(self, job_id: str) -> Receipts:
        """The job's step receipts (every one, oldest first), run summary (None while it
        runs), gate decisions and kernel receipts. A job whose end was seen (watch() or
        job()) has all of them: the daemon publishes its end only after committing them."""
        steps = []
        page = receipts_pb2.ListStepReceiptsRequest(job_id=job_id, limit=1000)
        while True:
            response = self._call(self._receipts, "ListStepReceipts", page)
            steps.extend(to_dict(s) for s in response.steps)
            if len(response.steps) < page.limit:
                break
            page.after_step = response.steps[-1].step
        request = receipts_pb2.JobReceiptsRequest(job_id=job_id)
        try:
            summary_json = self._call(self._receipts, "GetRunSummary", request).summary_json
            summary = json.loads(summary_json) if summary_json else None
        except MegacppError as error:
            if error.code != grpc.StatusCode.NOT_FOUND:
                raise
            summary = None
        gates = self._call(self._receipts, "ListGateDecisions", request).decisions
        kernels = self._call(self._receipts, "ListKernelReceipts", request).kernels
        return Receipts(
            steps=steps,
            summary=summary,
            gates=[to_dict(g) for g in gates],
            kernels=[to_dict(k) for k in kernels],
        )

    def compare(self, job_a: str, job_b: str, *, skip_steps: int = 0) -> Comparison:
        """CompareRuns: is B faster or slower than A, or within the runs' own noise?
        skip_steps: warm-up steps left out (0: the store's default)."""
        request = receipts_pb2.CompareRunsRequest(job_a=job_a, job_b=job_b, skip_steps=skip_steps)
        response = self._call(self._receipts, "CompareRuns", request)
        return Comparison(job_a, job_b, [to_dict(m) for m in response.metrics])

    # -- plumbing -----------------------------------------------------------------------------

    @staticmethod
    def _spec(spec: Union[Mapping, str, bytes, jobs_pb2.JobSpec]) -> jobs_pb2.JobSpec:
        if isinstance(spec, jobs_pb2.JobSpec):
            out = jobs_pb2.JobSpec()
            out.CopyFrom(spec)
            return out
        try:
            if isinstance(spec, Mapping):
                return json_format.ParseDict(dict(spec), jobs_pb2.JobSpec())
            if isinstance(spec, (str, bytes)):
                return json_format.Parse(spec, jobs_pb2.JobSpec())
        except json_format.ParseError as error:
            raise ValueError(f"job spec: {error}") from None
        raise TypeError(f"job spec: expected a dict, JSON text or JobSpec, got {type(spec)}")

    def _metadata(self) -> list:
        token = self._token
        if token is None and self._token_file:
            with open(self._token_file, encoding="utf-8") as f:
                token = f.read()
        if not token:
            return []
        return [("authorization", "Bearer " + token.rstrip("\n "))]

    def _call(self, stub: Any, name: str, request: Message) -> Any:
        try:
            return getattr(stub, name)(request, metadata=self._metadata(), timeout=self.timeout)
        except grpc.RpcError as error:
            raise MegacppError(name, error.code(), error.details()) from None


def _event(message: jobs_pb2.JobEvent) -> Event:
    job = to_dict(message.job)
    which = message.WhichOneof("event")
    if which == "step":
        step = to_dict(message.step)
        kind = "eval" if message.step.val_loss >= 0 else "step"
        return Event(kind, job["state"], job, step=step, message=message)
    if which == "summary":
        summary = json.loads(message.summary.summary_json) if message.summary.summary_json else {}
        return Event("summary", job["state"], job, summary=summary, message=message)
    if which == "log_line":
        return Event("log", job["state"], job, log_line=message.log_line, message=message)
    # state_changed: the new state; the job carries it too, but the event is authoritative.
    state = state_name(message.state_changed) if which == "state_changed" else job["state"]
    return Event("state", state, job, message=message)
