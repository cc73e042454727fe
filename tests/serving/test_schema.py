"""OpenAI request bodies: what is accepted, and the 400 (with its param) for what is not."""
import pytest

from serving.config import Limits
from serving.errors import InvalidRequest
from serving.schema import GREEDY_BELOW, Sampling, parse_chat, parse_json_body, parse_text

LIMITS = Limits(max_tokens=100)


def chat(**extra):
    return {"model": "python_expert", "messages": [{"role": "user", "content": "hi"}]} | extra


def test_a_chat_request_with_defaults():
    req = parse_chat(chat(), LIMITS)
    assert req.max_tokens == 100 and req.sampling.temperature == 1.0 and not req.stream and req.stop == ()
    assert req.messages == ({"role": "user", "content": "hi"},) and req.routing_text == "hi"


def test_text_parts_developer_role_and_max_completion_tokens():
    body = chat(messages=[{"role": "developer", "content": "be brief"},
                          {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                          {"role": "assistant", "content": "ok"}],
                max_completion_tokens=7, max_tokens=99, stop="\n", temperature=0, stream=True,
                stream_options={"include_usage": True})
    req = parse_chat(body, LIMITS)
    assert [m["role"] for m in req.messages] == ["system", "user", "assistant"] and req.messages[1]["content"] == "ab"
    assert req.routing_text == "ab"  # the last user turn, not the assistant's
    assert req.max_tokens == 7 and req.stop == ("\n",) and req.sampling.greedy and req.include_usage


def test_text_prompt_may_be_a_one_element_array():
    assert parse_text({"model": "m", "prompt": ["SELECT"]}, LIMITS).prompt == "SELECT"


@pytest.mark.parametrize("body, param", [
    (chat(model=""), "model"),
    (chat(model=3), "model"),
    (chat(messages="hi"), "messages"),
    (chat(messages=[]), "messages"),
    (chat(messages=["hi"]), "messages[0]"),
    (chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
    (chat(messages=[{"role": "user"}]), "messages[0].content"),
    (chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]), "messages[0].content"),
    (chat(max_tokens=101), "max_tokens"),
    (chat(max_tokens=0), "max_tokens"),
    (chat(max_tokens=2.5), "max_tokens"),
    (chat(max_tokens=True), "max_tokens"),
    (chat(temperature=-1), "temperature"),
    (chat(temperature="hot"), "temperature"),
    (chat(top_p=0), "top_p"),
    (chat(n=3), "n"),
    (chat(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat(stop=[""]), "stop"),
    (chat(stream="yes"), "stream"),
    (chat(stream_options={"include_usage": 1}), "stream_options"),
    (chat(tools=[{"type": "function"}]), "tools"),
    (chat(logprobs=True), "logprobs"),
    (chat(messages=[{"role": "user", "content": "a\ud800b"}]), "messages[0].content"),
    (chat(stop=["\udfff"]), "stop"),
])
def test_bad_chat_fields_name_their_param(body, param):
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(body, LIMITS)
    assert caught.value.param == param and caught.value.status == 400
    assert caught.value.body()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("prompt", [None, "", ["a", "b"], [1, 2], 5])
def test_bad_prompts(prompt):
    with pytest.raises(InvalidRequest) as caught:
        parse_text({"model": "m", "prompt": prompt}, LIMITS)
    assert caught.value.param == "prompt"


@pytest.mark.parametrize("raw", [b"", b"{", b"\xff\xfe", b"[]", b"null", b"1", b"[" * 100000])
def test_bodies_that_are_not_json_objects(raw):
    with pytest.raises(InvalidRequest):
        parse_json_body(raw)


def test_too_large_max_tokens_has_its_own_code():
    with pytest.raises(InvalidRequest) as caught:
        parse_chat(chat(max_tokens=1000), LIMITS)
    assert caught.value.code == "max_tokens_exceeded" and "100" in caught.value.message


@pytest.mark.parametrize("temperature", [1e-300, 5e-324, 1e-45, 1e-38, GREEDY_BELOW / 2])
def test_a_tiny_temperature_is_greedy_decoding(temperature):
    """Issue 30, 4: these passed the [0, 2] check and sampling divided the logits by them: NaN, a 500."""
    sampling = parse_chat(chat(temperature=temperature, top_p=0.5), LIMITS).sampling
    assert sampling == Sampling(temperature=0.0, top_p=1.0) == parse_chat(chat(temperature=0), LIMITS).sampling
    assert sampling.greedy and Sampling(temperature=temperature).greedy  # built directly, too
    assert not parse_chat(chat(temperature=GREEDY_BELOW), LIMITS).sampling.greedy
