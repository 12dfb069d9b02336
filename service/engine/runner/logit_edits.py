"""Everything that changes a step's logits before sampling, for the rows that ask, on the device: the logit bias,
then the penalties (repetition over prompt and output, as transformers defines it; frequency and presence over the
output, as OpenAI does), and min_tokens' bans on stop tokens (a banned logit stays -inf whatever comes after). The sampler calls `apply` on the
step's float32 logits before temperature, top-k and top-p, greedy rows alike, and `record` with the sampled tokens.

What each sequence needs lives in a slot of device tensors, filled from the host once, when the sequence first
samples (or again after its slot went to another: a preempted sequence's output counts are rebuilt from its tokens):
its penalties, its bias entries, which tokens its prompt holds, and how often each token appears in its output.
`record` adds each sampled token to its row's counts on the device, so the counts are right for the next step
even before the host has read the token back (overlap scheduling). A greedy step takes `argmax` instead: on CUDA the
row maximum's own kernels apply the bias, penalties and masks as they read the logits and count the chosen tokens,
so the edits add no launch to the step (runner/triton_sampling.py). Per step the host uploads only the rows' slot
indices; a step with no such row costs nothing here. Slots are reused on demand: a sequence that finished or waits
(preempted) gives its slot up when one is needed, never a sequence of the step being sampled.
"""

from typing import NamedTuple

import numpy as np
import torch

from service.engine.runner.pinned_upload import to_device
from service.engine.sampling import MAX_LOGIT_BIAS
from service.engine.sequence import Sequence, Status


_BYTE_BITS = (torch.arange(256).unsqueeze(1) >> torch.arange(8) & 1) == 0  # [byte, bit]: True where the bit is 0


class _Plan(NamedTuple):
    """What a step does for its edited rows, on the device; the next step reuses it while they hold the same
    sequences (steady decode), so such a step's host work is one comparison of the rows."""
    rows: list[int]
    mine: list[Sequence]
    size: int  # the step's rows, edited or not
    index: tuple[torch.Tensor, torch.Tensor]  # the rows, their slots
    row_slots: torch.Tensor | None  # [size] int64: each row's slot, -1 for a row without edits (CUDA: `argmax`)
    width: int  # the most bias entries of any row
    biased: tuple[torch.Tensor, torch.Tensor] | None  # (rows, slots) with a bias (the torch path's)
    penalized: tuple[torch.Tensor, torch.Tensor] | None  # (rows, slots) with a penalty
    repetition: bool  # any row with a repetition penalty
    ones: torch.Tensor  # [penalized rows] int32, what record adds


def mask_rows(rows: list[int], size: int) -> np.ndarray:
    """[size] int64: each of a step's `size` rows' row of the grammars' bitmask (`rows`: the masked rows, in the
    bitmask's order), -1 for a row without one: what `triton_sampling.row_max` takes."""
    mapped = np.full(size, -1, dtype=np.int64)
    mapped[rows] = np.arange(len(rows))
    return mapped


class LogitEdits:
    def __init__(self, device: torch.device, capacity: int):
        self.device, self.capacity = device, capacity  # slots: at least the most sequences a step samples
        self.owner: list[Sequence | None] = [None] * capacity
        self.free = list(range(capacity - 1, -1, -1))
        self.vocab = 0  # the tensors are made at first use, when the vocabulary is known
        self.triton = device.type == "cuda"
        self.kernels = None  # the Triton kernels (runner/triton_sampling.py), on CUDA (no Triton on a CPU)
        if self.triton:
            from service.engine.runner import triton_sampling
            self.kernels = triton_sampling
        self._plan: _Plan | None = None  # the last step's, reused while the edited rows hold the same sequences
        self._masked: tuple[list[int], torch.Tensor] | None = None  # the last step's masked rows, on the device
        self._mask_map: tuple[list[int], torch.Tensor] | None = None  # and each row's mask row (a greedy CUDA step)

    def _allocate(self, vocab: int) -> None:
        n, dev = self.capacity, self.device
        self.vocab = vocab
        self.counts = torch.zeros(n, vocab, dtype=torch.int32, device=dev)  # output tokens, by token id
        self.in_prompt = torch.zeros(n, vocab, dtype=torch.bool, device=dev)  # for the repetition penalty
        self.values = torch.zeros(n, 3, dtype=torch.float32, device=dev)  # presence, frequency, repetition
        self.bias_ids = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.long, device=dev)  # padding: token 0, bias 0
        self.bias_values = torch.zeros(n, MAX_LOGIT_BIAS, dtype=torch.float32, device=dev)

    # -- a step -----------------------------------------------------------------------------------------------
    def argmax(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], banned: list[tuple[int, int]],
               masks: "tuple[list[int], torch.Tensor] | None" = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A greedy step: each row's largest logit once edited as `apply` says (NaN if the row holds one) and the
        first token with it; the tokens of penalized rows counted (on CUDA those of every edited row, when
        one is penalized: the counts of a row without penalties are never read). On CUDA the bias, penalties and
        masks are applied by the row maximum's own two kernels (the edited logits are not stored; bans still are)."""
        plan = self.apply(logits, seqs, rows, banned, None if self.triton else masks, defer=self.triton)
        if self.triton:
            fused = None if plan is None else self.kernels.Fused(
                plan.row_slots, self.counts, self.in_prompt, self.values, self.bias_ids, self.bias_values, plan.width,
                plan.penalized is not None, plan.repetition)
            return self.kernels.row_max(logits, fused, masks and (self._mask_rows(masks[0], len(seqs)), masks[1]))
        top, tokens = logits.max(-1)
        if plan is not None:
            self.record(tokens, plan)
        return top, tokens

    def apply(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], banned: list[tuple[int, int]],
              masks: "tuple[list[int], torch.Tensor] | None" = None, defer: bool = False) -> "_Plan | None":
        """Edit `logits` [rows, vocab] in place (float32, or the model's dtype with the edits computed in float32):
        the bans (row, token), the grammars' `masks` (rows, bitmask [rows, words] on the device: -inf where a bit is
        0), then the bias and penalties of `rows` (indexes into `seqs`, whose sequences carry them). Bans and masks
        first change nothing: a -inf logit stays -inf through the bias and the penalties. `defer`: leave the bias
        and penalties to the caller's kernel (`argmax`). Returns what `record` needs, or None."""
        if banned:
            r, t = zip(*banned)
            logits[to_device(r, torch.long, self.device), to_device(t, torch.long, self.device)] = float("-inf")
        if masks is not None:
            self._mask(logits, *masks)
        if not rows:
            return None
        if self.vocab != logits.shape[1]:
            self._allocate(logits.shape[1])
        mine = seqs if len(rows) == len(seqs) else [seqs[i] for i in rows]  # every row: rows is 0, 1, ...
        plan = self._plan
        # steady decode keeps its plan: the same sequences in the same rows of a step of the same size
        if plan is None or plan.rows != rows or plan.mine != mine or plan.size != len(seqs):
            plan = self._plan = self._make_plan(rows, mine, seqs)
        if defer:
            return plan
        if self.triton:
            self.kernels.edit(logits, *plan.index, self.counts, self.in_prompt, self.values, self.bias_ids,
                 self.bias_values, plan.width, plan.penalized is not None, plan.repetition)
            return plan
        edited = logits if logits.dtype == torch.float32 else logits.float()
        if plan.width:
            r, sl = plan.biased
            edited.index_put_((r.unsqueeze(1).expand(-1, plan.width), self.bias_ids[sl, :plan.width]),
                              self.bias_values[sl, :plan.width], accumulate=True)
        if plan.penalized is not None:
            r, sl = plan.penalized
            edited.index_copy_(0, r, penalized(edited.index_select(0, r), self.counts.index_select(0, sl),
                                               self.in_prompt.index_select(0, sl) if plan.repetition else None,
                                               self.values.index_select(0, sl)))
        if edited is not logits:
            logits.copy_(edited)
        return plan

    def _mask_rows(self, rows: list[int], size: int) -> torch.Tensor:
        """`mask_rows` on the device (the last step's again while its rows and size stay)."""
        if self._mask_map is None or self._mask_map[0] != rows or len(self._mask_map[1]) != size:
            self._mask_map = rows, to_device(mask_rows(rows, size), torch.long, self.device)
        return self._mask_map[1]

    def _mask(self, logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
        if self._masked is None or self._masked[0] != rows:  # (steps in a row mostly mask the same rows)
            self._masked = rows, to_device(rows, torch.long, self.device)
        index = self._masked[1]
        if self.triton:
            self.kernels.mask(logits, index, bitmask)
            return
        # torch's ops, not xgrammar's CPU loop: that took 3 ms for 16 rows inside the engine (against 0.02 ms alone),
        # its threads fighting torch's still-spinning ones for two cores. Each byte of the words (little-endian: token
        # order) looks up its 8 flags
        banned = _BYTE_BITS[bitmask.view(torch.uint8).long()].view(len(rows), -1)[:, :logits.shape[1]]
        if len(rows) == logits.shape[0]:  # every row (rows are in order): in place
            logits.masked_fill_(banned, float("-inf"))
        else:
            logits[index] = logits[index].masked_fill(banned, float("-inf"))

    def record(self, tokens: torch.Tensor, plan: "_Plan") -> None:
        """The step's sampled `tokens` [rows] join the output counts of the penalized rows' sequences."""
        if plan.penalized is None:
            return
        r, sl = plan.penalized
        if self.triton:
            self.kernels.record(tokens, r, sl, self.counts)
        else:
            self.counts.view(-1).index_add_(0, sl * self.vocab + tokens.index_select(0, r), plan.ones)

    def _make_plan(self, rows: list[int], mine: list[Sequence], step: list[Sequence]) -> "_Plan":
        slots = self._slots(mine, step)
        dev = self.device
        both = to_device([rows, slots], torch.long, dev)
        index = both[0], both[1]

        def subset(which: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
            if len(which) == len(rows):
                return index
            picked = to_device([[rows[j] for j in which], [slots[j] for j in which]], torch.long, dev)
            return picked[0], picked[1]

        biased = [j for j, s in enumerate(mine) if s.params.logit_bias]
        width = max((len(mine[j].params.logit_bias) for j in biased), default=0)
        penalized_rows = [j for j, s in enumerate(mine) if s.params.presence_penalty or s.params.frequency_penalty
                          or s.params.repetition_penalty != 1]
        penalized = subset(penalized_rows) if penalized_rows else None
        row_slots = None
        if self.triton:
            row_slots = [-1] * len(step)
            for row, slot in zip(rows, slots):
                row_slots[row] = slot
            row_slots = to_device(row_slots, torch.long, dev)
        return _Plan(rows, mine, len(step), index, row_slots, width,
                     subset(biased) if biased and not self.triton else None, penalized,
                     any(mine[j].params.repetition_penalty != 1 for j in penalized_rows),
                     torch.ones(len(penalized_rows), dtype=torch.int32, device=dev))

    # -- slots ------------------------------------------------------------------------------------------------
    def _slots(self, mine: list[Sequence], step: list[Sequence]) -> list[int]:
        """Each sequence's slot; one without (new, or its slot was reused) takes a free one, filled from the host."""
        slots, new = [], []
        for seq in mine:
            slot = seq.edit_slot
            if slot < 0 or self.owner[slot] is not seq:
                if not self.free:
                    self._reclaim(step)
                slot = self.free.pop()
                self.owner[slot], seq.edit_slot = seq, slot
                new.append(seq)
            slots.append(slot)
        if new:
            self._fill(new)
        return slots

    def _reclaim(self, step: list[Sequence]) -> None:
        """Free the slots of sequences that finished, else of those that wait (preempted), but of none in `step`."""
        keep = set(map(id, step))
        for status in (Status.FINISHED, Status.WAITING):
            for slot, seq in enumerate(self.owner):
                if seq is not None and seq.status is status and id(seq) not in keep:
                    self.owner[slot] = None
                    self.free.append(slot)
            if self.free:
                return
        raise RuntimeError(f"{self.capacity} logit-edit slots cannot hold one step's sequences")

    def _fill(self, seqs: list[Sequence]) -> None:
        """Write the sequences' state into their new slots: penalties, bias, prompt tokens, output counts so far."""
        dev = self.device
        slots = to_device([s.edit_slot for s in seqs], torch.long, dev)
        self.values[slots] = to_device([[s.params.presence_penalty, s.params.frequency_penalty,
                                         s.params.repetition_penalty] for s in seqs], torch.float32, dev)
        self.counts[slots] = 0
        self.in_prompt[slots] = False
        self.bias_values[slots] = 0.0
        counted, prompt, bias = [[], []], [[], []], [[], [], []]
        for s in seqs:
            slot = s.edit_slot
            outputs = s.output_token_ids  # a sequence back from a preemption has some
            counted[0] += [slot] * len(outputs)
            counted[1] += outputs
            if s.params.repetition_penalty != 1:
                prompt[0] += [slot] * s.num_prompt_tokens
                prompt[1] += s.prompt_token_ids
            for k, (token, value) in enumerate((s.params.logit_bias or {}).items()):
                bias[0].append(slot * MAX_LOGIT_BIAS + k)
                bias[1].append(token)
                bias[2].append(value)
        if counted[1]:
            index = to_device(counted, torch.long, dev)
            self.counts.index_put_((index[0], index[1]), torch.ones(index.shape[1], dtype=torch.int32, device=dev),
                                   accumulate=True)
        if prompt[1]:
            index = to_device(prompt, torch.long, dev)
            self.in_prompt[index[0], index[1]] = True
        if bias[0]:
            at = to_device(bias[0], torch.long, dev)
            self.bias_ids.view(-1)[at] = to_device(bias[1], torch.long, dev)
            self.bias_values.view(-1)[at] = to_device(bias[2], torch.float32, dev)


def penalized(logits: torch.Tensor, counts: torch.Tensor, in_prompt: torch.Tensor | None,
              values: torch.Tensor) -> torch.Tensor:
    """The penalties on rows of `logits` [rows, vocab] float32, given each row's output `counts` (int), the tokens of
    its prompt (bool; None: no row has a repetition penalty) and its (presence, frequency, repetition) `values`."""
    c = counts.float()
    seen = c > 0
    if in_prompt is not None:
        scale = torch.where(seen | in_prompt, values[:, 2:3], 1.0)
        logits = torch.where(logits > 0, logits / scale, logits * scale)
    return logits - values[:, 1:2] * c - torch.where(seen, values[:, 0:1], 0.0)

