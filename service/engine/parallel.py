"""Tensor parallelism: one model over N processes on one host (one per GPU; gloo ranks on CPU), rank 0 drives.

Sharding follows the model's own transformers tensor-parallel plan (`base_model_tp_plan`): "colwise"
projections keep a slice of their output features, "rowwise" ones a slice of their input features and
sum their partial outputs with an all-reduce. Attention is split by KV head (each rank keeps its KV heads
and the query heads of their groups), so each rank's paged KV cache holds only its own heads. Heads that
do not divide evenly are spread as evenly as whole groups allow (the default model's 3 KV heads: 2 + 1).

Lockstep: rank 0 runs the whole engine - API, scheduler, sampler, telemetry - and before each forward
pass sends that pass's inputs: a header through shared memory (`Headers`), then the tensors (token ids, positions,
attention metadata; or a CUDA graph's input buffers) as one broadcast byte buffer, no pickled objects. Every rank
builds the same runner (compiled layers, CUDA graphs); the other ranks only run forward passes.
Broadcasting the inputs, rather than running identical schedulers on every rank, means nothing can drift:
seeds, aborts, disconnects and timing decisions happen once.
"""

import collections
import dataclasses
import fnmatch
import gc
import logging
import math
import multiprocessing
import os
import resource
import threading
import time
from datetime import timedelta
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist

from service.engine.errors import RankFailedError
from service.engine.runner import attention
from service.engine.runner.attention import AttentionMetadata, ForwardContext, forward_context
from service.engine.runner.pinned_upload import to_device

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a collective whose peer never answers fails within this
START_TIMEOUT = timedelta(minutes=10)  # the store's: connecting to rank 0
WATCH_PERIOD = 0.25  # seconds between the watcher's looks at the ranks' progress


# -- sharding -------------------------------------------------------------------------------------------
def _split(n: int, world: int, rank: int) -> tuple[int, int]:
    part = np.array_split(np.arange(n), world)[rank]
    return int(part[0]), int(part[-1]) + 1


def head_ranges(config, world: int, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(query heads, KV heads) [start, end) of a rank: whole KV groups, spread as evenly as they go."""
    config = config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if kv_heads < world:
        raise ValueError(f"tensor parallelism over {world} ranks needs at least {world} KV heads; "
                         f"this model has {kv_heads}")
    group = heads // kv_heads
    kv = _split(kv_heads, world, rank)
    return (kv[0] * group, kv[1] * group), kv


# styles we keep whole on every rank: embeddings and gathered outputs cost memory, never correctness
REPLICATED = {"embedding_rowwise", "colwise_rep", "colwise_gather_output", "gather", "replicate"}


def shard_model(model: torch.nn.Module, world: int, rank: int) -> dict[int, tuple[int, int, int, int]]:
    """Keep this rank's slice of every projection in the model's tensor-parallel plan, in place (a model on the meta
    device too). Returns, by the id of each sliced parameter, (dim, start, end, full size): which slice it holds."""
    config = model.config.get_text_config()
    plan = getattr(config, "base_model_tp_plan", None) or getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in its transformers config")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    (q0, q1), (k0, k1) = head_ranges(config, world, rank)
    base = model.base_model
    slices = {}

    def keep(module: torch.nn.Module, dim: int, lo: int, hi: int) -> None:
        for key in ("weight", "bias"):
            p = getattr(module, key)
            if p is None or p.dim() <= dim:
                continue
            kept = torch.nn.Parameter(p.narrow(dim, lo, hi - lo).contiguous(), requires_grad=False)
            setattr(module, key, kept)
            slices[id(kept)] = (dim, lo, hi, p.shape[dim])

    for name, module in list(base.named_modules()):
        style = next((s for pattern, s in plan.items() if fnmatch.fnmatchcase(name, pattern)), None)
        if style is None or style in REPLICATED:
            continue
        if style not in ("colwise", "rowwise") or not isinstance(module, torch.nn.Linear):
            raise ValueError(f"tensor-parallel style {style!r} of {name} is not supported")
        attn = "attn" in name
        if style == "colwise":
            if attn:
                units = module.out_features // head_dim
                lo, hi = (q0, q1) if units == heads else (k0, k1)
                lo, hi = lo * head_dim, hi * head_dim
            else:
                lo, hi = _split(module.out_features, world, rank)
            keep(module, 0, lo, hi)
            module.out_features = hi - lo
        else:
            lo, hi = (q0 * head_dim, q1 * head_dim) if attn else _split(module.in_features, world, rank)
            keep(module, 1, lo, hi)  # (a bias is 1-D: whole)
            if module.bias is not None and rank != 0:
                module.bias = None  # added once, on rank 0, before the partial outputs are summed
            module.in_features = hi - lo
            module.register_forward_hook(_all_reduce_output)
    # the runner sizes this rank's KV cache from the config: local heads, explicit head_dim
    config.head_dim = head_dim
    config.num_attention_heads = q1 - q0
    config.num_key_value_heads = k1 - k0
    return slices


_driver: "TensorParallelGroup | None" = None  # rank 0's group, which explains a collective that failed


def _all_reduce_output(module, inputs, output):
    all_reduce(output)
    return output


@torch.library.custom_op("llm_service::all_reduce", mutates_args=("x",))
def all_reduce(x: torch.Tensor) -> None:
    """Sum `x` over the ranks, in place. One opaque op, as paged attention is (runner/attention.py): a compiled
    decoder layer keeps it whole in its graph, and a CUDA graph captures the NCCL kernel it launches."""
    try:
        dist.all_reduce(x)
    except Exception as exc:
        if _driver is None:  # another rank: its process ends with the error
            raise
        raise _driver.lost(exc) from exc


@all_reduce.register_fake
def _(x):
    return None


# -- what rank 0 sends before each forward pass: a header in shared memory, one tensor broadcast, nothing pickled --
# A header of HEADER int64 (what kind of message, then its integers) goes through shared memory (`Headers`): a rank
# reads it as soon as rank 0 has written it, without waiting for its own device; then one byte buffer holding the
# tensors one after another (each padded to 8 bytes, so that each views as its dtype) goes by broadcast. On CUDA the
# buffer stays on the device: rank 0 packs its inputs there and NCCL moves them. Two kinds of forward pass:
# Every header starts with its kind and whether to gather every rank's busy time after the pass (`report`).
# - FORWARD, an eager one: its integers are the attention metadata's integers, then each tensor's dtype and shape; its
#   tensors the model's arguments and the metadata's. Every rank runs it over its own KV cache and attention backend
#   (the same config made them).
# - REPLAY, a CUDA graph's: which ladder (its KIND: cuda_graphs), which size, and the block-table rows the step changed;
#   its tensors the graph's input buffers, as rank 0 filled them (cuda_graphs: `mirrored`), which the other ranks
#   copy into theirs before replaying the same graph. The graphs hold the all-reduces.
KWARGS = ("input_ids", "position_ids")  # the model's tensor arguments
META_INTS = tuple(f.name for f in dataclasses.fields(AttentionMetadata) if f.type is int)
META_TENSORS = tuple(f.name for f in dataclasses.fields(AttentionMetadata) if f.name not in META_INTS)
TENSORS = KWARGS + META_TENSORS
DTYPES = (torch.int64, torch.int32, torch.bool)
FIELDS = 2 + len(META_INTS)  # op, report, the metadata's integers; then 3 per tensor
HEADER = FIELDS + 3 * len(TENSORS)
STOP, FORWARD, REPLAY = 0, 1, 2


class Forward(NamedTuple):
    kwargs: dict
    meta: AttentionMetadata
    report: bool  # gather every rank's busy time after it


class Replay(NamedTuple):
    kind: int  # which ladder of graphs: cuda_graphs' DecodeGraphs.KIND or MixedGraphs.KIND
    size: int
    report: bool
    tables: tuple[int, int, int]  # block-table rows [start, end) and columns [0, width) the step changed


class Headers:
    """Rank 0's headers to the other ranks, in shared memory: a ring of SLOTS headers, each rank's count of the
    headers it has read, and a semaphore per rank released once per header (a rank waits on it with no timeout: an
    idle engine leaves no collective waiting out its timeout). Rank 0 writes a slot only once every rank has read
    what it held before (they are a step or two behind at most)."""

    SLOTS = 8

    def __init__(self, ctx, world: int):
        self.slots = ctx.Array("q", self.SLOTS * HEADER, lock=False)
        self.read = ctx.Array("q", world, lock=False)  # rank 0's entry: headers written
        self.wakes = [ctx.Semaphore(0) for _ in range(world)]  # (rank 0's unused)

    def post(self, fields: list[int], failure) -> None:
        """Rank 0: the next header; `failure()` says why to stop waiting for a slot (a rank gone), if it should."""
        n = self.read[0]
        while min(self.read[1:]) <= n - self.SLOTS:
            if why := failure():
                raise RankFailedError(why)
            time.sleep(0)
        at = n % self.SLOTS * HEADER
        self.slots[at:at + HEADER] = fields + [0] * (HEADER - len(fields))
        self.read[0] = n + 1
        for wake in self.wakes[1:]:
            wake.release()  # (a system call: what was written before it is seen after the rank's acquire)

    def take(self, rank: int) -> list[int]:
        """Another rank: wait for the next header, and take it."""
        self.wakes[rank].acquire()
        n = self.read[rank]
        at = n % self.SLOTS * HEADER
        fields = self.slots[at:at + HEADER]
        self.read[rank] = n + 1
        return fields


def _packed(tensors) -> torch.Tensor:
    """The tensors' bytes one after another, each padded to 8 bytes."""
    parts = []
    for t in tensors:
        data = t.reshape(-1).view(torch.uint8)
        parts.append(data)
        if pad := -len(data) % 8:
            parts.append(data.new_zeros(pad))
    return torch.cat(parts)


def _receive_packed(specs, device: torch.device) -> list[torch.Tensor]:
    """Receive rank 0's `_packed` buffer of tensors of `specs` [(dtype, shape)]: views of it, one per spec."""
    sizes = [math.prod(shape) * dtype.itemsize for dtype, shape in specs]
    payload = torch.empty(sum(-(-n // 8) * 8 for n in sizes), dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    views, at = [], 0
    for (dtype, shape), n in zip(specs, sizes):
        views.append(payload[at:at + n].view(dtype).view(shape))
        at += -(-n // 8) * 8
    return views


def forward_message(kwargs: dict, meta: AttentionMetadata) -> tuple[list[int], list[torch.Tensor]]:
    """An eager forward pass as (its header's integers, tensors): `kwargs` input_ids and position_ids, and the
    attention metadata."""
    header = [getattr(meta, f) for f in META_INTS]
    tensors = []
    for name in TENSORS:
        t = kwargs[name] if name in KWARGS else getattr(meta, name)
        if t is None:
            header += [-1, 0, 0]
            continue
        assert t.dim() <= 2, name
        header += [DTYPES.index(t.dtype), t.shape[0], t.shape[1] if t.dim() == 2 else -1]
        tensors.append(t)
    return header, tensors


def receive_replay(inputs: list[torch.Tensor], device: torch.device) -> None:
    """Another rank: rank 0's graph inputs into this rank's own buffers `inputs` (the same views of them)."""
    for dst, src in zip(inputs, _receive_packed([(t.dtype, t.shape) for t in inputs], device)):
        dst.copy_(src)


def receive(h: list[int], device: torch.device) -> Forward | Replay | None:
    """Another rank: the forward pass header `h` announces, its tensors received (a Replay's inputs follow:
    receive_replay), or None: stop."""
    if h[0] == STOP:
        return None
    if h[0] == REPLAY:
        return Replay(h[2], h[3], bool(h[1]), tuple(h[4:7]))
    names, specs = [], []
    for k, name in enumerate(TENSORS):
        code, rows, cols = h[FIELDS + 3 * k:FIELDS + 3 * k + 3]
        if code >= 0:
            names.append(name)
            specs.append((DTYPES[code], (rows,) if cols < 0 else (rows, cols)))
    tensors = dict(zip(names, _receive_packed(specs, device)))
    kwargs = {name: tensors[name] for name in KWARGS}
    meta = AttentionMetadata(**{name: tensors.get(name) for name in META_TENSORS}, **dict(zip(META_INTS, h[2:FIELDS])))
    return Forward(kwargs, meta, bool(h[1]))


def _exit_reason(proc) -> str:
    """Why the group is lost when the process of a rank (named tp-rank-N) has ended."""
    return f"tensor-parallel rank {proc.name.rsplit('-', 1)[1]} exited with code {proc.exitcode}"


class BusyClock:
    """A rank's time inside forward passes: between CUDA events on a GPU (a replayed graph runs after its launch
    has returned; the events are read once they have passed), by the host's clock on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.counted = 0.0
        self.pending: collections.deque = collections.deque()  # (start, end) events not read yet
        self._start = None

    def start(self) -> None:
        if self.cuda:
            self._start = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._start = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.pending.append((self._start, end))
        else:
            self.counted += time.perf_counter() - self._start

    def seconds(self) -> float:
        """Time counted so far: passes still on the device count once they have run."""
        while self.pending and self.pending[0][1].query():
            start, end = self.pending.popleft()
            self.counted += start.elapsed_time(end) / 1e3
        return self.counted


def _rank_device(config, rank: int) -> torch.device:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


def _init_group(world: int, rank: int, store: dist.TCPStore, device: torch.device, timeout: timedelta) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share one host: stay on loopback
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, world_size=world, rank=rank,
                            timeout=timeout)


def _store(world: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 (port 0) binds a free port itself and keeps it, so no other process can take it in between;
    the other ranks connect to that port."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=port == 0, timeout=START_TIMEOUT,
                         wait_for_workers=False)


def wait_for_ranks(store: dist.TCPStore, world: int, rank: int, failure, what: str = "loaded") -> None:
    """Say this rank has reached `what` (started: "up"; loaded its shard: "loaded"), and wait until every rank has,
    without the collectives' timeout: starting and loading can take longer, and collectives follow (the group's
    rendezvous; the runner's dry runs and graphs). `failure()` says why to stop waiting (a rank gone), if it
    should."""
    store.set(f"{what}/{rank}", "1")
    keys = [f"{what}/{r}" for r in range(world)]
    while True:
        try:
            store.wait(keys, timedelta(seconds=1))
            return
        except RuntimeError:  # not yet (DistStoreError: a timeout)
            if why := failure():
                raise RankFailedError(why)


def load_shard(config, world: int, rank: int):
    """Load this rank's shard of the model onto the rank's device, its slices only (engine/weights.py).

    Random weights: the rank draws them on its GPU (every tensor-parallel size gets the same numbers), refused first
    when they would not fit. A checkpoint: the rank reads its slices from the safetensors files on the CPU, then
    moves them (one whose files do not name the model's parameters is read whole, then sliced). The log gives the
    rank's peak resident memory."""
    from service.engine.config import resolve_dtype
    from service.engine.models import load_model, memory_limit

    device = _rank_device(config, rank)
    where = device if config.model.startswith("random:") else torch.device("cpu")
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    loaded = load_model(config.model, resolve_dtype(config.dtype, device), where, config.cache_dir,
                        config.seed, config.trust_remote_code, tokenizer=config.tokenizer,
                        shard=lambda model: shard_model(model, world, rank),
                        memory_limit=memory_limit(config.gpu_memory_utilization, device))
    loaded.model.to(device)
    log.info("rank %d of %d loaded its shard: peak resident memory %.0f MiB (%.0f MiB before)", rank, world,
             resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, before)
    return loaded


# -- rank 0 ---------------------------------------------------------------------------------------------
class TensorParallelGroup:
    """Rank 0's side: starts the other ranks, broadcasts each forward pass, watches the ranks' health."""

    REPORT_EVERY = 16  # forward passes between gathers of every rank's busy time

    def __init__(self, config):
        self.world = config.tensor_parallel_size
        timeout = COLLECTIVE_TIMEOUT
        self._store = _store(self.world)
        port = self._store.port
        ctx = multiprocessing.get_context("spawn")
        # forward passes each rank has finished, -1 while it loads (rank 0's entry unused): the watcher's sign that a
        # rank still answers
        self.finished = ctx.Array("q", [-1] * self.world, lock=False)
        self.hang_timeout = config.tensor_parallel_hang_timeout
        self.headers = Headers(ctx, self.world)
        self.procs = [ctx.Process(target=_worker, args=(config, self.world, r, port, os.getpid(), self.finished,
                                                        self.headers, timeout),
                                  name=f"tp-rank-{r}", daemon=True) for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        self.device = _rank_device(config, 0)
        try:
            wait_for_ranks(self._store, self.world, 0, self._exited, "up")
            _init_group(self.world, 0, self._store, self.device, timeout)
        except BaseException:  # the ranks would wait for rank 0 until their own timeout
            for p in self.procs:
                p.kill()
                p.join()
            raise
        self.failure: str | None = None  # why the group can no longer run, once a rank died
        self.on_failure = None  # called with that reason, from the watching thread
        self.clock = BusyClock(self.device)
        self._rank_seconds = [0.0] * self.world
        self._gathered = torch.zeros(self.world, dtype=torch.float64, pin_memory=self.clock.cuda)
        self._gathered_at = torch.cuda.Event() if self.clock.cuda else None
        self._calls = 0
        self._report = False
        self._closed = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def _exited(self) -> str | None:
        return next((_exit_reason(p) for p in self.procs if not p.is_alive()), None)

    def wait_for_ranks(self) -> None:
        """Once rank 0 has loaded its shard: wait for the other ranks' (RankFailedError if one exits meanwhile)."""
        wait_for_ranks(self._store, self.world, 0, lambda: self.failure)

    def link(self, runner) -> None:
        """Send every forward pass of rank 0's `runner` to the other ranks before it runs: its model's eager ones
        (hooks), and its graphs' replays (the runner calls send_replay). Called once every rank has built its runner,
        whose start-up passes (dry runs, graph captures) each rank runs for itself, in step."""
        global _driver
        _driver = self
        runner.model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        runner.model.register_forward_hook(self._after_forward)
        runner.parallel = self

    def _before_forward(self, module, args, kwargs):
        self._send(FORWARD, *forward_message(kwargs, attention._context.meta))

    def _after_forward(self, module, args, output):
        self.forward_done()
        return output

    def send_replay(self, kind: int, size: int, tables: tuple[int, int, int], inputs: list[torch.Tensor]) -> None:
        """Before rank 0 replays graph `size` of ladder `kind`: the graph's `inputs`, as filled, to the other ranks."""
        self._send(REPLAY, [kind, size, *tables], inputs)

    def _send(self, op: int, ints: list[int], tensors: list[torch.Tensor]) -> None:
        """A forward pass's header (`op`, whether to report, its integers `ints`) and its tensors, to the other ranks."""
        if self.failure:
            raise RankFailedError(self.failure)
        self._calls += 1  # counted before it is sent: a rank that hangs takes the broadcast down with it
        self._report = self._calls % self.REPORT_EVERY == 0
        try:
            self.headers.post([op, int(self._report), *ints], lambda: self.failure)
            dist.broadcast(_packed(tensors).to(self.device), src=0)
        except RankFailedError:
            raise
        except Exception as exc:  # the group is broken either way: the engine ends with this
            raise self.lost(exc) from exc
        self.clock.start()

    def forward_done(self) -> None:
        """After rank 0's forward pass (launched): count its time; every REPORT_EVERY passes, gather every rank's
        time, which rank_seconds reads once it has arrived (no wait for the device)."""
        self.clock.stop()
        if self._report:
            gathered = _gather_seconds(self.clock.seconds(), self.world, self.device)
            self._gathered.copy_(gathered, non_blocking=True)
            if self.clock.cuda:
                self._gathered_at.record()

    @property
    def rank_seconds(self) -> list[float]:
        """Each rank's time inside forward passes, as last gathered."""
        if self._calls >= self.REPORT_EVERY and (not self.clock.cuda or self._gathered_at.query()):
            self._rank_seconds = self._gathered.tolist()
        return self._rank_seconds

    def lost(self, exc: Exception, wait: float = 5.0) -> RankFailedError:
        """The error for a collective that failed: a rank's exit, named by the watcher once it has seen it
        (a collective can fail a moment before the dead process is reaped)."""
        deadline = time.monotonic() + wait
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return RankFailedError(self.failure or f"a tensor-parallel collective failed: {exc}")

    def _watch(self) -> None:
        """Fail the group when a rank exits, or when one has not finished the forward pass rank 0 sent it within
        hang_timeout (0: never) once it has loaded its shard: that rank is killed, which fails rank 0's collective
        at once over gloo (instead of after the collectives' timeout)."""
        sentinels = {p.sentinel: p for p in self.procs}
        behind: dict[int, tuple[float, int]] = {}  # rank -> since when it has been at this count, behind rank 0
        reason = None
        while reason is None:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=WATCH_PERIOD)
            if self._closed:
                return
            if ready:
                dead = sentinels[ready[0]]
                dead.join(5)  # the sentinel can fire before the exit status is collected: exitcode would read None
                reason = _exit_reason(dead)
                break
            now, sent = time.monotonic(), self._calls
            for rank, proc in enumerate(self.procs, start=1):
                done = self.finished[rank]
                if done < 0 or done >= sent or not self.hang_timeout:  # still loading, level with rank 0, or off
                    behind.pop(rank, None)
                    continue
                since, count = behind.get(rank, (now, done))
                if count != done:  # it moves on
                    since = now
                behind[rank] = since, done
                if now - since > self.hang_timeout:
                    reason = (f"tensor-parallel rank {rank} finished no forward pass in {self.hang_timeout:g} s "
                              "(hung); it is stopped")
                    proc.kill()
                    break
        self.failure = reason
        log.error("%s: the engine stops", self.failure)
        if self.on_failure is not None:
            self.on_failure(self.failure)

    def close(self) -> None:
        global _driver
        if self._closed:
            return
        self._closed = True
        if _driver is self:
            _driver = None
        if not self.failure:
            try:
                self.headers.post([STOP], lambda: self.failure or self._exited())
            except Exception:
                pass
        deadline = time.monotonic() + 5
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(5)  # reaped: a killed rank counts as alive until then
        if dist.is_initialized() and not self.failure:  # with a rank gone, tearing down could wait on it
            dist.destroy_process_group()


def _gather_seconds(own: float, world: int, device: torch.device) -> torch.Tensor:
    """Every rank's `own` seconds, on the device (each rank calls it)."""
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, to_device([own], torch.float64, device))
    return torch.cat(gathered)


# -- ranks 1..N-1 -----------------------------------------------------------------------------------------
def _worker(config, world: int, rank: int, port: int, parent: int, finished, headers: Headers,
            timeout: timedelta) -> None:
    """Load this rank's shard, build its runner as rank 0 builds its own (compiled layers, KV cache, CUDA graphs:
    the same start-up passes, in step), then run each forward pass rank 0 sends until it says stop."""
    from service.engine.runner import cuda_graphs
    from service.engine.runner.model_runner import ModelRunner
    from service.processes import die_with_parent

    die_with_parent()  # (it waits for rank 0's headers without a timeout)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    device = _rank_device(config, rank)
    store = _store(world, port)
    gone = lambda: None if os.getppid() == parent else "rank 0 is gone"
    wait_for_ranks(store, world, rank, gone, "up")
    _init_group(world, rank, store, device, timeout)
    loaded = load_shard(config, world, rank)
    wait_for_ranks(store, world, rank, gone)
    runner = ModelRunner(loaded.model, config, device, loaded.max_model_len)
    ladders = (runner.decode_graphs, runner.mixed_graphs)  # by their KIND
    clock = BusyClock(device)
    finished[rank] = 0  # ready: from now on the watcher expects each pass sent to finish
    with torch.inference_mode():
        while True:
            header = headers.take(rank)  # idle, no collective waits
            try:
                call = receive(header, device)
            except Exception as exc:  # rank 0 is gone: nothing left to serve
                log.error("rank 0 stopped answering (%s); exiting", exc)
                os._exit(1)
            if call is None:
                break
            if isinstance(call, Replay):
                graphs = ladders[call.kind]
                receive_replay(graphs.mirrored(call.size, call.tables), device)
                clock.start()
                cuda_graphs.replay(runner, graphs, call.size, call.tables)  # (its runner has no group: it sends none)
            else:
                clock.start()
                with forward_context(ForwardContext(runner.kv_caches, call.meta, runner.backend)):
                    runner.model(**call.kwargs, use_cache=False, logits_to_keep=1)
            clock.stop()
            finished[rank] += 1
            if call.report:
                _gather_seconds(clock.seconds(), world, device)
    # the graphs first: destroying a communicator waits until the CUDA graphs that captured its kernels are freed
    ladders = graphs = None
    runner.release()
    gc.collect()
    dist.destroy_process_group()
