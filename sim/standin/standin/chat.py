"""The vLLM stand-in's chat requests as vLLM validates them: `parse_chat` (fields read as pydantic's lax mode reads
them, vLLM's limits and error bodies as `ApiError`), vLLM's tool rules and tool calls, and the pieces of an answer
(logprobs entries, non-finite floats as null in a stream). Stdlib only, as the whole stand-in
(sim/standin/README.md).
"""

from __future__ import annotations

import json
import math
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

from .engine import ChatRequest, Token
from .model import TOOL_CALL_TOKENS, VOCAB

# vLLM's serving_chat.py refusal of a request with `tools` (tool_choice "auto" is the default then).
AUTO_TOOL_CHOICE_MESSAGE = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": status}}


_WORD = re.compile(r"\w+|[^\w\s]")


def _message_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return " ".join(str(p.get("text", "")) for p in content if isinstance(p, dict) and p.get("type") == "text")
    if content is None:
        return ""
    raise ApiError(400, "messages[].content must be a string or a list of content parts", "BadRequestError", "messages")


def _validation_error(name: str, value: Any, kind: str, msg: str) -> ApiError:
    """FastAPI's request validation answer, as real vLLM 0.32 sent it (fixtures/real-vllm/http/error-bad-field)."""
    detail = {"type": kind, "loc": f"body.{name}", "msg": msg, "input": value}
    return ApiError(400, f"1 validation error:\n  {detail!r}", "Bad Request", f"body.{name}")


def _number(body: Mapping[str, Any], name: str, default: Any, kind: type) -> Any:
    """A numeric field as pydantic's lax mode reads it: numbers, and strings that parse as one."""
    value = body.get(name)
    if value is None:
        return default
    word = "an integer" if kind is int else "a number"
    if isinstance(value, str):
        try:
            return kind(value.strip())
        except ValueError:
            raise _validation_error(
                name,
                value,
                f"{kind.__name__}_parsing",
                f"Input should be a valid {word[3:] if kind is int else word[2:]}, unable to parse string as {word}",
            ) from None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _validation_error(
            name, value, f"{kind.__name__}_type", f"Input should be a valid {'integer' if kind is int else 'number'}"
        )
    if kind is int and isinstance(value, float) and not value.is_integer():
        raise _validation_error(
            name, value, "int_from_float", "Input should be a valid integer, got a number with a fractional part"
        )
    return kind(value)


def parse_chat(
    body: Any,
    served: Sequence[str],
    max_model_len: int,
    max_logprobs: int,
    defaults: Mapping[str, Any],
    tool_parser: str | None = None,
    auto_tools: bool = False,
) -> ChatRequest:
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", "BadRequestError")
    model = body.get("model") or served[0]
    if model not in served:
        raise ApiError(
            404, f"The model `{model}` does not exist. Valid aliases: {', '.join(served)}.", "NotFoundError", "model"
        )
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ApiError(
            400, "messages must be a non-empty list of {role, content} objects", "BadRequestError", "messages"
        )
    texts = [f"{m.get('role', 'user')}: {_message_text(m.get('content'))}" for m in messages]
    prompt = "\n".join(texts)
    prompt_tokens = 1 + sum(3 + len(_WORD.findall(t)) for t in texts)
    max_tokens = _number(body, "max_completion_tokens", None, int)
    if max_tokens is None:
        max_tokens = _number(body, "max_tokens", max_model_len - prompt_tokens, int)
    if max_tokens < 1:
        raise ApiError(400, f"max_tokens must be at least 1, got {max_tokens}.", "BadRequestError", "max_tokens")
    if max_tokens > max_model_len:  # checked first, as in vLLM 0.32 (fixtures/real-vllm/http)
        raise ApiError(
            400,
            f"max_tokens={max_tokens} cannot be greater than max_model_len={max_model_len}. Please request fewer "
            f"output tokens. (parameter=max_tokens, value={max_tokens})",
            "BadRequestError",
            "max_tokens",
        )
    if prompt_tokens + max_tokens > max_model_len:
        raise ApiError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or completion.",
            "BadRequestError",
            "max_tokens",
        )
    logprobs = body.get("logprobs") is True
    top_logprobs = _number(body, "top_logprobs", 0, int)
    if body.get("top_logprobs") is not None and not logprobs:
        raise ApiError(
            400,
            "when using `top_logprobs`, `logprobs` must be set to true.",
            "BadRequestError",
            "top_logprobs",
        )
    if top_logprobs < 0 or top_logprobs > max_logprobs:
        raise ApiError(
            400,
            f"Requested sample logprobs of {top_logprobs}, which is greater than max allowed: {max_logprobs}",
            "BadRequestError",
            "top_logprobs",
        )
    if _number(body, "n", 1, int) != 1:
        raise ApiError(400, "the vLLM stand-in serves n=1 only", "BadRequestError", "n")
    options = body.get("stream_options")
    tool = _tool_to_call(body, messages, tool_parser, auto_tools)
    return ChatRequest(
        model=str(model),
        prompt=prompt,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        temperature=_number(body, "temperature", float(defaults.get("temperature", 1.0)), float),
        top_p=_number(body, "top_p", float(defaults.get("top_p", 1.0)), float),
        top_k=_number(body, "top_k", int(defaults.get("top_k", 0)), int),
        seed=_number(body, "seed", None, int),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        stream=body.get("stream") is True,
        include_usage=isinstance(options, dict) and options.get("include_usage") is True,
        tool=tool,
    )


def _tool_to_call(
    body: Mapping[str, Any], messages: Sequence[Mapping[str, Any]], tool_parser: str | None, auto_tools: bool
) -> Mapping[str, Any] | None:
    """vLLM's tool rules: with `tools`, tool_choice defaults to "auto", which needs both
    --enable-auto-tool-choice and --tool-call-parser (HTTP 400 otherwise). The stand-in calls the
    named (or first) function unless the conversation already carries that tool's result."""
    tools = body.get("tools")
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
        isinstance(x, dict)
        and x.get("type") == "function"
        and isinstance(x.get("function"), dict)
        and isinstance(x["function"].get("name"), str)
        for x in tools
    ):
        raise ApiError(
            400, "tools must be a list of {type: function, function: {name, ...}}", "BadRequestError", "tools"
        )
    choice = body.get("tool_choice", "auto" if tools else "none")
    if choice == "none" or not tools:
        return None
    if choice == "auto" and not (auto_tools and tool_parser):
        raise ApiError(400, AUTO_TOOL_CHOICE_MESSAGE, "BadRequestError")
    functions = [x["function"] for x in tools]
    if isinstance(choice, dict):
        name = choice.get("function", {}).get("name") if isinstance(choice.get("function"), dict) else None
        named = [f for f in functions if f["name"] == name]
        if not named:
            raise ApiError(400, f"Tool '{name}' has not been passed in `tools`.", "BadRequestError", "tool_choice")
        functions = named
    elif choice not in ("auto", "required"):
        raise ApiError(400, f"Invalid value for `tool_choice`: {choice!r}", "BadRequestError", "tool_choice")
    if messages and messages[-1].get("role") == "tool":
        return None  # the result is back: answer in words
    chosen: Mapping[str, Any] = functions[0]
    return chosen


def tool_arguments(function: Mapping[str, Any], prompt: str) -> str:
    """Arguments that fit the function's JSON schema: strings from the prompt's last capitalised word."""
    words = re.findall(r"\b[A-Z][a-z]+\b", prompt.split(":", 1)[-1])
    raw_params = function.get("parameters")
    params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {}
    raw_props = params.get("properties")
    props: dict[str, Any] = raw_props if isinstance(raw_props, dict) else {}
    out: dict[str, Any] = {}
    for name, schema in props.items():
        kind = schema.get("type") if isinstance(schema, dict) else None
        if isinstance(schema, dict) and isinstance(schema.get("enum"), list) and schema["enum"]:
            out[name] = schema["enum"][0]
        elif kind == "integer":
            out[name] = 1
        elif kind == "number":
            out[name] = 1.0
        elif kind == "boolean":
            out[name] = True
        else:
            out[name] = words[-1] if words else "Paris"
    return json.dumps(out, ensure_ascii=False)


def for_engine(req: ChatRequest) -> ChatRequest:
    """A tool call's arguments are short: the engine computes a few tokens for it, not max_tokens."""
    return req if req.tool is None else replace(req, max_tokens=min(req.max_tokens, TOOL_CALL_TOKENS))


def tool_call(function: Mapping[str, Any], prompt: str) -> dict[str, Any]:
    """One entry of `message.tool_calls` in vLLM's shape."""
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": function["name"], "arguments": tool_arguments(function, prompt)},
    }


def _entry(token_id: int, logprob: float) -> dict[str, Any]:
    text = VOCAB[token_id]
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def logprobs_content(tokens: Sequence[Token]) -> list[dict[str, Any]]:
    return [{**_entry(t.id, t.logprob), "top_logprobs": [_entry(i, lp) for i, lp in t.top]} for t in tokens]


def json_safe(value: Any) -> Any:
    """What pydantic's model_dump_json writes in a stream: non-finite floats become null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [json_safe(v) for v in value]
    return value
