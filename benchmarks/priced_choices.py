"""What a priced `spec="auto"` chooses on a CPU at batch 1, counted, and what those choices cost at
given round prices. A priced policy (`spec_policy.round_prices`) times nothing: its choices follow
the drafts' acceptance alone, which greedy decoding makes the same in every run, so the speed-up
they imply at a set of prices is free of the machine's drift (2-core VMs move 3-8% between paired
runs of the same setting), where a timed run of `auto` against full depth is not.

Per set (`benchmarks/eval_sets.py`, 8 prompts, --new-tokens greedy tokens a row, EOS ignored,
tokens checked against full depth), it counts what each of the speculating rows' programs ran
(`Speculation.dispatch`, wrapped): rounds of each d, plain steps while speculation is on (with the
draft's catch-up) and plain steps once it is off, scaled to the rounds and plain steps the rows'
counters say they ran (a row's last program ends with it: it is counted whole). Each --prices
(a round's cost in full-depth steps by d; 0: the catch-up plain step, default 1) prices them:
the speed-up is the decoded tokens over their cost in steps. --policy-prices and
--turn-off-margin set what the policy is given in place of the shipped table and margin (what-if).

    python benchmarks/priced_choices.py [--model smollm2-135m-eagle-chat] [--sets cnndm mtbench pydoc code chat] \
        [--quantization gguf --activations int16] [--prices 0=1.02,1=1.25,2=1.51 ...] \
        [--policy-prices 1=1.42,2=1.47] [--turn-off-margin 0.05]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eejax  # noqa: E402
from benchmarks.common import add_quantization_args, load_model, write_result  # noqa: E402
from benchmarks.eval_sets import SETS, prompts  # noqa: E402
from eejax.cli.parsing import OneLineErrorParser  # noqa: E402
from eejax.decode import spec_policy  # noqa: E402
from eejax.engine import speculation  # noqa: E402

OFF, CATCH_UP = "off", "catch-up"


def parse_prices(text: str) -> dict[int, float]:
    """ "0=1.04,1=1.37,2=1.56" -> {0: 1.04, 1: 1.37, 2: 1.56} (d -> full-depth steps)."""
    try:
        prices = {int(d): float(p) for d, p in (item.split("=") for item in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(f"prices are d=steps pairs, like 1=1.37,2=1.56; got {text!r}") from None
    if any(d < 0 or p <= 0 for d, p in prices.items()):
        raise argparse.ArgumentTypeError(f"prices need d >= 0 and steps > 0; got {text!r}")
    return prices


class ChoiceCounter:
    """Counts, per program the engine's `Speculation` dispatches, what it ran: d (rounds), CATCH_UP
    (plain steps with the draft's catch-up) or OFF (plain steps of rows whose speculation is off)."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        choose, dispatch = spec_policy.SpeculationPolicy.next_speculations, speculation.Speculation.dispatch
        last = {}  # what the policy answered for the program being dispatched

        def next_speculations(policy):
            d = choose(policy)
            last.update(d=d, off=policy.turned_off)
            return d

        def counted(engine_part, table, group, options, members, decode_steps):
            last.clear()
            made = dispatch(engine_part, table, group, options, members, decode_steps)
            kind = OFF if options.spec_off or last.get("off") else (CATCH_UP if last["d"] == 0 else last["d"])
            self.counts[kind] += made
            return made

        spec_policy.SpeculationPolicy.next_speculations = next_speculations
        speculation.Speculation.dispatch = counted

    def take(self, stats, decoded: int) -> dict:
        """The counts since the last call, scaled to `stats`' rounds and plain steps (of `decoded`
        tokens: the rows' first tokens come from their prefills)."""
        counts, self.counts = self.counts, collections.Counter()
        plain = sum(n for k, n in counts.items() if k in (OFF, CATCH_UP))
        rounds = sum(n for k, n in counts.items() if k not in (OFF, CATCH_UP))
        plain_true = stats.plain_step_rate * decoded
        return {
            k: n * ((plain_true / plain if plain else 0.0) if k in (OFF, CATCH_UP) else stats.rounds / rounds)
            for k, n in counts.items()
        }


def speedup(counts: dict, decoded: int, prices: dict[int, float]) -> float:
    """Decoded tokens over the counted programs' cost in full-depth steps at `prices`."""
    cost = {OFF: 1.0, CATCH_UP: prices.get(0, 1.0), **{d: p for d, p in prices.items() if d > 0}}
    missing = {k for k in counts if k not in cost}
    if missing:
        raise SystemExit(f"--prices has no price for d = {sorted(missing)}")
    return decoded / sum(n * cost[k] for k, n in counts.items())


def main() -> int:
    parser = OneLineErrorParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-eagle-chat", help="an eejax model with a draft head")
    parser.add_argument("--sets", nargs="+", action="extend", choices=SETS, default=None)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument(
        "--prices",
        type=parse_prices,
        action="append",
        default=None,
        help="d=steps,... to price the choices at (repeat for several; default: the policy's own)",
    )
    parser.add_argument("--policy-prices", type=parse_prices, default=None, help="the policy's prices (what-if)")
    parser.add_argument("--turn-off-margin", type=float, default=None, help="the priced turn-off margin (what-if)")
    parser.add_argument("--layer-buffers", choices=("stacked", "split"), default="split")
    parser.add_argument("--name", default="priced_choices", help="output name under benchmarks/out/")
    add_quantization_args(parser)
    args = parser.parse_args()
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be >= 2, got {args.new_tokens}")
    if args.turn_off_margin is not None and not 0.0 <= args.turn_off_margin < 1.0:
        parser.error(f"--turn-off-margin is an acceptance in [0, 1), got {args.turn_off_margin}")
    if not spec_policy.on_cpu():
        parser.error("priced rounds are a CPU's (`spec_policy.round_prices`); here `auto` times its rounds")
    model = load_model(args, args.model)
    if model.quantization is not None:
        table = spec_policy.CPU_BLOCK_ROUND_STEPS
    else:
        table = spec_policy.CPU_FLOAT_ROUND_STEPS if model.drafts_in_blocks else spec_policy.CPU_FLOAT_DRAFT_ROUND_STEPS
    if args.policy_prices is not None and set(table) - set(args.policy_prices):
        parser.error(f"--policy-prices needs a price for every d of the table: {sorted(table)}")
    if args.policy_prices is not None:
        table.clear()
        table.update(args.policy_prices)
    if args.turn_off_margin is not None:
        spec_policy.PRICED_TURN_OFF_MARGIN = args.turn_off_margin
    price_sets = args.prices or [dict(table)]
    counter = ChoiceCounter()
    rows = []
    header = " | ".join(",".join(f"{d}={p}" for d, p in sorted(prices.items())) for prices in price_sets)
    print(f"| set | τ | rounds by d, catch-up and off steps | {header} |\n|---|---|---|" + "---|" * len(price_sets))
    for name in args.sets or SETS:
        asked = prompts(model.tokenizer, name, 8)
        kw = dict(max_new_tokens=args.new_tokens, ignore_eos=True, batch_size=1)
        full = eejax.generate(model, asked, spec=None, **kw)  # no speculation: nothing counted
        out = eejax.generate(model, asked, spec="auto", **kw)
        if out.stats.rounds is None:
            raise SystemExit(f"{args.model} has no draft head: `auto` decodes it at full depth")
        if out.tokens != full.tokens:
            raise SystemExit(f"{name}: auto's tokens differ from full depth's")
        decoded = out.stats.generated_tokens - len(asked)
        counts = counter.take(out.stats, decoded)
        speedups = [speedup(counts, decoded, prices) for prices in price_sets]
        rows.append(dict(set=name, tau=out.stats.tokens_per_round, counts=counts, speedups=speedups))
        shown = ", ".join(f"{k}: {n:.0f}" for k, n in sorted(counts.items(), key=str))
        cells = " | ".join(f"{s:.3f}x" for s in speedups)
        print(f"| {name} | {out.stats.tokens_per_round:.2f} | {shown} | {cells} |", flush=True)
    write_result(args.name, {"args": vars(args), "prices": price_sets, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
