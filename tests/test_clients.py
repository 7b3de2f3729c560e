"""What clients nobody here wrote ask of the server: lists of prompts in one completions
request (lm-eval's `--batch_size`, the openai client's `prompt=[...]`), a model looked up by
its id, and counters an operator's error-rate alert can trust.

A live `python -m minisgl` on CPU and the official `openai` client, as in test_server.py;
the reference for a batched prompt is the same prompt sent alone to the same server, greedy.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from helpers import MODEL, SMOL_CPU, Server, check_error, metrics, serving

from minisgl.server.protocol import MAX_PROMPTS

try:
    import httpx
except ModuleNotFoundError:  # the openai client may come with the httpx2 fork instead
    import httpx2 as httpx

PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
MAX = 4


@pytest.fixture(scope="module")
def server(tmp_path_factory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("clients"), *SMOL_CPU) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key="none", timeout=300, max_retries=0)


def alone(client: openai.OpenAI, prompt: str | list[int]) -> tuple[str, int]:
    """One prompt sent by itself, greedy: its text and its prompt tokens."""
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX, temperature=0)
    return out.choices[0].text, out.usage.prompt_tokens


# ---- lists of prompts ---------------------------------------------------------------------


def test_a_list_of_prompts_answers_each_as_if_alone(client):
    singles = [alone(client, p) for p in PROMPTS]
    out = client.completions.create(model=MODEL, prompt=PROMPTS, n=2, max_tokens=MAX, temperature=0)
    # OpenAI's numbering: prompt i's j-th choice is choice i*n + j.
    assert [c.index for c in out.choices] == list(range(2 * len(PROMPTS)))
    assert [c.text for c in out.choices] == [text for text, _ in singles for _ in range(2)]
    assert out.usage.prompt_tokens == sum(n for _, n in singles)  # each prompt once, not n times
    assert out.usage.completion_tokens == 2 * len(PROMPTS) * MAX
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_list_of_token_id_prompts(client):
    ids = [[504, 3575, 282, 4649, 314], [33, 30, 216, 34]]
    singles = [alone(client, p) for p in ids]
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX, temperature=0)
    assert [c.text for c in out.choices] == [text for text, _ in singles]
    assert out.usage.prompt_tokens == sum(len(p) for p in ids)


def test_a_list_of_prompts_streams(client):
    whole = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX, temperature=0)
    texts = [""] * len(PROMPTS)
    finished, usage = set(), None
    for chunk in client.completions.create(
        model=MODEL,
        prompt=PROMPTS,
        max_tokens=MAX,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    ):
        for c in chunk.choices:
            texts[c.index] += c.text
            if c.finish_reason is not None:
                finished.add(c.index)
        usage = chunk.usage or usage
    assert texts == [c.text for c in whole.choices]
    assert finished == set(range(len(PROMPTS)))
    assert usage is not None and usage.model_dump() == whole.usage.model_dump()


def test_too_many_prompts_is_a_400(server):
    url = server.base + "/v1/completions"
    body = {"model": MODEL, "prompt": ["Hi"] * (MAX_PROMPTS + 1), "max_tokens": 1}
    err = check_error(httpx.post(url, json=body, timeout=60), 400)
    assert err["param"] == "prompt" and str(MAX_PROMPTS) in err["message"], err
    body = {"model": MODEL, "prompt": ["Hi"] * 4, "n": MAX_PROMPTS // 2, "max_tokens": 1}
    err = check_error(httpx.post(url, json=body, timeout=60), 400)
    assert str(MAX_PROMPTS) in err["message"], err
    body = {"model": MODEL, "prompt": ["Hi", ""], "max_tokens": 1}
    assert "empty" in check_error(httpx.post(url, json=body, timeout=60), 400)["message"]


# ---- a model by its id --------------------------------------------------------------------


def test_models_retrieve(client, server):
    card = client.models.retrieve(MODEL)
    assert card.id == MODEL and card.object == "model"
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.code == "model_not_found" and "no-such-model" in e.value.message
    err = check_error(httpx.get(server.base + "/v1/models/org/no-such-model"), 404)
    assert err["param"] == "model" and "org/no-such-model" in err["message"]


# ---- counters -----------------------------------------------------------------------------


def test_refusals_are_not_failed_requests(server, client):
    before = metrics(server)
    for path in ("/v1/nope", "/admin", "/v1/engines"):  # a router probing for routes
        check_error(httpx.get(server.base + path), 404)
    check_error(httpx.post(server.base + "/v1/completions", json={"model": MODEL}), 400)
    client.completions.create(model=MODEL, prompt="Hi", max_tokens=1)
    after = metrics(server)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("minisgl:requests_total") == 1
    assert grew("minisgl:failed_requests_total") == 0
    assert grew('minisgl:error_responses_total{status="404"}') == 3
    assert grew('minisgl:error_responses_total{status="400"}') == 1
