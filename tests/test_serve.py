"""`failfast serve` driven by the official openai client: exact outputs, streaming,
concurrency, disconnects, bad requests, auth and queue limits (float64 models)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch
import uvicorn

from failfast.decode.policies import FailFast
from failfast.decode.sampling import SamplingParams
from failfast.pipeline import Pipeline
from failfast.serve.app import ServerSettings, create_app
from failfast.serve.chat import PLAIN_TEMPLATE, ChatTemplate
from failfast.serve.streaming import TextStream
from failfast.errors import FailfastError
from tests.helpers import copy_checkpoint, set_eos, tiny_config, write_model, write_word_tokenizer
from tests.synthetic import BLOCK

MODEL = "tiny"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve")
    target = write_model(root / "target", tiny_config(eos_token_ids=(), max_position_embeddings=2048), seed=0)
    write_word_tokenizer(target, 96)
    drafter = write_model(root / "dllm", tiny_config(eos_token_ids=(), mask_token_id=95, block_size=BLOCK,
                                                     max_position_embeddings=2048,
                                                     sub_block_size=4), seed=9)
    return target, drafter


def _pipeline(models) -> Pipeline:
    return Pipeline.load(models[0], models[1], FailFast(chunk=4, max_draft=12), dtype=torch.float64)


class _Server:
    """create_app on a free port in a thread, as `failfast serve` runs it."""

    def __init__(self, models, **settings) -> None:
        self.app = create_app(_pipeline(models), ServerSettings(MODEL, **settings))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def __enter__(self) -> "_Server":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(30)


@pytest.fixture(scope="module")
def server(models):
    with _Server(models, max_batch=8, max_queue=64) as s:
        yield s


@pytest.fixture(scope="module")
def reference(models) -> Pipeline:
    return _pipeline(models)


PROMPT = "<5> <17> <33> <8>"


def test_completions_match_generate_greedy_sampled_and_from_token_ids(server, reference):
    client = server.client()
    greedy = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    want = reference.generate(PROMPT, 40)
    assert greedy.choices[0].text == want.text and greedy.failfast["token_ids"] == want.token_ids
    assert greedy.choices[0].finish_reason == ("length" if want.stop_reason == "length" else "stop")
    assert greedy.usage.completion_tokens == len(want.token_ids) and greedy.usage.prompt_tokens == 4
    assert greedy.failfast["stats"]["rounds"] >= 1
    sampled = client.completions.create(model=MODEL, prompt=[5, 17, 33, 8], max_tokens=40, temperature=0.9,
                                        top_p=0.95, seed=11, extra_body={"top_k": 20})
    want = reference.generate([5, 17, 33, 8], 40, SamplingParams(0.9, 20, 0.95, 11))
    assert sampled.failfast["token_ids"] == want.token_ids and sampled.choices[0].text == want.text
    penalized = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0.9, seed=4,
                                          presence_penalty=1.5, frequency_penalty=0.5,
                                          extra_body={"repetition_penalty": 1.3})
    want = reference.generate(PROMPT, 40, SamplingParams(0.9, seed=4, presence_penalty=1.5, frequency_penalty=0.5,
                                                          repetition_penalty=1.3))
    assert penalized.failfast["token_ids"] == want.token_ids
    assert want.token_ids != reference.generate(PROMPT, 40, SamplingParams(0.9, seed=4)).token_ids
    stopped = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                        stop=[greedy.choices[0].text.split()[3]])
    want = reference.generate(PROMPT, 40, stop=[greedy.choices[0].text.split()[3]])
    assert stopped.choices[0].text == want.text and stopped.choices[0].finish_reason == "stop"


def test_streamed_text_is_the_full_text_for_completions_and_chat(server, reference):
    client = server.client()
    for stop in ([], [" <4"], ["<1", "9>"]):
        full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0.8, seed=3,
                                         stop=stop or None)
        chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=60, temperature=0.8, seed=3,
                                                stop=stop or None, stream=True))
        assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
        assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
        assert chunks[-1].failfast["token_ids"] == full.failfast["token_ids"]
    messages = [{"role": "system", "content": "<3> <4>"}, {"role": "user", "content": "<9> <12>"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0)
    want = reference.generate("<3> <4>\n<9> <12>", 30)  # the plain template joins contents by newlines
    assert chat.choices[0].message.content == want.text and chat.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_32_concurrent_streaming_clients_all_get_their_own_exact_output(server, reference):
    prompts = [f"<{2 + i}> <{40 + i}> <{i % 7 + 10}>" for i in range(32)]

    async def one(client: openai.AsyncOpenAI, i: int) -> str:
        stream = await client.completions.create(model=MODEL, prompt=prompts[i], max_tokens=24 + i, temperature=0.7,
                                                 seed=i, stream=True)
        return "".join([c.choices[0].text async for c in stream])

    async def main() -> list[str]:
        async with openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0) as client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    texts = asyncio.run(main())
    for i, text in enumerate(texts):
        assert text == reference.generate(prompts[i], 24 + i, SamplingParams(0.7, seed=i)).text


def test_a_client_leaving_mid_stream_frees_its_row_and_disturbs_no_one(server, reference):
    # long enough (seconds; the models have no EOS) that it is still running when its client leaves
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0.5, "seed": 1, "stream": True}
    results: dict[str, str] = {}

    def steady() -> None:
        results["steady"] = server.client().completions.create(model=MODEL, prompt="<7> <7>", max_tokens=120,
                                                               temperature=0).choices[0].text

    worker = threading.Thread(target=steady)
    worker.start()
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as response:
        first = next(response.iter_lines())
        assert first.startswith("data: ")
    worker.join(60)
    assert results["steady"] == reference.generate("<7> <7>", 120).text
    scheduler = server.app.state.scheduler
    deadline = time.monotonic() + 10
    while scheduler.running:  # the cancelled row leaves at the next round
        assert time.monotonic() < deadline, "the abandoned request kept its row"
        time.sleep(0.02)
    assert scheduler.freed_rows == 1
    metrics = httpx.get(server.url + "/metrics").text
    assert "failfast_running_requests 0.0" in metrics and "failfast_generated_tokens_total" in metrics


def test_bad_requests_get_openai_errors(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="n=2 is not supported"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=2)
    with pytest.raises(openai.BadRequestError, match="max_tokens is at most"):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10_000)
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=-1)
    with pytest.raises(openai.BadRequestError, match="presence_penalty must be a number in"):
        client.completions.create(model=MODEL, prompt=PROMPT, presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="repetition_penalty must be a number in"):
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"repetition_penalty": 0})
    with pytest.raises(openai.BadRequestError, match="unrecognized request arguments: colour"):
        client.completions.create(model=MODEL, prompt=PROMPT, extra_body={"colour": "red"})
    with pytest.raises(openai.BadRequestError, match="token ids must be in"):
        client.completions.create(model=MODEL, prompt=[5, 999])
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt=PROMPT)
    with pytest.raises(openai.BadRequestError, match="messages"):
        client.chat.completions.create(model=MODEL, messages=[])
    for body in (b"{not json", b"[" * 100_000):  # the second nests too deep for the parser
        raw = httpx.post(server.url + "/v1/completions", content=body, timeout=10)
        assert raw.status_code == 400 and "not valid JSON" in raw.json()["error"]["message"]
    for field in ('"prompt": "\\ud800"', '"prompt": "<5>", "stop": "\\udfff"'):  # lone surrogates
        raw = httpx.post(server.url + "/v1/completions", content=("{" + field + "}").encode(), timeout=10)
        assert raw.status_code == 400 and "not valid Unicode" in raw.json()["error"]["message"], field
    big = httpx.post(server.url + "/v1/completions", content=b" " * (2 << 20), timeout=10)
    assert big.status_code == 413 and big.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert client.models.list().data[0].id == MODEL  # the server still serves
    assert client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3).usage.completion_tokens == 3


def test_api_key_is_required_on_v1_only(models):
    with _Server(models, api_key="s3cret") as s:
        with pytest.raises(openai.AuthenticationError):
            s.client("wrong").models.list()
        assert httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT}).status_code == 401
        assert s.client("s3cret").completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).usage.total_tokens == 8
        assert httpx.get(s.url + "/health").json() == {"status": "ok"}


def test_a_full_queue_answers_429_with_retry_after(models):
    with _Server(models, max_batch=1, max_queue=1) as s:
        scheduler = s.app.state.scheduler
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "stream": True}
        with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as running:
            lines = running.iter_lines()  # kept: a dropped iterator closes the connection
            next(lines)  # the first request holds the only slot
            waiting = threading.Thread(target=lambda: httpx.post(s.url + "/v1/completions", timeout=60,
                                                                 json={**body, "stream": False, "max_tokens": 5}))
            waiting.start()
            deadline = time.monotonic() + 10
            while scheduler.waiting < 1:
                assert time.monotonic() < deadline, "the second request never queued"
                time.sleep(0.01)
            refused = httpx.post(s.url + "/v1/completions", json={**body, "stream": False}, timeout=10)
            assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["type"] == "rate_limit_error"
        waiting.join(60)


def test_text_stream_holds_back_what_a_stop_string_may_cut():
    decode = lambda ids: "".join(chr(97 + i) for i in ids)  # noqa: E731 - one letter per id
    stream = TextStream(decode, stops=["xyz"])
    assert stream.update([0, 1, 2, 3]) == "ab"  # "cd" could start "xyz"? no, but 2 chars are held back
    assert stream.update([0, 1, 2, 3, 23]) == "c"
    assert stream.finish("abcd") == "d"
    plain = TextStream(lambda ids: "ab\ufffd"[:len(ids)])
    assert plain.update([0, 1, 2]) == "ab"  # a split character waits for its other half


def test_chat_template_from_tokenizer_config_renders_like_transformers(tmp_path):
    from transformers import PreTrainedTokenizerFast

    template = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    write_word_tokenizer(tmp_path, 8)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": template, "bos_token": "<2>", "eos_token": {"content": "<1>"}}))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    hf = PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "tokenizer.json"), bos_token="<2>", eos_token="<1>")
    hf.chat_template = template
    assert ChatTemplate.for_model(tmp_path).render(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True)
    assert ChatTemplate.for_model(tmp_path / "none").source == PLAIN_TEMPLATE


def test_a_failing_round_fails_its_requests_cleanly_and_the_server_goes_on(models):
    with _Server(models) as s:
        engine = s.app.state.scheduler.engine
        real_round, calls = engine._round, []

        def broken_once(*args, **kwargs):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected failure")
            return real_round(*args, **kwargs)

        engine._round = broken_once
        failed = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30)
        assert failed.status_code == 500 and "Traceback" not in failed.text and "injected" not in failed.text
        assert failed.json()["error"]["type"] == "internal_error"
        ok = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=5, temperature=0)
        assert ok.usage.completion_tokens == 5


def test_an_end_of_sequence_token_ends_the_text_without_its_own_text(models, reference, tmp_path):
    eos = reference.generate(PROMPT, 10).token_ids[4]
    target = copy_checkpoint(models[0], tmp_path / "target")
    set_eos(target, eos)
    with _Server((target, models[1])) as s:
        out = s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0)
        chunks = list(s.client().completions.create(model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0,
                                                    stream=True))
    ids = out.failfast["token_ids"]
    assert out.failfast["stop_reason"] == "eos" and ids[-1] == eos and out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == reference.target.tokenizer.decode(ids[:-1])
    assert "".join(c.choices[0].text for c in chunks) == out.choices[0].text


def test_the_server_refuses_an_empty_queue(models):
    with pytest.raises(FailfastError, match="queue place"):
        create_app(_pipeline(models), ServerSettings(MODEL, max_queue=0))


def test_a_scheduler_that_cannot_build_a_batch_answers_503_and_health_says_so(models):
    with _Server(models) as s:
        scheduler = s.app.state.scheduler
        scheduler.engine.open_batch = lambda *args: (_ for _ in ()).throw(MemoryError("no room"))
        failed = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30)
        assert failed.status_code == 500  # the request that found the scheduler unable to run
        assert httpx.get(s.url + "/health").status_code == 503
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 5}, timeout=30)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
