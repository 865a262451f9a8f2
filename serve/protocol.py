"""The OpenAI API's request and response bodies, as pydantic models.

Requests forbid unknown fields (a typo is a 400 naming the field, never a silent default).
Ranges follow OpenAI's: temperature in [0, 2], top_p in (0, 1], max_tokens >= 1, n >= 1.
Fields vLLM's servers also take are accepted: `top_k`, `ignore_eos`, `stop_token_ids`, and
`return_token_ids` (each choice then carries its `token_ids`, exact where text is not).
"""
from __future__ import annotations

from typing import Annotated, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

TokenId = Annotated[int, Field(ge=0)]
StopStrings = Union[Annotated[str, Field(min_length=1)], Annotated[list[Annotated[str, Field(min_length=1)]],
                                                                   Field(max_length=16)]]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class _Sampling(_Request):
    """The fields completions and chat share."""
    model: Optional[str] = None  # None: the served model
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1)  # 0 or -1: off
    n: int = Field(1, ge=1, le=128)
    seed: Optional[int] = Field(None, ge=0, lt=2**63)
    stop: Optional[StopStrings] = None
    stop_token_ids: Optional[list[TokenId]] = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None  # accepted, unused

    @model_validator(mode="after")
    def _stream_options_need_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    def sampling_fields(self) -> dict:
        """SamplingParams keywords, except max_tokens and logprobs (the endpoint's to decide)."""
        stop = [self.stop] if isinstance(self.stop, str) else self.stop
        return dict(n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, seed=self.seed,
                    stop=stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos)


class CompletionRequest(_Sampling):
    # text, several texts, token ids, or several token-id lists (as OpenAI's completions API)
    prompt: Union[Annotated[str, Field(min_length=1)],
                  Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)],
                  Annotated[list[TokenId], Field(min_length=1)],
                  Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]]
    max_tokens: Optional[int] = Field(16, ge=1)  # null: 16, as OpenAI
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False

    @model_validator(mode="after")
    def _no_echo(self):
        if self.echo:
            raise ValueError("echo: not supported")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None

    def as_template_input(self) -> dict:
        text = self.content if isinstance(self.content, str) or self.content is None \
            else "".join(part.text for part in self.content)
        return {"role": self.role, "content": text or ""}


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: Optional[int] = Field(None, ge=1)  # the newer spelling of max_tokens
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self


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
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class ChatResponseMessage(BaseModel):
    role: Optional[Literal["assistant"]] = None
    content: Optional[str] = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: ChatResponseMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    token_ids: Optional[list[int]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion", "chat.completion.chunk"] = "chat.completion"
    created: int
    model: str
    choices: list[Union[ChatChoice, ChatStreamChoice]]
    usage: Optional[Usage] = None


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


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict:
    """OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
