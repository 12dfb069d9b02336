"""Per-request sampling parameters and their validation."""

from dataclasses import dataclass, field

from service.engine.errors import InvalidRequestError
from service.engine.structured import StructuredOutput, check as check_structured

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
SEED_RANGE = (-2**63, 2**64)  # what torch.Generator.manual_seed takes
INT32 = 2**31  # counts beyond this (top_k, min_tokens) are no count any model can reach
MAX_LOGPROBS = 20  # the most top alternatives a token's logprobs may list (OpenAI's cap)
MAX_LOGIT_BIAS = 1024  # the most logit_bias entries a request may carry (vLLM's cap)
BIAS_RANGE = (-100.0, 100.0)  # logit_bias values are clamped into it (OpenAI's range)


@dataclass
class SamplingParams:
    max_tokens: int | None = 16  # None: up to the context length; 0: the prompt only (no output token)
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    min_tokens: int = 0
    ignore_eos: bool = False
    logprobs: int | None = None  # None: off; k: the sampled token's logprob and the k most likely
    prompt_logprobs: int | None = None  # None: off; k: each prompt token's logprob (but the first) and the k most likely
    skip_special_tokens: bool = True
    # edits of the logits before sampling (runner/logit_edits.py), in this order: the bias, then the penalties
    presence_penalty: float = 0.0  # OpenAI's: subtracted once from every token the output holds, in [-2, 2]
    frequency_penalty: float = 0.0  # OpenAI's: subtracted per occurrence in the output, in [-2, 2]
    repetition_penalty: float = 1.0  # transformers': logits of prompt and output tokens divided (> 0) or multiplied
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, clamped to BIAS_RANGE
    # the output must match a grammar (engine/structured.py); check_request validates it
    structured: StructuredOutput | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()
        if self.logit_bias:
            low, high = BIAS_RANGE
            self.logit_bias = {t: min(high, max(low, float(b))) for t, b in self.logit_bias.items()}
        else:
            self.logit_bias = None

    @property
    def edits_logits(self) -> bool:
        """Whether a bias or a penalty changes this request's logits before sampling."""
        return bool(self.logit_bias or self.presence_penalty or self.frequency_penalty
                    or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        # below GREEDY_BELOW, logits / temperature overflows to inf (and softmax to NaN): take the argmax
        return self.temperature < GREEDY_BELOW or self.top_k == 1

    def validate(self) -> None:
        def bad(param: str, message: str):
            raise InvalidRequestError(message, param=param)

        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 0):
            bad("max_tokens", f"max_tokens must be a non-negative integer, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0.0 <= self.temperature <= 100.0:
            bad("temperature", f"temperature must be between 0 and 100, got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0.0 < self.top_p <= 1.0:
            bad("top_p", f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or not 0 <= self.top_k < INT32:
            bad("top_k", f"top_k must be -1, 0 (off) or a positive integer below 2**31, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]):
            bad("seed", f"seed must be an integer in [-2**63, 2**64), got {self.seed!r}")
        if not all(isinstance(s, str) for s in self.stop):
            bad("stop", "stop must be a string or a list of strings")
        if any(s == "" for s in self.stop):
            bad("stop", "stop strings must not be empty")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "stop_token_ids must be a list of non-negative integers")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens < INT32:
            bad("min_tokens", f"min_tokens must be a non-negative integer below 2**31, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not -2.0 <= v <= 2.0:
                bad(name, f"{name} must be between -2 and 2, got {v!r}")
        r = self.repetition_penalty
        if not isinstance(r, (int, float)) or not 0.0 < r < float("inf"):
            bad("repetition_penalty", f"repetition_penalty must be a positive number, got {r!r}")
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict) or len(self.logit_bias) > MAX_LOGIT_BIAS:
                bad("logit_bias", f"logit_bias must map at most {MAX_LOGIT_BIAS} token ids to biases")
            for t, b in self.logit_bias.items():
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    bad("logit_bias", f"logit_bias keys must be token ids (non-negative integers), got {t!r}")
                if not isinstance(b, (int, float)) or b != b:
                    bad("logit_bias", f"logit_bias values must be numbers, got {b!r} for token {t}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not isinstance(k, int) or not 0 <= k <= MAX_LOGPROBS):
                bad(name, f"{name} must be an integer between 0 and {MAX_LOGPROBS}, got {k!r}")


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample `index` of a request seeded with `seed` (n > 1): the request's seed plus the index, kept
    in SEED_RANGE, so that sample 0 is the request with n = 1 and every sample reproduces."""
    if seed is None or index == 0:
        return seed
    low, high = SEED_RANGE
    return (seed + index - low) % (high - low) + low


def tokenize(tokenizer, prompt: str | list[int]) -> list[int]:
    """A prompt's token ids: text through the tokenizer (no special tokens added), ids as they are."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise InvalidRequestError("this model has no tokenizer: send token ids", param="prompt")
        return tokenizer.encode(prompt, add_special_tokens=False)
    return list(prompt)


def check_request(ids: list[int], params: SamplingParams, max_model_len: int, vocab_size: int,
                  has_tokenizer: bool) -> None:
    """Validate a tokenized request against the model (raises InvalidRequestError); fills in max_tokens when
    None (up to the context length). The front end calls it before a request goes to the engine."""
    if not ids:
        raise InvalidRequestError("the prompt is empty", param="prompt")
    if not all(isinstance(t, int) and 0 <= t < vocab_size for t in ids):
        raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab_size})", param="prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidRequestError(f"logit_bias names token {max(params.logit_bias)}, outside the vocabulary "
                                  f"[0, {vocab_size})", param="logit_bias")
    if not all(t < vocab_size for t in params.stop_token_ids):
        raise InvalidRequestError(f"stop_token_ids must be below the vocabulary size {vocab_size}",
                                  param="stop_token_ids")
    limit = max_model_len
    if params.max_tokens == 0:  # the prompt only (echo, prompt logprobs): it may fill the whole context
        if len(ids) > limit:
            raise InvalidRequestError(f"This model's maximum context length is {limit} tokens, but the prompt has "
                                      f"{len(ids)} tokens.", param="prompt")
    elif len(ids) >= limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens, but the prompt has {len(ids)} tokens; "
            f"at least one token must be left to generate.", param="prompt")
    if params.max_tokens is None:
        params.max_tokens = limit - len(ids)
        if params.min_tokens > params.max_tokens:
            raise InvalidRequestError(f"min_tokens ({params.min_tokens}) exceeds the {params.max_tokens} tokens "
                                      "left in the context after the prompt", param="min_tokens")
    elif len(ids) + params.max_tokens > limit:
        raise InvalidRequestError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
            f"completion). Please reduce the prompt or max_tokens.", param="max_tokens")
    if params.stop and not has_tokenizer:
        raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids", param="stop")
    if params.structured is not None:
        if not has_tokenizer:
            raise InvalidRequestError("structured output needs a tokenizer (a random: model takes one with "
                                      "--tokenizer)", param="response_format")
        check_structured(params.structured)
