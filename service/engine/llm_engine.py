"""The synchronous engine: validate and add requests, run steps, report what each step produced."""

import concurrent.futures
import dataclasses
import itertools
import logging
import operator
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from service.engine.block_manager import BlockManager
from service.engine.config import EngineConfig, check, for_device, resolve_dtype
from service.engine.detokenizer import Detokenizer
from service.engine.errors import EngineDeadError, InvalidRequestError
from service.engine.models import LoadedModel, load_model, memory_limit
from service.engine.results import RequestOutput, StepObserver, StepStats, Timings
from service.engine.runner.model_runner import ModelRunner
from service.engine.runner.sampler import SampleResult
from service.engine.messages import sample_id
from service.engine.sampling import SamplingParams, check_request, sample_seed, tokenize
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import Sequence
from service.engine.structured import SWITCH_INTERVAL, Fill, Grammars

log = logging.getLogger(__name__)
_token_ids, _length_at = operator.attrgetter("token_ids"), operator.attrgetter("length_at")


@dataclass
class _Launched:
    """A step queued on the device whose sampled tokens the host has not read back yet."""

    batch: ScheduledBatch
    phase: str
    sampled: list[Sequence]  # the sequences that sample in it, in the order of result's rows
    result: SampleResult | None
    start: float
    masks: Fill | None = None  # its constrained rows' masks: a step with some (and only such a step) has them
    taken: bool = False  # its constrained rows' grammars took its tokens ahead of its read-back (the next step's fill)
    # the decode steps launched behind this one over the same batch, before the host reads any back (decode_steps)
    then: list["_Launched"] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, loaded: LoadedModel | None = None):
        self.config = config = config or EngineConfig()
        check(config)
        if config.device == "auto":
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        else:
            self.device = torch.device(config.device)
        self.config = config = for_device(config, self.device.type)
        self.parallel = None  # the tensor-parallel group, when the model is split over several ranks
        self._rank_failure = None  # with it: what the waits for the device look at (why a rank was lost, or None)
        if config.tensor_parallel_size > 1:
            config, loaded = self._start_parallel(config, loaded)
            self.config = config
            self._rank_failure = lambda: self.parallel.failure
        elif loaded is None:
            loaded = load_model(config.model, resolve_dtype(config.dtype, self.device, config.quantization),
                                self.device, config.cache_dir, config.seed, config.trust_remote_code,
                                config.quantization, config.tokenizer, config.smoothing,
                                memory_limit=memory_limit(config.gpu_memory_utilization, self.device))
        self.model_name = loaded.name
        self.quantization = loaded.quantization
        self.tokenizer = loaded.tokenizer
        self.eos_token_ids = loaded.eos_token_ids
        # the ids that end a sequence whatever its length (`_going`): EOS, and the grammars' stop tokens once a
        # grammar is ready (the same, where the tokenizer names its EOS)
        self._eos = np.array(sorted(self.eos_token_ids), dtype=np.int64)
        try:
            self.runner = ModelRunner(loaded.model, config, self.device, loaded.max_model_len)
        except BaseException as exc:
            if self.parallel is not None:  # the other ranks may wait in a start-up collective: they are stopped
                self.parallel.failure = f"rank 0 failed to start: {exc!r}"
                self.parallel.close()
            raise
        if self.parallel is not None:  # every rank has built its runner, in step: from now on rank 0 drives
            self.parallel.link(self.runner)
        self.max_model_len = self.runner.max_model_len
        self.vocab_size = loaded.model.config.get_text_config().vocab_size
        self.tokenizer_source = loaded.tokenizer_source
        self.blocks = BlockManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens,
                                   config.admission_wait_steps)
        self.detokenizer = Detokenizer(self.tokenizer)
        self.seqs: dict[str, Sequence] = {}
        self.observer: StepObserver | None = None  # telemetry sets it; called after every step and abort
        # the engine process sets it: outputs are bare rows (see messages.Step), not RequestOutput objects
        self.rows = False
        self._ids = itertools.count()
        # overlap scheduling: the launched step whose results the host has not read back yet
        self.overlap = config.overlap if config.overlap is not None else self.device.type == "cuda"
        self._in_flight: _Launched | None = None
        self._last_read_back = 0.0
        # structured output (engine/structured.py): the compiler, made at the first constrained request, and the
        # requests whose grammar compiles (they join the scheduler when it is ready)
        self.grammars: Grammars | None = None
        self._compiling: list[Sequence] = []
        # reported with the next step (_grammar_stats): grammars found compiled, each request's wait for its grammar,
        # host time spent on masks
        self._grammar_hits, self._grammar_waits, self._mask_seconds = 0, [], 0.0
        # whether the step being read back has constrained rows whose grammars take their tokens there (none took
        # them ahead)
        self._grammars_take = False

    def _start_parallel(self, config: EngineConfig, loaded: LoadedModel | None) -> tuple[EngineConfig, LoadedModel]:
        from service.engine.parallel import TensorParallelGroup, load_shard

        if loaded is not None:
            raise ValueError("a tensor-parallel engine loads its own shard on each rank; pass no loaded model")
        self.parallel = TensorParallelGroup(config)
        try:
            loaded = load_shard(config, config.tensor_parallel_size, 0)
            self.parallel.wait_for_ranks()
        except BaseException:
            self.parallel.close()
            raise
        log.info("tensor parallelism over %d ranks (%s)", config.tensor_parallel_size,
                 "nccl" if self.device.type == "cuda" else "gloo")
        return config, loaded

    @property
    def stuck(self) -> bool:
        """A tensor-parallel rank was lost on CUDA: a collective waiting for it may never end, and freeing GPU memory
        or tearing NCCL down would wait for it. The device is left as it is; the process should end (os._exit)."""
        return bool(self.parallel is not None and self.parallel.failure and self.device.type == "cuda")

    def close(self) -> None:
        """Give back the KV cache and CUDA graphs (not when `stuck`), and stop the other tensor-parallel ranks, if any
        (after the graphs: destroying a communicator waits until the graphs that captured its kernels are freed)."""
        if self.grammars is not None:
            self.grammars.close()
        if not self.stuck:
            self.runner.release()
        if self.parallel is not None:
            self.parallel.close()

    # -- requests -------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> list[int]:
        return tokenize(self.tokenizer, prompt)

    def make_sequence(self, prompt: str | list[int], params: SamplingParams | None = None,
                      request_id: str | None = None, arrival: float | None = None) -> Sequence:
        """Validate a request and build its sequence; raises InvalidRequestError for bad input.

        The request's clock starts at `arrival` (time.perf_counter; the server passes when it received the
        request) or now, so tokenization and validation count in its queue time and TTFT either way.
        """
        arrival = time.perf_counter() if arrival is None else arrival
        ids, params = self._checked(prompt, params)
        return self.new_sequence(request_id if request_id is not None else f"req-{next(self._ids)}", ids, params,
                                 arrival)

    def _checked(self, prompt: str | list[int], params: SamplingParams | None) -> tuple[list[int], SamplingParams]:
        """A request's token ids and its own copy of the params (the engine fills in max_tokens), validated."""
        params = dataclasses.replace(params) if params else SamplingParams()
        ids = self.tokenize(prompt)
        check_request(ids, params, self.max_model_len, self.vocab_size, self.tokenizer is not None)
        return ids, params

    def new_sequence(self, request_id: str, ids: list[int], params: SamplingParams, arrival: float) -> Sequence:
        """The sequence of a request already validated (check_request) and tokenized."""
        seq = Sequence(request_id, ids, params, eos_token_ids=self.eos_token_ids, timings=Timings(arrival=arrival))
        if params.max_tokens and not params.stop_token_ids:
            seq.length_at = min(len(ids) + params.max_tokens, self.max_model_len)
        if params.seed is not None:
            seq.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        self.detokenizer.start(seq)
        seq.timings.submitted = time.perf_counter()
        return seq

    def new_samples(self, request_id: str, ids: list[int], params: SamplingParams, arrival: float,
                    n: int) -> list[Sequence]:
        """The n sequences of one prompt (messages.sample_id names them), sample i seeded with sample_seed(seed, i).
        Samples after the first wait for the first's prompt blocks to be cached, and share them (Scheduler.held);
        those that want prompt logprobs compute their own prompt."""
        if n == 1:
            return [self.new_sequence(request_id, ids, params, arrival)]
        seqs = []
        for i in range(n):
            p = dataclasses.replace(params, seed=sample_seed(params.seed, i)) if params.seed is not None else params
            seq = self.new_sequence(sample_id(request_id, i, n), ids, p, arrival)
            if seqs and params.prompt_logprobs is None:
                seq.leader = seqs[0]
            seqs.append(seq)
        return seqs

    def add_sequence(self, seq: Sequence) -> None:
        seq.timings.arrival = seq.timings.arrival or time.perf_counter()
        self.seqs[seq.request_id] = seq
        if seq.params.structured is not None:  # the scheduler takes it once its grammar is compiled
            if self.grammars is None:
                self.grammars = Grammars(self.tokenizer, self.vocab_size, self.eos_token_ids,
                                         self.config.max_num_seqs)
                if self.overlap:  # (the process's: an engine with overlap owns its process, the engine process)
                    sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
            self._grammar_hits += self.grammars.start(seq)
            self._compiling.append(seq)
            return
        self.scheduler.add(seq)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None) -> str:
        # the id check is here, not in make_sequence: that runs on the server's event loop, while this table
        # belongs to the engine's thread (the async facade checks ids against its own streams)
        if request_id in self.seqs:
            raise InvalidRequestError(f"request id {request_id!r} is already in use", param="request_id")
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return None
        if seq.grammar is not None:
            self._compiling.remove(seq)
        self.scheduler.finish(seq, "abort")
        seq.timings.finished = time.perf_counter()
        out = self._output(seq, [], [])
        self._observe([out], finished=[out])
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or self._in_flight is not None or bool(self._compiling)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) + len(self._compiling)

    # -- steps ----------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Schedule and launch a step; return the outputs of the step read back now.

        Without overlap that is the step just launched. With overlap it is the previous one: the host reads
        step N-1's tokens, checks stops and builds outputs while the device computes step N, whose inputs
        took N-1's tokens on the device. A request that stopped at N-1 was already scheduled in N; its
        token from N is dropped when N is read back, and its blocks were freed when it stopped.
        """
        if self.parallel is not None and self.parallel.failure:
            raise EngineDeadError(self.parallel.failure)
        start = time.perf_counter()
        outputs = self._admit_compiled(start) if self._compiling else []
        batch = self.scheduler.schedule()
        launched = None
        if batch.seqs:
            for seq in batch.admitted:  # (a sequence first runs in the step that admits it: not a pass over all)
                if seq.timings.first_scheduled is None:
                    seq.timings.first_scheduled = start
            for seq in batch.preempted:
                seq.timings.preempted.append(start)
            try:
                launched = self._launch(batch, start)
                for _ in range(self._more_steps(batch, launched)):
                    launched.then.append(self._launch(batch, start))
            except EngineDeadError:  # a tensor-parallel rank is gone: no later step can run either
                raise
            except Exception as exc:
                if self.parallel is not None:  # the other ranks may have run part of it: they are out of step
                    raise EngineDeadError(f"a step failed on tensor-parallel rank 0 ({exc!r}); the ranks are out "
                                          "of step") from exc
                log.exception("engine step failed; failing its %d requests", len(batch.seqs))
                outputs += self._read_in_flight()
                return outputs + self._fail(batch, exc)
        elif self._in_flight is None and self._compiling and not outputs:
            # nothing to run but grammars compiling: wait for one a moment instead of spinning
            concurrent.futures.wait([s.grammar for s in self._compiling], timeout=0.001,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        had_in_flight = self._in_flight is not None
        outputs += self._read_in_flight()
        if launched is not None and self.overlap:
            self._in_flight = launched
        elif launched is not None:
            outputs += self._read_back(launched)
        elif not had_in_flight:  # no step ran or was read back: report the engine's state all the same
            self._observe([], batch=batch)
        if not self.has_unfinished():  # idle: the last steps' sequences, all finished, are let go
            self.runner.forget()
            if self.grammars is not None:
                self.grammars.forget()
        return outputs

    def _read_in_flight(self) -> list[RequestOutput]:
        step, self._in_flight = self._in_flight, None
        return self._read_back(step) if step is not None else []

    def _launch(self, batch: ScheduledBatch, start: float) -> "_Launched":
        """Launch the step: its forward pass, then its sampler. For a step that samples constrained rows, the masks
        start filling in between (structured.Grammars.fill), their grammars taking the step in flight's tokens first
        as soon as they are on the host. On CUDA with overlap the sampler is launched at once, behind a gate where the
        device waits for the masks (runner/host_gate.py): the host waits for nothing, and the masks fill while the
        device runs the forward pass. Elsewhere the host waits for the masks before it launches the sampler."""
        phase = batch.phase  # before num_computed_tokens moves
        sampled, logits = self.runner.forward(batch)
        self.scheduler.advance(batch, sampled)
        masks = fill = None
        if self.grammars is not None and any(s.matcher is not None for s in sampled):
            previous = self._in_flight  # (without overlap there is none: read back already)
            taken = (previous.sampled, previous.result) if previous is not None and previous.result else None
            gate = self.runner.gate if self.overlap else None
            fill = self.grammars.fill(sampled, self.device, taken, gate, self._rank_failure, not self.overlap)
            if taken is not None:
                previous.taken = True
            if gate is None:
                concurrent.futures.wait([fill.done])  # (a failed fill fails the step at its read-back)
            masks = fill.rows, fill.host, fill.ticket
        elif self.grammars is not None:
            self.grammars.forget()  # no constrained row: the last constrained step's sequences are let go
        result = self.runner.sample(sampled, logits, masks)
        return _Launched(batch, phase, sampled, result, start, fill)

    def _more_steps(self, batch: ScheduledBatch, launched: "_Launched") -> int:
        """How many more decode steps of the same batch to launch behind `launched` before the host reads any back
        (decode_steps - 1 at most; the next step feeds on the last one's tokens on the device, as with overlap), and
        their KV blocks, allocated. None (0) unless every sequence decodes, none is constrained by a grammar, none was
        admitted or preempted in this step, and no request waits but those the scheduler holds back (up to the end of
        its hold). No sequence is run past its max_tokens or max_model_len; one that stops at an EOS or stop token
        in the first steps computes the rest, which are dropped, as overlap drops one."""
        more = self.config.decode_steps - 1
        scheduler = self.scheduler
        if (not more or batch.phase != "decode" or batch.admitted or batch.preempted or self._compiling
                or not launched.sampled or len(launched.sampled) != len(batch.seqs)):
            return 0
        if scheduler.waiting:
            if not scheduler.held_steps:  # they were not held: admitting them failed (no room), or the hold is over
                return 0
            more = min(more, scheduler.admission_wait_steps - scheduler.held_steps)
        max_len = self.max_model_len
        for seq in batch.seqs:  # (written without calls: it runs for every sequence of every launch)
            if seq.matcher is not None:
                return 0
            limit = seq.params.max_tokens
            limit = max_len if limit is None else min(len(seq.prompt_token_ids) + limit, max_len)
            room = limit - len(seq.token_ids) - seq.num_pending_tokens
            if room < more:
                more = room
                if more <= 0:
                    return 0
        blocks, need, growing = self.blocks, 0, []
        block_size = blocks.block_size
        for seq in batch.seqs:  # (BlockManager.blocks_needed, written out)
            short = seq.num_computed_tokens + more - len(seq.block_table) * block_size
            if short > 0:
                need += -(-short // block_size)
                growing.append(seq)
        if need > blocks.num_free_blocks - scheduler.admission_reserve():
            return 0
        for seq in growing:
            blocks.allocate(seq, more)
        if scheduler.held_steps:
            scheduler.held_steps += more
        return more

    def _admit_compiled(self, now: float) -> list:
        """Requests whose grammar is ready join the scheduler; those whose grammar failed finish with an error."""
        failed, waiting = [], []
        for seq in self._compiling:
            why = self.grammars.poll(seq, now)
            if why is None:
                waiting.append(seq)
                continue
            self._grammar_waits.append(now - seq.grammar_since)
            if why == "":
                self.scheduler.add(seq)
                if len(self._eos) < len(ends := self.grammars.stops | set(self.eos_token_ids)):
                    self._eos = np.array(sorted(ends), dtype=np.int64)
                continue
            log.warning("request %s fails: %s", seq.request_id, why)
            seq.grammar = None
            failed.append(seq)
        self._compiling = waiting
        return self._end_with_error(failed, now)

    def _end_with_error(self, seqs: list[Sequence], now: float) -> list:
        """Finish `seqs` (outside a step's read-back) with an error, and report them."""
        outputs = []
        for seq in seqs:
            self.scheduler.finish(seq, "error")
            seq.timings.finished = now
            del self.seqs[seq.request_id]
            outputs.append(self._output(seq, [], []))
        if outputs:
            self._observe(outputs, finished=outputs)
        return outputs

    def _read_back(self, step: "_Launched") -> list[RequestOutput]:
        """Wait for a launched step's tokens, hand them to the scheduler's postprocess, and report the step. The steps
        launched behind it (`then`) are read back with it; each is reported with an even share of their time, and in
        the engine process a request's tokens of them go in one row."""
        parts, reads, failure, refused = [step, *step.then], [], None, []
        self._grammars_take = step.masks is not None and not step.taken
        for part in parts:
            try:
                reads.append(part.result.read(self._rank_failure) if part.result else ([], []))
            except EngineDeadError:
                raise
            except Exception as exc:  # a device fault (or NaN logits) surfaces here, when the host waits for the step
                failure = exc
                break
        if step.masks is not None and failure is None:  # (a constrained step: one part)
            try:
                seconds, refused = self.grammars.ready(step.masks)
                self._mask_seconds += seconds
            except Exception as exc:  # the fill failed: the step's tokens, sampled with its masks, are void
                failure, reads = exc, []
            for seq in refused:  # (its token of this step is dropped)
                log.error("request %s: token %d breaks its grammar", seq.request_id, seq.token_ids[-1])
            refused = self._end_with_error([seq for seq in refused if not seq.is_finished], time.perf_counter())
        if failure is None and self.rows and self.detokenizer.tokenizer is None and step.phase == "decode" and all(
                part.result is not None and not part.result.logprob_rows for part in parts):
            taken = self._take_rows(parts, reads)
        else:
            heads = {} if step.then and self.rows else None
            taken = [self._take(part.batch, part.sampled, tokens, logprobs, heads)
                     for part, (tokens, logprobs) in zip(parts, reads)]
        end = time.perf_counter()
        # with overlap, a step's span starts where the previous one's read-back ended, so steps do not overlap
        duration = (end - max(step.start, self._last_read_back)) / len(parts)
        wait = sum(part.result.waited for part in parts if part.result) / len(parts)
        self._last_read_back = end
        outputs = refused
        for part, (rows, first_tokens, finished) in zip(parts, taken):
            self._observe(rows, first_tokens, finished, part.batch, part.phase, duration, device_wait=wait)
            outputs += rows
        if failure is not None:
            log.error("engine step failed on the device; failing its %d requests", len(step.batch.seqs),
                      exc_info=failure)
            return outputs + self._fail(step.batch, failure)
        return outputs

    def _take_rows(self, parts: list["_Launched"], reads: list) -> list[tuple[list, list, list]]:
        """`_take` of a launch's decode steps (one or more) in the engine process, with no logprobs: a sequence that
        goes on through all of them (no EOS among its tokens, short of its `length_at`: most of them) takes its tokens
        at once (Scheduler.take_steps), in one row reported with the first step; the rest go through `_take`, step by
        step, as they would alone."""
        sampled, k = parts[0].sampled, len(parts)
        tokens = (np.stack([part.result.token_array() for part in parts]) if k > 1  # [step, row]
                  else parts[0].result.token_array()[None])
        columns = tokens.T.tolist()
        going, rest = self.scheduler.take_steps(sampled, columns, self._going(sampled, tokens).tolist())
        outputs = [[sampled[row].request_id, columns[row], None, None, None] for row in going]  # _output's rows
        seqs = [sampled[row] for row in rest]
        picked = [([ids[row] for row in rest], [None] * len(rest)) for ids, _ in reads]
        heads = {} if k > 1 else None
        taken = [self._take(part.batch, seqs, ids, logprobs, heads) for part, (ids, logprobs) in zip(parts, picked)]
        taken[0][0].extend(outputs)
        return taken

    def _take(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int], logprobs: list,
              heads: dict | None = None) -> tuple[list, list, list]:
        """A step's tokens, read back, taken by its sequences that sampled them (`sampled`, those of `batch` or some of
        them): (outputs, those with a first token, finished ones).
        With `heads` (the engine process, in a launch of several steps: each request's latest row of the launch), a
        request's token without logprobs extends its row there (messages.Step: a row's tokens in order) instead of
        making a row of its own, which `outputs` then leaves out."""
        now = time.perf_counter()
        outputs, first_tokens, finished, rows = [], [], [], self.rows
        for row, reason in self.scheduler.postprocess(batch, sampled, tokens, self._check_stop,
                                                      self._may_stop(sampled, tokens)):
            seq, token, lp = sampled[row], tokens[row], logprobs[row]
            timings = seq.timings
            head = heads.get(seq.request_id) if heads is not None else None
            if rows and not reason and lp is None and timings.first_token is not None:  # most rows of a step:
                if head is not None:
                    head[1].append(token)
                    continue
                out = [seq.request_id, [token], None, None, None]  # _output's row, written out
                outputs.append(out)
                if heads is not None:
                    heads[seq.request_id] = out
                continue
            if not rows:  # the engine process: the front end keeps the token times, where the client's clock is
                timings.token_times.append(now)
            first = timings.first_token is None
            if first:
                timings.first_token = now
            if lp is not None:
                seq.logprobs.append(lp)
            if reason:
                timings.finished = now
                del self.seqs[seq.request_id]
            if reason and seq.params.max_tokens == 0:  # the prompt only: no token to report
                token, lp = None, None
            out = self._output(seq, [token] if token is not None else [], [lp] if lp is not None else [], first)
            if head is not None and lp is None and not first and head[3] is None:
                head[1] += out[1]
                head[2] = out[2]
            else:
                outputs.append(out)
                if heads is not None:
                    heads[seq.request_id] = out
            if first:
                first_tokens.append(out)
            if reason:
                finished.append(out)
        return outputs, first_tokens, finished

    def _observe(self, outputs: list, first_tokens: list = (), finished: list = (),
                 batch: ScheduledBatch | None = None, phase: str | None = None, duration: float = 0.0,
                 error: str | None = None, device_wait: float = 0.0) -> None:
        if self.observer is None:
            return
        ids = lambda seqs: [s.request_id for s in seqs]
        blocks = self.blocks
        computed = cached = 0
        if phase:
            for seq in batch.admitted:  # a preempted request counts again: its prompt is computed (or found) again
                hit = min(seq.num_cached_tokens, seq.num_prompt_tokens)
                cached += hit
                computed += seq.num_prompt_tokens - hit
        self.observer(StepStats(
            phase, batch.num_tokens if phase else 0, len(batch.seqs) if phase else 0, duration, outputs,
            list(first_tokens), list(finished),
            ids(batch.admitted) if phase else [], ids(batch.preempted) if batch else [],
            self.num_running, self.num_waiting, blocks.usage,
            self.parallel.rank_seconds if self.parallel is not None else None, error,
            finished_ids=tuple(self._request_id(out) for out in finished),
            kv_blocks_used=blocks.num_used_blocks, kv_blocks_total=blocks.num_usable_blocks,
            prompt_tokens_computed=computed, prompt_tokens_cached=cached, device_wait=device_wait,
            **self._grammar_stats()))

    def _grammar_stats(self) -> dict:
        """What structured output did since the last report (each is reported once)."""
        if self.grammars is None:
            return {}
        stats = dict(grammar_waits=tuple(self._grammar_waits), grammar_hits=self._grammar_hits,
                     mask_seconds=self._mask_seconds)
        self._grammar_waits, self._grammar_hits, self._mask_seconds = [], 0, 0.0
        return stats

    def _may_stop(self, seqs: list[Sequence], tokens: list[int]) -> "np.ndarray | None":
        """Which rows `_check_stop` must look at (None: all): with text left to the front ends (the engine process),
        a row whose sequence only EOS and its length can end (`Sequence.length_at`) and that reached neither goes on
        without a look. For the whole step at once: most rows of a step go on."""
        if self.detokenizer.tokenizer is not None or not seqs:  # every token goes through the detokenizer
            return None
        return ~self._going(seqs, np.asarray(tokens, dtype=np.int64)[None])

    def _going(self, seqs: list[Sequence], tokens: np.ndarray) -> np.ndarray:
        """Which rows' sequences none of their new `tokens` ([step, row], not appended yet) can end, with text left to
        the front ends: no EOS (nor a grammar's stop token) among them, the sequence short of its `length_at` after
        them, and, where a grammar constrains it, a token that its grammar took ahead of the read-back (while the next
        step's masks filled)."""
        lengths = np.fromiter(map(len, map(_token_ids, seqs)), np.int64, len(seqs))
        going = lengths + len(tokens) < np.fromiter(map(_length_at, seqs), np.int64, len(seqs))  # (-1: never short)
        for eos in self._eos:  # (a few ids: np.isin costs three times as much)
            going &= (tokens != eos).all(axis=0)
        if self._grammars_take:
            for row, seq in enumerate(seqs):
                if seq.matcher is not None:
                    going[row] = False
        return going

    def _check_stop(self, seq: Sequence, token: int) -> str | None:
        p, produced = seq.params, len(seq.token_ids) - len(seq.prompt_token_ids)  # seq.num_output_tokens
        if p.max_tokens == 0:  # the prompt only: its one sample is dropped
            seq.token_ids.pop()
            return "length"
        if seq.matcher is not None:  # its grammar takes the token (unless it took it ahead: `_read_back`
            # ends a request whose grammar refused it); a stop token, which only a complete grammar allows, ends it
            if self._grammars_take and not self.grammars.accept(seq.matcher, token):
                log.error("request %s: token %d breaks its grammar", seq.request_id, token)
                return "error"
            if token in self.grammars.stops:
                return "stop"
        if produced >= p.min_tokens and (
                token in p.stop_token_ids or (not p.ignore_eos and token in seq.eos_token_ids)):
            return "stop"
        if self.detokenizer.tokenizer is not None and self.detokenizer.append(seq):
            return "stop"
        if produced >= p.max_tokens or len(seq.token_ids) >= self.max_model_len:
            return "length"
        return None

    def _fail(self, batch: ScheduledBatch, exc: Exception) -> list[RequestOutput]:
        """Finish the step's requests with an error (the step failed with `exc`) and report them."""
        outputs = []
        for seq in batch.seqs:
            self.blocks.forget(seq)  # registered at launch: what its blocks hold is not to be reused
            if seq.is_finished:  # it stopped (or was aborted) before the failure
                continue
            self.scheduler.finish(seq, "error")
            seq.timings.finished = time.perf_counter()
            self.seqs.pop(seq.request_id, None)
            outputs.append(self._output(seq, [], []))
        self._observe(outputs, finished=outputs, batch=batch, error=type(exc).__name__)
        return outputs

    def _output(self, seq: Sequence, new_tokens: list[int], logprobs: list, first: bool = False):
        if self.rows:  # the engine process: one bare row per request and step (see messages.Step)
            return [seq.request_id, new_tokens, seq.finish_reason, logprobs or None,
                    (seq.timings.first_scheduled, seq.num_cached_tokens, seq.prompt_logprobs) if first else None]
        return RequestOutput(seq.request_id, new_tokens, Detokenizer.take_delta(seq), seq.is_finished,
                             seq.finish_reason, seq.num_prompt_tokens, seq.num_output_tokens, seq.num_cached_tokens,
                             logprobs, seq.timings, seq.prompt_logprobs if first else None)

    def _request_id(self, out) -> str:
        return out[0] if self.rows else out.request_id

    # -- offline use ----------------------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 n: int = 1) -> list[dict]:
        """Run prompts to completion; return each one's token ids, text and finish reason, in order (with n samples
        of each prompt: prompt-major, prompt i's sample j at i * n + j)."""
        if not isinstance(params, list):
            params = [params or SamplingParams() for _ in prompts]
        seqs = []
        for p, sp in zip(prompts, params):
            ids, sp = self._checked(p, sp)
            seqs += self.new_samples(f"req-{next(self._ids)}", ids, sp, time.perf_counter(), n)
        for seq in seqs:
            self.add_sequence(seq)
        while any(not s.is_finished for s in seqs):
            self.step()
        return [{"token_ids": s.output_token_ids, "text": s.text, "finish_reason": s.finish_reason,
                 "num_prompt_tokens": s.num_prompt_tokens, "prompt_logprobs": s.prompt_logprobs} for s in seqs]
