"""The OpenAI completions body's prompt: which JSON shapes are token ids, which
text, and what is refused (router/http/schemas.py)."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from router.http.schemas import ChatCompletionRequest, CompletionRequest, InvalidField


def generate(prompt):
    return CompletionRequest.model_validate_json(json.dumps({"prompt": prompt})).to_generate()


def test_token_ids_text_and_batches_keep_their_kind():
    (ids,) = generate([5, 7, 9])
    assert ids.WhichOneof("input") == "token_ids" and list(ids.token_ids.ids) == [5, 7, 9]
    (text,) = generate("12")
    assert text.WhichOneof("input") == "prompt" and text.prompt == "12"
    # Strings that look like numbers stay text: ids are tried strictly.
    assert [g.prompt for g in generate(["12", "a"])] == ["12", "a"]
    batch = generate([[1, 2], [3]])
    assert [list(g.token_ids.ids) for g in batch] == [[1, 2], [3]]


@pytest.mark.parametrize("prompt", [[1, True], [1, 2.5], [1, "2"], [], {"a": 1}])
def test_mixed_or_non_integer_prompts_are_refused(prompt):
    with pytest.raises((ValidationError, InvalidField)):
        generate(prompt)


@pytest.mark.parametrize("bad", [2**63, -(2**63) - 1, 10**30])
def test_a_token_id_protobuf_cannot_hold_names_the_prompt(bad):
    with pytest.raises(InvalidField) as e:
        generate([1, bad])
    assert e.value.param == "prompt" and "out of range" in str(e.value)


def test_a_chat_only_field_of_any_shape_on_a_completion_is_no_server_error():
    # The range check reads declared fields only: an extra may hold any JSON
    # (a list here, which compared with an int would be a TypeError: a 500).
    body = CompletionRequest.model_validate({"prompt": "", "top_logprobs": []})
    body.check()
    with pytest.raises(InvalidField):
        CompletionRequest.model_validate({"prompt": "", "max_tokens": 2**63}).check()


# -- what the HTTP edge honours and refuses (issue 50, items 1, 3 and 7) ---------------------


def completion(**body):
    return CompletionRequest.model_validate_json(json.dumps({"prompt": "Hi", **body}))


def chat(**body):
    messages = body.pop("messages", [{"role": "user", "content": "Hi"}])
    return ChatCompletionRequest.model_validate_json(json.dumps({"messages": messages, **body}))


def test_max_tokens_absent_null_and_given():
    assert completion().to_generate()[0].sampling.max_tokens == 16  # OpenAI's default there
    assert not completion(max_tokens=None).to_generate()[0].sampling.HasField("max_tokens")
    assert not chat().to_generate()[0].sampling.HasField("max_tokens")  # up to the context left
    assert chat(max_tokens=5, max_completion_tokens=9).to_generate()[0].sampling.max_tokens == 9


def test_pdserves_speculation_opt_out_reaches_the_engine_params():
    from common.wire import sampling_params_from_proto

    for body in (completion(disable_spec_decode=True), chat(disable_spec_decode=True)):
        sampling = body.to_generate()[0].sampling
        assert sampling.disable_spec_decode
        assert sampling_params_from_proto(sampling).disable_spec_decode is True
    sampling = chat().to_generate()[0].sampling
    assert not sampling.HasField("disable_spec_decode")
    assert sampling_params_from_proto(sampling).disable_spec_decode is False


def test_echo_with_logprobs_asks_for_the_prompts_logprobs():
    (g,) = completion(echo=True, logprobs=2, max_tokens=1).to_generate()
    assert (g.sampling.prompt_logprobs, g.sampling.logprobs, g.sampling.max_tokens) == (2, 2, 1)
    only = completion(echo=True, logprobs=1, max_tokens=0)
    assert only.echo_only and only.to_generate()[0].sampling.max_tokens == 1
    (plain,) = completion(prompt_logprobs=3).to_generate()  # vLLM's extra
    assert plain.sampling.prompt_logprobs == 3 and not completion().echo_only


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"guided_json": 5}, "guided_json"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"use_beam_search": True}, "use_beam_search"),
        ({"priority": 3}, "priority"),
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt": ""}, "prompt"),
    ],
)
def test_completion_fields_that_ask_for_what_pdserve_lacks_are_named(body, param):
    with pytest.raises(InvalidField) as e:
        completion(**body).to_generate()
    assert e.value.param == param


def test_neutral_values_of_unsupported_fields_pass():
    completion(use_beam_search=False, guided_json=None, priority=0, tools=[]).to_generate()
    chat(functions=[], modalities=["text"], tool_choice="none", store=False).to_generate()
    chat(add_special_tokens=False).to_generate()
    completion(add_special_tokens=True).to_generate()
    with pytest.raises(InvalidField):
        completion(add_special_tokens=False).to_generate()


IMAGE = {"type": "image_url", "image_url": {"url": "data:,"}}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "text", "text": "?"}, IMAGE]}]},
         "messages.0.content.1", "images are not supported by this model"),
        ({"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]},
         "messages.0.content.0", "audio is not supported"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
        ({"function_call": "auto"}, "function_call", "not supported"),
        ({"tools": [{"type": "function"}]}, "tools.0.function", "needs a function"),
        ({"modalities": ["text", "audio"]}, "modalities", "audio"),
        ({"audio": {"voice": "alloy"}}, "audio", "audio"),
        ({"echo": True}, "echo", "not supported"),
        ({"add_special_tokens": True}, "add_special_tokens", "not supported"),
    ],
)  # fmt: skip
def test_chat_fields_and_parts_that_ask_for_what_pdserve_lacks_are_named(body, param, words):
    with pytest.raises(InvalidField) as e:
        chat(**body).to_generate()
    assert e.value.param == param and words in str(e.value)


def test_text_parts_are_joined():
    parts = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    request, _ = chat(messages=[{"role": "developer", "content": parts}]).to_generate()
    assert [(m.role, m.content) for m in request.chat.messages] == [("system", "ab")]


SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    ("body", "kind", "value"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object", True),
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}},
         "json_schema", json.dumps(SCHEMA)),
        ({"guided_json": SCHEMA}, "json_schema", json.dumps(SCHEMA)),
        ({"guided_regex": "[ab]+"}, "regex", "[ab]+"),
        ({"guided_choice": ["x", "y"]}, "choice", ["x", "y"]),
        ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
        ({"structured_outputs": {"choice": ["x"]}}, "choice", ["x"]),
        ({"structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}},
         "json_schema", json.dumps(SCHEMA)),
    ],
)  # fmt: skip
def test_every_spelling_of_a_constraint_reaches_the_wire(body, kind, value):
    so = chat(**body).to_generate()[0].sampling.structured_outputs
    assert so.WhichOneof("kind") == kind
    got = list(so.choice.choices) if kind == "choice" else getattr(so, kind)
    assert got == value
    assert so.disable_any_whitespace == bool(body.get("structured_outputs", {}).get("disable_any_whitespace"))  # fmt: skip
    (g,) = completion(**body).to_generate()
    assert g.sampling.structured_outputs == so
    assert (
        not chat(response_format={"type": "text"})
        .to_generate()[0]
        .sampling.HasField("structured_outputs")
    )


def test_tools_reach_the_template_and_tool_messages_are_kept():
    tool = {"type": "function", "function": {"name": "f", "parameters": SCHEMA}}
    messages = [
        {"role": "user", "content": "?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "call_1", "type": "function",
                         "function": {"name": "f", "arguments": '{"a": 1}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "42"},
    ]  # fmt: skip
    request, plan = chat(messages=messages, tools=[tool], tool_choice="required").to_generate()
    assert [t.name for t in request.chat.tools] == ["f"] and plan.constraint_param == "tool_choice"
    call = request.chat.messages[1].tool_calls[0]
    assert (call.id, call.name, call.arguments) == ("call_1", "f", '{"a": 1}')
    assert request.chat.messages[2].tool_call_id == "call_1"
    assert request.sampling.structured_outputs.json_schema
    with pytest.raises(InvalidField) as e:
        chat(tools=[tool], tool_choice="required", guided_regex="a").to_generate()
    assert e.value.param == "tool_choice" and "guided_regex" in str(e.value)


# -- vLLM's continue_final_message, chat_template and bad_words ---------------------------


def test_bad_words_reach_the_wire_on_both_endpoints():
    for body in (completion(bad_words=["Paris", "big city"]), chat(bad_words=["Paris"])):
        request = body.to_generate()[0]
        assert list(request.sampling.bad_words) == body.bad_words
    assert not chat(bad_words=[]).to_generate()[0].sampling.bad_words


def test_continue_final_message_and_chat_template_reach_the_wire():
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hel"}]
    body = chat(
        messages=messages,
        continue_final_message=True,
        add_generation_prompt=False,
        chat_template="{{ messages[0].content }}",
    )
    request, _ = body.to_generate()
    assert request.chat.continue_final_message and not request.chat.add_generation_prompt
    assert request.chat.chat_template == "{{ messages[0].content }}"
    plain, _ = chat().to_generate()
    assert not plain.chat.continue_final_message and plain.chat.chat_template == ""


@pytest.mark.parametrize("add_generation_prompt", [True, None])
def test_continue_final_message_with_a_generation_prompt_is_vllms_400(add_generation_prompt):
    body = {"continue_final_message": True}
    if add_generation_prompt is not None:  # unset, it is true: the same refusal
        body["add_generation_prompt"] = add_generation_prompt
    with pytest.raises(InvalidField) as e:
        chat(**body).to_generate()
    assert e.value.param == "continue_final_message"
    assert str(e.value) == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )
