"""The scheduler's policy decisions, called one at a time: chunk size, whom to admit, whom to preempt."""

from service.engine.block_manager import BlockManager
from service.engine.sampling import SamplingParams
from service.engine.scheduler import ScheduledBatch, Scheduler
from service.engine.sequence import Sequence, Status


def seq(name: str, length: int) -> Sequence:
    return Sequence(name, list(range(length)), SamplingParams(max_tokens=4))


def scheduler(num_blocks: int, max_num_seqs: int = 8) -> Scheduler:
    return Scheduler(BlockManager(num_blocks, 16, enable_prefix_caching=False), max_num_seqs, 64)


def test_chunk_is_what_is_left_to_compute_up_to_the_budget():
    s = seq("a", 30)
    assert Scheduler.chunk_size(s, 64) == 30
    assert Scheduler.chunk_size(s, 16) == 16
    s.num_computed_tokens = 16
    assert Scheduler.chunk_size(s, 64) == 14


def test_admission_is_first_come_first_served_with_the_first_chunk():
    sched = scheduler(10)
    a, b = seq("a", 40), seq("b", 5)
    sched.add(a)
    sched.add(b)
    assert sched.admit(budget=20, reserve=0) == (a, 20)
    assert a.status is Status.RUNNING and len(a.block_table) == 2
    assert list(sched.waiting) == [b] and sched.running == [a]


def test_a_waiting_request_whose_blocks_do_not_fit_stays_at_the_head_holding_none():
    sched = scheduler(4)  # 3 usable blocks
    a = seq("a", 40)  # needs 3 blocks
    sched.add(a)
    assert sched.admit(budget=64, reserve=1) is None
    assert list(sched.waiting) == [a] and a.status is Status.WAITING
    assert a.block_table == [] and a.num_computed_tokens == 0
    assert sched.blocks.num_free_blocks == 3


def test_reserve_is_one_block_per_running_sequence_up_to_a_hundredth_of_the_cache():
    sched = scheduler(301)  # 300 usable blocks: at most 3 in reserve
    assert sched.admission_reserve() == 0
    for i in range(5):
        sched.add(seq(f"r{i}", 4))
        sched.admit(budget=64, reserve=0)
    assert len(sched.running) == 5 and sched.admission_reserve() == 3


def test_no_admission_after_a_preemption_over_the_budget_or_at_the_sequence_cap():
    sched = scheduler(10, max_num_seqs=1)
    sched.add(seq("a", 4))
    assert sched.may_admit(ScheduledBatch([], [], []), budget=1)
    assert not sched.may_admit(ScheduledBatch([], [], [seq("x", 4)]), budget=64)
    assert not sched.may_admit(ScheduledBatch([], [], []), budget=0)
    sched.admit(budget=64, reserve=0)
    sched.add(seq("b", 4))
    assert not sched.may_admit(ScheduledBatch([], [], []), budget=64)


def test_the_most_recently_admitted_is_preempted_until_the_blocks_fit():
    sched = scheduler(5)  # 4 usable blocks
    a, b, c = seq("a", 16), seq("b", 16), seq("c", 16)
    for s in (a, b, c):
        sched.add(s)
        sched.admit(budget=16, reserve=0)
    assert sched.choose_victim() is c
    a.num_computed_tokens = 16
    batch = ScheduledBatch([], [], [])
    assert sched.make_room(a, 32, batch)  # a needs 2 more blocks: 1 is free, c's is taken
    assert batch.preempted == [c] and sched.running == [a, b] and len(a.block_table) == 3
    assert list(sched.waiting) == [c] and c.status is Status.WAITING and c.block_table == []


def test_a_sequence_that_must_preempt_itself_reports_it():
    sched = scheduler(3)  # 2 usable blocks
    a = seq("a", 32)
    sched.add(a)
    sched.admit(budget=32, reserve=0)
    a.num_computed_tokens = 32
    batch = ScheduledBatch([], [], [])
    assert not sched.make_room(a, 1, batch)
    assert batch.preempted == [a] and sched.running == [] and list(sched.waiting) == [a]


def _step(sched: Scheduler) -> ScheduledBatch:
    """Schedule a step and apply it as the engine does, every sampled token being 7 (no stop)."""
    batch = sched.schedule()
    sampled = [s for s, n in zip(batch.seqs, batch.num_new_tokens) if s.num_computed_tokens + n == s.num_tokens]
    sched.advance(batch, sampled)
    sched.postprocess(batch, sampled, [7] * len(sampled), lambda s, t: None)
    return batch


def _decoding(wait_steps: int, max_num_seqs: int = 8, running: int = 2) -> Scheduler:
    sched = Scheduler(BlockManager(64, 16, enable_prefix_caching=False), max_num_seqs, 64, wait_steps)
    for i in range(running):
        sched.add(seq(f"r{i}", 4))
    assert [b.phase for b in (_step(sched), _step(sched))] == ["prefill", "decode"]
    return sched


def test_under_load_arrivals_wait_a_few_decode_steps_then_join_together():
    sched = _decoding(wait_steps=2)  # 2 running of at most 8: under load (a quarter or more)
    sched.add(seq("a", 10))
    first = _step(sched)
    assert [s.request_id for s in first.seqs] == ["r0", "r1"] and first.phase == "decode" and sched.held_steps == 1
    sched.add(seq("b", 10))
    second = _step(sched)
    assert [s.request_id for s in second.seqs] == ["r0", "r1"] and sched.held_steps == 2
    joined = _step(sched)  # the third step: both join at once
    assert [s.request_id for s in joined.admitted] == ["a", "b"] and joined.phase == "mixed"
    assert sched.held_steps == 0 and not sched.waiting


def test_arrivals_that_fill_the_budget_light_load_or_a_prefill_in_the_step_are_not_held():
    sched = _decoding(wait_steps=8)
    sched.add(seq("big", 70))  # more than the 62 tokens left beside the two decodes
    assert _step(sched).admitted and sched.held_steps == 0
    light = _decoding(wait_steps=8, max_num_seqs=16, running=3)  # 3 running of at most 16: under a quarter
    light.add(seq("a", 4))
    assert _step(light).admitted
    off = _decoding(wait_steps=0)  # the CPU default
    off.add(seq("a", 4))
    assert _step(off).admitted
    chunked = _decoding(wait_steps=8)
    batch = ScheduledBatch([], [], [])
    chunked._schedule_running(batch, 64)
    chunked.add(seq("a", 4))
    assert not chunked.hold_admissions(ScheduledBatch(batch.seqs, [1, 5], []), budget=58)  # a chunk runs anyway
    assert chunked.hold_admissions(batch, budget=62)
