"""Iteration-level scheduler: each step mixes decode tokens with chunked prefill under a token budget.

Running sequences are served first, in admission order (save those whose last allowed token is
still on the device); waiting ones are admitted FIFO while the token budget, the sequence cap and
free blocks allow (a sample of an n > 1 request waits for its prompt's blocks to be cached, see `held`). When blocks run out, the most recently
admitted sequence is preempted: its blocks are freed and it is recomputed later.
Under load, new requests may wait a few decode steps so that they join the batch together (hold_admissions).
Each decision is a method of its own (chunk_size, hold_admissions, may_admit, admit, admission_reserve,
choose_victim, make_room); after the forward pass, advance and postprocess apply a step's results.
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
    # rows that decode: a running sequence (not admitted in this step) computing its newest token, which it samples
    num_decode: int = 0

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def phase(self) -> str:
        """decode (every row decodes: each samples, none computes prompt logprobs), prefill (none does) or mixed."""
        return "decode" if self.num_decode == len(self.seqs) else "prefill" if not self.num_decode else "mixed"


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 admission_wait_steps: int = 0):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission_wait_steps = admission_wait_steps
        self.held_steps = 0  # steps in a row that held admissions back
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> ScheduledBatch:
        """This step's batch: running sequences first, then admissions from the waiting queue."""
        batch = ScheduledBatch([], [], [])
        budget = self._schedule_running(batch, self.max_num_batched_tokens)
        if self.hold_admissions(batch, budget):
            self.held_steps += 1
            return batch
        self.held_steps = 0
        reserve = self.admission_reserve()
        while self.may_admit(batch, budget):
            admitted = self.admit(budget, reserve)
            if admitted is None:
                break
            seq, n = admitted
            batch.admitted.append(seq)
            batch.seqs.append(seq)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        """Add the running sequences in admission order while the budget lasts; return the budget left.

        Written without calls for a decoding sequence (one token to compute, a new block every block_size tokens):
        this runs for every sequence of every step."""
        running, seqs, counts = self.running, batch.seqs, batch.num_new_tokens
        i = decode = 0
        chunk_size, blocks_needed, block_size = self.chunk_size, self.blocks.blocks_needed, self.blocks.block_size
        while i < len(running) and budget > 0:
            seq = running[i]
            pending, computed = seq.num_pending_tokens, seq.num_computed_tokens
            total = len(seq.token_ids) + pending  # seq.num_tokens
            # its max_tokens-th token is still on the device (overlap): the host ends it on reading it back
            if pending and total - len(seq.prompt_token_ids) >= seq.params.max_tokens:
                i += 1
                continue
            if total - computed == 1 and total > len(seq.prompt_token_ids):  # it decodes (chunk_size: 1)
                n = 1
                if computed >= len(seq.block_table) * block_size and not self.make_room(seq, 1, batch):
                    break  # it was preempted itself: those after it in `running` were already
                decode += 1
            else:
                n = chunk_size(seq, budget)
                if blocks_needed(seq, n) and not self.make_room(seq, n, batch):
                    break
            seqs.append(seq)
            counts.append(n)
            budget -= n
            i += 1
        batch.num_decode = decode
        return budget

    # -- the policy's decisions ---------------------------------------------------------------------------
    @staticmethod
    def chunk_size(seq: Sequence, budget: int) -> int:
        """Tokens to compute for `seq` in this step: all it has not computed, up to the step's token budget."""
        return min(seq.num_tokens - seq.num_computed_tokens, budget)

    def choose_victim(self) -> Sequence:
        """Whom to preempt when blocks run out: the most recently admitted running sequence."""
        return self.running[-1]

    def make_room(self, seq: Sequence, num_new_tokens: int, batch: ScheduledBatch) -> bool:
        """Give running `seq` blocks for `num_new_tokens` tokens, preempting victims until they fit.

        Returns False if `seq` itself had to be preempted. Victims are added to `batch.preempted`.
        """
        if not self.blocks.blocks_needed(seq, num_new_tokens):  # most decode steps: nothing to allocate
            return True
        while not self.blocks.allocate(seq, num_new_tokens):
            victim = self.choose_victim()
            self.running.remove(victim)
            self._preempt(victim)
            batch.preempted.append(victim)
            if victim is seq:
                return False
        return True

    def hold_admissions(self, batch: ScheduledBatch, budget: int) -> bool:
        """Whether the waiting requests wait this step, so that later arrivals join the batch with them.

        A step that computes a prefill chunk beside the decodes cannot replay a decode graph, and on CUDA such a
        step costs the host about the same whatever its size: requests that arrive a few a step would make
        every step one. So, while the batch is under load (a quarter of max_num_seqs or more running) and all
        decode, waiting requests are held for up to admission_wait_steps steps in a row (TGI's
        max_waiting_tokens does the same), unless their tokens already fill the step's budget. Off with 0.
        """
        if not self.waiting or self.held_steps >= self.admission_wait_steps or batch.preempted:
            return False
        if len(self.running) < max(1, self.max_num_seqs // 4) or max(batch.num_new_tokens, default=0) > 1:
            return False  # light load, or a prefill chunk runs in this step anyway
        waiting_tokens = 0
        for seq in self.waiting:
            waiting_tokens += seq.num_tokens - seq.num_computed_tokens
            if waiting_tokens >= budget:
                return False
        return True

    def admission_reserve(self) -> int:
        """Blocks an admission must leave free, so that running sequences can grow without thrashing: one per
        running sequence, at most 1% of the cache."""
        return min(len(self.running), self.blocks.num_usable_blocks // 100)

    def may_admit(self, batch: ScheduledBatch, budget: int) -> bool:
        """Whether to try admitting another waiting sequence into `batch`: not after a preemption in this step
        (admitting now would evict again at once), and only within the token budget and the sequence cap."""
        return (not batch.preempted and bool(self.waiting) and budget > 0
                and len(self.running) < self.max_num_seqs)

    def held(self, seq: Sequence) -> bool:
        """Whether a waiting sample (n > 1) waits for its leader, sample 0 of the same prompt: while the leader runs
        and the prompt's full blocks are not all in the prefix cache yet. Admitted then, it finds them there and
        computes only the prompt's last partial block. (Without prefix caching every sample computes its prompt.)"""
        leader = seq.leader
        return (leader is not None and leader.status is Status.RUNNING and self.blocks.enable_prefix_caching
                and leader.num_hashed_blocks < (seq.num_prompt_tokens - 1) // self.blocks.block_size)

    def admit(self, budget: int, reserve: int) -> tuple[Sequence, int] | None:
        """Admit the first waiting sequence (FIFO) that is not held for its leader, if the blocks of its first
        chunk fit, leaving `reserve` free: reuse its cached prefix, and return it with its chunk size. If they do
        not fit, it stays in the queue holding no blocks, and None is returned."""
        waiting = self.waiting
        at = 0
        while self.held(waiting[at]):
            at += 1
            if at == len(waiting):
                return None
        seq = waiting[at]
        self.blocks.match_prefix(seq)
        n = self.chunk_size(seq, budget)
        if not self.blocks.allocate(seq, n, reserve=reserve):
            self.blocks.free_sequence(seq)
            seq.num_computed_tokens = 0
            return None
        del waiting[at]
        seq.status = Status.RUNNING
        self.running.append(seq)
        return seq, n

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
    def advance(self, batch: ScheduledBatch, sampled: list[Sequence]) -> None:
        """A step was launched: its tokens' keys and values are in the cache (or will be, in stream order),
        and each sequence that sampled has one more token, on the device until `postprocess` reads it. The full
        blocks of prompt chunks go into the prefix cache now, so that a request admitted at the next step (a
        sample of the same prompt) shares them."""
        if batch.num_decode == len(batch.seqs):  # every row computed and sampled one token
            for seq in batch.seqs:
                seq.num_computed_tokens += 1
                seq.num_pending_tokens += 1
            return
        commit = self.blocks.commit if self.blocks.enable_prefix_caching else None
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if n > 1 and commit is not None:
                commit(seq)
        for seq in sampled:
            seq.num_pending_tokens += 1

    def postprocess(self, batch: ScheduledBatch, sampled: list[Sequence], tokens: list[int],
                    check_stop: Callable[[Sequence, int], str | None],
                    may_stop=None) -> list[tuple[int, str | None]]:
        """A launched step's sampled tokens are back on the host: append them, register the full blocks, check
        each for a stop (only the rows `may_stop` marks, when given) and finish those that stopped (their blocks are
        freed).

        A sequence that finished since the launch (it stopped at the step before, found out a step late, or was
        aborted) drops its token. Returns, for each row of `sampled` whose sequence took its token, the row and
        the reason it finished (None: it goes on).
        """
        done, blocks = Status.FINISHED, self.blocks
        commit = blocks.commit if blocks.enable_prefix_caching else None
        if commit is not None and batch.num_decode != len(batch.seqs):  # a prompt chunk may fill blocks too
            blocks.commit_all(seq for seq in batch.seqs if seq.status is not done)
        block_size, taken = blocks.block_size, []
        for row, (seq, token) in enumerate(zip(sampled, tokens)):
            if seq.status is done:
                continue
            ids = seq.token_ids
            ids.append(token)
            seq.num_pending_tokens -= 1
            # register its full blocks (one in block_size tokens): every token they hold is known now (commit's own
            # test, written here: it runs for every row of every step)
            if commit is not None and min(seq.num_computed_tokens, len(ids)) // block_size > seq.num_hashed_blocks:
                commit(seq)
            reason = check_stop(seq, token) if may_stop is None or may_stop[row] else None
            if reason:
                self.finish(seq, reason)
            taken.append((row, reason))
        return taken

    def take_steps(self, sampled: list[Sequence], columns: list[list[int]],
                   going: list[bool]) -> tuple[list[int], list[int]]:
        """`postprocess` of several decode steps at once for the rows that `going` marks, whose tokens (`columns`: each
        row's, in order) the caller found none of them stops at: append them and register the full blocks. Returns
        the rows that took their tokens, and the rest, for `postprocess` step by step: those not marked, those that
        finished since the launch, and those whose first token is not taken yet."""
        running, blocks, taken, rest = Status.RUNNING, self.blocks, [], []
        commit = blocks.commit if blocks.enable_prefix_caching else None
        block_size = blocks.block_size
        for row, (seq, tokens, go) in enumerate(zip(sampled, columns, going)):
            if not go or seq.status is not running or seq.timings.first_token is None:
                rest.append(row)
                continue
            ids = seq.token_ids
            ids += tokens
            seq.num_pending_tokens -= len(tokens)
            if commit is not None and min(seq.num_computed_tokens, len(ids)) // block_size > seq.num_hashed_blocks:
                commit(seq)
            taken.append(row)
        return taken, rest

    def _preempt(self, seq: Sequence) -> None:
        self.blocks.free_sequence(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
