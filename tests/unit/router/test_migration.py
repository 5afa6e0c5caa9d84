"""The router's stitching of a migrated stream (router/migration.py), without processes."""

from __future__ import annotations

from proto import pdserve_pb2
from router.migration import Seam, StreamProgress


def response(text: str, token_ids: list[int], final: bool = False) -> pdserve_pb2.GenerateResponse:
    r = pdserve_pb2.GenerateResponse(request_id="r")
    r.deltas.add(index=0, text=text, token_ids=token_ids)
    if final:
        r.final.completions.add(index=0, finish_reason=pdserve_pb2.FINISH_REASON_LENGTH)
        r.final.usage.prompt_tokens = 12  # the continuation's longer prompt
        r.final.usage.completion_tokens = len(token_ids)
    return r


def test_held_back_text_comes_first_without_stops():
    seam = Seam("ab", [], False)
    assert seam.feed("cd", last=False) == ("abcd", None)
    assert seam.feed("ef", last=False) == ("ef", None)


def test_a_stop_string_across_the_seam_is_found_and_cut():
    seam = Seam("x\n", ["\n\n"], False)
    assert seam.feed("\nmore", last=False) == ("x", "\n\n")
    kept = Seam("x\n", ["\n\n"], True)
    assert kept.feed("\nmore", last=False) == ("x\n\n", "\n\n")


def test_text_waits_until_no_stop_can_start_in_the_held_part():
    seam = Seam("E", ["END"], False)
    assert seam.feed("N", last=False) == ("", None)  # "EN": "END" may still come
    assert seam.feed("o", last=False) == ("ENo", None)
    ended = Seam("E", ["END"], False)
    assert ended.feed("N", last=True) == ("EN", None)  # the stream ended: flush


def test_a_stop_wholly_in_new_text_is_the_nodes_business():
    seam = Seam("ab", ["zz"], False)
    assert seam.feed("czz", last=False) == ("abczz", None)


def test_continuation_sampling_and_usage():
    progress = StreamProgress(prompt_len=5)
    progress.observe(response("Hello", [1, 2, 3]))
    original = pdserve_pb2.SamplingParams(
        max_tokens=10, min_tokens=4, truncate_prompt_tokens=5, disable_spec_decode=True
    )
    assert progress.sampling(original) is original  # not migrated: unchanged
    progress.resume_offset = 3
    progress.seam = Seam(" wor", ["world"], False)
    cont = progress.sampling(original)
    assert (cont.max_tokens, cont.min_tokens) == (7, 1)
    assert not cont.HasField("truncate_prompt_tokens")
    assert cont.disable_spec_decode  # opted out of speculation on the next node too
    first = response("ld!", [4])
    assert progress.rewrite(first)  # "world" spans the seam: the router ends it
    assert first.deltas[0].text == " "  # up to the stop string
    assert first.final.completions[0].stop_string == "world"
    assert first.final.usage.prompt_tokens == 5
    assert first.final.usage.completion_tokens == 4


def test_a_continuation_final_counts_every_token():
    progress = StreamProgress(prompt_len=5)
    progress.observe(response("Hi", [1, 2]))
    progress.resume_offset = 2
    progress.seam = Seam("", [], False)
    last = response(" there", [3, 4], final=True)
    assert not progress.rewrite(last)
    assert last.deltas[0].text == " there"
    assert last.final.usage.prompt_tokens == 5
    assert last.final.usage.completion_tokens == 4
