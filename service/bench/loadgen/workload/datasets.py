"""Where the prompts of a load run come from: random lengths, the built-in set, or a ShareGPT JSON file.

A workload maps a request index to a sample deterministically from the seed, so the same seed gives the same
prompts and lengths however long the run is. The generator never needs the server's tokenizer: random prompts
are token ids (exact lengths, /v1/completions only) or random common words (about one token each, any
endpoint); the prompt tokens reported are the server's own `usage` counts.
"""

import json
import math
from dataclasses import dataclass

import numpy as np

from service.bench.loadgen.workload.prompts import BUILTIN_PROMPTS

# Common English words; with a leading space each is a single token in the usual BPE vocabularies.
WORDS = tuple("""the of and to in is was for on are with as his they be at one have this from or had by word but
what some we can out other were all there when up use your how said an each she which do their time if will way
about many then them write would like so these her long make thing see him two has look more day could go come did
number sound no most people my over know water than call first who may down side been now find any new work part
take get place made live where after back little only round man year came show every good me give our under name
very through just form sentence great think say help low line differ turn cause much mean before move right boy
old too same tell does set three want air well also play small end put home read hand port large spell add even
land here must big high such follow act why ask men change went light kind off need house picture try us again
animal point mother world near build self earth father head stand own page should country found answer school grow
study still learn plant cover food sun four between state keep eye never last let thought city tree cross farm hard
start might story saw far sea draw left late run while press close night real life few north""".split())


@dataclass(frozen=True)
class Sample:
    prompt: str | list[int]  # text, or token ids for /v1/completions
    output_len: int  # max_tokens to send
    prompt_len: int  # tokens: exact for token ids, an estimate for text (the server's usage is what is reported)
    # a mixed load (bench soak) shapes each request itself; the defaults leave the load's own settings in force
    endpoint: str | None = None  # instead of the load's endpoint
    stream: bool = True  # False: one JSON reply, its tokens all at once
    extra: dict | None = None  # merged into the body last, over the load's extra body
    timeout: float | None = None  # seconds before the client gives up, instead of the load's request timeout
    leave_after: int | None = None  # the client hangs up after this many data events (error kind client_left)


def estimate_tokens(text: str) -> int:
    """About 4 characters per token, the usual rule for English text in BPE vocabularies."""
    return max(1, math.ceil(len(text) / 4))


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """Inclusive [length * (1 - r), length * (1 + r)], at least 1 (vLLM's random dataset uses the same range)."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range ratio must be in [0, 1), got {range_ratio}")
    if length < 1:
        raise ValueError(f"lengths must be >= 1, got {length}")
    low = max(1, int(length * (1 - range_ratio)))
    return low, max(low, int(length * (1 + range_ratio)))


class RandomWorkload:
    """Prompts of random tokens (or words) with lengths uniform in a range around input_len and output_len."""

    def __init__(self, input_len: int, output_len: int, range_ratio: float = 0.0, seed: int = 0,
                 prompt_kind: str = "ids", id_range: tuple[int, int] = (1000, 10000), prefix_len: int = 0):
        if prompt_kind not in ("ids", "words"):
            raise ValueError(f"prompt kind is 'ids' or 'words', got {prompt_kind!r}")
        if not 0 <= id_range[0] < id_range[1]:
            raise ValueError(f"token id range must be LOW:HIGH with 0 <= LOW < HIGH, got {id_range}")
        self.input_range, self.output_range = length_range(input_len, range_ratio), length_range(output_len,
                                                                                                range_ratio)
        self.seed, self.prompt_kind, self.id_range = seed, prompt_kind, id_range
        self.prefix = self._tokens(np.random.default_rng([seed, 2**32 - 1]), prefix_len)

    def _tokens(self, rng: np.random.Generator, n: int) -> list:
        if self.prompt_kind == "ids":
            return rng.integers(self.id_range[0], self.id_range[1], n).tolist()
        return [WORDS[i] for i in rng.integers(0, len(WORDS), n)]

    def sample(self, i: int) -> Sample:
        rng = np.random.default_rng([self.seed, i])
        n_in = int(rng.integers(self.input_range[0], self.input_range[1] + 1))
        n_out = int(rng.integers(self.output_range[0], self.output_range[1] + 1))
        tokens = self.prefix + self._tokens(rng, n_in)
        prompt = tokens if self.prompt_kind == "ids" else " ".join(tokens)
        return Sample(prompt, n_out, len(tokens))


class ListWorkload:
    """A fixed list of samples, visited in a seeded random order; each pass over the list is shuffled anew."""

    def __init__(self, samples: list[Sample], seed: int = 0):
        if not samples:
            raise ValueError("the dataset holds no usable sample")
        self.samples, self.seed = samples, seed
        self._order: dict[int, np.ndarray] = {}

    def sample(self, i: int) -> Sample:
        n = len(self.samples)
        epoch = i // n
        if epoch not in self._order:
            self._order = {epoch: np.random.default_rng([self.seed, epoch]).permutation(n)}
        return self.samples[int(self._order[epoch][i % n])]


def builtin(output_len: int | None = None, seed: int = 0) -> ListWorkload:
    """The project's own prompt set (service/bench/loadgen/workload/prompts.py), with its output lengths unless overridden."""
    return ListWorkload([Sample(p, output_len or n, estimate_tokens(p)) for p, n in BUILTIN_PROMPTS], seed)


def _turns(entry: dict) -> list[str]:
    """The texts of a conversation's turns: ShareGPT {'from', 'value'} or OpenAI-style {'role', 'content'}."""
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages") or []
    return [t.get("value", t.get("content")) for t in turns if isinstance(t, dict)]


def sharegpt(path: str, output_len: int | None = None, seed: int = 0, max_prompt_len: int = 1024,
             max_total_len: int = 2048) -> ListWorkload:
    """First human turn as the prompt, the reply's length as max_tokens (unless output_len is given).

    Filtered as vLLM's benchmark does, with estimated token counts: prompt (and reply, when its length is
    used) of at least 4 tokens, prompt at most max_prompt_len, prompt + output at most max_total_len.
    """
    with open(path, encoding="utf-8") as f:
        entries = json.load(f)
    if not isinstance(entries, list):
        raise ValueError(f"{path}: a ShareGPT file is a JSON list of conversations")
    samples = []
    for entry in entries:
        turns = _turns(entry) if isinstance(entry, dict) else []
        if len(turns) < 2 or not all(isinstance(t, str) for t in turns[:2]):
            continue
        prompt_len, reply_len = estimate_tokens(turns[0]), estimate_tokens(turns[1])
        out = output_len or reply_len
        if prompt_len < 4 or (output_len is None and out < 4) or prompt_len > max_prompt_len or prompt_len + out > max_total_len:
            continue
        samples.append(Sample(turns[0], out, prompt_len))
    return ListWorkload(samples, seed)
