"""`eejax serve` (the OpenAI-style HTTP server) and `eejax models` (known names, the cache)."""

from __future__ import annotations

import argparse
import time

from eejax.cli.args import (
    REQUEST_OPTIONS,
    add_model_placement,
    add_processes,
    add_sampling_args,
    join_processes,
    load_model,
    non_negative_float,
    non_negative_int,
    positive_int,
    request_options,
    sampling_of,
    seconds_or_off,
)
from eejax.errors import EejaxError


def cmd_serve(args: argparse.Namespace) -> int:
    import logging
    import os
    import signal
    import threading

    from eejax.cache import parse_bytes
    from eejax.engine.engine import Engine
    from eejax.options import DEFAULT_SPEC
    from eejax.serve.access import ACCESS_LOG, api_keys, exposure_warning
    from eejax.serve.http import create_app

    try:
        import uvicorn
    except ImportError:
        raise EejaxError('eejax serve needs the serve extra: pip install "eejax[serve]"') from None
    max_body = parse_bytes(args.max_body_size)
    check_decoding_defaults(args.exit, args.spec)
    if args.warmup_for and not args.warmup:
        raise EejaxError("--warmup-for needs --warmup TOKENS (the prompt lengths to compile for)")
    if (args.ssl_keyfile is None) != (args.ssl_certfile is None):
        raise EejaxError("TLS needs both --ssl-keyfile and --ssl-certfile")
    for tls_file in (args.ssl_keyfile, args.ssl_certfile):
        if tls_file is not None and not os.path.isfile(tls_file):
            raise EejaxError(f"no such file: {tls_file}")
    keys = api_keys(args.api_key, os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.log_format == "json":  # each access line a JSON object of its own
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(message)s"))
        ACCESS_LOG.addHandler(handler)
        ACCESS_LOG.propagate = False
    log = logging.getLogger("eejax.serve")
    if exposure_warning(args.host, keys):
        log.warning(exposure_warning(args.host, keys))
    join_processes(args)
    model = load_model(args)
    engine = Engine(
        model,
        max_slots=args.max_slots,
        max_new_tokens=args.max_tokens_limit,
        cache_budget=args.cache_budget,
        exit=args.exit,
        spec=DEFAULT_SPEC if args.spec is None else args.spec,
        sampling=sampling_of(args),
        policy=args.policy,
        bucketing=not args.no_bucketing,
        pages=args.pages,
        max_decoding_options=args.max_decoding_options,
        prefix_caching=not args.no_prefix_caching,
        prefill_chunk=args.prefill_chunk or None,
        steps_per_dispatch=args.steps_per_dispatch,
    )
    exit_config, spec_config = engine.requests.exit_config, engine.requests.checked_spec(engine.requests.spec)
    default = f"speculation {spec_config.spec}" if spec_config else exit_config and f"early exit {exit_config.spec}"
    log.info("requests that name neither exit nor spec decode with %s", default or "full depth")
    if args.warmup:
        engine.warmup(args.warmup, requests=args.warmup_for)
    if args.num_processes > 1 and args.process_id != 0:  # a replica: steps with process 0 until it stops
        from eejax.engine.replicas import follow

        log.info("process %d follows process 0's engine", args.process_id)
        follow(engine)
        return 0
    engine.start()
    app = create_app(
        engine,
        served_model_name=args.served_model_name or args.model,
        max_waiting=args.max_waiting,
        max_body_bytes=max_body,
        api_keys=keys,
        protect_metrics=args.protect_metrics,
        log_format=args.log_format,
        request_timeout=args.request_timeout or None,
    )

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

    server = Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level="info",
            access_log=False,  # eejax.access logs every request, with its id
            timeout_graceful_shutdown=args.shutdown_timeout + 1,
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
        )
    )

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


def check_decoding_defaults(exit_spec: str | None, spec: str | None) -> None:
    """--exit and --spec read before the model loads: one of them at most, each well formed."""
    from eejax.options import ExitConfig, SpecConfig, check_exit_or_spec, is_auto, is_off

    check_exit_or_spec(exit_spec, spec, ("--exit", "--spec"))
    if exit_spec is not None:
        ExitConfig.parse(exit_spec)
    if spec is not None and not (is_off(spec) or is_auto(spec)):
        SpecConfig.parse(spec)


def cmd_models(args: argparse.Namespace) -> int:
    from eejax.loading.hub import KNOWN_MODELS, cache_dir

    for name, known in KNOWN_MODELS.items():
        built = (cache_dir() / "models" / name).exists()
        state = "converted" if built else "not fetched yet" if known.delta is None else "built on first load"
        print(f"{name}\t{known.description} [{state}]")
    print(f"cache: {cache_dir()} (set EEJAX_CACHE to move it)")
    return 0


def add_parsers(sub) -> None:
    """Adds this module's commands to the `eejax` subparsers."""
    srv = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description="Continuous batching over one paged KV cache behind POST /v1/completions and "
        "/v1/chat/completions (stream: true for server-sent events), GET /health and GET /metrics (Prometheus).",
    )
    srv.add_argument("--model", required=True, help="eejax checkpoint directory or known model name")
    srv.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    srv.add_argument("--port", type=positive_int, default=8000, help="port (default 8000)")
    srv.add_argument("--served-model-name", help="the model name clients must send (default: --model as given)")
    srv.add_argument("--max-slots", type=positive_int, default=8, help="rows decoded together (default 8)")
    add_model_placement(
        srv,
        "stacked",
        ": a server compiles hundreds of programs, and Linux's default vm.max_map_count holds ~250 "
        "stacked ones per process, ~65 unrolled",
    )
    add_processes(srv, "process 0 serves HTTP and schedules, the others follow its steps")
    srv.add_argument(
        "--max-tokens-limit",
        type=positive_int,
        default=256,
        help="the largest max_tokens a request may ask (default 256)",
    )
    srv.add_argument(
        "--max-waiting", type=positive_int, default=256, help="requests queued before new ones get 429 (default 256)"
    )
    srv.add_argument("--cache-budget", default="1GiB", help="KV cache memory (default 1GiB)")
    srv.add_argument(
        "--exit",
        metavar="SPEC",
        help="the early exit of requests that name neither exit nor spec, as in eejax generate --exit (default: "
        "none, full depth); a request's own exit or spec replaces it",
    )
    srv.add_argument(
        "--spec",
        metavar="SPEC",
        help="the speculation of requests that name neither exit nor spec, as in eejax generate --spec, e.g. "
        "auto or draft:4:lookup (default: auto unless --exit is given: the draft head where it pays, full "
        "depth on a model without one and on a CPU serving more than one slot); a request's own exit or spec "
        'replaces it ("none": full depth). --warmup compiles its programs too',
    )
    add_sampling_args(srv, "requests' default: ")
    srv.add_argument("--policy", choices=("fcfs", "sjf", "ljf"), default="fcfs", help="order inside a bucket")
    srv.add_argument("--no-bucketing", action="store_true", help="one bucket (plain FCFS continuous batching)")
    srv.add_argument(
        "--prefill-chunk",
        type=non_negative_int,
        default=0,
        metavar="TOKENS",
        help="chunked prefill: at most TOKENS prompt tokens prefilled per engine step, between decode "
        "steps, so that long prompts do not stall the running requests (default 0: whole prompts)",
    )
    srv.add_argument(
        "--steps-per-dispatch",
        type=positive_int,
        default=4,
        metavar="N",
        help="decode steps the engine runs in one device program (default 4: one dispatch and one "
        "read per 4 tokens; streamed tokens then come 4 at a time). It runs 1 while a prompt "
        "prefills in chunks or a waiting request could take the slot of a row reaching its limit, "
        "so admission is not delayed; 1 here: always one",
    )
    srv.add_argument(
        "--no-prefix-caching",
        action="store_true",
        help="do not share the KV pages of prompt prefixes between requests (shared by default: full "
        "pages of prompt tokens are kept, least recently used evicted first)",
    )
    srv.add_argument(
        "--pages",
        choices=("reserve", "grow"),
        default="reserve",
        help="reserve: a request's pages for prompt + max_tokens at admission (never preempts); grow: "
        "pages as rows grow, preempting the lowest-priority row (recomputed later) when they run out",
    )
    srv.add_argument(
        "--max-decoding-options",
        type=positive_int,
        default=16,
        metavar="N",
        help="distinct early-exit / speculation options requests may use (each compiles its own "
        "programs; later new ones get 400; default 16)",
    )
    srv.add_argument(
        "--shutdown-timeout",
        type=non_negative_float,
        default=30.0,
        metavar="SECONDS",
        help="on SIGTERM / SIGINT, how long requests in flight may run on; then they end with "
        'finish reason "abort" and the server exits (default 30)',
    )
    srv.add_argument(
        "--max-body-size",
        default="2MiB",
        metavar="BYTES",
        help="the largest request body read; larger ones get 413 (default 2MiB)",
    )
    srv.add_argument(
        "--warmup",
        type=positive_int,
        metavar="TOKENS",
        help="before listening, compile the programs for prompts of up to TOKENS tokens (default: "
        "each program compiles on its first request)",
    )
    srv.add_argument(
        "--warmup-for",
        action="append",
        type=request_options,
        default=[],
        metavar="OPTIONS",
        help="with --warmup, also compile the programs of requests with these options, as key=value pairs "
        f"separated by commas ({', '.join(REQUEST_OPTIONS)}), e.g. 'temperature=0.8,top_p=0.95' or "
        "'spec=15:2'; repeat for several kinds of request (default: the server's own options only). Each kind "
        "costs programs (SmolLM2, 8 slots, 256 tokens: ~260 prefills per sampler, log-prob or penalty kind): "
        "compile what the clients will send",
    )
    srv.add_argument(
        "--api-key",
        action="append",
        metavar="KEY",
        help="require Authorization: Bearer KEY on every /v1/* route (repeat for several keys; "
        "default: the comma-separated keys of $EEJAX_API_KEY, else none: the server is open). /health "
        "stays open; a missing or wrong key gets 401",
    )
    srv.add_argument("--protect-metrics", action="store_true", help="/metrics needs the API key too (default: open)")
    srv.add_argument("--ssl-keyfile", metavar="FILE", help="TLS private key (PEM); with --ssl-certfile serves https")
    srv.add_argument("--ssl-certfile", metavar="FILE", help="TLS certificate chain (PEM)")
    srv.add_argument(
        "--request-timeout",
        type=seconds_or_off,
        default=0.0,
        metavar="SECONDS",
        help="a request ends this long after it arrived (waiting in the queue included) with what it has: "
        'finish reason "length" and eejax.timed_out, or a 504 if a non-streamed request has no token yet. '
        "A request's own timeout field (seconds) can only shorten it (default 0 or off: no deadline)",
    )
    srv.add_argument(
        "--log-format",
        choices=("text", "json"),
        default="text",
        help="the access log (one line per request on the eejax.access logger: id, route, status, "
        "tokens, finish reason, time to first token, total time, decoding option) as key=value text "
        "or one JSON object per line (default text)",
    )
    srv.set_defaults(func=cmd_serve)

    models = sub.add_parser("models", help="list the known model names and the cache")
    models.set_defaults(func=cmd_models)
