"""`dynatree serve`: load the models, warm up, serve until interrupted."""

from __future__ import annotations

import re
import socket
import sys
import threading

from ..cli_args import add_model_args, given_method_options, method_options
from ..errors import DynaTreeError
from ..methods import METHODS, get_method, make_config, served_methods
from ..weights import weights_dtype

DRAFT_HELP = ("draft of every request whose method drafts: 'ngram', 'ngram+MODEL', 'ngram+STORE[+MODEL]', a draft LM or "
              "feature head "
              "(as `dynatree generate --draft`) [ngram]")


def add_serve_command(sub) -> None:
    p = sub.add_parser(
        "serve", help="serve an OpenAI-compatible HTTP API (chat and text completions, streamed or not)",
        description="Load the models once, warm up (compiled graphs, the cost curve), then serve "
                    "/v1/chat/completions, /v1/completions, /v1/models, /health and /metrics. One decode runs "
                    "at a time; up to --queue requests wait, more are answered 429. Requests choose their method "
                    "and its options with an extra field, e.g. \"dynatree\": {\"method\": \"fixed-tree\", "
                    "\"depth\": 6}; the flags below set the defaults.")
    p.add_argument("--method", default="dynatree", help="method of requests that name none [dynatree]")
    add_model_args(p, DRAFT_HELP, baselines=False)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on [127.0.0.1]")
    p.add_argument("--port", type=int, default=8000, help="port [8000]")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait while one decodes [16]")
    p.add_argument("--max-tokens", type=int, default=1024,
                   help="most tokens one request may generate, and the default within the context [1024]")
    p.add_argument("--ngram-max", type=int, help="longest context the n-gram drafter matches [4]; only with a draft "
                   "that has the n-gram drafter")
    p.add_argument("--kv-window", metavar="SINK,RECENT", help="attention-sink KV window for every request")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model id clients send and /v1/models lists [the --target as given]")
    p.add_argument("--allow-origin", action="append", default=[], metavar="ORIGIN",
                   help="a browser origin (e.g. http://localhost:3000; '*': any) allowed to call the API from a web "
                        "page (CORS headers); repeatable [none: browsers refuse cross-origin calls]")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="report ready without decoding a warm-up prompt (the first request then compiles and "
                        "measures)")
    p.set_defaults(method_fields=method_options(p, baselines=False), run=cmd_serve)


def settings_from(args):
    """ServeSettings from parsed arguments, every value checked before any model loads."""
    from ..draftspec import parse as parse_draft
    from ..models import check_findable
    from ..window import KVWindow
    from .engine import ServeSettings

    if args.method not in METHODS:  # name the methods a server decodes with, not the peers' baselines too
        raise DynaTreeError(f"unknown method {args.method!r}; the server decodes with {', '.join(served_methods())}")
    spec = get_method(args.method)
    if spec.policy_cls is None:
        raise DynaTreeError(f"--method {args.method}: the server decodes with dynatree's own methods, not "
                            f"{spec.baseline}")
    options = given_method_options(args)
    make_config(args.method, **options)  # unknown or bad options fail here, named
    draft_model = parse_draft(args.draft).model
    if draft_model is not None:
        check_findable(draft_model)  # a mistyped --draft is named before the target loads, not after
    KVWindow.parse(args.kv_window)
    weights_dtype(args.weights, args.dtype)  # q4/int8 + other --dtype: error
    for flag, value, low in (("--port", args.port, 0), ("--queue", args.queue, 1), ("--max-tokens", args.max_tokens, 1),
                             ("--ngram-max", args.ngram_max, 1)):
        if value is not None and value < low:
            raise DynaTreeError(f"{flag} must be at least {low}, got {value}")
    if args.port > 65535:
        raise DynaTreeError(f"--port must be at most 65535, got {args.port}")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise DynaTreeError("--served-model-name must not be empty")
    for origin in args.allow_origin:
        if origin != "*" and not re.fullmatch(r"https?://[^/\sA-Z]+", origin):
            raise DynaTreeError(f"--allow-origin takes an origin such as http://localhost:3000 (scheme and host, no "
                                f"path, lower case as browsers send it) or '*', got {origin!r}")
    return ServeSettings(target=args.target, draft=args.draft, method=args.method, options=options,
                         compile=args.compile, device=args.device, dtype=args.dtype, linear=args.linear,
                         weights=args.weights, ngram_max=args.ngram_max, kv_window=args.kv_window, queue=args.queue,
                         max_tokens=args.max_tokens, warmup=args.warmup, served_model_name=args.served_model_name,
                         allow_origins=tuple(args.allow_origin))


def listen(host: str, port: int) -> socket.socket:
    """A listening socket, bound before any model loads (a busy port is a one-line error)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(128)
    except OSError as exc:
        raise DynaTreeError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sock


def cmd_serve(args) -> int:
    import uvicorn

    from .app import create_app
    from .engine import Engine

    engine = Engine(settings_from(args))
    sock = listen(args.host, args.port)
    config = uvicorn.Config(create_app(engine, load=False), log_level="warning")
    server = uvicorn.Server(config)

    def load():
        print(f"dynatree serve: loading {args.target} and warming up (/health answers 'loading')",
              file=sys.stderr, flush=True)
        engine.load()
        if engine.state == "failed":
            server.should_exit = True
        else:
            for note in engine.notes:
                print(f"dynatree serve: note: {note}", file=sys.stderr, flush=True)
            print(f"dynatree serve: ready at http://{args.host}:{args.port}/v1 (model {engine.model_id!r})",
                  file=sys.stderr, flush=True)

    threading.Thread(target=load, name="dynatree-load", daemon=True).start()
    server.run(sockets=[sock])
    if engine.state == "failed":
        raise DynaTreeError(engine.error)
    return 0
