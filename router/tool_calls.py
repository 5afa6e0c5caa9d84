"""Tool calls on the gRPC API: ChatMessages.tool_choice -> a grammar where a
call is forced, and the calls in each completion's text -> Completion.tool_calls.

The HTTP API's own machinery does the work (router/http/tools.py plans the
tools and the grammar, router/http/chat_output.py parses the output with the
router's --tool-call-parser), so a gRPC client gets the calls an OpenAI client
gets. The deltas stay the model's raw text (a gRPC client sees every token as
it comes); the calls parsed from the whole text come on the Final.
"""

from __future__ import annotations

import grpc

from proto import pdserve_pb2
from router.frontend import template_kwargs
from router.http.chat_output import ChoiceOutput, OutputPlan
from router.http.structured import InvalidField
from router.http.tools import plan_tools

_MODES = {
    pdserve_pb2.TOOL_CHOICE_MODE_NONE: "none",
    pdserve_pb2.TOOL_CHOICE_MODE_AUTO: "auto",
    pdserve_pb2.TOOL_CHOICE_MODE_REQUIRED: "required",
}


class ToolCallsFailed(ValueError):
    """A request whose tools or tool_choice cannot be honoured (INVALID_ARGUMENT)."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ToolCallOutput:
    """One gRPC request's calls: its completions' texts, parsed at the Final."""

    def __init__(self, plan: OutputPlan) -> None:
        self.plan = plan
        self.choices: dict[int, ChoiceOutput] = {}

    @classmethod
    def of(cls, request: pdserve_pb2.GenerateRequest, parser: str | None) -> ToolCallOutput | None:
        """None where no calls are to be parsed (no tools, or tool_choice unset or
        none); sets the request's grammar where tool_choice forces a call.
        Raises ToolCallsFailed naming the field."""
        chat = request.chat
        if request.WhichOneof("input") != "chat" or not chat.HasField("tool_choice"):
            return None  # unset: the calls are the client's to parse, as before tool_choice
        try:
            plan = plan_tools(
                template_kwargs(chat).get("tools"),
                _choice(chat.tool_choice),
                chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else None,
                parser,
            )
        except InvalidField as e:  # named as the proto names it
            field = e.param.replace(".function.", ".").replace("choice.name", "choice.function_name")  # fmt: skip
            raise ToolCallsFailed(f"chat.{field}: {e}") from None
        except ValueError as e:  # template_kwargs: a bad tool, named
            raise ToolCallsFailed(str(e)) from None
        if plan is None or not OutputPlan(tools=plan, tool_parser=parser).active:
            return None
        if (constraint := plan.constraint()) is not None:
            if request.sampling.HasField("structured_outputs"):
                raise ToolCallsFailed(
                    "chat.tool_choice forces a call, and sampling.structured_outputs "
                    "constrains the output too: set one"
                )
            request.sampling.structured_outputs.CopyFrom(constraint.spec)
        return cls(OutputPlan(tools=plan, tool_parser=parser))

    def observe(self, response: pdserve_pb2.GenerateResponse) -> None:
        """Feeds the message's text; on the Final, adds each completion's calls."""
        for delta in response.deltas:
            choice = self.choices.get(delta.index)
            if choice is None:
                choice = self.choices[delta.index] = self.plan.new_choice()
            choice.feed(delta.text)
        if not response.HasField("final"):
            return
        for completion in response.final.completions:
            choice = self.choices.pop(completion.index, None) or self.plan.new_choice()
            choice.finish()
            for call in choice.calls:
                function = call["function"]
                completion.tool_calls.add(
                    id=call["id"], name=function["name"], arguments=function["arguments"]
                )


def _choice(choice: pdserve_pb2.ToolChoice) -> str | dict:
    which = choice.WhichOneof("choice")
    if which == "function_name":
        return {"type": "function", "function": {"name": choice.function_name}}
    if which == "mode" and choice.mode in _MODES:
        return _MODES[choice.mode]
    raise ToolCallsFailed("chat.tool_choice sets no mode and no function_name")
