"""From a chat request's ``response_format`` or ``structured_outputs`` to the engines' ``Constraint``.

A ``tool_choice`` that forces a call is a constraint too (``tool_grammar``). The constraint is checked here with the grammar engine the engines use (``services.model.grammar``),
so a schema feature it cannot enforce is a 400 that names it before anything is placed: a
constrained request never runs unconstrained.
"""

from __future__ import annotations

import json

from crescent.protos.common_pb2 import ChoiceList, Constraint
from crescent.services.gateway.api_models import ChatCompletionRequest
from crescent.services.gateway.errors import InvalidRequestError
from crescent.services.gateway.output_format import OutputFormat
from crescent.services.gateway.tool_grammar import forced_tool_constraint
from crescent.services.model.grammar import ConstraintError, check_constraint


def constraint_of(request: ChatCompletionRequest, output: OutputFormat) -> Constraint | None:
    """The request's output constraint (None: free text); ``InvalidRequestError`` naming the field.
    ``output`` is the model's markup, which a forced tool call (``tool_grammar``) is written in."""
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
    try:
        check_constraint(constraint)
    except ConstraintError as exc:
        raise InvalidRequestError(f"the output constraint cannot be enforced: {exc}", param=param,
                                  code="unsupported_constraint") from exc
    return constraint
