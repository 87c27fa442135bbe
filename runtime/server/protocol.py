"""The OpenAI request bodies the server accepts, as pydantic models (they become the OpenAPI
spec), and their translation into SamplingParams.

Every field of OpenAI's and vLLM's request schemas is either honoured as vLLM honours it or,
with a value other than its default, refused with a 400 naming it (`REFUSED`): never accepted
and silently ignored. Fields neither schema has are ignored, as vLLM ignores them; metadata
that changes no output (`user`, `metadata`, `store`, `request_id`) is accepted.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from kiln.runtime.base.errors import UsageError
from kiln.runtime.engine.sampling import SamplingParams

MAX_LOGPROBS = 20
MAX_N = 16


def lone_surrogate(body: Any) -> tuple[str, int, str] | None:
    """Where a JSON body holds a lone UTF-16 surrogate (`"\\ud800"` parses into one): the
    field's path, the character's index and the character escaped; None when all is text.

    No tokenizer, and no UTF-8 encoder, can take such a string. Iterative, so that a deeply
    nested body costs no recursion; a key is looked at before what it holds."""
    stack: list[tuple[str, Any]] = [("body", body)]
    while stack:
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                return where, exc.start, f"\\u{ord(value[exc.start]):04x}"
        elif isinstance(value, dict):
            for key, item in reversed(list(value.items())):
                stack.append((f"{where}.{key}".removeprefix("body."), item))
                stack.append((f"a key of {where}", key))
        elif isinstance(value, list):
            stack.extend((f"{where}[{i}]", item) for i, item in reversed(list(enumerate(value))))
    return None


class FieldError(UsageError):
    """A request field the server cannot honour as sent: a 400 whose `param` names it (as
    OpenAI's and vLLM's errors do)."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


# OpenAI and vLLM request fields kiln does not implement: (the values that mean "off", why).
# A request that sends one with another value is refused naming it; vLLM's field names.
_NO_DECODING = "constrained decoding, which this server does not do"
REFUSED: dict[str, tuple[tuple[Any, ...], str]] = {
    "best_of": ((None, 1), "best_of > 1 (ranking several candidates) is not supported; use n"),
    "use_beam_search": ((None, False), "beam search is not supported"),
    "length_penalty": ((None, 1, 1.0), "length_penalty applies to beam search only"),
    "allowed_token_ids": ((None,), f"allowed_token_ids needs {_NO_DECODING}"),
    "bad_words": ((None, []), f"bad_words needs {_NO_DECODING}"),
    "guided_json": ((None,), f"guided_json needs {_NO_DECODING}"),
    "guided_regex": ((None,), f"guided_regex needs {_NO_DECODING}"),
    "guided_choice": ((None,), f"guided_choice needs {_NO_DECODING}"),
    "guided_grammar": ((None,), f"guided_grammar needs {_NO_DECODING}"),
    "structured_outputs": ((None,), f"structured_outputs needs {_NO_DECODING}"),
    "logits_processors": ((None, []), "custom logits_processors are not supported"),
    "truncate_prompt_tokens": ((None,), "truncate_prompt_tokens is not supported; shorten it"),
    "spaces_between_special_tokens": ((None, True), "only the default spacing is supported"),
    "return_tokens_as_token_ids": ((None, False), "tokens are returned as text only"),
    "return_token_ids": ((None, False), "token ids are not returned; use logprobs"),
    "priority": ((None, 0), "request priorities are not supported (first come, first served)"),
    "chat_template": ((None,), "the model's own chat template is used; drop chat_template"),
    "chat_template_kwargs": ((None, {}), "chat_template_kwargs are not supported"),
    "documents": ((None, []), "documents (RAG templates) are not supported"),
    "continue_final_message": ((None, False), "continue_final_message is not supported"),
    "add_special_tokens": ((None, False), "add_special_tokens is not supported for chat"),
    "tool_choice": ((None, "none"), "tools (function calling) are not supported"),
    "functions": ((None, []), "functions (function calling) are not supported"),
    "function_call": ((None, "none"), "function_call (function calling) is not supported"),
    "parallel_tool_calls": ((None, False, True), "tools are not supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "audio": ((None,), "audio output is not supported"),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported by this model's server"),
    "web_search_options": ((None,), "web search is not supported"),
    "mm_processor_kwargs": ((None, {}), "multimodal inputs are not supported"),
    "kv_transfer_params": ((None,), "disaggregated KV transfer is not supported"),
}


def refused_field(body: Any, refused: dict[str, tuple[tuple[Any, ...], str]]) -> str | None:
    """The first field of `body` in `refused` sent with a value other than null or one of its
    "off" values (of the same JSON type); None when there is none."""
    if not isinstance(body, dict):
        return None
    for name, (off, _) in refused.items():
        value = body.get(name)
        if value is not None and not any(value == v and type(value) is type(v) for v in off):
            return name
    return None


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Options shared by completions and chat."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] | None = None
    # vLLM's extension: 0 or -1 turns top-k off.
    top_k: Annotated[int, Field(ge=-1)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N)] = 1
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-(2**63), le=2**63 - 1)] | None = None  # torch's range
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] = 0.0
    # OpenAI's: token id (as a string) → a bias in [-100, 100] added to its logit.
    logit_bias: dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]] | None = None
    ignore_eos: bool = False
    user: str | None = None
    # vLLM's sampling extensions.
    min_tokens: Annotated[int, Field(ge=0)] = 0
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] = 1.0
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, body: Any) -> Any:
        name = refused_field(body, REFUSED)
        if name is not None:
            raise PydanticCustomError(
                "unsupported_field",
                "{name}: {why}; leave it out (or at its default)",
                {"name": name, "why": REFUSED[name][1], "param": name},
            )
        return body

    @model_validator(mode="before")
    @classmethod
    def _unicode_text(cls, body: Any) -> Any:
        found = lone_surrogate(body)
        if found is not None:
            where, index, char = found
            field = re.split(r"[.\[]", where.removeprefix("a key of "))[0]
            raise PydanticCustomError(
                "unicode_surrogate",
                "{where}: character {index} is a lone UTF-16 surrogate ({char}), which is not "
                "text; send valid Unicode (a surrogate escape only as half of a pair)",
                {"where": where, "index": index, "char": char, "param": field},
            )
        return body

    def _params(self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None) -> Any:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.lstrip("-").isdigit():
                raise FieldError("logit_bias", f"logit_bias: key {key!r} is not a token id")
            bias[int(key)] = value
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not s for s in stop):
            raise FieldError("stop", "`stop` strings must be non-empty")
        top_k = self.top_k if self.top_k is not None and self.top_k > 0 else 0
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_k=top_k,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=stop,
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            min_tokens=self.min_tokens,  # above max_tokens: SamplingParams refuses it (a 400)
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias=bias,
            stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


Prompt = (
    str | list[str] | list[Annotated[int, Field(ge=0)]] | list[list[Annotated[int, Field(ge=0)]]]
)


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Prompt
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    echo: bool = False
    # vLLM's extension: each prompt token's log-probability and the top N at its position,
    # as `choices[i].prompt_logprobs` (token id → logprob, rank, decoded_token).
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    suffix: str | None = None

    def prompts(self) -> list[str | list[int]]:
        """Each prompt of the request: a text, or a list of token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if not p:
            raise FieldError("prompt", "`prompt` is empty; send a string, strings, or token ids")
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        if all(isinstance(x, str) for x in p) or all(isinstance(x, list) for x in p):
            return list(p)  # type: ignore[arg-type]
        raise FieldError("prompt", "`prompt` mixes strings and token ids; send one kind")

    def sampling_params(self) -> tuple[SamplingParams, bool]:
        """The engine's params, and whether the single generated token is to be dropped
        (echo with max_tokens 0: the caller wants the prompt's log-probabilities only)."""
        if self.suffix:
            raise FieldError("suffix", "`suffix` is not supported by this server")
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        if max_tokens == 0 and not self.echo:
            raise FieldError(
                "max_tokens", "max_tokens=0 is allowed only with echo=true (prompt scoring)"
            )
        if self.prompt_logprobs is not None and self.stream:
            raise FieldError(
                "prompt_logprobs", "`prompt_logprobs` are not available when `stream` is true"
            )
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None:
            prompt_logprobs = max(prompt_logprobs or 0, self.logprobs)
        params = self._params(max(max_tokens, 1), self.logprobs, prompt_logprobs)
        return params, max_tokens == 0


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    # null only for an assistant's turn (as OpenAI's and vLLM's schemas have it): checked
    # by ChatCompletionRequest, which knows the message's index.
    content: str | list[TextPart] | None = None
    name: str | None = None
    # Read to refuse them: a tool call the template is not given would vanish from the chat.
    tool_calls: list[Any] | None = None
    function_call: Any = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's: False renders the chat without opening the assistant's turn.
    add_generation_prompt: bool = True
    echo: bool = False
    prompt_logprobs: Annotated[int, Field(ge=0, le=MAX_LOGPROBS)] | None = None

    @model_validator(mode="after")
    def _servable_messages(self) -> ChatCompletionRequest:
        """Refuse a message with nothing to say (null content where its role needs text, as
        OpenAI and vLLM do) and a message carrying tool calls, which this server cannot
        render; the error names the message's field."""
        for i, message in enumerate(self.messages):
            for call in ("tool_calls", "function_call"):
                if getattr(message, call):
                    raise PydanticCustomError(
                        "unsupported_field",
                        "{param}: tool calls (function calling) are not supported by this "
                        "server; send the conversation as text",
                        {"param": f"messages[{i}].{call}"},
                    )
            if message.content is None and message.role != "assistant":
                raise PydanticCustomError(
                    "missing_content",
                    "{param} is null: a {role} message needs content (a string, or a list of "
                    "text parts); only an assistant's message may leave it null",
                    {"param": f"messages[{i}].content", "role": message.role},
                )
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as the chat template expects them (developer reads as system)."""
        return [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            for m in self.messages
        ]

    def sampling_params(self, room: int) -> SamplingParams:
        """The engine's params; `room` is the context left after the prompt (the default
        max_tokens, as OpenAI's is "up to the context")."""
        if self.tools:
            raise FieldError("tools", "`tools` (function calling) is not supported by this server")
        if self.echo:
            raise FieldError("echo", "chat `echo` is not supported by this server; leave it false")
        if self.prompt_logprobs is not None:
            raise FieldError(
                "prompt_logprobs",
                "chat `prompt_logprobs` are not supported; use /v1/completions with the "
                "rendered prompt",
            )
        kind = (self.response_format or {}).get("type", "text")
        if kind != "text":
            raise FieldError(
                "response_format",
                f"response_format {kind!r} needs constrained decoding, which this server does "
                "not do; ask for JSON in the prompt or leave response_format out",
            )
        limit = self.max_completion_tokens or self.max_tokens or max(room, 1)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs and not self.logprobs:
            raise FieldError("top_logprobs", "`top_logprobs` needs `logprobs: true`")
        return self._params(limit, logprobs, None)


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
