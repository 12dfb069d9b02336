"""What the engine hands to its callers: each request's output of a step, each step's statistics, timings.

Plain data only (dataclasses and typing, no torch), so that telemetry and the front ends can name these types
without loading the engine, the model runner or tensor parallelism.
"""

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class Timings:
    """Monotonic clock readings (time.perf_counter) of one request's life.

    `arrival` is when the server received the request (its first bytes parsed), `submitted` when it was handed to
    the engine, validated and tokenized: the time between them is the server's front end.
    """

    arrival: float = field(default_factory=time.perf_counter)
    submitted: float | None = None
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    preempted: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass
class RequestOutput:
    """What one step produced for one request: new tokens and text, and its state when finished."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int
    new_logprobs: list
    timings: Timings
    # with the first output of a request that asked for them: (logprob, [(token id, logprob), ...]) per prompt token
    # after the first
    prompt_logprobs: list | None = None


@dataclass
class StepStats:
    """One engine step (or an abort) for telemetry: what it produced and the engine's load after it.

    In a step that ran, every output carries the one token it produced; the lists below are parts of
    `outputs`, collected where the engine decides them, so an observer need not scan for them. (In the engine
    process, where the outputs are bare rows, the later steps of a launch of several (decode_steps) add a request's
    token to its row of the launch's first step where they can: their `outputs` leave those rows out.)
    """

    phase: str | None  # prefill, decode or mixed; None when no forward pass ran (an abort, a failed step)
    num_tokens: int  # tokens computed
    num_seqs: int  # sequences in the batch
    duration: float  # seconds from its launch (with overlap: from the previous step's read-back) to its read-back
    outputs: list  # RequestOutput objects, or bare rows in the engine process (messages.Step)
    first_tokens: list[RequestOutput]  # outputs carrying their request's first token
    finished: list[RequestOutput]  # outputs of requests that finished: stop, length, abort, error
    admitted: list[str]  # requests that entered the running batch (new, or back after preemption)
    preempted: list[str]
    num_running: int
    num_waiting: int
    kv_usage: float  # kv_blocks_used / kv_blocks_total
    rank_seconds: list[float] | None = None  # tensor parallelism: each rank's time in forward passes so far
    error: str | None = None  # a failed step: the exception's type (its requests finished with "error")
    finished_ids: tuple[str, ...] = ()  # the request ids of `finished`, for observers that need no outputs
    kv_blocks_used: int = 0  # KV cache blocks held by requests after the step
    kv_blocks_total: int = 0  # usable KV cache blocks (the scratch block not counted)
    # prompt tokens of the requests admitted in this step: to be computed, and found in the prefix cache
    prompt_tokens_computed: int = 0
    prompt_tokens_cached: int = 0
    # structured output since the last report: each request's wait for its grammar, how many found it compiled,
    # and the host seconds spent on grammar masks
    grammar_waits: tuple[float, ...] = ()
    grammar_hits: int = 0
    mask_seconds: float = 0.0
    device_wait: float = 0.0  # seconds of `duration` the engine thread waited for the device's results


# Called on the engine's thread after every step and abort.
StepObserver = Callable[[StepStats], None]
