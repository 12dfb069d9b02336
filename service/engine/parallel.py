"""Tensor parallelism: one model over N processes on one host (one per GPU; gloo ranks on CPU), rank 0 drives.

Sharding follows the model's own transformers tensor-parallel plan (`base_model_tp_plan`): "colwise"
projections keep a slice of their output features, "rowwise" ones a slice of their input features and
sum their partial outputs with an all-reduce. Attention is split by KV head (each rank keeps its KV heads
and the query heads of their groups), so each rank's paged KV cache holds only its own heads. Heads that
do not divide evenly are spread as evenly as whole groups allow (the default model's 3 KV heads: 2 + 1).

Lockstep: rank 0 runs the whole engine - API, scheduler, sampler, telemetry - and before each forward
pass broadcasts that pass's inputs (token ids, positions, attention metadata, which cache) as tensors: a
header and one byte buffer, no pickled objects (`send_forward`). The other ranks only run forward passes.
Broadcasting the inputs, rather than running identical schedulers on every rank, means nothing can drift:
seeds, aborts, disconnects and timing decisions happen once.
"""

import dataclasses
import fnmatch
import importlib
import logging
import math
import multiprocessing
import os
import resource
import threading
import time
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from service.engine.config import resolve_kv_dtype
from service.engine.errors import RankFailedError
from service.engine.runner import attention
from service.engine.runner.attention import AttentionMetadata, ForwardContext, forward_context
from service.engine.runner.kv_cache import cache_tensor, kv_shape
from service.engine.runner.pinned_upload import to_device

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a collective whose peer never answers fails within this
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
    try:
        dist.all_reduce(output)
    except Exception as exc:
        if _driver is None:  # another rank: its process ends with the error
            raise
        raise _driver.lost(exc) from exc
    return output


# -- what rank 0 sends before each forward pass: two tensor broadcasts, nothing pickled ---------------------
# A header of HEADER int64 (what kind of message, which KV cache, the metadata's integers, each tensor's dtype and
# shape), then one byte buffer holding the tensors one after another (each padded to 8 bytes, so that each views
# as its dtype). On CUDA both stay on the device: rank 0 packs its inputs there, NCCL moves them; only the other
# ranks read the header back, and they wait for rank 0 anyway.
KWARGS = ("input_ids", "position_ids")  # the model's tensor arguments
META_INTS = tuple(f.name for f in dataclasses.fields(AttentionMetadata) if f.type is int)
META_TENSORS = tuple(f.name for f in dataclasses.fields(AttentionMetadata) if f.name not in META_INTS)
TENSORS = KWARGS + META_TENSORS
DTYPES = (torch.int64, torch.int32, torch.bool)
BACKENDS = ((attention.__name__, "torch_paged_attention"),
            ("service.engine.runner.triton_attention", "triton_paged_attention"))
FIELDS = 4 + len(META_INTS)  # op, num_blocks, report, backend, the metadata's integers; then 3 per tensor
HEADER = FIELDS + 3 * len(TENSORS)
STOP, FORWARD = 0, 1


def send_forward(kwargs: dict, ctx: ForwardContext, report: bool, device: torch.device) -> None:
    """Rank 0: broadcast a forward pass's inputs (`kwargs` input_ids and position_ids, the attention metadata, which
    cache, which backend)."""
    meta = ctx.meta
    backend = BACKENDS.index((ctx.backend.__module__, ctx.backend.__name__))
    header = [FORWARD, ctx.kv_caches[0][0].shape[0], int(report), backend, *(getattr(meta, f) for f in META_INTS)]
    parts = []
    for name in TENSORS:
        t = kwargs[name] if name in KWARGS else getattr(meta, name)
        if t is None:
            header += [-1, 0, 0]
            continue
        assert t.dim() <= 2, name
        header += [DTYPES.index(t.dtype), t.shape[0], t.shape[1] if t.dim() == 2 else -1]
        data = t.contiguous().view(-1).view(torch.uint8)
        parts += [data, torch.zeros(-len(data) % 8, dtype=torch.uint8, device=data.device)]
    dist.broadcast(to_device(header, torch.int64, device), src=0)  # (pinned on CUDA: no wait for queued work)
    dist.broadcast(torch.cat(parts).to(device), src=0)


def send_stop(device: torch.device) -> None:
    dist.broadcast(to_device([STOP] + [0] * (HEADER - 1), torch.int64, device), src=0)


def receive_forward(device: torch.device) -> tuple[dict, AttentionMetadata, int, bool, object] | None:
    """Another rank: the next forward pass's (kwargs, metadata, cache's blocks, report, backend), or None: stop."""
    header = torch.empty(HEADER, dtype=torch.int64, device=device)
    dist.broadcast(header, src=0)
    h = header.tolist()
    if h[0] == STOP:
        return None
    pieces, size = [], 0  # (name, dtype, shape, offset, bytes) of each tensor sent; the buffer's size
    for k, name in enumerate(TENSORS):
        code, rows, cols = h[FIELDS + 3 * k:FIELDS + 3 * k + 3]
        if code >= 0:
            dtype, shape = DTYPES[code], (rows,) if cols < 0 else (rows, cols)
            nbytes = math.prod(shape) * dtype.itemsize
            pieces.append((name, dtype, shape, size, nbytes))
            size += -(-nbytes // 8) * 8
    payload = torch.empty(size, dtype=torch.uint8, device=device)
    dist.broadcast(payload, src=0)
    tensors = {name: payload[at:at + n].view(dtype).view(shape) for name, dtype, shape, at, n in pieces}
    kwargs = {name: tensors[name] for name in KWARGS}
    meta = AttentionMetadata(**{name: tensors.get(name) for name in META_TENSORS}, **dict(zip(META_INTS, h[4:FIELDS])))
    module, name = BACKENDS[h[3]]
    return kwargs, meta, h[1], bool(h[2]), getattr(importlib.import_module(module), name)


def _rank_device(config, rank: int) -> torch.device:
    device = config.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(f"cuda:{rank}") if device.startswith("cuda") else torch.device("cpu")


def _init_group(world: int, rank: int, store: dist.TCPStore, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks share one host: stay on loopback
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, world_size=world, rank=rank,
                            timeout=COLLECTIVE_TIMEOUT)


def _store(world: int, port: int = 0) -> dist.TCPStore:
    """Rank 0 (port 0) binds a free port itself and keeps it, so no other process can take it in between;
    the other ranks connect to that port."""
    return dist.TCPStore("127.0.0.1", port, world, is_master=port == 0, timeout=COLLECTIVE_TIMEOUT,
                         wait_for_workers=False)


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
        self._store = _store(self.world)
        port = self._store.port
        ctx = multiprocessing.get_context("spawn")
        # forward passes each rank has finished, -1 while it loads (rank 0's entry unused): the watcher's sign that a
        # rank still answers
        self.finished = ctx.Array("q", [-1] * self.world, lock=False)
        self.hang_timeout = config.tensor_parallel_hang_timeout
        self.procs = [ctx.Process(target=_worker, args=(config, self.world, r, port, os.getpid(), self.finished),
                                  name=f"tp-rank-{r}", daemon=True) for r in range(1, self.world)]
        for p in self.procs:
            p.start()
        self.device = _rank_device(config, 0)
        try:
            _init_group(self.world, 0, self._store, self.device)
        except BaseException:  # the ranks would wait for rank 0 until their own timeout
            for p in self.procs:
                p.kill()
                p.join()
            raise
        self.failure: str | None = None  # why the group can no longer run, once a rank died
        self.on_failure = None  # called with that reason, from the watching thread
        self.rank_seconds = [0.0] * self.world  # each rank's time inside forward passes, as last gathered
        self._own_seconds = 0.0
        self._calls = 0
        self._closed = False
        threading.Thread(target=self._watch, name="tp-watch", daemon=True).start()

    def link(self, model: torch.nn.Module) -> None:
        """Broadcast every forward pass of `model` (rank 0's shard) to the other ranks before it runs."""
        global _driver
        _driver = self
        model.register_forward_pre_hook(self._before_forward, with_kwargs=True)
        model.register_forward_hook(self._after_forward)

    def _before_forward(self, module, args, kwargs):
        if self.failure:
            raise RankFailedError(self.failure)
        self._calls += 1  # counted before it is sent: a rank that hangs takes the broadcast down with it
        self._report = self._calls % self.REPORT_EVERY == 0
        try:
            send_forward(kwargs, attention._context, self._report, self.device)
        except Exception as exc:  # the group is broken either way: the engine ends with this
            raise self.lost(exc) from exc
        self._start = time.perf_counter()
        return None

    def lost(self, exc: Exception, wait: float = 5.0) -> RankFailedError:
        """The error for a collective that failed: a rank's exit, named by the watcher once it has seen it
        (a collective can fail a moment before the dead process is reaped)."""
        deadline = time.monotonic() + wait
        while self.failure is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return RankFailedError(self.failure or f"a tensor-parallel collective failed: {exc}")

    def _after_forward(self, module, args, output):
        self._own_seconds += time.perf_counter() - self._start
        if self._report:
            self.rank_seconds = _gather_seconds(self._own_seconds, self.world, self.device)
        return output

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
                reason = f"tensor-parallel rank {dead.name.rsplit('-', 1)[1]} exited with code {dead.exitcode}"
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
                send_stop(self.device)
            except Exception:
                pass
        for p in self.procs:
            p.join(5)
            if p.is_alive():
                p.kill()
        if dist.is_initialized() and not self.failure:  # with a rank gone, tearing down could wait on it
            dist.destroy_process_group()


def _gather_seconds(own: float, world: int, device: torch.device) -> list[float]:
    values = torch.tensor([own], dtype=torch.float64, device=device)
    gathered = [torch.zeros(1, dtype=torch.float64, device=device) for _ in range(world)]
    dist.all_gather(gathered, values)
    return [float(t) for t in gathered]


# -- ranks 1..N-1 -----------------------------------------------------------------------------------------
def _worker(config, world: int, rank: int, port: int, parent: int, finished) -> None:
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s rank{rank} %(name)s: %(message)s")
    device = _rank_device(config, rank)
    _init_group(world, rank, _store(world, port), device)
    model = load_shard(config, world, rank).model
    if config.fuse_qkv:  # as rank 0's runner does with its shard
        from service.engine.fusion import fuse
        fuse(model)
    layers, kv_heads, head_dim = kv_shape(model.config)
    dtype = resolve_kv_dtype(config.kv_cache_dtype, next(model.parameters()).dtype)
    caches: dict[int, list] = {}
    busy = 0.0
    finished[rank] = 0  # loaded: from now on the watcher expects each pass sent to finish
    with torch.inference_mode():
        while True:
            try:
                call = receive_forward(device)
            except Exception as exc:  # rank 0 is gone: nothing left to serve
                log.error("rank 0 stopped answering (%s); exiting", exc)
                os._exit(1)
            if call is None:
                break
            kwargs, meta, num_blocks, report, backend = call
            if num_blocks not in caches:
                if len(caches) >= 2:  # the engine's cache and one throwaway: drop the oldest throwaway
                    caches.pop(next(k for k in caches if k != max(caches)))
                args = (num_blocks, config.block_size, kv_heads, head_dim, dtype, device)
                caches[num_blocks] = [(cache_tensor(*args), cache_tensor(*args)) for _ in range(layers)]
            start = time.perf_counter()
            with forward_context(ForwardContext(caches[num_blocks], meta, backend)):
                model(**kwargs, use_cache=False, logits_to_keep=1)
            busy += time.perf_counter() - start
            finished[rank] += 1
            if report:
                _gather_seconds(busy, world, device)
    dist.destroy_process_group()

