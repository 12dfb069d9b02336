"""What the engine process and its front ends say to each other over ZeroMQ, encoded with msgspec (no pickle).

Front ends send `Add` and `Abort` to the engine's one inbox; the supervisor sends `FrontendGone` there too. The
engine answers each front end on a socket of its own: `Hello` once loaded, `Admitted` after each read of its
inbox, one `Step` per engine step (every request of that front end with new tokens or a finish, in one message),
`FrontendGone` when another front end has died (its metrics are no longer gathered), and `Dead` if its loop fails.
Sockets are `ipc://` files in a private folder (mode 0700), never TCP.
"""

import os
import tempfile

import msgspec

from service.engine.sampling import SamplingParams


class Add(msgspec.Struct, array_like=True, tag="add"):
    request_id: str
    frontend: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float  # time.perf_counter() in the front end (CLOCK_MONOTONIC: one clock for every process)
    traceparent: str | None = None  # W3C trace context of the request's span in the front end
    n: int = 1  # samples of this prompt: engine requests sample_id(request_id, i, n), admitted all or none


def sample_id(request_id: str, index: int, n: int) -> str:
    """The engine's id of sample `index` of an Add of `n` samples (the Add's own id when n is 1)."""
    return request_id if n == 1 else f"{request_id}-{index}"


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class FrontendGone(msgspec.Struct, array_like=True, tag="gone"):
    frontend: int


class Hello(msgspec.Struct, array_like=True, tag="hello"):
    """The engine is loaded: what a front end needs to validate, tokenize and describe the model."""

    pid: int
    model_name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    tokenizer: str | None  # a folder AutoTokenizer loads; None: token ids only (random weights)
    quantization: str
    quantization_scheme: str  # what the mode stores and computes in (quantization.describe), for /v1/models
    dtype: str
    block_size: int
    num_blocks: int


class Admitted(msgspec.Struct, array_like=True, tag="admitted"):
    accepted: list[str]
    rejected: list[tuple[str, str]]  # (request id, why): the engine's waiting queue was full


class Step(msgspec.Struct, array_like=True, tag="step"):
    """One engine step's outputs for one front end: `rows` are [request id, new token ids, finish reason or
    None, logprobs or None, (first scheduled, cached prompt tokens, prompt logprobs or None) with a request's first
    output (token or finish) or None]. Prompt logprobs, when asked for, are one (logprob, [(token id, logprob),
    ...]) per prompt token after the first."""

    rows: list
    num_waiting: int


class Dead(msgspec.Struct, array_like=True, tag="dead"):
    reason: str


ToEngine = Add | Abort | FrontendGone
ToFrontend = Hello | Admitted | Step | FrontendGone | Dead
encode = msgspec.msgpack.Encoder().encode
engine_decoder = msgspec.msgpack.Decoder(ToEngine)
frontend_decoder = msgspec.msgpack.Decoder(ToFrontend)


def frontend_name(frontend: int) -> str:
    """Front end i's process name, in logs and in its metrics' `process` label."""
    return f"api-{frontend}"


def private_dir() -> str:
    """A folder only this user can enter (mkdtemp makes it 0700) for the ipc:// socket files."""
    return tempfile.mkdtemp(prefix="llm-service-")


def inbox(folder: str) -> str:
    return f"ipc://{os.path.join(folder, 'engine')}"


def outbox(folder: str, frontend: int) -> str:
    return f"ipc://{os.path.join(folder, frontend_name(frontend))}"
