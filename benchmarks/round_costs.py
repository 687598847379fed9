"""What one speculation round costs, in full-depth steps, without the engine around it: each
setting's round (drafts + one verify pass + the draft's catch-up) as one jitted program on the
same prefilled rows (CNN/DM evaluation row 0.., a --prompt-tokens summary prompt), timed against
one full-depth decode step, medians of --repeats alternating runs; with --per-program N, programs of
N steps and of N rounds (the engine's dispatch: 4), each cost divided by N. Each program gets its own copy
of the cache, donated as the engine donates it (made outside the timing), so no program pays a
copy of the cache the engine never makes. On a CPU a verify pass costs more per position it
scores (`verified rows` = rows x positions); this is what a tree of drafts pays for its extra
nodes. A prompt lookup's round (`draft:d:lookup`) is timed twice: with every row copying and with
no row matching. With --verify-only, each chain's verify pass is also timed alone (its positions
given, no draft pass run): what the round's price is besides its drafts. With a draft head, the
plain step its rows run while their speculation is on (the draft layer catching up over the
step's position: "catch-up step") is timed too.

    python benchmarks/round_costs.py [--batch 1] [--specs draft:2 draft:4 draft:2:tree draft:4:tree] \
        [--quantization gguf|int8] [--activations float32|int16|int8] [--prompt-activations int16] \
        [--per-program 4] [--verify-only]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import add_quantization_args, load_model, write_result  # noqa: E402
from benchmarks.early_exit import summary_prompts  # noqa: E402
from eejax.cache import init_cache  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.decode import speculative, steps  # noqa: E402
from eejax.decode.drafts import Drafts  # noqa: E402
from eejax.decode.lookup import PromptTokens  # noqa: E402
from eejax.decode.sampling import RowSampling, SamplingParams  # noqa: E402
from eejax.models.modules import embed  # noqa: E402
from eejax.options import SpecConfig, StepOptions  # noqa: E402

PAGE = 16


def prefilled(model, prompts, new_tokens: int):
    """(state, cache, block table) after a full-depth greedy prefill of `prompts`."""
    c, b, t = model.config, len(prompts), max(map(len, prompts))
    tokens = np.zeros((b, t), np.int32)
    for i, p in enumerate(prompts):
        tokens[i, : len(p)] = p
    per_row = -(-(t + new_tokens) // PAGE)
    table = jnp.asarray(1 + np.arange(b * per_row, dtype=np.int32).reshape(b, per_row))
    cache = init_cache(model.cache_layers, 1 + b * per_row, PAGE, c.num_kv_heads, c.head_dim, model.dtype)
    state, cache = steps.prefill(
        model.run_params,
        cache,
        jnp.asarray(tokens),
        jnp.asarray([len(p) for p in prompts], jnp.int32),
        table,
        jax.random.PRNGKey(0),
        sampling=RowSampling.of(SamplingParams(), b),
        config=c,
        options=StepOptions(new_tokens),
    )
    return state, cache, table


def with_prompts(state, copied: bool):
    """`state` with a prompt lookup's prompts: in each row 7, its first new token, 1, 2, 3, 4, 7,
    so that its history ends in "7 first" again and the lookup copies min(k, 6) drafts (`copied`),
    or a prompt of one -1, which nothing matches (the head drafts every row)."""
    b = state.last_token.shape[0]
    first = np.asarray(state.last_token)
    if copied:
        tokens = np.stack([[7, int(f), 1, 2, 3, 4, 7] for f in first]).astype(np.int32)
    else:
        tokens = np.full((b, 1), -1, np.int32)  # no token equals -1: nothing matches
    return dataclasses.replace(
        state, prompt=PromptTokens(jnp.asarray(tokens), jnp.full((b,), tokens.shape[1], jnp.int32))
    )


def round_program(config, table, batch: int, spec: SpecConfig, rounds: int = 1):
    """`rounds` rounds of `spec` (each its d drafts, the verify pass with the bonus, the
    acceptance) as one jitted program of (params, cache, state), the cache donated."""
    options = StepOptions(64, spec=spec).round(spec.num_speculations, bonus=True)

    def run(params, cache, state):
        counters = speculative.SpecCounters.zeros(batch)
        for _ in range(rounds):
            drafting = options.drafting()
            drafts, state, cache = speculative.draft(params, cache, state, table, config=config, options=drafting)
            verifying = options.verifying()
            state, cache, counters = speculative.verify(
                params, cache, state, drafts, counters, table, config=config, options=verifying
            )
        return state, cache, counters

    return jax.jit(run, donate_argnums=(1,))


def verify_program(config, table, batch: int, spec: SpecConfig, rounds: int = 1):
    """`rounds` verify passes of a chain `spec`'s positions (each row's last token, then
    spec.positions_ahead drafts of token 0: a rejection at the first) with no draft pass, as one
    jitted program of (params, cache, state), the cache donated."""
    options = StepOptions(64, spec=spec).round(spec.num_speculations, bonus=True).verifying()
    zeros = jnp.zeros((batch, spec.positions_ahead), jnp.int32)

    def run(params, cache, state):
        counters = speculative.SpecCounters.zeros(batch)
        for _ in range(rounds):
            tokens = jnp.concatenate([state.last_token[:, None], zeros], axis=1)
            drafts = Drafts(tokens=tokens, hidden=embed(params, tokens), probs=jnp.zeros((batch, zeros.shape[1], 0)))
            state, cache, counters = speculative.verify(
                params, cache, state, drafts, counters, table, config=config, options=options
            )
        return state, cache, counters

    return jax.jit(run, donate_argnums=(1,))


def steps_program(config, table, num_steps: int = 1):
    """`num_steps` full-depth decode steps as one jitted program (the engine's dispatch)."""
    options = StepOptions(64).decoding(num_steps)
    return jax.jit(
        lambda params, cache, state: steps.decode_steps(params, cache, state, table, config=config, options=options),
        donate_argnums=(1,),
    )


def catch_up_program(config, table, batch: int, spec: SpecConfig, num_steps: int = 1):
    """`num_steps` plain full-depth steps as an adaptive draft head's rows run them while their
    speculation is on (`speculative.plain_step`: the draft layer then catches up over their
    positions), as one jitted program of (params, cache, state), the cache donated."""
    options = StepOptions(64, spec=spec).plain(num_steps, catch_up=True)

    def run(params, cache, state):
        counters = speculative.SpecCounters.zeros(batch)
        return speculative.plain_step(params, cache, state, counters, table, config=config, options=options)

    return jax.jit(run, donate_argnums=(1,))


def setting_programs(model, specs, state, table, batch: int, per_program: int = 1, verify_only=False) -> dict:
    """{name: (program, its input state)}: `per_program` full-depth steps, as many plain steps with
    the draft head's catch-up ("catch-up step") and as many rounds of each spec, a program each (a
    lookup's twice: every row copying, no row matching); with `verify_only`, each chain's verify
    passes alone too ("verify of SPEC")."""
    programs = {"full-depth step": (steps_program(model.config, table, per_program), state)}
    head = next((s for s in specs if s.draft_head), None)
    if head is not None:
        programs["catch-up step"] = (catch_up_program(model.config, table, batch, head, per_program), state)
    for s in specs:
        if verify_only and s.tree is None:
            programs[f"verify of {s.spec}"] = (verify_program(model.config, table, batch, s, per_program), state)
        program = round_program(model.config, table, batch, s, per_program)
        if s.lookup:
            programs[f"{s.spec} (copied)"] = (program, with_prompts(state, True))
            programs[f"{s.spec} (no match)"] = (program, with_prompts(state, False))
        else:
            programs[s.spec] = (program, state)
    return programs


def median_seconds(programs: dict, params, cache, repeats: int) -> dict[str, float]:
    """{name: median wall seconds of one blocking run}, the programs alternating over `repeats`
    rounds after two warm-up rounds; each run gets its own copy of `cache` (donated), made
    outside the timing."""
    seconds = {name: [] for name in programs}
    for rep in range(repeats + 2):
        for name, (program, state_in) in programs.items():
            own = jax.block_until_ready(jax.tree.map(jnp.copy, cache))
            start = time.perf_counter()
            jax.block_until_ready(program(params, own, state_in))
            if rep >= 2:  # the first runs compile and warm up
                seconds[name].append(time.perf_counter() - start)
    return {name: float(np.median(s)) for name, s in seconds.items()}


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-eagle", help="an eejax model with a draft head")
    parser.add_argument("--batch", type=int, default=1, help="rows (CNN/DM evaluation rows 0..)")
    parser.add_argument("--specs", nargs="+", action="extend", default=None, help="fixed speculation settings")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each program (median kept)")
    parser.add_argument(
        "--per-program",
        type=int,
        default=1,
        help="steps and rounds a program runs, as the engine dispatches them (its steps_per_dispatch: 4)",
    )
    parser.add_argument(
        "--verify-only", action="store_true", help="also time each chain's verify pass alone (no draft pass)"
    )
    parser.add_argument("--layer-buffers", choices=("stacked", "split"), default="split")
    parser.add_argument("--name", default="round_costs", help="output name under benchmarks/out/")
    add_quantization_args(parser)
    args = parser.parse_args()
    specs = [SpecConfig.parse(s) for s in (args.specs or ["draft:2", "draft:4", "draft:2:tree", "draft:4:tree"])]
    if any(s.adaptive for s in specs):
        parser.error("--specs takes fixed settings (an adaptive round is one of them)")
    if args.per_program < 1:
        parser.error(f"--per-program must be >= 1, got {args.per_program}")
    model = load_model(args, args.model)
    prompts, _ = summary_prompts(model.tokenizer, args.batch, args.prompt_tokens)
    state, cache, table = prefilled(model, prompts, 64)
    programs = setting_programs(model, specs, state, table, args.batch, args.per_program, args.verify_only)
    seconds = {
        k: v / args.per_program for k, v in median_seconds(programs, model.run_params, cache, args.repeats).items()
    }
    step_s = seconds["full-depth step"]
    rows = []
    print("| setting | verified rows | ms | steps |\n|---|---|---|---|")
    by_name = {
        name: next((s for s in specs if name.removeprefix("verify of ").split(" ")[0] == s.spec), None)
        for name in programs
    }
    for name, spec in by_name.items():
        ms = 1e3 * seconds[name]
        verified = args.batch * (1 if spec is None else spec.positions_ahead + 1)
        rows.append(dict(setting=name, verified_rows=verified, ms=ms, steps=ms / 1e3 / step_s))
        print(f"| {name} | {verified} | {ms:.1f} | {ms / 1e3 / step_s:.2f} |", flush=True)
    write_result(args.name, {"args": vars(args), "device": jax.devices()[0].device_kind, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
