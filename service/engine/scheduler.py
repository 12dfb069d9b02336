"""Iteration-level scheduler: each step mixes decode tokens with chunked prefill under a token budget.

Running sequences are served first, in admission order (save those whose last allowed token is
still on the device); waiting ones are admitted FIFO while the token budget, the sequence cap and
free blocks allow. When blocks run out, the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later.
"""

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from service.engine.block_manager import BlockManager
from service.engine.sequence import Sequence, Status


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]  # tokens computed for each sequence in this step
    preempted: list[Sequence]
    admitted: list[Sequence] = field(default_factory=list)  # taken from the waiting queue in this step

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def phase(self) -> str:
        """prefill, decode or mixed; read before the step updates num_computed_tokens."""
        kinds = {"decode" if n == 1 and s.num_tokens > s.num_prompt_tokens and s.num_computed_tokens + 1 == s.num_tokens
                 else "prefill" for s, n in zip(self.seqs, self.num_new_tokens)}
        return kinds.pop() if len(kinds) == 1 else "mixed"


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending_tokens and self._sampled_last_token(seq):
                i += 1
                continue
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.blocks.allocate(seq, n):
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.seqs.append(seq)
                batch.num_new_tokens.append(n)
                budget -= n
                i += 1
                continue
            break
        # Admit only when nothing was preempted: admitting now would evict again at once.
        # Keep a few blocks in reserve so running sequences can grow without thrashing.
        reserve = min(len(self.running), self.blocks.num_usable_blocks // 100)
        while (not batch.preempted and self.waiting and budget > 0
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            self.blocks.match_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not self.blocks.allocate(seq, n, reserve=reserve):
                self.blocks.free_sequence(seq)
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            seq.status = Status.RUNNING
            self.running.append(seq)
            batch.admitted.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def finish(self, seq: Sequence, reason: str) -> None:
        """Remove a sequence (running or waiting) for good and free its blocks."""
        if seq.status is Status.RUNNING:
            self.running.remove(seq)
        elif seq.status is Status.WAITING:
            try:
                self.waiting.remove(seq)
            except ValueError:
                pass
        self.blocks.free_sequence(seq)
        seq.status = Status.FINISHED
        seq.finish_reason = reason

    # -- after the forward pass: the one place a step's results change the sequences ----------------------
    @staticmethod
    def advance(batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """A step was launched: its tokens' keys and values are in the cache (or will be, in stream order),
        and each sequence that sampled has one more token, on the device until `postprocess` reads it."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
        for seq in sampled:
            seq.num_pending_tokens += 1

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                    check_stop: Callable[[Sequence, int], str | None]) -> list[tuple[int, str | None]]:
        """A launched step's sampled tokens are back on the host: append them, register the full blocks, check
        each for a stop and finish those that stopped (their blocks are freed).

        A sequence that finished since the launch (it stopped at the step before, found out a step late, or was
        aborted) drops its token. Returns, for each row of `sampled` whose sequence took its token, the row and
        the reason it finished (None: it goes on).
        """
        done = Status.FINISHED
        for seq, token in zip(sampled, tokens):
            if seq.status is not done:
                seq.token_ids.append(token)
                seq.num_pending_tokens -= 1
        if self.blocks.enable_prefix_caching:  # register full blocks: every token they hold is known now
            for seq in batch.seqs:
                if seq.status is not done:
                    self.blocks.commit(seq)
        taken = []
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            if seq.status is done:
                continue
            reason = check_stop(seq, token)
            if reason:
                self.finish(seq, reason)
            taken.append((row, reason))
        return taken

    @staticmethod
    def _sampled_last_token(seq: Sequence) -> bool:
        """Its max_tokens-th token is still on the device (overlap): the host ends it on reading it back."""
        return seq.num_pending_tokens > 0 and seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
