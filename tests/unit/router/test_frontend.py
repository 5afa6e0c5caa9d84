"""router/frontend.py: what Frontend.early gives before the checks is what parse checks.

The router hashes a prompt and starts its routing read before it validates
the request (service.py); parse must then produce the same ids and hashes as
without that head start, and refuse the same requests with the same message.
"""

from __future__ import annotations

import json

import pytest

from common.cluster.state import NodeInfo, NodeRole
from engine.config import EngineConfig
from proto import pdserve_pb2
from router.frontend import Frontend
from router.migration import StreamProgress


@pytest.fixture(scope="module")
def frontend(demo_model_dir):
    return Frontend(EngineConfig.from_kwargs(str(demo_model_dir), max_model_len=1024))


def request(**kw) -> pdserve_pb2.GenerateRequest:
    sampling = pdserve_pb2.SamplingParams(**kw.pop("sampling", {"max_tokens": 4}))
    return pdserve_pb2.GenerateRequest(sampling=sampling, **kw)


CASES = {
    "token ids": request(token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70)))),
    "salted": request(token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70))), cache_salt="t"),
    "text": request(prompt="The capital of France is a city whose name has five letters. " * 3),
    "out of vocabulary": request(token_ids=pdserve_pb2.TokenIds(ids=[5, 10**9])),
    "bad sampling and ids": request(
        token_ids=pdserve_pb2.TokenIds(ids=[10**9]), sampling={"temperature": -1.0}
    ),
    "too long for max_tokens": request(
        token_ids=pdserve_pb2.TokenIds(ids=[7] * 100), sampling={"max_tokens": 1000}
    ),
    "empty": request(token_ids=pdserve_pb2.TokenIds(ids=[])),
}


@pytest.mark.parametrize("name", CASES)
def test_parse_with_the_head_start_equals_parse_without(frontend, name):
    req = CASES[name]
    early = frontend.early(req)
    assert early is not None
    try:
        plain = frontend.parse(req)
    except ValueError as e:
        with pytest.raises(ValueError) as info:
            frontend.parse(req, early)
        assert str(info.value) == str(e)
        return
    fast = frontend.parse(req, early)
    assert fast.prompt_token_ids == plain.prompt_token_ids
    assert fast.block_hashes == plain.block_hashes and fast.block_hashes is early.block_hashes
    assert fast.params == plain.params and fast.cache_salt == plain.cache_salt


def test_no_head_start_where_the_checks_may_change_the_prompt(frontend):
    truncated = request(
        token_ids=pdserve_pb2.TokenIds(ids=list(range(1, 70))),
        sampling={"max_tokens": 4, "truncate_prompt_tokens": 20},
    )
    chat = request(chat=pdserve_pb2.ChatMessages(messages=[{"role": "user", "content": "hi"}]))
    assert frontend.early(truncated) is None  # the checks cut the prompt first
    assert frontend.early(chat) is None  # its template's errors come after sampling's
    assert frontend.early(request()) is None  # no input at all
    assert len(frontend.parse(truncated).prompt_token_ids) == 20


# -- max_tokens and the nodes' context length (issue 50, items 1 and 2) -------------------


def test_an_unset_max_tokens_goes_downstream_resolved(frontend):
    req = request(token_ids=pdserve_pb2.TokenIds(ids=[7] * 100), sampling={})
    parsed = frontend.parse(req)
    assert parsed.params.max_tokens == 1024 - 100  # the context left, not SamplingParams' 16
    assert parsed.sampling.max_tokens == 1024 - 100
    assert not req.sampling.HasField("max_tokens")  # the client's request is left alone
    # A migrated continuation after 30 tokens asks for the rest of the same budget.
    progress = StreamProgress(prompt_len=100)
    progress.token_ids = [5] * 30
    progress.resume_offset = 30
    continuation = frontend.continuation(parsed, progress.token_ids)
    assert progress.sampling(continuation.sampling).max_tokens == 1024 - 100 - 30
    explicit = frontend.parse(request(token_ids=pdserve_pb2.TokenIds(ids=[7] * 100)))
    assert explicit.sampling.max_tokens == 4


def test_an_explicit_max_tokens_that_cannot_fit_is_refused(frontend):
    req = request(token_ids=pdserve_pb2.TokenIds(ids=[7] * 1000), sampling={"max_tokens": 30})
    with pytest.raises(ValueError, match="more than max_model_len 1024: .* at most 24 tokens"):
        frontend.parse(req)


def test_the_nodes_registered_length_is_the_one_checked(demo_model_dir):
    # The router's own default is the model's 8192; its nodes serve 512.
    frontend = Frontend(EngineConfig.from_kwargs(str(demo_model_dir)))
    assert frontend.max_model_len == 8192
    node = NodeInfo("d", NodeRole.DECODE, "h:1", frontend.model_id, 16, max_model_len=512)
    old = NodeInfo("o", NodeRole.DECODE, "h:2", frontend.model_id, 16)  # publishes none
    other = NodeInfo("x", NodeRole.DECODE, "h:3", "another-model", 16, max_model_len=64)
    frontend.served.observe([node, old, other])
    assert frontend.max_model_len == 512
    long = request(token_ids=pdserve_pb2.TokenIds(ids=[7] * 600))
    with pytest.raises(ValueError, match="prompt has 600 tokens but max_model_len is 512"):
        frontend.parse(long)
    unset = frontend.parse(request(token_ids=pdserve_pb2.TokenIds(ids=[7] * 500), sampling={}))
    assert unset.params.max_tokens == 12 and unset.max_model_len == 512
    # Nodes that disagree: the smallest, so that every node serves what is accepted.
    frontend.served.observe(
        [node, NodeInfo("e", NodeRole.DECODE, "h:4", frontend.model_id, 16, max_model_len=256)]
    )
    assert frontend.max_model_len == 256
    frontend.served.observe([])  # every node gone: the last length learnt
    assert frontend.max_model_len == 256


# -- chat: continue_final_message and a request's own chat_template ------------------------


CONTINUED = [
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is"},
]
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"


def chat_request(messages=CONTINUED, **chat) -> pdserve_pb2.GenerateRequest:
    return request(chat=pdserve_pb2.ChatMessages(messages=messages, **chat))


def test_continue_final_message_renders_as_transformers_does(frontend, demo_tokenizer):
    parsed = frontend.parse(chat_request(add_generation_prompt=False, continue_final_message=True))
    text = demo_tokenizer.apply_chat_template(
        CONTINUED, continue_final_message=True, tokenize=False
    )
    assert text.endswith("<|im_start|>assistant\nThe capital of France is")  # left open
    assert parsed.prompt_token_ids == demo_tokenizer.encode(text, add_special_tokens=False)
    for flags in ({}, {"add_generation_prompt": True}):  # unset, add_generation_prompt is true
        with pytest.raises(ValueError, match="Cannot set both `continue_final_message`"):
            frontend.parse(chat_request(**flags, continue_final_message=True))


def test_a_requests_chat_template_needs_the_routers_trust(demo_model_dir, frontend):
    cases = [  # the field, and vLLM's other way: chat_template_kwargs' chat_template
        chat_request(chat_template=TEMPLATE),
        chat_request(chat_template_kwargs=json.dumps({"chat_template": TEMPLATE})),
    ]
    for req in cases:
        with pytest.raises(ValueError, match="--trust-request-chat-template is not set"):
            frontend.parse(req)
    trusting = Frontend(
        EngineConfig.from_kwargs(str(demo_model_dir), max_model_len=1024),
        trust_request_chat_template=True,
    )
    want = "[user] What is the capital of France?\n[assistant] The capital of France is\n"
    for req in cases:
        parsed = trusting.parse(req)
        assert trusting.tokenizer.decode(parsed.prompt_token_ids) == want
    both = chat_request(
        chat_template=TEMPLATE, chat_template_kwargs=json.dumps({"chat_template": TEMPLATE})
    )
    with pytest.raises(ValueError, match="chat_template is set twice"):
        trusting.parse(both)
