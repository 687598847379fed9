"""The engine's host cost, measured where device time is negligible: a tiny Llama (2 layers of
width 64, a 512-token vocabulary, a random draft head) generating on the CPU, batch 1.

On a GPU the host's work per dispatch is what a round pays on top of its kernels: an H100 ran
SmolLM2's draft:4 round in 2.8 ms as one program and in 7.0 ms inside the engine (2026-11-27,
`benchmarks/gpu_profile.py`). For each mode this prints:
- host µs per generated token and per engine step (a dispatch: several full-depth steps or
  rounds): this thread's CPU time in each `Engine.step` that prefilled nothing, the median over
  the steps of --repeats runs (robust to this VM's bursts of slowness), times the decode steps
  per token; each program ended before the engine goes on (a GPU's programs never slow the host;
  here they would share its cores: `--overlap` to let them);
- programs dispatched per generated token; arrays read back (device to host) and sent (host to
  device) per dispatch, the prefill's uploads counted in (spread over the decode's dispatches);
- of the host's µs per step, those inside program calls (on a CPU XLA runs small programs in the
  calling thread; on a GPU a call only enqueues) and the rest: the engine's own work, which is
  what a GPU pays between programs;
- data-dependent loops and conditionals in the programs it ran, compiled with the GPU's structure
  (`early_exit.static_loops`; each a host round trip per iteration or run on a GPU);
- copies of a whole layer's cache in those programs (`control_flow.cache_copies`), and of the
  arguments they take (`control_flow.argument_copies`: each a kernel on a GPU).
Then the floor, measured in the same run: the full-depth decode program alone in a bare loop
(call it on its last outputs, start its packed read, read the one before: what a dispatch costs
with no engine at all), this thread's CPU µs per token. On a CPU that is mostly XLA running the
tiny program; no engine can cost less.

    python benchmarks/host_overhead.py [--modes full exit:softmax:0.9 1:1 draft:4 ...] [--new-tokens 64] [--overlap]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import os
import sys
import time
from unittest import mock

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

import eejax  # noqa: E402
from benchmarks.common import decoding_options, write_result  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.config import LlamaConfig  # noqa: E402
from eejax.decode import early_exit  # noqa: E402
from eejax.decode.control_flow import argument_copies, cache_copies, control_flow  # noqa: E402
from eejax.decode.slot_args import SlotArgs  # noqa: E402
from eejax.engine import dispatch as dispatch_module  # noqa: E402
from eejax.engine import transfers  # noqa: E402
from eejax.engine.engine import Engine  # noqa: E402
from eejax.loading.model import Model  # noqa: E402
from eejax.models import draft_head  # noqa: E402
from eejax.models.llama import init_params  # noqa: E402

MODES = ("full", "exit:softmax:0.9", "1:1", "draft:4", "draft:4:lookup", "draft:4:tree", "draft:4:adaptive")
PAGE = 16


def tiny_model() -> Model:
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        eos_token_ids=(1,),
    )
    params = init_params(config, jax.random.PRNGKey(0))
    params["draft"] = draft_head.init_draft(config, jax.random.PRNGKey(1), params=params)
    return Model(config, params)


@contextlib.contextmanager
def programs_wrapped(model: Model, wrap):
    """While open, every program the model's cache hands out is `wrap(fn, program)`, one wrapper
    per program: an adaptive policy times a program only once it ran before (`run_timed`), which
    a new wrapper at every dispatch would never have."""
    programs = model.programs
    get, get_soon = programs.get, programs.get_soon
    wrappers: dict = {}

    def wrapped(fn, program):
        if program not in wrappers:
            wrappers[program] = wrap(fn, program)
        return wrappers[program]

    def get_wrapped(fn, args, *rest, **kw):
        return wrapped(fn, get(fn, args, *rest, **kw))

    def get_soon_wrapped(fn, args, *rest, **kw):
        program, used = get_soon(fn, args, *rest, **kw)
        return wrapped(fn, program), used

    with mock.patch.object(programs, "get", get_wrapped), mock.patch.object(programs, "get_soon", get_soon_wrapped):
        yield


class Counts:
    """Programs run (by function), and arrays read back and sent, while installed."""

    def __init__(self):
        self.programs = collections.Counter()
        self.compiled = {}  # function name -> compiled programs it ran
        self.reads = self.sends = 0

    @contextlib.contextmanager
    def installed(self, model: Model):
        to_host, device_put, asarray = dispatch_module.to_host, jax.device_put, jax.numpy.asarray
        packed_read, send = dispatch_module.PackedRead.read, transfers.send

        def counted(fn, program):
            self.compiled.setdefault(fn.__name__, set()).add(program)

            def run(*args):
                self.programs[fn.__name__] += 1
                return program(*args)

            return run

        def to_host_counted(tree):
            self.reads += sum(isinstance(x, jax.Array) for x in jax.tree.leaves(tree))
            return to_host(tree)

        def packed_read_counted(packed):
            self.reads += 1
            return packed_read(packed)

        def sent(x):
            return isinstance(x, np.ndarray)

        def device_put_counted(x, *a, **kw):
            self.sends += sum(map(sent, jax.tree.leaves(x)))
            return device_put(x, *a, **kw)

        def send_counted(x):
            self.sends += 1
            return send(x)

        def asarray_counted(x, *a, **kw):
            self.sends += sent(x)
            return asarray(x, *a, **kw)

        with (
            programs_wrapped(model, counted),
            mock.patch.object(dispatch_module, "to_host", to_host_counted),
            mock.patch.object(dispatch_module.PackedRead, "read", packed_read_counted),
            mock.patch.object(jax, "device_put", device_put_counted),
            mock.patch.object(transfers, "send", send_counted),
            mock.patch.object(jax.numpy, "asarray", asarray_counted),
        ):
            yield self


class StepTimes:
    """This thread's CPU seconds in each `Engine.step` that prefilled nothing, and in the program
    calls inside it (`ProgramTime`), while installed: [(host s, in programs s)]."""

    def __init__(self, programs: ProgramTime):
        self.steps: list[tuple[float, float]] = []
        self._programs = programs

    @contextlib.contextmanager
    def installed(self):
        step = Engine.step

        def timed(engine):
            counts = engine.admission.counts
            prefills, programs, start = counts.prefills, self._programs.seconds, time.thread_time()
            step(engine)
            if counts.prefills == prefills:
                self.steps.append((time.thread_time() - start, self._programs.seconds - programs))

        with mock.patch.object(Engine, "step", timed):
            yield self


class ProgramTime:
    """This thread's CPU seconds inside program calls while installed: on a CPU, XLA running the
    program (small programs run in the calling thread) and JAX's dispatch; on a GPU only the
    latter. The rest of the host's time is the engine's own work, which a GPU pays as well.
    `serial`: each call returns once its program ran (the wait, asleep, costs this thread
    nothing), so that no program runs on the other core while the engine works: on this 2-vCPU
    machine a program's XLA threads running beside the engine slowed its Python 2-3x (the
    vCPUs share a core), which a GPU, running programs on its own chips, never does."""

    def __init__(self, serial: bool = False):
        self.seconds, self.serial = 0.0, serial

    @contextlib.contextmanager
    def installed(self, model: Model):
        def timed(fn, program):
            def run(*args):
                start = time.thread_time()
                try:
                    out = program(*args)
                    return jax.block_until_ready(out) if self.serial else out
                finally:
                    self.seconds += time.thread_time() - start

            return run

        with programs_wrapped(model, timed):
            yield self


def measure(mode: str, prompt: list[int], new_tokens: int, repeats: int, overlap: bool = False) -> dict:
    model = tiny_model()
    kw = dict(max_new_tokens=new_tokens, ignore_eos=True, page_size=PAGE, cache_budget="4MiB", **decoding_options(mode))

    def run(n: int):
        """(stats, this thread's CPU seconds in each decode step and in its program calls)."""
        programs = ProgramTime(serial=not overlap)
        times = StepTimes(programs)
        with programs.installed(model), times.installed():
            stats = eejax.generate(model, [prompt], **{**kw, "max_new_tokens": n}).stats
        return stats, times.steps

    run(1), run(new_tokens)  # compile
    runs = [run(new_tokens) for _ in range(repeats)]
    best = min((r[0] for r in runs), key=lambda s: s.run_s - s.prefill_s)
    decode_s, tokens = best.run_s - best.prefill_s, best.generated_tokens - 1  # the first: the prefill's
    steps = [step for _, times in runs for step in times]
    host_step, in_programs_step = float(np.median([h for h, _ in steps])), float(np.median([p for _, p in steps]))
    engine_step = float(np.median([h - p for h, p in steps]))
    steps_per_token = len(steps) / (repeats * tokens)
    with Counts().installed(model) as counts:
        stats = eejax.generate(model, [prompt], **kw).stats
    dispatches = sum(n for name, n in counts.programs.items() if not name.startswith("prefill"))
    # The same programs compiled with the GPU's structure, for their control flow and cache copies.
    gpu = dataclasses.replace(model, programs=type(model.programs)())
    with mock.patch.object(early_exit, "static_loops", lambda: True), Counts().installed(gpu) as gpu_counts:
        eejax.generate(gpu, [prompt], **kw)
    loops = conditionals = copies = copied_in = 0
    for name, compiled in gpu_counts.compiled.items():
        if name.startswith("prefill"):
            continue
        for program in compiled:
            text = program.as_text()
            flow = control_flow(text)
            loops, conditionals = loops + flow.dynamic_loops, conditionals + flow.conditionals
            copies += cache_copies(text, layer_elements(gpu, stats))
            copied_in += argument_copies(text)
    return dict(
        mode=mode,
        us_per_token=1e6 * decode_s / tokens,
        host_us_per_token=1e6 * host_step * steps_per_token,
        host_us_per_step=1e6 * host_step,
        programs_us_per_step=1e6 * in_programs_step,
        engine_us_per_step=1e6 * engine_step,
        engine_us_per_token=1e6 * engine_step * steps_per_token,
        us_per_step=1e6 * decode_s / max(best.engine_steps - 1, 1),
        tokens_per_round=best.tokens_per_round,
        programs_per_token=dispatches / (stats.generated_tokens - 1),
        reads_per_dispatch=counts.reads / max(dispatches, 1),
        sends_per_dispatch=counts.sends / max(dispatches, 1),
        gpu_dynamic_loops=loops,
        gpu_conditionals=conditionals,
        cache_copies=copies,
        argument_copies=copied_in,
    )


def floor(prompt: list[int], repeats: int, serial: bool = True, dispatches: int = 48) -> float:
    """This thread's CPU µs per token of full depth's steady decode program (the one the engine
    dispatched most: `steps_per_dispatch` steps over one block-table width) alone in a bare loop:
    the program called on its own last state and cache, its packed read started, the previous one
    read; `serial`: each program ended before the host goes on (as `ProgramTime`). A loop runs
    the program as often as the engine did, from the inputs it first had (so its row never runs
    out of pages), until `dispatches`; the median over `repeats` of those, tokens counted by the
    row's own count."""
    model = tiny_model()
    calls, captured = collections.Counter(), {}

    def capture(fn, program):
        def run(*args):
            if fn.__name__ == "decode_slots":
                calls[program] += 1
                captured.setdefault(program, jax.tree.map(lambda x: x.copy(), args))
            return program(*args)

        return run

    kw = dict(max_new_tokens=256, ignore_eos=True, page_size=PAGE, cache_budget="4MiB", spec=None)
    with programs_wrapped(model, capture):
        eejax.generate(model, [prompt], **kw)
    (program, runs), *_ = calls.most_common(1)
    medians = []
    for _ in range(repeats + 1):  # the first warms up
        times, tokens = [], 0
        while len(times) < dispatches:
            args = SlotArgs(*jax.tree.map(lambda x: x.copy(), captured[program]))  # `DeviceSlots.program`'s
            made, previous = np.asarray(args.state.num_generated).copy(), None
            for _ in range(runs):
                start = time.thread_time()
                state, cache, counters, packed = program(*args)
                args = args._replace(state=state, cache=cache, spec_counters=counters)
                if serial:
                    jax.block_until_ready(packed)
                packed.copy_to_host_async()
                if previous is not None:
                    np.asarray(previous)
                previous = packed
                times.append(time.thread_time() - start)
            tokens += int(np.sum(np.asarray(args.state.num_generated) - made))
        medians.append(float(np.median(times)) * len(times) / tokens)
    return 1e6 * float(np.median(medians[1:]))


def layer_elements(model: Model, stats) -> int:
    """One layer's keys over every page of the cache a generate call of `stats` made."""
    c = model.config
    return c.num_kv_heads * stats.kv_cache_pages * stats.page_size * c.head_dim


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", nargs="+", action="extend", default=None, help=f"default: {' '.join(MODES)}")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per mode (the fastest kept)")
    parser.add_argument("--name", default="host_overhead", help="output name under benchmarks/out/")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="let programs run while the engine works, as it does (default: each program ends before "
        "the engine goes on, so that on a CPU its XLA threads do not slow the engine's: see ProgramTime)",
    )
    args = parser.parse_args()
    if args.new_tokens < 2 or args.repeats < 1 or args.prompt_tokens < 1:
        parser.error("--new-tokens must be >= 2, --repeats and --prompt-tokens >= 1")
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, 512, args.prompt_tokens)]
    rows = []
    header = (
        "| mode | µs/token | µs/step | host µs/token | host µs/step | in programs µs/step | engine µs/step "
        "| engine µs/token "
        "| tokens/round | programs/token "
        "| reads/dispatch | sends/dispatch "
        "| GPU loops | GPU conds | cache copies | argument copies |"
    )
    print(header + "\n|" + "---|" * header.count(" | ") + "---|", flush=True)
    for mode in args.modes or MODES:
        r = measure(mode, prompt, args.new_tokens, args.repeats, args.overlap)
        rows.append(r)
        tau = "-" if r["tokens_per_round"] is None else f"{r['tokens_per_round']:.2f}"
        print(
            f"| {mode} | {r['us_per_token']:.0f} | {r['us_per_step']:.0f} | {r['host_us_per_token']:.0f} "
            f"| {r['host_us_per_step']:.0f} | {r['programs_us_per_step']:.0f} | {r['engine_us_per_step']:.0f} "
            f"| {r['engine_us_per_token']:.0f} "
            f"| {tau} | {r['programs_per_token']:.2f} "
            f"| {r['reads_per_dispatch']:.1f} | {r['sends_per_dispatch']:.1f} | {r['gpu_dynamic_loops']} "
            f"| {r['gpu_conditionals']} | {r['cache_copies']} | {r['argument_copies']} |",
            flush=True,
        )
    bare = floor(prompt, args.repeats, serial=not args.overlap)
    line = f"\nfloor: full depth's program alone in a bare loop (no engine): {bare:.0f} host µs a token"
    full = next((r for r in rows if r["mode"] == "full"), None)
    if full is not None:
        line += f"; full depth in the engine: {full['host_us_per_token'] / bare:.2f}x that"
    print(line, flush=True)
    payload = {"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows, "floor_us_per_token": bare}
    write_result(args.name, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
