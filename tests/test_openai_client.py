"""What users of the official `openai` client send, against `eejax serve` on 127.0.0.1: models,
stop strings and tokens, seeds, n, logprobs, max_completion_tokens, usage in streams, and fields
that ask for nothing."""

import math

import numpy as np
import pytest

import eejax
from eejax.engine.engine import Engine
from tests.helpers import serve_in_thread

openai = pytest.importorskip("openai")

CHAT_TEMPLATE = "{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}"
PROMPT = "The river rose above the"


@pytest.fixture(scope="module")
def client(tiny_model):
    tokenizer = tiny_model.tokenizer
    tokenizer.chat_template = CHAT_TEMPLATE
    engine = Engine(tiny_model, max_slots=4, max_new_tokens=32, cache_budget="4MiB", page_size=8)
    try:
        with serve_in_thread(engine) as url:
            yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        tokenizer.chat_template = None


def greedy(model, prompt, n):
    return eejax.generate(model, [prompt], max_new_tokens=n)


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert client.models.retrieve("tiny").owned_by == "eejax"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_greedy_completion_and_chat_equal_generate(client, tiny_model):
    want = greedy(tiny_model, PROMPT, 10)
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0)
    assert r.choices[0].text == want.texts[0] and r.usage.completion_tokens == len(want.tokens[0])
    messages = [{"role": "user", "content": PROMPT}]
    ids = tiny_model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    r = client.chat.completions.create(model="tiny", messages=messages, max_completion_tokens=7)
    assert r.choices[0].message.content == eejax.generate(tiny_model, [list(ids)], max_new_tokens=7).texts[0]
    assert r.usage.completion_tokens == 7 or r.choices[0].finish_reason == "stop"


def test_stop_strings_cut_the_text_exactly(client, tiny_model):
    text = greedy(tiny_model, PROMPT, 24).texts[0]
    stop = text[6:9]  # a piece of the greedy continuation, possibly across token boundaries
    assert len(stop) == 3 and stop in text
    want = text[: text.find(stop)]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=[stop, "never said"])
    assert r.choices[0].text == want and r.choices[0].finish_reason == "stop"
    # Streaming never shows text that the match then removes.
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].choices[0].finish_reason == "stop"
    # A stop string the text never contains changes nothing; stop=[] asks for nothing.
    for stop in (["zzzz"], [], None):
        r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, stop=stop)
        assert r.choices[0].text == text and r.choices[0].finish_reason == "length"


def test_stop_token_ids_end_the_request_at_the_token(client, tiny_model):
    tokens = greedy(tiny_model, PROMPT, 16).tokens[0]
    stop = tokens[5]
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, extra_body={"stop_token_ids": [stop]})
    assert r.model_extra["eejax"]["tokens"] == tokens[: tokens.index(stop) + 1]
    assert r.choices[0].finish_reason == "stop"


def test_seed_gives_generates_draw_whatever_else_runs(client, tiny_model):
    """A seeded sampled request equals row j of `generate(seed=...)` for its choice j, alone or
    beside other requests; n choices are different draws."""
    want = eejax.generate(tiny_model, [PROMPT] * 3, max_new_tokens=12, temperature=1.0, seed=1234).texts
    assert len(set(want)) > 1
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234, n=3)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert r.usage.completion_tokens == sum(len(c["tokens"]) for c in [ch.model_extra["eejax"] for ch in r.choices])
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        busy = [
            pool.submit(
                client.completions.create, model="tiny", prompt="Officials said", max_tokens=20, temperature=0.7
            )
            for _ in range(3)
        ]
        again = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=1234)
        [f.result() for f in busy]
    assert again.choices[0].text == want[0]


def test_logprobs_are_the_models_log_softmax(client, tiny_model, tiny_checkpoints):
    """Greedy: each token's log-prob is the largest of its alternatives, and the first equals
    HF PyTorch's log-softmax at the prompt's last position."""
    import torch

    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        # (Alternatives are keyed by text: tokens that decode alike, such as bytes of one
        # character, keep the likeliest.)
        assert len(top) <= 3 and chosen == pytest.approx(max(top.values())) and top[token] == pytest.approx(chosen)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    hf = tiny_checkpoints["gqa-untied"][0]
    ids = tiny_model.tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, -1].double(), -1).numpy()
    assert lp.token_logprobs[0] == pytest.approx(float(np.max(ref)), abs=1e-4)
    # Chat: logprobs with top_logprobs; logprobs=false asks for nothing.
    messages = [{"role": "user", "content": PROMPT}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 and c.bytes == list(c.token.encode()) for c in content)
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, logprobs=False)
    assert r.choices[0].logprobs is None
    # Sampled: the log-probs of the tempered distribution (temperature 2 flattens it).
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=3, logprobs=1, temperature=2.0, seed=3)
    first = r.choices[0].logprobs.token_logprobs[0]
    tempered = ref / 2.0 - np.log(np.sum(np.exp(ref / 2.0)))
    token = r.model_extra["eejax"]["tokens"][0]
    assert first == pytest.approx(float(tempered[token]), abs=1e-4) and math.isfinite(first)


def test_streams_report_usage_when_asked(client):
    chunks = list(
        client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": PROMPT}],
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks[:-1])
    # n > 1 streams: every choice gets its chunks and its own finish.
    chunks = list(
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, n=2, temperature=1.0, seed=9, stream=True)
    )
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert finished == [0, 1]


def test_fields_that_ask_for_nothing_are_accepted(client, tiny_model):
    want = greedy(tiny_model, PROMPT, 5).texts[0]
    r = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        max_tokens=5,
        n=1,
        seed=None,
        stop=[],
        presence_penalty=0,
        frequency_penalty=0.0,
        extra_body={"repetition_penalty": 1.0},  # every penalty off: today's tokens
        logit_bias={},
        echo=False,
        best_of=1,
        suffix=None,
        user="someone",
        stream_options=None,
    )
    assert r.choices[0].text == want
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=5,
        logprobs=False,
        top_logprobs=0,
        tools=[],
        tool_choice="none",
        response_format={"type": "text"},
        stop="",
    )
    assert r.choices[0].finish_reason in ("length", "stop")
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, logit_bias={"5": 1.0})
    with pytest.raises(openai.BadRequestError, match="max_completion_tokens"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "x"}], max_completion_tokens=-1
        )


def test_penalties_are_honoured_and_new_values_compile_nothing(client, tiny_model):
    """presence_penalty, frequency_penalty and vLLM's repetition_penalty give `generate`'s tokens
    with the same penalties (completions and chat); twenty other values compile no program."""
    penalties = dict(presence_penalty=0.5, frequency_penalty=0.8, repetition_penalty=1.3)
    want = eejax.generate(tiny_model, [PROMPT], max_new_tokens=12, **penalties).texts[0]
    assert want != greedy(tiny_model, PROMPT, 12).texts[0]
    kw = dict(
        model="tiny",
        max_tokens=12,
        presence_penalty=0.5,
        frequency_penalty=0.8,
        extra_body={"repetition_penalty": 1.3},
    )
    assert client.completions.create(prompt=PROMPT, **kw).choices[0].text == want
    chat = client.chat.completions.create(messages=[{"role": "user", "content": PROMPT}], **kw)
    assert chat.choices[0].finish_reason in ("length", "stop")
    before = tiny_model.programs.num_programs
    texts = set()
    for i in range(20):
        r = client.completions.create(
            model="tiny",
            prompt=PROMPT,
            max_tokens=12,
            presence_penalty=-1 + i / 10,
            frequency_penalty=2 - i / 10,
            extra_body={"repetition_penalty": 0.5 + i / 10},
        )
        texts.add(r.choices[0].text)
    assert tiny_model.programs.num_programs == before and len(texts) > 1


def test_echo_returns_the_prompt_and_its_logprobs(client, tiny_model):
    """echo puts the prompt before each choice's text (a batch: its own prompt; a stream: in the
    first chunk); with logprobs, the prompt's tokens lead the logprobs, the first one null, and
    the completion's entries are those of the same request without echo."""
    prompts = [PROMPT, "Another prompt"]
    want = eejax.generate(tiny_model, prompts, max_new_tokens=6).texts
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, echo=True, n=2)
    assert [c.text for c in r.choices] == [prompts[0] + want[0]] * 2 + [prompts[1] + want[1]] * 2
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2).choices[0].logprobs
    r = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, logprobs=2, echo=True)
    lp, n_prompt = r.choices[0].logprobs, len(tiny_model.tokenizer(PROMPT)["input_ids"])
    assert r.choices[0].text == PROMPT + want[0] and r.usage.prompt_tokens == n_prompt
    assert len(lp.tokens) == n_prompt + len(plain.tokens) and "".join(lp.tokens[:n_prompt]) == PROMPT
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:n_prompt]) and all(1 <= len(t) <= 2 for t in lp.top_logprobs[1:])
    # (the plain request may resume after a cached prefix, in a wider page table: the last digits differ)
    assert lp.token_logprobs[n_prompt:] == pytest.approx(plain.token_logprobs, abs=1e-5)
    assert lp.tokens[n_prompt:] == plain.tokens
    assert lp.text_offset[n_prompt] == len(PROMPT)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT + want[0]


def test_a_batch_of_prompts_gets_one_choice_per_prompt_and_n(client, tiny_model):
    """`prompt` as a list of strings or of token-id lists: choice i * n + j is choice j of prompt
    i (OpenAI's numbering), each equal to `generate` on its prompt; usage sums the prompts."""
    prompts = [PROMPT, "A second, longer prompt about the weather"]
    want = eejax.generate(tiny_model, prompts, max_new_tokens=6)
    r = client.completions.create(model="tiny", prompt=prompts, max_tokens=6, n=2)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want.texts[0]] * 2 + [want.texts[1]] * 2
    ids = [tiny_model.tokenizer(p)["input_ids"] for p in prompts]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    r = client.completions.create(model="tiny", prompt=ids, max_tokens=6)
    assert [c.text for c in r.choices] == want.texts
