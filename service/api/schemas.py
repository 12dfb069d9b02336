"""Request bodies of every route, as pydantic models (responses are plain dicts in OpenAI's shapes)."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.errors import bad_request
from service.engine.sampling import SamplingParams


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
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None

    def _check_unsupported(self) -> None:
        if self.n != 1:
            raise bad_request("only n=1 is supported", "n")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise bad_request(f"{param} is not supported; leave it at 0", param)
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", "logit_bias")

    def sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        self._check_unsupported()
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, seed=self.seed,
            stop=self.stop or [], stop_token_ids=self.stop_token_ids or [], min_tokens=self.min_tokens,
            ignore_eos=self.ignore_eos, logprobs=logprobs)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    model: str
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(None, description="return the log-probabilities of this many top tokens (0-20)")
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def single_prompt(self) -> str | list[int]:
        if self.echo:
            raise bad_request("echo is not supported", "echo")
        if self.best_of not in (None, 1):
            raise bad_request("best_of is not supported", "best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", "suffix")
        p = self.prompt
        if isinstance(p, list) and p and isinstance(p[0], (str, list)):
            if len(p) != 1:
                raise bad_request("send one prompt per request (batches of prompts are not supported)", "prompt")
            p = p[0]
        return p


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
        if (self.prompt is None) == (self.token_ids is None):
            raise bad_request("send exactly one of prompt or token_ids", "prompt")
        return self.prompt if self.prompt is not None else self.token_ids
