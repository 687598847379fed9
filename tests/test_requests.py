"""The engine's front door alone (`engine/requests.py`): a request that passes `submit`'s checks
is posted to the loop (an `inbox.Submit`) and counted live until it finishes, one that fails them
is refused with a message that names the problem and posts nothing, at most `max_decoding_options` early-exit /
speculation options are served, and the seeds drawn for requests follow the engine's seed."""

import pytest

from eejax.decode.sampling import SamplingParams
from eejax.engine.inbox import Submit
from eejax.engine.requests import Requests
from eejax.errors import EejaxError


def front_door(model, seed: int = 0, max_decoding_options: int = 2):
    posted = []
    requests = Requests(
        model,
        posted.append,
        sampling=SamplingParams(),
        exit_config=None,
        max_new_tokens=16,
        max_len=64,
        cache_len=64,
        max_prompt_tokens=None,
        num_pages=9,
        page_size=8,
        max_decoding_options=max_decoding_options,
        seed=seed,
        prompt_positions=len,
    )
    return requests, posted


def test_a_request_is_posted_to_the_loop_and_a_bad_one_posts_nothing(tiny_model):
    requests, posted = front_door(tiny_model)
    seq = requests.submit([5, 6, 7], max_new_tokens=4)
    assert posted == [Submit(seq)] and seq.id == 0 and requests.live() == [seq]
    for bad, message in [
        (dict(max_new_tokens=17), "max_new_tokens must lie in"),
        (dict(max_new_tokens=4, stop_token_ids=[10**6]), "stop_token_ids must lie in"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(EejaxError, match=message):
            requests.submit([5, 6, 7], **bad)
    with pytest.raises(EejaxError, match="prompt of 60 tokens \\+ 8 new tokens exceeds"):
        requests.submit([5] * 60, max_new_tokens=8)
    assert posted == [Submit(seq)]
    assert requests.submit([5], max_new_tokens=1, queue=False).id == 1 and len(posted) == 1  # checked, not queued
    seq._done.set()  # finished
    assert requests.live() == []


def test_decoding_options_are_capped_and_seeds_follow_the_engines(tiny_model):
    requests, _ = front_door(tiny_model, max_decoding_options=2)
    requests.submit([5], max_new_tokens=2, spec="1:2")  # the engine's own option and this one
    with pytest.raises(EejaxError, match="at most 2 early-exit / speculation options"):
        requests.submit([5], max_new_tokens=2, spec="1:3")
    requests.submit([5], max_new_tokens=2, spec="1:2")  # served already
    seeds = [front_door(tiny_model, seed=7)[0].fresh_seed() for _ in range(2)]
    assert seeds[0] == seeds[1] != front_door(tiny_model, seed=8)[0].fresh_seed()
