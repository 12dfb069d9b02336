"""The synchronous engine: validate and add requests, run steps, report what each step produced."""

import dataclasses
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from service.engine.block_manager import BlockManager
from service.engine.config import EngineConfig
from service.engine.detokenizer import Detokenizer
from service.engine.errors import EngineDeadError, InvalidRequestError
from service.engine.model_runner import ModelRunner
from service.engine.models import LoadedModel, load_model, resolve_dtype
from service.engine.sampling import SamplingParams
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import Sequence, Status, Timings

log = logging.getLogger(__name__)


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


@dataclass
class StepStats:
    """One engine step (or an abort) for telemetry: what it produced and the engine's load after it.

    In a step that ran, every output carries the one token it produced; the lists below are parts of
    `outputs`, collected where the engine decides them, so an observer need not scan for them.
    """

    phase: str | None  # prefill, decode or mixed; None when no forward pass ran (an abort, a failed step)
    num_tokens: int  # tokens computed
    num_seqs: int  # sequences in the batch
    duration: float
    outputs: list["RequestOutput"]
    first_tokens: list["RequestOutput"]  # outputs carrying their request's first token
    finished: list["RequestOutput"]  # outputs of requests that finished: stop, length, abort, error
    admitted: list[str]  # requests that entered the running batch (new, or back after preemption)
    preempted: list[str]
    num_running: int
    num_waiting: int
    kv_usage: float
    rank_seconds: list[float] | None = None  # tensor parallelism: each rank's time in forward passes so far


# Called on the engine's thread after every step and abort.
StepObserver = Callable[[StepStats], None]


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.parallel = None  # the tensor-parallel group, when the model is split over several ranks
        if config.tensor_parallel_size > 1:
            config, loaded = self._start_parallel(config, loaded)
            self.config = config
        elif loaded is None:
            loaded = load_model(config.model, resolve_dtype(config.dtype, self.device, config.quantization),
                                self.device, config.cache_dir, config.seed, config.trust_remote_code,
                                config.quantization)
        self.model_name = loaded.name
        self.quantization = loaded.quantization
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        max_len = min(config.max_model_len or loaded.max_model_len, loaded.max_model_len)
        self.runner = ModelRunner(loaded.model, config, self.device, max_len)
        self.max_model_len = self.runner.max_model_len
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.observer: StepObserver | None = None  # telemetry sets it; called after every step and abort
        self._ids = itertools.count()

    def _start_parallel(self, config: EngineConfig, loaded: LoadedModel | None) -> tuple[EngineConfig, LoadedModel]:
        from service.engine.parallel import TensorParallelGroup, load_shard

        if loaded is not None:
            raise ValueError("a tensor-parallel engine loads its own shard on each rank; pass no loaded model")
        if config.cuda_graphs or config.compile:
            # graph replays and compiled layers would skip the broadcast that keeps the other ranks in step
            log.info("tensor parallelism: CUDA graphs and torch.compile are off")
            config = dataclasses.replace(config, cuda_graphs=False, compile=False)
        self.parallel = TensorParallelGroup(config)
        try:
            loaded = load_shard(config, config.tensor_parallel_size, 0)
        except BaseException:
            self.parallel.close()
            raise
        self.parallel.link(loaded.model)
        log.info("tensor parallelism over %d ranks (%s)", config.tensor_parallel_size,
                 "nccl" if self.device.type == "cuda" else "gloo")
        return config, loaded

    def close(self) -> None:
        """Stop the other tensor-parallel ranks, if any."""
        if self.parallel is not None:
            self.parallel.close()

    # -- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer: send token ids", param="prompt")
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        return list(prompt)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival: float | None = None) -> Sequence:
        """Validate a request and build its sequence; raises InvalidRequestError for bad input.

        The request's clock starts at `arrival` (time.perf_counter; the server passes when it received the
        request) or now, so tokenization and validation count in its queue time and TTFT either way.
        """
        arrival = time.perf_counter() if arrival is None else arrival
        params = dataclasses.replace(params) if params else SamplingParams()  # the engine fills in max_tokens
        ids = self.tokenize(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty", param="prompt")
        vocab = self.runner.model.config.get_text_config().vocab_size
        if not all(isinstance(t, int) and 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})", param="prompt")
        if not all(t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab}",
                                      param="stop_token_ids")
        limit = self.max_model_len
        if len(ids) >= limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens, but the prompt has {len(ids)} tokens; "
                f"at least one token must be left to generate.", param="prompt")
        if params.max_tokens is None:
            params.max_tokens = limit - len(ids)
        elif len(ids) + params.max_tokens > limit:
            raise InvalidRequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                f"completion). Please reduce the prompt or max_tokens.", param="max_tokens")
        if params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids", param="stop")
        rid = request_id or f"req-{next(self._ids)}"
        if rid in self.seqs:
            raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
        seq = Sequence(rid, ids, params, eos_token_ids=self.eos_token_ids, timings=Timings(arrival=arrival))
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.detokenizer.start(seq)
        seq.timings.submitted = time.perf_counter()
        return seq

    def add_sequence(self, seq: Sequence) -> None:
        seq.timings.arrival = seq.timings.arrival or time.perf_counter()
        self.seqs[seq.request_id] = seq
        self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        self.scheduler.finish(seq, "abort")
        seq.timings.finished = time.perf_counter()
        out = self._output(seq, [], [])
        self._observe([out], finished=[out])
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # -- steps ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        if self.parallel is not None and self.parallel.failure:
            raise EngineDeadError(self.parallel.failure)
        start = time.perf_counter()
        batch = self.scheduler.schedule()
        if not batch.seqs:
            self._observe([], batch=batch)
            return []
        phase = batch.phase
        for seq in batch.seqs:
            if seq.timings.first_scheduled is None:
                seq.timings.first_scheduled = start
        for seq in batch.preempted:
            seq.timings.preempted.append(start)
        try:
            sampled, result = self.runner.execute(batch)
        except EngineDeadError:  # a tensor-parallel rank is gone: no later step can run either
            raise
        except Exception:
            log.exception("engine step failed; failing its %d requests", len(batch.seqs))
            outputs = self._fail(batch)
            self._observe(outputs, finished=outputs, batch=batch)
            return outputs
        now = time.perf_counter()
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            self.blocks.commit(seq)
        outputs, first_tokens, finished = [], [], []
        for i, seq in enumerate(sampled):
            token = result.token_ids[i]
            seq.token_ids.append(token)
            seq.timings.token_times.append(now)
            first = seq.timings.first_token is None
            if first:
                seq.timings.first_token = now
            logprobs = [result.logprobs[i]] if result.logprobs[i] is not None else []
            seq.logprobs.extend(logprobs)
            reason = self._check_stop(seq, token)
            if reason:
                self.scheduler.finish(seq, reason)
                seq.timings.finished = now
                del self.seqs[seq.request_id]
            out = self._output(seq, [token], logprobs)
            outputs.append(out)
            if first:
                first_tokens.append(out)
            if reason:
                finished.append(out)
        self._observe(outputs, first_tokens, finished, batch, phase, time.perf_counter() - start)
        return outputs

    def _observe(self, outputs: list[RequestOutput], first_tokens: list[RequestOutput] = (),
                 finished: list[RequestOutput] = (), batch: ScheduledBatch | None = None, phase: str | None = None,
                 duration: float = 0.0) -> None:
        if self.observer is None:
            return
        ids = lambda seqs: [s.request_id for s in seqs]
        self.observer(StepStats(
            phase, batch.num_tokens if phase else 0, len(batch.seqs) if phase else 0, duration, outputs, list(first_tokens), list(finished),
            ids(batch.admitted) if phase else [], ids(batch.preempted) if batch else [],
            self.num_running, self.num_waiting, self.blocks.usage,
            self.parallel.rank_seconds if self.parallel is not None else None))

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.num_output_tokens >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in seq.eos_token_ids)):
            return "stop"
        if self.detokenizer.append(seq):
            return "stop"
        if seq.num_output_tokens >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _fail(self, batch: ScheduledBatch) -> list[RequestOutput]:
        outputs = []
        for seq in batch.seqs:
            self.scheduler.finish(seq, "error")
            seq.timings.finished = time.perf_counter()
            self.seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [], []))
        return outputs

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: list) -> RequestOutput:
        return RequestOutput(seq.request_id, new_tokens, Detokenizer.take_delta(seq), seq.is_finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                             logprobs, seq.timings)

    # -- offline use ----------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[dict]:
        """Run prompts to completion; return each one's token ids, text and finish reason, in order."""
        if not isinstance(params, list):
            params = [params or SamplingParams() for _ in prompts]
        seqs = [self.make_sequence(p, sp) for p, sp in zip(prompts, params)]
        for seq in seqs:
            self.add_sequence(seq)
        while any(not s.is_finished for s in seqs):
            self.step()
        return [{"token_ids": s.output_token_ids, "text": s.text, "finish_reason": s.finish_reason,
                 "num_prompt_tokens": s.num_prompt_tokens} for s in seqs]
