"""The `eejax` command: `eejax convert`, `generate`, `calibrate`, `exit-vocab`, `train-exits`,
`train-layerskip`, `serve`, `models`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Callable

from eejax.cli_parsing import OneLineErrorParser
from eejax.errors import EejaxError

PROMPT_FIELDS = ("prompt", "text", "article", "document")


def run_guarded(fn: Callable[[], int]) -> int:
    """Runs a command; bad input becomes one line on stderr and exit status 2."""
    try:
        return fn()
    except EejaxError as e:
        print(f"eejax: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("eejax: interrupted", file=sys.stderr)
        return 130


def read_prompts_file(path: str, field: str | None) -> list[str]:
    """Prompts from a .jsonl file: one JSON string or object per line."""
    p = Path(path)
    if not p.is_file():
        raise EejaxError(f"prompts file not found: {path}")
    prompts = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise EejaxError(f"{path}:{n}: not valid JSON ({e.msg})") from None
        if isinstance(row, str):
            prompts.append(row)
            continue
        if not isinstance(row, dict):
            raise EejaxError(f"{path}:{n}: expected a JSON string or object")
        name = field or next((f for f in PROMPT_FIELDS if f in row), None)
        if name is None or name not in row:
            wanted = field or " / ".join(PROMPT_FIELDS)
            raise EejaxError(f"{path}:{n}: no {wanted} field (choose one with --prompt-field)")
        prompts.append(str(row[name]))
    if not prompts:
        raise EejaxError(f"no prompts in {path}")
    return prompts


def prompts_from_args(args: argparse.Namespace) -> list[str]:
    """The prompts of --prompt or --prompts-file, cut to --limit."""
    prompts = args.prompt if args.prompt is not None else read_prompts_file(args.prompts_file, args.prompt_field)
    return prompts[: args.limit] if args.limit else prompts


def add_model_and_prompts(parser: argparse.ArgumentParser, what: str, model_help: str) -> None:
    """--model, --prompt | --prompts-file, --prompt-field, --limit."""
    parser.add_argument("--model", required=True, help=model_help)
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", nargs="+", action="extend", metavar="TEXT",
                     help=f"one or more {what} (repeat --prompt or give several)")
    src.add_argument("--prompts-file", metavar="F.jsonl",
                     help=f"{what}, one JSON string or object per line (field prompt, text, article or document)")
    parser.add_argument("--prompt-field", help="which field of --prompts-file objects holds the prompt")
    parser.add_argument("--limit", type=_positive_int, help="use only the first N prompts")


def _integer(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive_int(text: str) -> int:
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _non_negative_int(text: str) -> int:
    """An integer >= 0 (0: the option is off)."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0 (0: off), got {value}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
    return value


def _float(text: str, option: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise EejaxError(f"{option}: expected a number or 'off', got {text!r}") from None


def cmd_generate(args: argparse.Namespace) -> int:
    import eejax

    prompts = prompts_from_args(args)
    exit_config = None
    if args.exit is not None:
        decay = None if args.exit_decay in ("off", "none") else _float(args.exit_decay, "--exit-decay")
        exit_config = eejax.ExitConfig.parse(
            args.exit, decay=decay, min_exit_layer=args.min_exit_layer, every=args.exit_every,
            exit_layers=args.exit_layers, head=args.exit_head or "auto", emit=args.exit_emit or "full",
        )
    elif (args.exit_decay, args.min_exit_layer, args.exit_every) != ("4", 1, 1) or any(
            x is not None for x in (args.exit_layers, args.exit_head, args.exit_emit)):
        raise EejaxError("--exit-decay, --min-exit-layer, --exit-every, --exit-layers, --exit-head and --exit-emit "
                         "need --exit")
    spec = None
    if args.spec is not None:
        if args.exit is not None:
            raise EejaxError("choose --exit or --spec, not both")
        options = {} if args.spec_max_d is None else {"max_speculations": args.spec_max_d}
        spec = eejax.SpecConfig.parse(args.spec, head=args.spec_head or "auto",
                                      bonus={"on": True, "off": False, "auto": None}[args.spec_bonus or "auto"],
                                      **options)
    if args.spec_max_d is not None and not (spec and spec.adaptive):
        raise EejaxError("--spec-max-d needs --spec E:d:adaptive")
    if spec is None and (args.spec_head or args.spec_bonus):
        raise EejaxError("--spec-head and --spec-bonus need --spec")
    model = eejax.load(args.model)
    result = eejax.generate(
        model, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
        top_k=args.top_k, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
        batch_size=args.batch_size, cache_budget=args.cache_budget,
        truncate_prompt_tokens=args.truncate_prompt_tokens, exit=exit_config, spec=spec,
    )
    stats = result.stats
    if args.json:
        outputs = [
            {"prompt": p, "text": t, "tokens": toks, "exit_layers": layers, "confident_layers": confident}
            for p, t, toks, layers, confident in zip(
                prompts, result.texts, result.tokens, result.exit_layers, result.confident_layers
            )
        ]
        json.dump({"outputs": outputs, "stats": stats}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for i, (p, t) in enumerate(zip(prompts, result.texts)):
        shown = p if len(p) <= 300 else p[:300] + " ..."
        print(f"=== prompt {i} ===\n{shown}\n--- generated ({len(result.tokens[i])} tokens) ---\n{t}\n")
    print(
        f"{stats['generated_tokens']} tokens in {stats['run_s']:.2f} s: {stats['tokens_per_s']:.1f} tokens/s "
        f"(compile {stats['compile_s']:.1f} s, {stats['compiled_programs']} programs); "
        f"mean layers per token {stats['mean_layers_per_token']:.1f} of {stats['num_layers']} "
        + (f"(exit {stats['exit']}, KV fill {stats['kv_fill_layers_per_token']:.1f} layers per token)" if spec is None
           else f"(self-speculation {stats['spec']}: acceptance {stats['acceptance_rate']:.1%}, "
                f"{stats['tokens_per_round']:.2f} tokens per round, mean d {stats['mean_speculations']:.1f}"
                + (f", {stats['plain_step_rate']:.0%} of tokens by plain steps" if stats["plain_step_rate"] else "")
                + ")")
    )
    return 0


def cmd_exit_vocab(args: argparse.Namespace) -> int:
    import eejax
    from eejax.checkpoint import check_destination
    from eejax.decode.prompts import prompt_token_ids
    from eejax.train.exit_vocab import add_exit_vocab, count_tokens, most_frequent

    output = Path(args.output).expanduser()
    check_destination(output, overwrite=args.overwrite)
    texts = prompts_from_args(args)
    model = eejax.load(args.model)
    if not 1 <= args.size <= model.config.vocab_size:
        raise EejaxError(f"--size {args.size} must lie in [1, {model.config.vocab_size}] (the model's vocabulary)")
    prompts, _ = prompt_token_ids(model.tokenizer, texts)
    prompts = [p[: args.max_prompt_tokens] for p in prompts]
    counts = count_tokens(model, prompts, corpus=args.corpus, new_tokens=args.continuation_tokens,
                          batch_size=args.batch_size, progress=not args.quiet)
    ids = most_frequent(counts, args.size, always=model.eos_token_ids)
    covered = counts[ids].sum() / max(counts.sum(), 1)
    eejax.save(add_exit_vocab(model, ids), output, overwrite=args.overwrite, metadata={"exit_vocab": {
        "base": str(args.model), "size": args.size, "corpus": args.corpus, "prompts": len(prompts),
        "continuation_tokens": args.continuation_tokens, "tokens_counted": int(counts.sum()),
        "coverage": float(covered)}})
    print(f"wrote {output}: a reduced exit head of {args.size} of {model.config.vocab_size} tokens, covering "
          f"{covered:.1%} of the {int(counts.sum())} tokens counted ({args.corpus} of {len(prompts)} prompts)")
    return 0


def cmd_calibrate(args: argparse.Namespace) -> int:
    import eejax
    from eejax.train.calibrate import calibrate_exit_threshold

    prompts = prompts_from_args(args)
    decay = None if args.exit_decay in ("off", "none") else _float(args.exit_decay, "--exit-decay")
    model = eejax.load(args.model)
    cal, layers = calibrate_exit_threshold(
        model, prompts, measure=args.measure, thresholds=args.thresholds, delta=args.delta, epsilon=args.epsilon,
        max_new_tokens=args.max_new_tokens, consistency=args.consistency, decay=decay,
        min_exit_layer=args.min_exit_layer, every=args.exit_every, batch_size=args.batch_size, progress=True,
    )
    num_layers = model.config.num_layers
    if args.json:
        json.dump({"threshold": cal.threshold, "certified": cal.certified, "thresholds": cal.thresholds,
                   "risks": cal.risks, "p_values": cal.p_values, "mean_layers_per_token": list(layers.values()),
                   "num_layers": num_layers, "delta": cal.delta, "epsilon": cal.epsilon, "n": cal.n,
                   "method": cal.method, "certificate": cal.certificate()}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    for t, r, p in zip(cal.thresholds, cal.risks, cal.p_values):
        mark = "certified" if cal.certified and t >= cal.threshold else ""
        print(f"λ={t:<8g} risk {r:.4f}  p-value {p:.3g}  layers/token {layers[t]:.2f} of {num_layers}  {mark}")
    if cal.certified:
        print(f"chosen λ = {cal.threshold:g}: mean layers per token {layers[cal.threshold]:.2f} of {num_layers} "
              f"(exit rate {1 - layers[cal.threshold] / num_layers:.1%} of the layers skipped)")
    print(cal.certificate())
    return 0


def _exit_layers(text: str) -> list[int]:
    try:
        return [int(x) for x in text.replace(",", " ").split()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected layer counts such as 3,6,9, got {text!r}") from None


def cmd_train_exits(args: argparse.Namespace) -> int:
    import time

    import eejax
    from eejax.train.loop import fit_exit_adapters

    output = Path(args.output).expanduser()
    if output.exists() and not args.overwrite:
        raise EejaxError(f"{output} already exists (pass --overwrite to replace it)")
    if args.loss_plot:
        try:  # before the long work
            import matplotlib  # noqa: F401
        except ImportError:
            raise EejaxError('--loss-plot needs matplotlib: pip install "eejax[bench]"') from None
    texts = prompts_from_args(args)
    model = eejax.load(args.model)
    if model.tokenizer is None:
        raise EejaxError(f"{args.model} has no tokenizer to read the prompts with")
    suffix = model.tokenizer(args.suffix, add_special_tokens=False)["input_ids"] if args.suffix else []
    keep = args.max_len - args.continuation_tokens - len(suffix)
    if keep < 1:
        raise EejaxError(f"--max-len {args.max_len} leaves no room for a prompt after {args.continuation_tokens} "
                         f"continuation tokens and a {len(suffix)}-token suffix")
    prompts = [model.tokenizer(t)["input_ids"][:keep] + suffix for t in texts]
    t0 = time.perf_counter()
    model, losses = fit_exit_adapters(
        model, prompts, adapter_rank=args.adapter_rank, continuation_tokens=args.continuation_tokens,
        max_len=args.max_len, batch_size=args.batch_size, steps=args.steps, learning_rate=args.learning_rate,
        weights=args.weights, exit_layers=args.exit_layers, ce_weight=args.ce_weight,
        positions_per_row=args.positions_per_row or None, seed=args.seed, checkpoint_dir=args.checkpoint_dir,
        save_every=args.save_every, progress=not args.quiet,
    )
    seconds = time.perf_counter() - t0
    eejax.save(model, output, overwrite=args.overwrite, metadata={"exit_training": {
        "base": str(args.model), "steps": args.steps, "exit_layers": args.exit_layers, "weights": args.weights,
        "ce_weight": args.ce_weight, "prompts": len(prompts), "final_loss": float(losses[-1])}})
    if args.loss_plot:
        from eejax.train.plot import save_loss_plot

        save_loss_plot(losses, args.loss_plot)
    k = min(10, len(losses))
    print(f"trained exit adapters for {args.steps} steps on {len(prompts)} prompts in {seconds:.0f} s; "
          f"loss {losses[:k].mean():.4f} -> {losses[-k:].mean():.4f} (mean of the first / last {k} steps); "
          f"saved to {output}" + (f"; loss curve {args.loss_plot}" if args.loss_plot else ""))
    return 0


def cmd_train_layerskip(args: argparse.Namespace) -> int:
    import numpy as np

    import eejax
    from eejax.train.layerskip import LayerSkipConfig
    from eejax.train.layerskip_run import RunSettings, export_run, train_layerskip

    for option, value in (("--skip", args.skip), ("--sampled-every", args.sampled_every),
                          ("--exit-vocab-size", args.exit_vocab_size)):
        if value < 0:
            raise EejaxError(f"{option} must be >= 0, got {value}")
    if args.hours is not None and not 0 < args.hours < float("inf"):
        raise EejaxError(f"--hours must be a positive number, got {args.hours}")
    settings = RunSettings(
        steps=args.steps, batch_size=args.batch_size, learning_rate=args.learning_rate, lora_rank=args.lora_rank,
        exit_positions=args.exit_positions, seed=args.seed,
        layerskip=LayerSkipConfig(p_max=args.p_max, e_scale=args.e_scale, curriculum=args.curriculum,
                                  rotation=args.rotation, total_steps=args.steps,
                                  exit_layers=tuple(args.exit_layers) if args.exit_layers else None))
    data_options = {"prompts": args.prompts_file or "--prompt", "skip": args.skip, "limit": args.limit,
                    "window": args.window, "continuation_tokens": args.continuation_tokens,
                    "sampled_every": args.sampled_every, "top_k": args.top_k, "suffix": args.suffix}
    run = json.loads(json.dumps({"model": str(args.model), "settings": settings.to_json(), "data": data_options,
                                 "exit_vocab_size": args.exit_vocab_size}))  # as run.json will hold it
    out = Path(args.output).expanduser()
    run_file = out / "run.json"
    if run_file.exists():
        before = json.loads(run_file.read_text())
        if before != run:
            changed = [k for k, v in _flat(run).items() if _flat(before).get(k) != v]
            raise EejaxError(f"{out} holds a run started with other settings ({', '.join(changed)}); "
                             f"repeat its command (see {run_file}) or choose another --output")
    elif out.exists() and any(out.iterdir()):
        raise EejaxError(f"{out} exists and is not a LayerSkip run directory; choose another --output")
    if args.loss_plot:
        try:  # before the long work
            import matplotlib  # noqa: F401
        except ImportError:
            raise EejaxError('the loss plot needs matplotlib: pip install "eejax[bench]" (or pass --no-loss-plot)') from None
    texts = args.prompt if args.prompt is not None else read_prompts_file(args.prompts_file, args.prompt_field)
    texts = texts[args.skip:][: args.limit]  # the held-out rows first, then the limit
    if not texts:
        raise EejaxError(f"no prompts left after --skip {args.skip}")
    model = eejax.load(args.model)
    from eejax.train.loop import check_trainable

    check_trainable(model.config)
    settings.layerskip.eligible(model.config.num_layers)  # exit layers within the model
    if args.exit_vocab_size > model.config.vocab_size:
        raise EejaxError(f"--exit-vocab-size must lie in [0, {model.config.vocab_size}], got {args.exit_vocab_size}")
    if model.tokenizer is None:
        raise EejaxError(f"{args.model} has no tokenizer to read the prompts with")
    out.mkdir(parents=True, exist_ok=True)
    run_file.write_text(json.dumps(run, indent=2) + "\n")
    data = _layerskip_data(model, texts, out / "data.npz", args)
    t0 = time.perf_counter()
    trainable, log, done = train_layerskip(model, data, settings, out / "checkpoints", hours=args.hours,
                                           save_every=args.save_every, progress=not args.quiet)
    hours = (time.perf_counter() - t0) / 3600
    steps_done = len(log["loss"])
    if args.loss_plot and steps_done:
        from eejax.train.plot import save_layerskip_plot, save_loss_plot

        save_loss_plot(log["loss"], out / "loss.png", title="LayerSkip training loss")
        save_layerskip_plot(log, out / "kl.png", model.config.num_layers)
    tokens = steps_done * settings.batch_size * data.tokens.shape[1]
    if not done:
        print(f"stopped after {hours:.2f} h at step {steps_done} of {settings.steps} (about {tokens} tokens so far); "
              f"run the same command again to continue from {out / 'checkpoints'}")
        return 0
    path = export_run(model, trainable, settings, data, out, base_name=str(args.model),
                      exit_vocab_size=args.exit_vocab_size)
    k = min(10, steps_done)
    print(f"trained {settings.steps} steps (about {tokens} tokens); loss {np.mean(log['loss'][:k]):.4f} -> "
          f"{np.mean(log['loss'][-k:]):.4f} (first / last {k} steps); model {path}"
          + (f", LoRA delta {out / 'delta.safetensors'}" if settings.lora_rank else ""))
    return 0


def _flat(d: dict, prefix: str = "") -> dict:
    """Nested dict -> {"a.b": value}."""
    flat = {}
    for k, v in d.items():
        flat.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return flat


def _layerskip_data(model, texts: list[str], path: Path, args: argparse.Namespace):
    """The run's self-distillation data: read from `path`, or built once and saved there."""
    from eejax.train.distill import DistillData, continue_windows, teacher_targets, text_windows

    if path.exists():
        return DistillData.load(path)
    ids = [model.tokenizer(t)["input_ids"] for t in texts]
    windows = text_windows(ids, args.window, args.windows_per_prompt)
    if args.suffix:  # and each text's beginning followed by the suffix, e.g. a summary request
        suffix = model.tokenizer(args.suffix, add_special_tokens=False)["input_ids"]
        windows += [t[: args.window] + suffix for t in ids]
    sequences = continue_windows(model, windows, args.continuation_tokens, sampled_every=args.sampled_every,
                                 seed=args.seed, progress=not args.quiet)
    data = teacher_targets(model, sequences, top_k=args.top_k, progress=not args.quiet)
    data.save(path)
    return data


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import threading

    import eejax
    from eejax.decode.generate import parse_bytes
    from eejax.serve.engine import Engine
    from eejax.serve.http import create_app

    try:
        import uvicorn
    except ImportError:
        raise EejaxError('eejax serve needs the serve extra: pip install "eejax[serve]"') from None
    max_body = parse_bytes(args.max_body_size)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("eejax.serve")
    model = eejax.load(args.model)
    engine = Engine(model, max_slots=args.max_slots, max_new_tokens=args.max_tokens_limit,
                    cache_budget=args.cache_budget, exit=args.exit, temperature=args.temperature,
                    policy=args.policy, bucketing=not args.no_bucketing, pages=args.pages,
                    max_decoding_options=args.max_decoding_options, prefix_caching=not args.no_prefix_caching,
                    prefill_chunk=args.prefill_chunk or None)
    if args.warmup:
        engine.warmup(args.warmup)
    engine.start()
    app = create_app(engine, served_model_name=args.served_model_name or args.model, max_waiting=args.max_waiting,
                     max_body_bytes=max_body)

    class Server(uvicorn.Server):
        """uvicorn, plus a deadline: `--shutdown-timeout` seconds after the first SIGTERM / SIGINT
        the requests still running end with finish reason "abort" (their clients get that), and
        connections still open a second later are dropped."""

        deadline: threading.Timer | None = None

        def handle_exit(self, sig, frame):
            if self.deadline is None:
                log.info("shutting down: requests in flight have %s s to finish", args.shutdown_timeout)
                self.deadline = threading.Timer(args.shutdown_timeout, engine.abort)
                self.deadline.daemon = True
                self.deadline.start()
            super().handle_exit(sig, frame)

    server = Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                                   timeout_graceful_shutdown=args.shutdown_timeout + 1))

    def watchdog():  # a dead engine loop serves nobody: exit non-zero so a supervisor restarts us
        while engine.error is None and not server.should_exit:
            time.sleep(0.2)
        if engine.error is not None:
            log.critical("the engine loop died (%r); shutting down", engine.error)
            server.should_exit = True

    threading.Thread(target=watchdog, name="eejax-watchdog", daemon=True).start()
    # uvicorn raises the signal again once its graceful shutdown is over: ignoring that second
    # SIGTERM makes it a clean exit after the engine has stopped.
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        if server.deadline is not None:
            server.deadline.cancel()
        stopped = engine.stop(cancel=True, timeout=5)
    code = 1 if engine.error is not None else 0
    if not stopped:  # the loop is stuck inside a program: do not wait for it at interpreter exit
        logging.shutdown()
        os._exit(code)
    return code


def cmd_models(args: argparse.Namespace) -> int:
    from eejax.hub import KNOWN_MODELS, cache_dir

    for name, known in KNOWN_MODELS.items():
        built = (cache_dir() / "models" / name).exists()
        state = "converted" if built else "not fetched yet" if known.delta is None else "built on first load"
        print(f"{name}\t{known.description} [{state}]")
    print(f"cache: {cache_dir()} (set EEJAX_CACHE to move it)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    from conversion import cli as convert_cli

    parser = OneLineErrorParser(
        prog="eejax", description="Fast early-exit language model inference in JAX.",
        epilog="Run `eejax COMMAND --help` for a command's options.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=OneLineErrorParser)

    conv = sub.add_parser("convert", help="convert an HF checkpoint or .gguf file to eejax",
                          description=convert_cli.DESCRIPTION,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    convert_cli.add_arguments(conv)
    conv.set_defaults(func=convert_cli.run)

    gen = sub.add_parser(
        "generate", help="generate text for prompts",
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
    add_model_and_prompts(gen, "prompts", 'eejax checkpoint directory, or a known name such as "smollm2-135m" '
                          "(see `eejax models`)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=64, help="tokens to generate per prompt (default 64)")
    gen.add_argument("--batch-size", type=_positive_int, help="rows decoded together (default: all prompts)")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS: always generate --max-new-tokens")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    gen.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1.0 = off)")
    gen.add_argument("--seed", type=int, default=0, help="PRNG seed for sampling")
    gen.add_argument("--truncate-prompt-tokens", type=_positive_int, metavar="N", help="keep the first N tokens of each prompt")
    gen.add_argument("--cache-budget", default="1GiB", help="KV cache memory budget, e.g. 512MiB, 2GiB (default 1GiB)")
    gen.add_argument(
        "--exit", metavar="SPEC",
        help="early exit: none (the exit loop at full depth), static:E (always run E layers), softmax:λ "
        "(top-1 minus top-2 probability of the exit head > λ), state:λ (cosine of the hidden state before "
        "and after a layer > λ), classifier:λ (trained exit classifier's P(exit) > λ); λ may be inf or -inf. "
        "The batch exits when all its rows are confident. Default: plain full depth",
    )
    gen.add_argument("--exit-decay", default="4", metavar="τ",
                     help="CALM's decaying threshold λ(t) = clip(0.9λ + 0.1exp(-τt/N), 0, 1); 'off' keeps λ (default 4)")
    gen.add_argument("--min-exit-layer", type=_positive_int, default=1, metavar="K",
                     help="never exit before K layers ran (default 1)")
    gen.add_argument("--exit-every", type=_positive_int, default=1, metavar="k",
                     help="exit only after a multiple of k layers (default 1: after any layer)")
    gen.add_argument("--exit-layers", type=_exit_layers, action="extend", metavar="E,E,...",
                     help="check confidence only after these layer counts, e.g. 8,16,24 (default: the checkpoint's "
                     "trained exits, else every layer allowed by --min-exit-layer / --exit-every)")
    gen.add_argument("--exit-head", choices=("auto", "full", "reduced"),
                     help="head of the softmax checks: the reduced-vocabulary head of eejax exit-vocab, the full "
                     "head, or auto (reduced when the checkpoint has one; default)")
    gen.add_argument("--exit-emit", choices=("full", "reduced"),
                     help="head of the token at an early exit (default full: one full-head evaluation per exit)")
    gen.add_argument(
        "--spec", metavar="E:d",
        help="self-speculative decoding (LayerSkip): draft d tokens with the first E layers and the exit head, "
        "verify them with the other layers in one pass; greedy output equals full depth, sampling keeps the "
        "full model's distribution. E:d:adaptive chooses d per round from the measured acceptance and costs",
    )
    gen.add_argument("--spec-max-d", type=_positive_int, metavar="N",
                     help="the largest d that E:d:adaptive may choose (default 8)")
    gen.add_argument("--spec-head", choices=("auto", "full", "reduced"),
                     help="head of the drafts (default auto: the reduced-vocabulary head when the checkpoint has one)")
    gen.add_argument("--spec-bonus", choices=("auto", "on", "off"),
                     help="the (d+1)-th draft pass that lets a fully accepted round emit d+1 tokens: on, off, or auto "
                     "(when it pays at the measured acceptance; default)")
    gen.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    gen.set_defaults(func=cmd_generate)

    cal = sub.add_parser(
        "calibrate", help="pick an early-exit threshold with a Learn-then-Test guarantee",
        description="Generate the prompts (the calibration set) at full depth and with each candidate threshold, "
        "measure each prompt's inconsistency with full depth, and certify thresholds in order (most conservative "
        "first) while the p-value of 'risk > delta' is <= epsilon (Learn then Test, fixed-sequence testing). "
        "Prints the smallest certified threshold, its layers per token and the certificate.",
    )
    add_model_and_prompts(cal, "calibration prompts", "eejax checkpoint directory or known model name")
    cal.add_argument("--measure", required=True, choices=("softmax", "state", "classifier"))
    cal.add_argument("--thresholds", type=float, nargs="+", action="extend", required=True, metavar="λ",
                     help="candidates, most conservative (largest) first, e.g. 0.99 0.95 0.9 0.8")
    cal.add_argument("--delta", type=float, default=0.1, help="tolerated risk (mean inconsistency), default 0.1")
    cal.add_argument("--epsilon", type=float, default=0.05, help="risk level of the guarantee, default 0.05")
    cal.add_argument("--consistency", choices=("tokens", "rouge"), default="tokens",
                     help="tokens: share of full-depth tokens not reproduced; rouge: 1 - ROUGE-L to full depth")
    cal.add_argument("--max-new-tokens", type=_positive_int, default=64)
    cal.add_argument("--batch-size", type=_positive_int, default=1,
                     help="rows decoded together (a batch exits when all its rows are confident: calibrate at the "
                     "batch size you decode with; default 1)")
    cal.add_argument("--exit-decay", default="4", metavar="τ", help="decaying threshold τ, or 'off' (default 4)")
    cal.add_argument("--min-exit-layer", type=_positive_int, default=1, metavar="K")
    cal.add_argument("--exit-every", type=_positive_int, default=1, metavar="k")
    cal.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    cal.set_defaults(func=cmd_calibrate)

    ev = sub.add_parser(
        "exit-vocab", help="add a reduced-vocabulary exit head (cheap exit checks and drafts)",
        description="Count token frequencies over a corpus (by default the model's own greedy continuations of "
        "the prompts) and store the --size most frequent tokens (EOS always among them) with the LM head's rows "
        "for them in a new checkpoint's exits. Softmax exit checks and self-speculation drafts then evaluate "
        "that reduced head (FR-Spec) instead of the whole vocabulary; verification and, by default, the emitted "
        "token of an early exit still use the full head, so self-speculation stays lossless.",
    )
    add_model_and_prompts(ev, "prompts of the corpus", "eejax checkpoint directory or known model name")
    ev.add_argument("--output", required=True, metavar="DIR", help="where to write the model with the reduced head")
    ev.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    ev.add_argument("--size", type=_positive_int, default=8192, metavar="K",
                    help="tokens in the reduced vocabulary (default 8192; the vocabulary size gives the full head)")
    ev.add_argument("--corpus", choices=("continuations", "prompts", "both"), default="continuations",
                    help="count the model's greedy continuations of the prompts (default), the prompts, or both")
    ev.add_argument("--continuation-tokens", type=_positive_int, default=64, metavar="N",
                    help="greedy tokens generated per prompt (default 64)")
    ev.add_argument("--max-prompt-tokens", type=_positive_int, default=512, metavar="T",
                    help="cut each prompt to its first T tokens (default 512)")
    ev.add_argument("--batch-size", type=_positive_int, default=8, help="rows generated together (default 8)")
    ev.add_argument("--quiet", action="store_true", help="no progress bar")
    ev.set_defaults(func=cmd_exit_vocab)

    tr = sub.add_parser(
        "train-exits", help="train exit adapters on a frozen model (self-distillation)",
        description="Make a model exit-capable: add an adapter before the shared final norm and LM head at each "
        "trained exit and train the adapters with optax (adam, cosine decay) so that each exit's next-token "
        "distribution matches the full model's (KL, per-layer weights; optionally plus cross-entropy on the "
        "data) while the backbone stays frozen. The data are the prompts followed by the model's own greedy "
        "continuations. Writes a new eejax checkpoint with the trained exits; with --checkpoint-dir, training "
        "state is saved every --save-every steps and a rerun resumes from it.",
    )
    add_model_and_prompts(tr, "training prompts", "eejax checkpoint directory or known model name (a Llama)")
    tr.add_argument("--output", required=True, metavar="DIR", help="where to write the model with trained exits")
    tr.add_argument("--overwrite", action="store_true", help="replace --output if it exists")
    tr.add_argument("--suffix", default="", metavar="TEXT",
                    help='appended to each (cut) prompt before the continuation, e.g. "\n\nSummary:"')
    tr.add_argument("--continuation-tokens", type=int, default=64, metavar="N",
                    help="greedy tokens generated after each prompt (default 64; 0 = the prompts alone)")
    tr.add_argument("--max-len", type=_positive_int, default=512, metavar="T",
                    help="tokens per training sequence, prompt cut to fit (default 512)")
    tr.add_argument("--exit-layers", type=_exit_layers, action="extend", metavar="E,E,...",
                    help="the exits to train, as layers run, e.g. 3,6,9 (default: every layer 1..L-1)")
    tr.add_argument("--adapter-rank", type=_positive_int, default=128, metavar="R",
                    help="rank of each adapter's D x D map; the hidden size is a full map (default 128)")
    tr.add_argument("--steps", type=_positive_int, default=200, help="optimizer steps (default 200)")
    tr.add_argument("--batch-size", type=_positive_int, default=4, help="sequences per step (default 4)")
    tr.add_argument("--positions-per-row", type=int, default=64, metavar="P",
                    help="positions of each sequence whose exits a step trains, drawn at random; 0 = all (default 64)")
    tr.add_argument("--learning-rate", type=float, default=1e-3, help="peak adam learning rate (default 1e-3)")
    tr.add_argument("--weights", choices=("calm", "layerskip", "uniform"), default="calm",
                    help="per-exit loss weights: calm ∝ l, layerskip ∝ 1+...+l, uniform (default calm)")
    tr.add_argument("--ce-weight", type=float, default=0.0,
                    help="weight of cross-entropy on the data's next tokens beside the KL (default 0)")
    tr.add_argument("--checkpoint-dir", metavar="DIR", help="orbax training checkpoints; a rerun resumes from the latest")
    tr.add_argument("--save-every", type=_positive_int, default=50, help="steps between checkpoints (default 50)")
    tr.add_argument("--loss-plot", metavar="F.png", help="save the loss curve as a PNG (needs matplotlib)")
    tr.add_argument("--seed", type=int, default=0, help="seed of the position sampling (default 0)")
    tr.add_argument("--quiet", action="store_true", help="no progress bars")
    tr.set_defaults(func=cmd_train_exits)
    ls = sub.add_parser(
        "train-layerskip", help="LayerSkip training (layer dropout + early-exit loss) with LoRA, resumable",
        description="Train a Llama for early exit with LayerSkip's recipe: layer dropout (rates rising with depth "
        "to --p-max; a dropped layer is skipped for the whole step) and an early-exit loss through the shared LM "
        "head at the exits the curriculum enables each step, on LoRA factors of every projection (or the whole "
        "model with --lora-rank 0). The data are windows of the prompts followed by the model's own continuations "
        "(greedy, and sampled for some), and every position's target is the original model's next-token "
        "distribution (self-distillation), so full depth stays close to the original. Everything lives in "
        "--output: run the same command again to continue an interrupted run (--hours bounds one invocation). "
        "At the end it writes OUTPUT/model (an eejax checkpoint whose trained exits are the default check layers, "
        "with a reduced exit head) and OUTPUT/delta.safetensors (the LoRA factors).",
    )
    add_model_and_prompts(ls, "training texts", "eejax checkpoint directory or known model name (a Llama)")
    ls.add_argument("--output", required=True, metavar="DIR", help="the run directory (created; reused to resume)")
    ls.add_argument("--skip", type=int, default=0, metavar="N",
                    help="leave out the first N prompts (e.g. the rows you evaluate on; default 0)")
    ls.add_argument("--hours", type=float, metavar="H", help="stop this invocation after H hours (resumable)")
    ls.add_argument("--steps", type=_positive_int, default=600, help="optimizer steps of the whole run (default 600)")
    ls.add_argument("--batch-size", type=_positive_int, default=8, help="sequences per step (default 8)")
    ls.add_argument("--learning-rate", type=float, default=2e-4,
                    help="peak adam learning rate, 5%% warm-up then cosine to 10%% (default 2e-4)")
    ls.add_argument("--lora-rank", type=int, default=16, metavar="R",
                    help="rank of the LoRA factors on every projection; 0 = full fine-tuning (default 16)")
    ls.add_argument("--exit-layers", type=_exit_layers, action="extend", metavar="E,E,...",
                    help="exits with an early-exit loss, as layers run, e.g. 8,15,22 (default: every layer)")
    ls.add_argument("--p-max", type=float, default=0.1, help="layer dropout rate of the last layer (default 0.1)")
    ls.add_argument("--e-scale", type=float, default=0.2, help="early-exit loss scale e_scale (default 0.2)")
    ls.add_argument("--curriculum", choices=("rotational", "gradual", "all"), default="rotational",
                    help="which exits carry a loss each step (default rotational)")
    ls.add_argument("--rotation", type=_positive_int, default=8, metavar="R",
                    help="the rotational curriculum enables every R-th exit (default 8)")
    ls.add_argument("--exit-positions", type=int, default=64, metavar="P",
                    help="positions per sequence of the early exits' losses, drawn each step; 0 = all (default 64)")
    ls.add_argument("--window", type=_positive_int, default=192, metavar="T",
                    help="prompt tokens per training sequence: consecutive windows of each text (default 192)")
    ls.add_argument("--windows-per-prompt", type=_positive_int, default=4, metavar="N",
                    help="at most N windows of each text (default 4)")
    ls.add_argument("--continuation-tokens", type=_positive_int, default=64, metavar="N",
                    help="tokens of the model's own continuation after each window (default 64)")
    ls.add_argument("--suffix", default="", metavar="TEXT",
                    help="also train on the first window of each text followed by TEXT and the continuation, "
                    "e.g. a summary request (bash: --suffix $'\\n\\nSummary:')")
    ls.add_argument("--sampled-every", type=int, default=2, metavar="K",
                    help="every K-th window also gets a sampled continuation (temperature 0.8, top-p 0.95); "
                    "0 = greedy only (default 2)")
    ls.add_argument("--top-k", type=_positive_int, default=32, metavar="K",
                    help="the teacher distribution kept per position: its K most likely tokens (default 32)")
    ls.add_argument("--exit-vocab-size", type=int, default=8192, metavar="K",
                    help="reduced exit head of the K most frequent training tokens; 0 = none (default 8192)")
    ls.add_argument("--save-every", type=_positive_int, default=25, help="steps between checkpoints (default 25)")
    ls.add_argument("--no-loss-plot", dest="loss_plot", action="store_false",
                    help="do not write OUTPUT/loss.png (it needs matplotlib)")
    ls.add_argument("--seed", type=int, default=0, help="seed of the data order, dropout and sampling (default 0)")
    ls.add_argument("--quiet", action="store_true", help="no progress bars")
    ls.set_defaults(func=cmd_train_layerskip)
    srv = sub.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Continuous batching over one paged KV cache behind POST /v1/completions and "
        "/v1/chat/completions (stream: true for server-sent events), GET /health and GET /metrics (Prometheus).",
    )
    srv.add_argument("--model", required=True, help="eejax checkpoint directory or known model name")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=_positive_int, default=8000, help="port (default 8000)")
    srv.add_argument("--served-model-name", help="the model name clients must send (default: --model as given)")
    srv.add_argument("--max-slots", type=_positive_int, default=8, help="rows decoded together (default 8)")
    srv.add_argument("--max-tokens-limit", type=_positive_int, default=256,
                     help="the largest max_tokens a request may ask (default 256)")
    srv.add_argument("--max-waiting", type=_positive_int, default=256,
                     help="requests queued before new ones get 429 (default 256)")
    srv.add_argument("--cache-budget", default="1GiB", help="KV cache memory (default 1GiB)")
    srv.add_argument("--exit", metavar="SPEC", help="early exit for every request, as in eejax generate --exit")
    srv.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    srv.add_argument("--policy", choices=("fcfs", "sjf", "ljf"), default="fcfs", help="order inside a bucket")
    srv.add_argument("--no-bucketing", action="store_true", help="one bucket (plain FCFS continuous batching)")
    srv.add_argument("--prefill-chunk", type=_non_negative_int, default=0, metavar="TOKENS",
                     help="chunked prefill: at most TOKENS prompt tokens prefilled per engine step, between decode "
                     "steps, so that long prompts do not stall the running requests (default 0: whole prompts)")
    srv.add_argument("--no-prefix-caching", action="store_true",
                     help="do not share the KV pages of prompt prefixes between requests (shared by default: full "
                     "pages of prompt tokens are kept, least recently used evicted first)")
    srv.add_argument("--pages", choices=("reserve", "grow"), default="reserve",
                     help="reserve: a request's pages for prompt + max_tokens at admission (never preempts); grow: "
                     "pages as rows grow, preempting the lowest-priority row (recomputed later) when they run out")
    srv.add_argument("--max-decoding-options", type=_positive_int, default=16, metavar="N",
                     help="distinct early-exit / speculation options requests may use (each compiles its own "
                     "programs; later new ones get 400; default 16)")
    srv.add_argument("--shutdown-timeout", type=_non_negative_float, default=30.0, metavar="SECONDS",
                     help="on SIGTERM / SIGINT, how long requests in flight may run on; then they end with "
                     'finish reason "abort" and the server exits (default 30)')
    srv.add_argument("--max-body-size", default="2MiB", metavar="BYTES",
                     help="the largest request body read; larger ones get 413 (default 2MiB)")
    srv.add_argument("--warmup", type=_positive_int, metavar="TOKENS",
                     help="before listening, compile the programs for prompts of up to TOKENS tokens (default: "
                     "each program compiles on its first request)")
    srv.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the known model names and the cache")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_guarded(lambda: args.func(args))


if __name__ == "__main__":
    sys.exit(main())
