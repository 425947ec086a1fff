"""From a chat request's ``response_format`` or ``structured_outputs`` to the engines' ``Constraint``.

A ``tool_choice`` that forces a call is a constraint too (``tool_grammar``). The constraint is
placed in the reply's response channel for Kimi K3 (``xtml_grammar``), and checked (``ensure_enforceable``) with the grammar engine the engines use
(``services.model.grammar``), so a schema feature it cannot enforce is a 400 that names it before
anything is placed: a constrained request never runs unconstrained.

Compiling a grammar can take seconds, so the check runs after the request passed its key's rate
limits (a client over them costs no compile), in a pool of ``_CHECK_THREADS`` threads of its own
(llguidance releases the GIL): the event loop, key checks and tokenizing never wait for it. A
constraint over ``max_bytes`` is refused before anything compiles.
"""

from __future__ import annotations

import asyncio
import json
from concurrent.futures import ThreadPoolExecutor

from crescent.protos.common_pb2 import ChoiceList, Constraint
from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.errors import InvalidRequestError
from crescent.services.gateway.parsing.output_format import OutputFormat
from crescent.services.gateway.parsing.tool_grammar import forced_tool_constraint
from crescent.services.gateway.parsing.xtml_grammar import in_response_channel
from crescent.services.model.grammar import ConstraintError, check_constraint

_CHECK_THREADS = 2
_checks = ThreadPoolExecutor(max_workers=_CHECK_THREADS, thread_name_prefix="grammar-check")


def constraint_of(request: ChatCompletionRequest, output: OutputFormat, max_bytes: int) -> Constraint | None:
    """The request's output constraint (None: free text), not yet compiled; ``InvalidRequestError``
    naming the field when it is over ``max_bytes``. ``output`` is the model's markup, which a forced
    tool call (``tool_grammar``) is written in."""
    fmt, extension = request.response_format, request.structured_outputs
    forced = forced_tool_constraint(request, output)
    if forced is not None:
        if request.constrains_output():
            raise InvalidRequestError("a forced tool call and a structured output cannot both shape the reply",
                                      param="tool_choice")
        constraint, param = forced, "tool_choice"
    elif fmt is not None and fmt.type == "json_object":
        constraint, param = Constraint(json_object=True), "response_format"
    elif fmt is not None and fmt.type == "json_schema":
        assert fmt.json_schema is not None  # the model's validator requires it
        constraint, param = Constraint(json_schema=json.dumps(fmt.json_schema.schema_)), "response_format.json_schema"
    elif extension is not None:
        param = "structured_outputs"
        if extension.json_ is not None:
            constraint = Constraint(json_schema=json.dumps(extension.json_))
        elif extension.regex is not None:
            constraint = Constraint(regex=extension.regex)
        elif extension.choice is not None:
            constraint = Constraint(choice=ChoiceList(choices=extension.choice))
        else:
            constraint = Constraint(grammar=extension.grammar)
    else:
        return None
    if output.xtml and param != "tool_choice":  # K3: the constrained text is the response channel's
        constraint = in_response_channel(constraint, request.thinking is None or request.thinking.type == "enabled")
    size = constraint.ByteSize()
    if size > max_bytes:
        raise InvalidRequestError(
            f"the output constraint is {size} bytes, over the gateway's limit of {max_bytes} "
            "(max_constraint_bytes)", param=param, code="constraint_too_large")
    return constraint


def constraint_param(request: ChatCompletionRequest) -> str:
    """The request field its constraint came from (what a 400 names)."""
    if request.forces_tool_call() and not request.constrains_output():
        return "tool_choice"
    if request.response_format is not None and request.response_format.type == "json_schema":
        return "response_format.json_schema"
    return "response_format" if request.response_format is not None else "structured_outputs"


async def ensure_enforceable(request: ChatCompletionRequest, constraint: Constraint | None) -> None:
    """Compile ``constraint`` off the event loop; the 400 naming what cannot be enforced."""
    if constraint is None:
        return
    try:
        await asyncio.get_running_loop().run_in_executor(_checks, check_constraint, constraint)
    except ConstraintError as exc:
        raise InvalidRequestError(f"the output constraint cannot be enforced: {exc}", param=constraint_param(request),
                                  code="unsupported_constraint") from exc
