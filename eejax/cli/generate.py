"""`eejax generate`: continuations of prompts at full depth, with early exit or by self-speculation."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

from eejax.cli.args import (
    add_model_and_prompts,
    add_model_placement,
    add_processes,
    add_sampling_args,
    join_processes,
    layer_counts,
    load_model,
    number_or_off,
    positive_int,
    prompts_from_args,
    sampling_of,
)
from eejax.errors import EejaxError
from eejax.options import DEFAULT_SPEC, check_exit_or_spec, is_auto, is_off


def cmd_generate(args: argparse.Namespace) -> int:
    import eejax

    prompts = prompts_from_args(args)
    exit_config = None
    if args.exit is not None:
        decay = None if args.exit_decay in ("off", "none") else number_or_off(args.exit_decay, "--exit-decay")
        exit_config = eejax.ExitConfig.parse(
            args.exit,
            decay=decay,
            min_exit_layer=args.min_exit_layer,
            every=args.exit_every,
            exit_layers=args.exit_layers,
            head=args.exit_head or "auto",
            emit=args.exit_emit or "full",
        )
    elif (args.exit_decay, args.min_exit_layer, args.exit_every) != ("4", 1, 1) or any(
        x is not None for x in (args.exit_layers, args.exit_head, args.exit_emit)
    ):
        raise EejaxError(
            "--exit-decay, --min-exit-layer, --exit-every, --exit-layers, --exit-head and --exit-emit need --exit"
        )
    spec = None
    check_exit_or_spec(exit_config, args.spec, ("--exit", "--spec"))
    named = is_auto(args.spec) or is_off(args.spec)
    if named and any(x is not None for x in (args.spec_max_d, args.spec_head, args.spec_bonus)):
        raise EejaxError(f"--spec {args.spec} takes no --spec-max-d, --spec-head or --spec-bonus (auto sets its own)")
    if named:
        spec = args.spec
    elif args.spec is not None:
        given = (("max_speculations", args.spec_max_d), ("head", args.spec_head))
        options = {name: value for name, value in given if value is not None}
        if args.spec_bonus is not None:  # E:d's alone: a draft head's round always verifies d + 1
            options["bonus"] = {"on": True, "off": False, "auto": None}[args.spec_bonus]
        spec = eejax.SpecConfig.parse(args.spec, **options)
    if args.spec_max_d is not None and not named and not (spec and spec.adaptive):
        raise EejaxError("--spec-max-d needs an adaptive --spec (E:d:adaptive or draft:d:adaptive)")
    if spec is None and not named and (args.spec_head or args.spec_bonus):
        raise EejaxError("--spec-head and --spec-bonus need --spec")
    join_processes(args)
    # Collective libraries (gloo) print on stdout; the result must be alone there.
    with _stdout_to_stderr(args.num_processes > 1):
        model = load_model(args)
        result = eejax.generate(
            model,
            prompts,
            max_new_tokens=args.max_new_tokens,
            sampling=sampling_of(args),
            seed=args.seed,
            ignore_eos=args.ignore_eos,
            batch_size=args.batch_size,
            cache_budget=args.cache_budget,
            truncate_prompt_tokens=args.truncate_prompt_tokens,
            exit=exit_config,
            spec=DEFAULT_SPEC if args.spec is None else spec,
        )
    stats = result.stats
    if args.num_processes > 1 and args.process_id != 0:
        return 0  # every process computed the same result; process 0 prints it
    if args.json:
        outputs = [
            {"prompt": p, "text": t, "tokens": toks, "exit_layers": layers, "confident_layers": confident}
            for p, t, toks, layers, confident in zip(
                prompts, result.texts, result.tokens, result.exit_layers, result.confident_layers
            )
        ]
        json.dump({"outputs": outputs, "stats": stats.as_dict()}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for i, (p, t) in enumerate(zip(prompts, result.texts)):
        shown = p if len(p) <= 300 else p[:300] + " ..."
        print(f"=== prompt {i} ===\n{shown}\n--- generated ({len(result.tokens[i])} tokens) ---\n{t}\n")
    print(
        f"{stats['generated_tokens']} tokens in {stats['run_s']:.2f} s: {stats['tokens_per_s']:.1f} tokens/s "
        f"(compile {stats['compile_s']:.1f} s, {stats['compiled_programs']} programs); "
        f"mean layers per token {stats['mean_layers_per_token']:.1f} of {stats['num_layers']} "
        + (
            f"(exit {stats['exit']}, KV fill {stats['kv_fill_layers_per_token']:.1f} layers per token)"
            if stats["spec"] is None
            else f"(self-speculation {stats['spec']}: acceptance {stats['acceptance_rate']:.1%}, "
            f"{stats['tokens_per_round']:.2f} tokens per round, mean d {stats['mean_speculations']:.1f}"
            + (f", {stats['plain_step_rate']:.0%} of tokens by plain steps" if stats["plain_step_rate"] else "")
            + ")"
        )
    )
    return 0


@contextlib.contextmanager
def _stdout_to_stderr(active: bool):
    """While active, what anything in this process writes to file descriptor 1 goes to 2."""
    if not active:
        yield
        return
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def add_parsers(sub) -> None:
    """Adds this module's commands to the `eejax` subparsers."""
    gen = sub.add_parser(
        "generate",
        help="generate text for prompts",
        description="Generate continuations for prompts, at full depth, with early exit (--exit) or by "
        "self-speculation (--spec). With "
        '--json, stdout is one JSON object: {"outputs": [{"prompt", "text", "tokens", "exit_layers", '
        '"confident_layers"}], "stats": {"tokens_per_s", "generated_tokens", "mean_layers_per_token", '
        '"kv_fill_layers_per_token", "num_layers", "compile_s", ...}}; tokens are the generated ids only, '
        "exit_layers the layers run for each token (the batch's exit layer; the first token comes from the "
        "full-depth prompt pass; with --spec, E for an accepted draft and L for a token of the full model), "
        "confident_layers the row's own first confident layer, and tokens_per_s excludes compilation. "
        "With --spec, stats add acceptance_rate, tokens_per_round, drafted_tokens, accepted_tokens, rounds, "
        "mean_speculations (mean d of the rounds), bonus_pass_rate, and plain_step_rate (the share of tokens "
        "an adaptive run decoded at full depth because no round paid).",
    )
    add_model_and_prompts(
        gen, "prompts", 'eejax checkpoint directory, or a known name such as "smollm2-135m" (see `eejax models`)'
    )
    gen.add_argument(
        "--max-new-tokens", type=positive_int, default=64, help="tokens to generate per prompt (default 64)"
    )
    gen.add_argument("--batch-size", type=positive_int, help="rows decoded together (default: all prompts)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS: always generate --max-new-tokens")
    add_sampling_args(gen)
    gen.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    gen.add_argument(
        "--truncate-prompt-tokens", type=positive_int, metavar="N", help="keep the first N tokens of each prompt"
    )
    gen.add_argument("--cache-budget", default="1GiB", help="KV cache memory budget, e.g. 512MiB, 2GiB (default 1GiB)")
    gen.add_argument(
        "--exit",
        metavar="SPEC",
        help="early exit: none (the exit loop at full depth), static:E (always run E layers), softmax:λ "
        "(top-1 minus top-2 probability of the exit head > λ), state:λ (cosine of the hidden state before "
        "and after a layer > λ), classifier:λ (trained exit classifier's P(exit) > λ); λ may be inf or -inf. "
        "The batch exits when all its rows are confident. Default: plain full depth",
    )
    gen.add_argument(
        "--exit-decay",
        default="4",
        metavar="τ",
        help="CALM's decaying threshold λ(t) = clip(0.9λ + 0.1exp(-τt/N), 0, 1); 'off' keeps λ (default 4)",
    )
    gen.add_argument(
        "--min-exit-layer", type=positive_int, default=1, metavar="K", help="never exit before K layers ran (default 1)"
    )
    gen.add_argument(
        "--exit-every",
        type=positive_int,
        default=1,
        metavar="k",
        help="exit only after a multiple of k layers (default 1: after any layer)",
    )
    gen.add_argument(
        "--exit-layers",
        type=layer_counts,
        action="extend",
        metavar="E,E,...",
        help="check confidence only after these layer counts, e.g. 8,16,24 (default: the checkpoint's "
        "trained exits, else every layer allowed by --min-exit-layer / --exit-every)",
    )
    gen.add_argument(
        "--exit-head",
        choices=("auto", "full", "reduced"),
        help="head of the softmax checks: the reduced-vocabulary head of eejax exit-vocab, the full "
        "head, or auto (reduced when the checkpoint has one; default)",
    )
    gen.add_argument(
        "--exit-emit",
        choices=("full", "reduced"),
        help="head of the token at an early exit (default full: one full-head evaluation per exit)",
    )
    gen.add_argument(
        "--spec",
        metavar="auto|E:d|draft:d",
        help="speculative decoding: auto speculates with the checkpoint's draft head where it pays (draft:2:adaptive "
        "with prompt lookup, d up to 4, plain steps where no round pays; on a CPU one row at a time, and there"
        " d 1 or 2 and up to 2 copied drafts, its rounds priced from measured costs) and decodes"
        " at full depth on a model without one; it is the default unless --exit is given. none or off: full "
        "depth. E:d drafts d tokens with the first E layers and the exit head (LayerSkip) and verifies them with"
        " the other layers in one pass; draft:d drafts"
        " them with the checkpoint's trained draft head (eejax train-draft; e.g. the model smollm2-135m-eagle) "
        "and verifies with every layer. Greedy output equals full depth, sampling keeps the full model's "
        "distribution. A :adaptive suffix chooses d per round from the measured acceptance and costs. "
        "draft:d:tree drafts a tree of depth d (the head's likeliest chain plus its 2nd choices near the root; "
        "draft:tree=0,00,1 names the nodes) verified in one pass, greedy only. draft:d:stop=η stops a round's "
        "drafting at the first draft whose top probability is below η (Kangaroo); η 0 is off. draft:d:lookup "
        "copies a row's drafts from its prompt or output where its last 2-4 tokens occurred before (prompt "
        "lookup: summaries, code edits), and drafts with the head elsewhere",
    )
    gen.add_argument(
        "--spec-max-d",
        type=positive_int,
        metavar="N",
        help="the largest d that an adaptive --spec may choose (default 8)",
    )
    gen.add_argument(
        "--spec-head",
        choices=("auto", "full", "reduced"),
        help="head of the drafts (default auto: the reduced-vocabulary head when the checkpoint has one)",
    )
    gen.add_argument(
        "--spec-bonus",
        choices=("auto", "on", "off"),
        help="E:d's (d+1)-th draft pass that lets a fully accepted round emit d+1 tokens: on, off, or auto "
        "(when it pays at the measured acceptance; default)",
    )
    add_model_placement(gen)
    add_processes(gen, "process 0 prints the result")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    gen.set_defaults(func=cmd_generate)
