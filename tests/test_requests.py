"""The engine's front door alone (`engine/requests.py`) over a real queue: a request that passes
`submit`'s checks queues and wakes the loop, one that fails them is refused with a message that
names the problem and leaves nothing queued, at most `max_decoding_options` early-exit /
speculation options are served, and the seeds drawn for requests follow the engine's seed."""

import threading

import pytest

from eejax.decode.sampling import SamplingParams
from eejax.engine.replicas import ChangeLog
from eejax.engine.requests import Requests
from eejax.engine.scheduler import BucketScheduler
from eejax.engine.waiting import WaitingQueue
from eejax.errors import EejaxError


def front_door(model, seed: int = 0, max_decoding_options: int = 2):
    waiting = WaitingQueue(BucketScheduler(65, 8, max_rows=2), grow=False, prompt_positions=len)
    woken = []
    requests = Requests(
        model,
        waiting,
        ChangeLog(False),
        lambda: woken.append(True),
        threading.RLock(),
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
    return requests, waiting, woken


def test_a_request_queues_and_wakes_the_loop_and_a_bad_one_leaves_nothing(tiny_model):
    requests, waiting, woken = front_door(tiny_model)
    seq = requests.submit([5, 6, 7], max_new_tokens=4)
    assert waiting.values() == [seq] and woken == [True] and seq.id == 0
    for bad, message in [
        (dict(max_new_tokens=17), "max_new_tokens must lie in"),
        (dict(max_new_tokens=4, stop_token_ids=[10**6]), "stop_token_ids must lie in"),
        (dict(max_new_tokens=4, temperature=-1.0), "temperature"),
    ]:
        with pytest.raises(EejaxError, match=message):
            requests.submit([5, 6, 7], **bad)
    with pytest.raises(EejaxError, match="prompt of 60 tokens \\+ 8 new tokens exceeds"):
        requests.submit([5] * 60, max_new_tokens=8)
    assert waiting.values() == [seq] and woken == [True]
    assert requests.submit([5], max_new_tokens=1, queue=False).id == 1 and len(waiting) == 1  # checked, not queued


def test_decoding_options_are_capped_and_seeds_follow_the_engines(tiny_model):
    requests, _, _ = front_door(tiny_model, max_decoding_options=2)
    requests.submit([5], max_new_tokens=2, spec="1:2")  # the engine's own option and this one
    with pytest.raises(EejaxError, match="at most 2 early-exit / speculation options"):
        requests.submit([5], max_new_tokens=2, spec="1:3")
    requests.submit([5], max_new_tokens=2, spec="1:2")  # served already
    seeds = [front_door(tiny_model, seed=7)[0].fresh_seed() for _ in range(2)]
    assert seeds[0] == seeds[1] != front_door(tiny_model, seed=8)[0].fresh_seed()
