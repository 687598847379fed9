"""Host round trips per decode step on a GPU, counted from the programs compiled on this CPU.

XLA's GPU runtime reads a `while` loop's predicate back to the host after every iteration (and
once more to leave) unless the loop's trip count is known at compile time, and a
`conditional`'s branch index every time it runs: each is a device-to-host copy and a stream
synchronisation, 10-20 us, as much as one small decoder layer. For each configuration this
prints the decode programs' loops and conditionals (from their optimised HLO,
`eejax.decode.control_flow`), once with the CPU's structure (traced loops) and once with the
GPU's (`early_exit.static_loops`: KV fill of known trip count, no conditional around the
reduced-head check), and the round trips per decode step for the exit layers the run took.

    python benchmarks/host_round_trips.py [--new-tokens 24] [--batch 4]

Full depth, `static:E` and self-speculation's draft and verify programs have no data-dependent
control flow (one host read per step or round, for the tokens, in every configuration).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.common import cnndm_prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402

CONFIGS = (  # (model, exit option)
    ("smollm2-135m-layerskip", "softmax:0.9"),  # checks at the trained exits 8, 12, 15, 18, 22 (reduced head)
    ("smollm2-135m-layerskip", "state:0.99"),
    ("smollm2-135m", "softmax:0.9"),  # a check after every layer from min_exit_layer
    ("smollm2-135m-layerskip", "static:15"),
    ("smollm2-135m-layerskip", None),
)


def round_trips_per_step(
    bounds, exit_layer: int, *, measure: str, reduced_check: bool, reuse: bool, static: bool
) -> int:
    """Round trips of one early-exit step that exits at `exit_layer` (a value of `bounds`, the
    segment boundaries 0, c_1, ..., c_m, L), by the step's structure (`decode.early_exit`)."""
    num_layers = bounds[-1]
    s = bounds.index(exit_layer)  # segments run
    lengths = [b - a for a, b in zip(bounds, bounds[1:])]
    short = 1 if measure == "state" else 0  # the state measure runs each segment's last layer on its own
    # The layers of each segment in a traced loop (one trip per layer, one to leave); with static
    # loops, those beyond the shortest segment's only, and no loop when all are equally long.
    common = max(min(lengths) - short, 0) if static else 0
    traced = 0 if static and len(set(lengths)) == 1 else sum(n - short - common + 1 for n in lengths[:s])
    return (
        s
        + 1  # the segment loop: one per segment, one to leave
        + traced
        + (s if reduced_check and not static else 0)  # the conditional around the reduced check
        + (0 if reuse else 1)  # the exit head's conditional: the emit head below L, the model's at L
        + (0 if static else num_layers - exit_layer + 1)
    )  # KV fill with a traced start


def main() -> None:
    parser = OneLineErrorParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=160)
    args = parser.parse_args()

    import eejax
    from eejax.decode import early_exit

    original = early_exit.static_loops
    models = {}
    print(f"{'model':24} {'exit':12} {'layers':>6} {'structure':9} {'loops':>5} {'conds':>5} {'round trips/step':>16}")
    try:
        for name, option in CONFIGS:
            if name not in models:
                models[name] = eejax.load(name, quantization=None)
            prompts = cnndm_prompts(models[name].tokenizer, args.batch, args.prompt_tokens)
            for static in (False, True):
                early_exit.static_loops = lambda static=static: static
                print(row(models[name], name, option, prompts, args.new_tokens, static), flush=True)
    finally:
        early_exit.static_loops = original


def row(base, name: str, option: str | None, prompts, new_tokens: int, static: bool) -> str:
    """One configuration's table row: mean layers, the decode programs' data-dependent loops and
    conditionals, round trips per step."""
    import eejax
    from eejax.decode.control_flow import control_flow
    from eejax.models.exits import has_reduced_head, resolve_options
    from eejax.options import ExitConfig

    model = eejax.Model(base.config, base.params, base.tokenizer)  # its own programs
    res = eejax.generate(model, prompts, max_new_tokens=new_tokens, ignore_eos=True, exit=option)
    flows = [control_flow(p.as_text()) for fn, p in model.programs.compiled() if fn == "decode_slots"]
    loops, conds = max(f.dynamic_loops for f in flows), max(f.conditionals for f in flows)
    steps = res.exit_layers[0][1:]  # the batch's exit layer per step (the first token is the prefill's)
    per_step = 0.0
    if loops or conds:
        config = resolve_options(model.params, model.config, exit=ExitConfig.parse(option))[0]
        bounds = (0,) + config.check_layers(model.config.num_layers) + (model.config.num_layers,)
        reduced_check, reduced_emit = config.uses_reduced_head(has_reduced_head(model.params.get("exits")))
        reuse = config.measure == "softmax" and not (reduced_check or reduced_emit)
        # The structure the formula assumes, read from the HLO: it cannot drift silently.
        uniform = len({b - a for a, b in zip(bounds, bounds[1:])}) == 1
        assert loops == (1 + (not uniform) if static else 3), loops
        assert conds == (reduced_check and not static) + (not reuse), conds
        per_step = sum(
            round_trips_per_step(
                bounds, e, measure=config.measure, reduced_check=reduced_check, reuse=reuse, static=static
            )
            for e in steps
        ) / len(steps)
    return (
        f"{name:24} {str(option):12} {sum(steps) / len(steps):6.1f} {'GPU' if static else 'CPU':9} {loops:5} "
        f"{conds:5} {per_step:16.1f}"
    )


if __name__ == "__main__":
    main()
