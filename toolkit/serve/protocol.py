"""The OpenAI request bodies the server takes, validated before any work: a field we do not know, a value out of
range, a field OpenAI has and we do not support: each a 400 that names it.

Beyond OpenAI's fields (vLLM's names where vLLM has them): ``top_k`` (-1 or 0: off), ``repetition_penalty``,
``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (each choice's generated ids), ``return_routing`` (each
choice's routed experts per MoE layer, prompt and completion).
"""
from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

Num = Annotated[float, Field(allow_inf_nan=False)]
MAX_N = 16
MAX_STOPS = 16
MAX_TOP_LOGPROBS = 20


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Body):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class _Sampling(_Body):
    model: StrictStr
    temperature: Annotated[Num, Field(ge=0, le=100)] | None = None
    top_p: Annotated[Num, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=1 << 24)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, le=2**63 - 1)] | None = None
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOPS)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Num, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[Num, Field(ge=-2, le=2)] = 0.0
    logit_bias: dict[str, Annotated[Num, Field(ge=-100, le=100)]] | None = None
    user: StrictStr | None = None
    # extensions
    repetition_penalty: Annotated[Num, Field(gt=0, le=100)] = 1.0
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(max_length=64)] | None = None
    return_token_ids: StrictBool = False
    return_routing: StrictBool = False
    # OpenAI's, not supported here: refused by name (``unsupported``)
    best_of: Any = None
    suffix: Any = None


Prompt = Union[StrictStr, list[StrictStr], list[StrictInt], list[list[StrictInt]]]


class CompletionRequest(_Sampling):
    prompt: Prompt
    max_tokens: Annotated[StrictInt, Field(ge=0)] | None = 16
    echo: StrictBool = False
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: StrictStr


class Message(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[TextPart] | None = None
    name: StrictStr | None = None
    tool_call_id: StrictStr | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatRequest(_Sampling):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    add_generation_prompt: StrictBool = True
    # OpenAI's, not supported here
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    parallel_tool_calls: Any = None
    response_format: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None


def unsupported(body: BaseModel) -> str | None:
    """The first OpenAI field the request sets that this server does not support, or None."""
    names = ("best_of", "suffix", "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
             "response_format", "audio", "modalities", "prediction", "reasoning_effort")
    for name in names:
        v = getattr(body, name, None)
        if v is None:
            continue
        if name == "best_of" and v == getattr(body, "n", 1):
            continue  # best_of = n is plain sampling
        if name == "response_format" and v == {"type": "text"}:
            continue
        return name
    return None
