"""Properties of the paged KV bookkeeping under random workloads, with preemption and aborts."""

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from service.engine.block_manager import BlockManager
from service.engine.sampling import SamplingParams
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import Sequence, Status


def run_step(sched: Scheduler, token: int) -> tuple[ScheduledBatch, list[Sequence]]:
    """One step as the engine runs it, without a model: schedule, advance, every sample is `token`, postprocess.

    The sequences that sample are those whose step reaches their last known token, as in the model runner.
    Returns the batch and the sequences that finished (at max_tokens).
    """
    batch = sched.schedule()
    sampled = [s for s, k in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + k == s.num_tokens]
    sched.advance(batch, sampled)
    at_length = lambda seq, _: "length" if seq.num_output_tokens >= seq.params.max_tokens else None
    taken = sched.postprocess(batch, sampled, [token] * len(sampled), at_length)
    return batch, [sampled[row] for row, reason in taken if reason]


def check_invariants(blocks: BlockManager, live: list[Sequence]) -> None:
    owners: dict[int, list[Sequence]] = {}
    for seq in live:
        assert len(set(seq.block_table)) == len(seq.block_table), "a block twice in one table"
        assert 0 not in seq.block_table, "the scratch block was handed out"
        for b in seq.block_table:
            owners.setdefault(b, []).append(seq)
    for b in range(1, blocks.num_usable_blocks + 1):
        holders = owners.get(b, [])
        assert blocks.ref_count[b] == len(holders)
        assert (b in blocks.free) == (not holders)
        if len(holders) > 1:  # only a shared prefix block may have several owners
            i = holders[0].block_table.index(b)
            assert blocks.block_hash[b] is not None
            assert all(h.block_table.index(b) == i for h in holders)
            assert all(h.token_ids[:(i + 1) * 16] == holders[0].token_ids[:(i + 1) * 16] for h in holders)
            assert all(h.num_computed_tokens >= (i + 1) * 16 for h in holders)


ops = st.lists(st.tuples(st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
                         st.integers(0, 10**6)), min_size=1, max_size=80)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(4, 40), budget=st.integers(1, 64), prefix=st.booleans())
def test_scheduler_and_blocks_never_leak_or_double_own(ops, num_blocks, budget, prefix):
    blocks = BlockManager(num_blocks, 16, enable_prefix_caching=prefix)
    sched = Scheduler(blocks, max_num_seqs=6, max_num_batched_tokens=budget)
    live: list[Sequence] = []
    shared_prefix = list(range(40))  # many prompts start alike, so prefix blocks get shared
    for n, (op, r) in enumerate(ops):
        rng = random.Random(r)
        if op == "add":
            cap = (num_blocks - 1) * 16
            length = rng.randint(1, min(60, cap - 8))
            prompt = (shared_prefix + [rng.randrange(100) for _ in range(length)])[:length] if rng.random() < .5 \
                else [rng.randrange(100) for _ in range(length)]
            seq = Sequence(f"r{n}", prompt, SamplingParams(max_tokens=min(8, cap - length)))
            sched.add(seq)
            live.append(seq)
        elif op == "abort" and live:
            seq = live.pop(rng.randrange(len(live)))
            sched.finish(seq, "abort")
        elif op == "step":
            batch, finished = run_step(sched, rng.randrange(100))
            assert all(k >= 1 for k in batch.num_new_tokens)
            for seq in finished:
                live.remove(seq)
            assert sum(batch.num_new_tokens) <= budget
        check_invariants(blocks, [s for s in live if s.status is Status.RUNNING])
        assert all(not s.block_table for s in live if s.status is Status.WAITING)
    for seq in list(live):
        sched.finish(seq, "abort")
    assert blocks.num_free_blocks == blocks.num_usable_blocks
    assert not sched.running and not sched.waiting


def test_everything_finishes_when_blocks_are_scarce():
    """With room for one sequence at a time, preemption still lets every request finish (no livelock)."""
    blocks = BlockManager(5, 16)
    sched = Scheduler(blocks, max_num_seqs=4, max_num_batched_tokens=32)
    seqs = [Sequence(f"r{i}", list(range(i, i + 30)), SamplingParams(max_tokens=30)) for i in range(4)]
    for s in seqs:
        sched.add(s)
    for _ in range(2000):
        if not sched.has_work():
            break
        run_step(sched, 1)
    assert all(s.finish_reason == "length" for s in seqs)
    assert sched.num_preemptions > 0
    assert blocks.num_free_blocks == blocks.num_usable_blocks
