"""Tensor parallelism: one model over N processes on one host (one per GPU; gloo ranks on CPU), rank 0 drives.

Sharding follows the model's own transformers tensor-parallel plan (`base_model_tp_plan`): "colwise"
projections keep a slice of their output features, "rowwise" ones a slice of their input features and
sum their partial outputs with an all-reduce. Attention is split by KV head (each rank keeps its KV heads
and the query heads of their groups), so each rank's paged KV cache holds only its own heads. Heads that
do not divide evenly are spread as evenly as whole groups allow (the default model's 3 KV heads: 2 + 1).

Lockstep: rank 0 runs the whole engine - API, scheduler, sampler, telemetry - and before each forward
pass broadcasts that pass's inputs (token ids, positions, attention metadata, which cache). The other
ranks only run forward passes. Broadcasting the inputs, rather than running identical schedulers on
every rank, means nothing can drift: seeds, aborts, disconnects and timing decisions happen once.
"""

import dataclasses
import fnmatch
import importlib
import logging
import multiprocessing
import os
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

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a rank that stops answering fails the step within this


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


def shard_model(model: torch.nn.Module, world: int, rank: int) -> None:
    """Keep this rank's slice of every projection in the model's tensor-parallel plan, in place."""
    config = model.config.get_text_config()
    plan = getattr(config, "base_model_tp_plan", None) or getattr(model.config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(f"{type(model).__name__} has no tensor-parallel plan in its transformers config")
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    (q0, q1), (k0, k1) = head_ranges(config, world, rank)
    base = model.base_model
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
            module.weight = torch.nn.Parameter(module.weight[lo:hi].contiguous(), requires_grad=False)
            if module.bias is not None:
                module.bias = torch.nn.Parameter(module.bias[lo:hi].contiguous(), requires_grad=False)
            module.out_features = hi - lo
        else:
            lo, hi = (q0 * head_dim, q1 * head_dim) if attn else _split(module.in_features, world, rank)
            module.weight = torch.nn.Parameter(module.weight[:, lo:hi].contiguous(), requires_grad=False)
            if module.bias is not None and rank != 0:
                module.bias = None  # added once, on rank 0, before the partial outputs are summed
            module.in_features = hi - lo
            module.register_forward_hook(_all_reduce_output)
    # the runner sizes this rank's KV cache from the config: local heads, explicit head_dim
    config.head_dim = head_dim
    config.num_attention_heads = q1 - q0
    config.num_key_value_heads = k1 - k0


_driver: "TensorParallelGroup | None" = None  # rank 0's group, which explains a collective that failed


def _all_reduce_output(module, inputs, output):
    try:
        dist.all_reduce(output)
    except Exception as exc:
        if _driver is None:  # another rank: its process ends with the error
            raise
        raise _driver.lost(exc) from exc
    return output


# -- what rank 0 sends before each forward pass ---------------------------------------------------------
@dataclasses.dataclass
class ForwardCall:
    kwargs: dict  # the model's keyword arguments (tensors on the CPU)
    meta: AttentionMetadata  # tensors on the CPU
    num_blocks: int  # which KV cache: the engine's, or a throwaway one (a memory-profiling dry run)
    backend: tuple[str, str]  # module and name of the attention backend
    report: bool  # gather every rank's time in forward passes after this one


def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if dataclasses.is_dataclass(obj):
        return dataclasses.replace(obj, **{f.name: _to(getattr(obj, f.name), device) for f in dataclasses.fields(obj)})
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


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
    """Load the whole model, keep this rank's shard, move it to the rank's device.

    A checkpoint is read on the CPU; random weights are drawn on the rank's GPU (the same seed gives every
    device the same numbers, and drawing billions of them on a CPU takes minutes)."""
    from service.engine.config import resolve_dtype
    from service.engine.models import load_model

    device = _rank_device(config, rank)
    where = device if config.model.startswith("random:") else torch.device("cpu")
    loaded = load_model(config.model, resolve_dtype(config.dtype, device), where, config.cache_dir,
                        config.seed, config.trust_remote_code, tokenizer=config.tokenizer)
    shard_model(loaded.model, world, rank)
    loaded.model.to(device)
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
        self.procs = [ctx.Process(target=_worker, args=(config, self.world, r, port, os.getpid()),
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
        ctx = attention._context
        self._calls += 1
        self._report = self._calls % self.REPORT_EVERY == 0
        backend = (ctx.backend.__module__, ctx.backend.__name__)
        call = ForwardCall(_to({**kwargs, "logits_to_keep": 1}, "cpu"), _to(ctx.meta, "cpu"),
                           ctx.kv_caches[0][0].shape[0], backend, self._report)
        try:
            dist.broadcast_object_list([call], src=0)
        except Exception as exc:
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
        sentinels = {p.sentinel: p for p in self.procs}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self._closed:
            return
        dead = sentinels[ready[0]]
        dead.join(5)  # the sentinel can fire before the exit status is collected: exitcode would read None
        self.failure = f"tensor-parallel rank {dead.name.rsplit('-', 1)[1]} exited with code {dead.exitcode}"
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
                dist.broadcast_object_list([None], src=0)
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
def _worker(config, world: int, rank: int, port: int, parent: int) -> None:
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
    with torch.inference_mode():
        while True:
            box = [None]
            try:
                dist.broadcast_object_list(box, src=0)
            except Exception as exc:  # rank 0 is gone: nothing left to serve
                log.error("rank 0 stopped answering (%s); exiting", exc)
                os._exit(1)
            call: ForwardCall | None = box[0]
            if call is None:
                break
            if call.num_blocks not in caches:
                if len(caches) >= 2:  # the engine's cache and one throwaway: drop the oldest throwaway
                    caches.pop(next(k for k in caches if k != max(caches)))
                args = (call.num_blocks, config.block_size, kv_heads, head_dim, dtype, device)
                caches[call.num_blocks] = [(cache_tensor(*args), cache_tensor(*args)) for _ in range(layers)]
            backend = getattr(importlib.import_module(call.backend[0]), call.backend[1])
            start = time.perf_counter()
            with forward_context(ForwardContext(caches[call.num_blocks], _to(call.meta, device), backend)):
                model(**_to(call.kwargs, device))
            busy += time.perf_counter() - start
            if call.report:
                _gather_seconds(busy, world, device)
    dist.destroy_process_group()

