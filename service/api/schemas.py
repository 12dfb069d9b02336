"""Request bodies of every route, as pydantic models (responses are plain dicts in OpenAI's shapes)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.errors import bad_request
from service.engine.sampling import SamplingParams

MAX_N = 128  # samples per prompt (OpenAI's own cap)
MAX_PROMPTS = 2048  # prompts in one /v1/completions request (and prompts x n may not exceed --max-waiting)


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields every generation route shares; unsupported OpenAI options are rejected, not ignored."""

    model_config = ConfigDict(extra="ignore")

    temperature: float | None = Field(1.0, description="0 means greedy")
    top_p: float | None = 1.0
    top_k: int | None = Field(None, description="extension: keep the k most likely tokens (-1 or 0: off)")
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="extension")
    min_tokens: int = Field(0, description="extension")
    ignore_eos: bool = Field(False, description="extension, for benchmarks")
    n: int | None = Field(1, description=f"samples per prompt, 1 to {MAX_N}")
    presence_penalty: float | None = Field(0.0, description="-2 to 2: lowers the logit of every token the output "
                                           "already holds, once")
    frequency_penalty: float | None = Field(0.0, description="-2 to 2: lowers a token's logit per time the output "
                                            "holds it")
    repetition_penalty: float | None = Field(1.0, description="extension, > 0: divides the positive logits (and "
                                             "multiplies the negative) of tokens in the prompt or output")
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> added to its logit, "
                                                "clamped to [-100, 100]; at most 1024 entries")
    user: str | dict | None = Field(None, description="ignored; a string, or an object as Open WebUI sends")
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _check_n(self) -> None:
        if self.n is None:
            self.n = 1
        if not 1 <= self.n <= MAX_N:
            raise bad_request(f"n must be between 1 and {MAX_N}, got {self.n}", "n")

    def _logit_bias(self) -> dict[int, float] | None:
        """OpenAI's logit_bias, keys token ids written as strings, as token ids."""
        if not self.logit_bias:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise bad_request(f"logit_bias keys must be token ids (integers), got {key!r}", "logit_bias") from None
        return bias

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        self._check_n()
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            logit_bias=self._logit_bias())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return the log-probabilities of this many top tokens (0-20)")
    echo: bool = Field(False, description="the prompt before the completion (with logprobs: the prompt's too)")
    best_of: int | None = Field(None, description="accepted when equal to n (no ranking of extra samples)")
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: a string or a token-id list is one, a list of them is several."""
        if self.suffix:
            raise bad_request("suffix is not supported; put the text in the prompt", "suffix")
        p = self.prompt
        if not p:
            raise bad_request("the prompt is empty: send a string, token ids, or a list of them", "prompt")
        if isinstance(p, str) or isinstance(p[0], int):
            return [p]
        if len(p) > MAX_PROMPTS:
            raise bad_request(f"at most {MAX_PROMPTS} prompts per request, got {len(p)}", "prompt")
        return list(p)

    def completion_params(self) -> SamplingParams:
        params = self.sampling_params(self.max_tokens, self.logprobs, self.logprobs if self.echo else None)
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request(f"best_of must equal n ({self.n}) when given, got {self.best_of}; samples are "
                              "not ranked", "best_of")
        return params


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict] | None = None
    response_format: dict | None = None

    def check(self) -> None:
        if self.tools:
            raise bad_request("tools are not supported", "tools")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request("only the text response_format is supported", "response_format")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class GenerateRequest(_Sampling):
    """Native route: text or token ids in; text, token ids and the request's own timings out."""

    prompt: str | None = None
    token_ids: list[int] | None = None
    max_tokens: int | None = 16
    logprobs: int | None = None

    def single_prompt(self) -> str | list[int]:
        if self.n not in (None, 1):
            raise bad_request("/generate takes n=1; use /v1/completions for several samples", "n")
        if (self.prompt is None) == (self.token_ids is None):
            raise bad_request("send exactly one of prompt or token_ids", "prompt")
        return self.prompt if self.prompt is not None else self.token_ids
