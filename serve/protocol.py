"""The OpenAI API's request and response bodies, as pydantic models.

Requests are strict: unknown fields are refused (a typo is a 400 naming the field, never a
silent default) and nothing is coerced (no "8" or true for an integer, no "yes" for a boolean;
an integer is a valid number, as 1 is a valid temperature). Every string must be valid Unicode
(a lone surrogate such as "\\ud800" is refused). Ranges follow OpenAI's: temperature in [0, 2],
top_p in (0, 1], max_tokens >= 1, n >= 1; the model's own bounds (top_k within the vocabulary,
max_tokens within max_seq) are `SamplingRequest.check_limits`'. Fields vLLM's servers also take are
accepted: `top_k`, `min_tokens`, `ignore_eos`, `stop_token_ids`, `return_token_ids` (each choice
then carries its `token_ids`, exact where text is not), and for chat `chat_template_kwargs`
(the template's extra variables, such as enable_thinking), `tools` and `documents` (handed to
the template) and `add_generation_prompt`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dsc.errors import UserError
from dsc.runtime.checks import check_token_ids

TokenId = Annotated[int, Field(ge=0)]
StopStrings = (
    Annotated[str, Field(min_length=1)] | Annotated[list[Annotated[str, Field(min_length=1)]], Field(max_length=16)]
)
MAX_SEED = 2**63  # seeds are 63-bit: the sampler hashes them as int64


def lone_surrogate(value: Any) -> int | None:
    """The position of the first lone surrogate in any string of value (nested in lists and
    dicts, keys included), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            return e.start
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else ((None, v) for v in value)
        if isinstance(value, (list, tuple))
        else ()
    )
    for k, v in items:
        at = lone_surrogate(k) if k is not None else None
        if at is None:
            at = lone_surrogate(v)
        if at is not None:
            return at
    return None


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data):
        if isinstance(data, dict):
            for key, value in data.items():
                try:
                    at = lone_surrogate(value)
                except RecursionError:
                    raise ValueError(f"{key}: nested too deeply") from None
                if at is not None:
                    raise ValueError(f"{key}: invalid Unicode (a lone surrogate at character {at})")
        return data


class StreamOptions(_Request):
    include_usage: bool = False


class SamplingRequest(_Request):
    """The fields completions and chat share."""

    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    min_tokens: int | None = Field(None, ge=0)  # None: the artifact's default (else 0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # 0 or -1: off; at most the vocabulary (check_limits)
    n: int = Field(1, ge=1, le=128)
    seed: int | None = Field(None, ge=0, lt=MAX_SEED)
    stop: StopStrings | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=1024)] | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # accepted, unused

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def check_limits(self, vocab_size: int, max_model_len: int) -> None:
        """The model's bounds on the request (ValueError naming the field): top_k, token ids
        and top logprobs within the vocabulary, max_tokens and min_tokens within max_seq."""
        if self.top_k is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k: at most the vocabulary size {vocab_size} (got {self.top_k})")
        try:
            check_token_ids(self.stop_token_ids or [], vocab_size, "stop_token_ids")
        except UserError as e:
            raise ValueError(str(e)) from None
        most = self.requested_max_tokens()
        if most is not None and most > max_model_len:
            raise ValueError(f"max_tokens: at most the model's context, {max_model_len} tokens (got {most})")
        if self.min_tokens is not None and self.min_tokens > (most if most is not None else max_model_len):
            raise ValueError(
                f"min_tokens: at most max_tokens ({most if most is not None else max_model_len}; got {self.min_tokens})"
            )

    def sampling_fields(self) -> dict:
        """SamplingParams keywords, except max_tokens and logprobs (the endpoint's to decide)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return dict(
            n=self.n,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
            min_tokens=self.min_tokens,
        )


class CompletionRequest(SamplingRequest):
    # text, several texts, token ids, or several token-id lists (as OpenAI's completions API)
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    max_tokens: int | None = Field(16, ge=1)  # null: 16, as OpenAI
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo: not supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


MAX_EMBEDDING_INPUTS = 2048  # inputs of one request, as OpenAI's embeddings API


class EmbeddingRequest(_Request):
    """OpenAI's embeddings request; `normalize` is vLLM's (None: the model's pooling config)."""

    model: str | None = None
    # text, several texts, token ids, or several token-id lists
    input: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[
            list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)
        ]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None
    user: str | None = None  # accepted, unused

    def inputs(self) -> list[str | list[int]]:
        p = self.input
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool's answer to one of them
    reasoning_content: str | None = None

    def as_template_input(self) -> dict:
        """The message as a chat template reads it: text parts joined into one string, tool
        calls' arguments as JSON objects (as vLLM hands them to templates), unset fields left out."""
        text = (
            self.content
            if isinstance(self.content, str) or self.content is None
            else "".join(part.text for part in self.content)
        )
        out = {"role": self.role, "content": text}
        for key in ("name", "tool_call_id", "reasoning_content"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.tool_calls is not None:
            out["tool_calls"] = [
                {
                    "id": c.id,
                    "type": c.type,
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
                }
                for c in self.tool_calls
            ]
        return {k: v for k, v in out.items() if v is not None}


def _arguments(text: str):
    import json

    try:
        return json.loads(text)
    except ValueError:  # not JSON: the template gets the text as it came
        return text


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # JSON schema keywords pass through
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class ChatCompletionRequest(SamplingRequest):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer spelling of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: Annotated[list[Tool], Field(max_length=256)] | None = None
    tool_choice: Literal["none", "auto"] | None = None  # the template sees the tools; calls are text
    documents: Annotated[list[dict[str, Any]], Field(max_length=256)] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_inputs(self) -> dict:
        """LLMEngine.apply_chat_template's keywords."""
        return dict(
            tools=[t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None,
            documents=self.documents,
            add_generation_prompt=self.add_generation_prompt,
            chat_template_kwargs=self.chat_template_kwargs,
        )


# -- responses ------------------------------------------------------------------------------------
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice | ChatStreamChoice]
    usage: Usage | None = None


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # base64: the float32 values, little-endian


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    object: Literal["list"] = "list"
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "dsc"
    max_model_len: int  # prompt + generated tokens, as vLLM reports it
    vocab_size: int  # token ids of a prompt are 0..vocab_size-1


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def error_body(
    message: str, type_: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
