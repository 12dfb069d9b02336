"""A request's state inside the engine: its tokens, KV blocks, status and timings."""

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from service.engine.results import Timings
from service.engine.sampling import SamplingParams

if TYPE_CHECKING:  # a type only: naming a Sequence (or its Timings) loads no torch
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    status: Status = Status.WAITING
    token_ids: list[int] = field(init=False)  # prompt and the output tokens the host has read back
    num_pending_tokens: int = 0  # sampled on the device, not yet read back (overlap: one, or decode_steps)
    num_computed_tokens: int = 0  # tokens whose keys and values are in the cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache on last admission
    block_table: list[int] = field(default_factory=list)
    num_hashed_blocks: int = 0  # leading full blocks already registered in the prefix cache
    finish_reason: str | None = None
    num_preemptions: int = 0
    generator: "torch.Generator | None" = None  # per-request RNG when a seed is given
    # sample 0 of the same prompt (n > 1): this one waits to be admitted until the leader's prompt blocks are in the
    # prefix cache, so that the prompt is computed once (Scheduler.held)
    leader: "Sequence | None" = None
    # with params.prompt_logprobs: (logprob, top) of prompt tokens 1, 2, ... as the runner computes them
    prompt_logprobs: list | None = None
    edits_logits: bool = False  # a bias or penalty edits its logits (params.edits_logits, read once)
    # greedy with nothing for the sampler to edit, ban or report (no bias, penalty, logprobs, or stop tokens banned
    # before min_tokens): its row takes the plain argmax (runner/sampler.py; read once)
    plain: bool = False
    edit_slot: int = -1  # its slot in the sampler's LogitEdits, once it has one
    graph_row: int = 0  # its row of the decode graphs' block table (runner/cuda_graphs.TableRows), once it has one
    # when only EOS, its length and its grammar's verdict can end it (no stop token ids, not prompt-only): the token
    # count at which it ends for length (the engine sets it; -1: every token it samples is checked in full)
    length_at: int = -1
    # with params.structured (engine/structured.py): the grammar compiling (a Future) and since when, then the matcher
    # that takes each token it samples
    grammar: object = None
    grammar_since: float = 0.0
    matcher: object = None
    timings: Timings = field(default_factory=Timings)
    # detokenizer and stop-string state, owned by service.engine.detokenizer
    text: str = ""
    emitted_text_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    logprobs: list = field(default_factory=list)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.params is not None:
            if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
                self.prompt_logprobs = []
            p = self.params
            self.edits_logits = p.edits_logits
            bans = p.min_tokens and (p.stop_token_ids or not p.ignore_eos and self.eos_token_ids)
            self.plain = p.greedy and p.logprobs is None and not self.edits_logits and not bans

    @property
    def num_prompt_logprobs_missing(self) -> int:
        """Prompt tokens whose logprobs the runner has yet to compute (0 when none were asked for)."""
        if self.prompt_logprobs is None:
            return 0
        return len(self.prompt_token_ids) - 1 - len(self.prompt_logprobs)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Tokens the scheduler and the runner plan with: those read back and those still on the device."""
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Output tokens the host has read back (what the client has been or is being sent)."""
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED
