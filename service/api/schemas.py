"""Request bodies of every route, as pydantic models (responses are plain dicts in OpenAI's shapes)."""

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from service.api.errors import bad_request
from service.engine.sampling import SamplingParams
from service.api.tools import ToolPlan, plan
from service.engine.structured import StructuredOutput

MAX_N = 128  # samples per prompt (OpenAI's own cap)
MAX_PROMPTS = 2048  # prompts in one /v1/completions request (and prompts x n may not exceed --max-waiting)


class StreamOptions(BaseModel):
    include_usage: bool = False


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict | bool = Field(alias="schema", description="the JSON Schema the output must match")
    strict: bool | None = Field(None, description="accepted either way: the schema is always enforced")


class ResponseFormat(BaseModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    def structured(self) -> StructuredOutput | None:
        if self.type == "text":
            return None
        if self.type == "json_object":
            return StructuredOutput("json_object")
        if self.json_schema is None:
            raise bad_request("response_format json_schema needs json_schema: {name, schema}", "response_format")
        try:
            return StructuredOutput("json_schema", json.dumps(self.json_schema.schema_))
        except (RecursionError, ValueError):  # nested deeper than json can write: far past the limit
            raise bad_request("the JSON schema nests too deeply", "response_format") from None


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
    response_format: ResponseFormat | None = Field(None, description="text, json_object (any JSON object) or "
                                                   "json_schema (an instance of its schema)")
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
            logit_bias=self._logit_bias(),
            structured=self.response_format.structured() if self.response_format else None)

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


class FunctionCall(BaseModel):
    name: str
    arguments: str = Field(description="the arguments as JSON text")


class ToolCall(BaseModel):
    id: str = ""
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, description="an assistant's calls")
    tool_call_id: str | None = Field(None, description="a tool message: the call it answers")

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class FunctionSpec(BaseModel):
    name: str
    description: str | None = None
    parameters: dict | None = Field(None, description="a JSON Schema of type object (none: no arguments)")
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(_Sampling):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="auto when there are tools, else none")
    parallel_tool_calls: bool | None = True

    def check(self) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs: true", "top_logprobs")

    def tool_plan(self, parser: str) -> ToolPlan | None:
        """What the tools ask for (None: no tools, or tool_choice none); a 400 names what is wrong."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        tools = [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None
        found = plan(tools, choice, self.parallel_tool_calls is not False, parser)
        if found is not None and found.structured is not None and self.response_format is not None \
                and self.response_format.type != "text":
            raise bad_request("response_format cannot be combined with tool_choice required or a named function "
                              "(the output is then the calls)", "response_format")
        return found

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
