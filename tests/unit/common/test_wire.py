"""common/wire.py's conversions at the protobuf edge."""

from __future__ import annotations

from common.wire import token_ids_of
from proto import internal_pb2, pdserve_pb2


def test_token_ids_of_is_a_plain_list_of_the_ids_that_does_not_alias_the_message():
    ids = [5, 0, 49151, 7, 2**40]
    request = internal_pb2.PrefillRequest(prompt_token_ids=ids)
    got = token_ids_of(request.prompt_token_ids)
    assert type(got) is list and got == ids and all(type(t) is int for t in got)
    got.append(9)  # the engine owns its list: the message keeps its ids
    assert list(request.prompt_token_ids) == ids
    assert token_ids_of(pdserve_pb2.TokenIds().ids) == []
