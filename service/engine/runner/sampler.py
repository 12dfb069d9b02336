"""Turns the last-position logits of a step into next tokens, per request parameters, on the device.

First the rows that ask get their logits edited (runner/logit_edits.py: min_tokens' bans, grammar masks, bias,
penalties).
Greedy rows take the argmax (a decode graph takes it already: a step of plain greedy rows, `Sequence.plain`,
launches nothing here). Other rows apply temperature, top-k and top-p, then draw with the
exponential race (argmax of p / Exp(1)), using the request's own generator when it has a seed so
that its output does not depend on what else is in the batch. Nothing here waits for the device:
the sampled ids stay there (the next step reads them as inputs) and are copied into pinned host memory
(`HostRing`) behind the step; `SampleResult.read` waits for that copy only when the host needs the ids.
"""

import operator
import time
from typing import Callable

import numpy as np
import torch

from service.engine.errors import RankFailedError
from service.engine.runner.logit_edits import LogitEdits
from service.engine.runner.pinned_upload import to_device
from service.engine.sequence import Sequence

# the least log-probability reported: a token the request's grammar or its bans rule out has -inf, which JSON cannot
# carry (a non-streamed answer failed to encode, a streamed one sent -Infinity); vLLM reports the same floor
LOGPROB_FLOOR = -9999.0


_plain = operator.attrgetter("plain")


class NonFiniteLogitsError(RuntimeError):
    """The forward pass produced NaN logits (an overflow, corrupt weights or cache); the step fails."""


class SampleResult:
    """One step's samples: `token_ids` on the device at once, on the host once `read` has waited."""

    def __init__(self, token_ids: torch.Tensor, top: torch.Tensor, logprob_rows: list[int], logprob_ks: list[int],
                 logprob_tensors: list[torch.Tensor], ring: "HostRing | None"):
        self.token_ids = token_ids  # [rows] int64 on the device
        # top: each row's largest logit, NaN where the row holds a NaN (the host looks, once it has the copy)
        self.logprob_rows, self.logprob_ks = logprob_rows, logprob_ks
        self._read = None
        self.waited = 0.0  # seconds `read` waited for the device (the host's idle time in the step)
        if ring is None:  # CPU: the values are already there
            self._host, self._event = [token_ids.numpy(), top.float().numpy(), *logprob_tensors], None
            return
        self._ring, self._slot, self._generation, self._event, self._host = ring, *ring.copy(token_ids, top,
                                                                                              logprob_tensors)

    def read(self, failure: Callable[[], str | None] | None = None) \
            -> tuple[list[int], list[tuple[float, list[tuple[int, float]]] | None]]:
        """Wait for the copy; the token ids, and (chosen logprob, top-k) per row where asked for (the same lists
        again when called again). With `failure` (tensor parallelism), the wait looks at it as it polls the copy and
        raises RankFailedError when it names a reason: a collective whose peer is gone never ends on the device."""
        if self._read is not None:
            return self._read
        self.waited = self.wait(failure)
        token_ids, top, *extra = self._host
        tokens = token_ids.tolist()
        if np.isnan(top).any():  # a NaN makes the argmax meaningless: fail the step rather than emit garbage
            raise NonFiniteLogitsError(f"the model produced NaN logits for {len(tokens)} sequences")
        logprobs = [None] * len(tokens)
        if self.logprob_rows:
            chosen, top_v, top_i = (t.tolist() for t in extra)
            for j, (row, k) in enumerate(zip(self.logprob_rows, self.logprob_ks)):
                logprobs[row] = (chosen[j], list(zip(top_i[j][:k], top_v[j][:k])))
        self._read = tokens, logprobs
        return self._read

    def wait(self, failure: Callable[[], str | None] | None = None) -> float:
        """Wait for the copy (`read`'s wait, for any thread: the masks' thread then takes the tokens from
        `token_array`); the seconds it waited."""
        if self._event is None:
            return 0.0
        begin = time.perf_counter()
        if failure is None:
            self._event.synchronize()
        else:
            while not self._event.query():
                if why := failure():
                    raise RankFailedError(why)
                time.sleep(0)  # (the watcher, which names the failure, gets the GIL)
        self._ring.check(self._slot, self._generation)
        return time.perf_counter() - begin

    def token_array(self) -> np.ndarray:
        """The token ids `read` returned, as the host's array: the ring's slot itself, to be read before the ring
        reuses it (a later launch's copy)."""
        return self._host[0]


class HostRing:
    """Pinned host memory for the samples' copies to the host, in `slots` slots used in turn: a step's copy goes into
    the next slot, on the compute stream right after its sampler (a few hundred bytes), so that no step allocates
    pinned memory or switches streams. A result is read one launch later at most (overlap; a launch of several
    decode steps takes a slot for each), long before its slot comes round again; `check` says if one was not. Logprob
    tensors (rare) are copied into pinned memory of their own."""

    def __init__(self, rows: int, slots: int = 4):
        self.slots = slots
        self.tokens = torch.empty(slots, rows, dtype=torch.int64, pin_memory=True)
        self.tops = torch.empty(slots, rows, dtype=torch.float32, pin_memory=True)
        self.tokens_np, self.tops_np = self.tokens.numpy(), self.tops.numpy()
        self.events = [torch.cuda.Event() for _ in range(slots)]
        self.generations = [0] * slots
        self.turn = 0

    def copy(self, token_ids: torch.Tensor, top: torch.Tensor, extra: list[torch.Tensor]):
        """Queue the copies of one step's samples: (slot, its generation, the event after the copies, host arrays)."""
        i = self.turn
        self.turn = (i + 1) % self.slots
        self.generations[i] += 1
        n = len(token_ids)
        self.tokens[i, :n].copy_(token_ids, non_blocking=True)
        self.tops[i, :n].copy_(top, non_blocking=True)
        host = [self.tokens_np[i, :n], self.tops_np[i, :n]]
        for t in extra:
            copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            copy.copy_(t, non_blocking=True)
            host.append(copy)
        self.events[i].record()
        return i, self.generations[i], self.events[i], host

    def check(self, slot: int, generation: int) -> None:
        if self.generations[slot] != generation:
            raise RuntimeError("a step's samples were read after their pinned slot was reused")


class Sampler:
    def __init__(self, device: torch.device, seed: int = 0, max_num_seqs: int = 256, decode_steps: int = 1):
        self.device = device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        # two launches of decode_steps steps each in flight (overlap), and room to spare
        self.ring = HostRing(max_num_seqs, max(4, 2 * decode_steps + 2)) if device.type == "cuda" else None
        # the one place logits change before sampling, and greedy steps' argmax: on CUDA a kernel that spreads each
        # row over the SMs (engine/runner/triton_sampling.py: PyTorch's reduction reads a row on one SM, 28-41 us for
        # 128,256 logits on the H100)
        self.edits = LogitEdits(device, max_num_seqs)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence],
                 masks: "tuple[list[int], torch.Tensor] | None" = None,
                 argmax: tuple[torch.Tensor, torch.Tensor] | None = None,
                 masked: "Callable[[list[int], torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None" = None) \
            -> SampleResult:
        """Sample a token per row of `logits` [len(seqs), vocab]; `masks` (rows, bitmask): the grammars' allowed
        tokens of constrained rows (engine/structured.py), the bitmask on the device or in pinned host memory;
        `argmax`: the rows' (maxima, argmax) as `LogitEdits.argmax` gives them unedited, when a CUDA graph took them
        already; `masked(rows, bitmask)`: that graph's (maxima, argmax) with `masks` applied
        (cuda_graphs.DecodeGraphs.masked_max), for a step whose rows are all plain."""
        if all(map(_plain, seqs)):  # plain greedy rows: nothing to edit, ban or report
            banned, wanted, edited, all_greedy = [], [], [], True
            if masks is not None and masked is not None:
                argmax, masks = masked(*masks), None
        else:
            banned, wanted, edited, all_greedy = self._scan(seqs)
        if masks is not None or edited or banned:
            argmax = None  # (the graph's is of the logits unedited)
        if masks is not None and masks[1].device.type != self.device.type:  # (pinned host memory, behind the gate)
            masks = masks[0], masks[1].to(self.device, non_blocking=True)
        if all_greedy and not wanted:
            # argmax is the same in the model's dtype: skip the float copy of [rows, vocab] (edits are computed in
            # float32 as the logits are read). max propagates NaN, so the row maxima tell whether any logit was NaN:
            # one pass over the logits instead of two
            top, tokens = argmax or self.edits.argmax(logits, seqs, edited, banned, masks)
            return SampleResult(tokens, top, [], [], [], self.ring)
        top = logits.amax(-1)  # NaN where a row holds one, read back with the tokens: no extra device sync
        logits = logits.float()
        recorded = self.edits.apply(logits, seqs, edited, banned, masks) if edited or banned or masks else None
        tokens = logits.argmax(-1) if all_greedy else self._sample(logits, seqs, [s.params.greedy for s in seqs])
        if recorded is not None:
            self.edits.record(tokens, recorded)
        extra, ks = [], []
        if wanted:
            index = to_device(wanted, torch.long, self.device)
            lp = torch.log_softmax(logits.index_select(0, index), -1).clamp_(min=LOGPROB_FLOOR)
            ks = [seqs[i].params.logprobs for i in wanted]
            top_v, top_i = lp.topk(max(max(ks), 1), -1)
            chosen = lp.gather(1, tokens.index_select(0, index).unsqueeze(1)).squeeze(1)
            extra = [chosen, top_v, top_i]
        return SampleResult(tokens, top, wanted, ks, extra, self.ring)

    @staticmethod
    def _scan(seqs: list[Sequence]) -> tuple[list[tuple[int, int]], list[int], list[int], bool]:
        """One pass over the rows (a step's host time grows with each): the (row, token) pairs that may not be
        sampled yet (stop and EOS tokens before min_tokens), the rows that want logprobs, the rows whose bias or
        penalties edit their logits, and whether every row is greedy."""
        bans, wanted, edited, all_greedy = [], [], [], True
        for i, s in enumerate(seqs):
            if s.plain:  # greedy, and nothing to ban, report or edit
                continue
            p = s.params
            # tokens on the device count; a grammar decides for itself when the output may end
            if p.min_tokens and s.num_tokens - s.num_prompt_tokens < p.min_tokens and s.matcher is None:
                stop = p.stop_token_ids if p.ignore_eos else [*p.stop_token_ids, *s.eos_token_ids]
                bans += [(i, t) for t in set(stop)]
            if p.logprobs is not None:
                wanted.append(i)
            if s.edits_logits:
                edited.append(i)
            if all_greedy and not p.greedy:
                all_greedy = False
        return bans, wanted, edited, all_greedy

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        temps = to_device([1.0 if g else s.params.temperature for s, g in zip(seqs, greedy)], torch.float32, dev)
        logits = logits / temps.unsqueeze(1)
        top_k = [s.params.top_k for s in seqs]
        top_p = [s.params.top_p for s in seqs]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            logits = self._top_k_top_p(logits, top_k, top_p)
        probs = logits.softmax(-1)
        noise = torch.empty_like(probs)
        shared = [i for i, s in enumerate(seqs) if s.generator is None]
        if shared:
            noise[to_device(shared, torch.long, dev)] = torch.empty(
                (len(shared), probs.shape[1]), device=dev).exponential_(generator=self.generator)
        for i, s in enumerate(seqs):
            if s.generator is not None:
                noise[i].exponential_(generator=s.generator)
        sampled = (probs / noise).argmax(-1)
        if any(greedy):
            sampled = torch.where(to_device(greedy, torch.bool, dev), logits.argmax(-1), sampled)
        return sampled

    @staticmethod
    def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        sorted_logits, order = logits.sort(-1, descending=True)
        vocab, dev = logits.shape[1], logits.device
        ks = to_device([k if k > 0 else vocab for k in top_k], torch.long, dev)
        ranks = torch.arange(vocab, device=dev)
        cut = ranks.unsqueeze(0) >= ks.unsqueeze(1)
        probs = sorted_logits.masked_fill(cut, float("-inf")).softmax(-1)
        before = probs.cumsum(-1) - probs  # mass of the tokens ranked above each token
        cut |= before >= to_device(top_p, torch.float32, dev).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(cut, float("-inf"))
        return torch.empty_like(logits).scatter_(1, order, sorted_logits)
