"""The `jengine` command: `jengine serve [MODEL] ...` (OpenAI-compatible server),
`jengine generate "PROMPT" ...` (one offline completion through `LLM`), `jengine chat
"MESSAGE" ...` (one reply through the model's chat template, streamed; a conversation at a
terminal when the message is left out, or with -i) and `jengine bench
NAME ...` (the benchmarks of bench/, installed as jengine.bench).

Where it sits: the outermost entry point. Flags keep vLLM's names (`--max-model-len`,
`--max-num-seqs`, `--served-model-name`, `--api-key`, ...). With no model, all use the
default model (SmolLM2 when installed, else the bundled one). `serve` never imports jax in
this process (the engine process does); `generate` and `chat` run the engine in-process
and compile only the step shapes their one request needs, when it needs them.
"""

import argparse
import contextlib
import importlib
import logging
import os
import select
import signal
import socket
import sys
from dataclasses import fields

from jengine.engine.arg_utils import EngineArgs
from jengine.entrypoints.openai.cli_args import add_serve_args, flags_met_by_construction
from jengine.logger import init_logging
from jengine.lora_request import parse_lora_modules
from jengine.models.default import default_model, describe_default
from jengine.torch_free import keep_torch_out

logger = logging.getLogger("jengine")

# `jengine bench NAME`: vLLM's names where vLLM has one.
BENCHMARKS = (
    "throughput", "latency", "serve", "prefix", "overhead", "startup", "parallel", "structured",
    "spec_decode", "moe", "lora", "embed",
)  # fmt: skip


# What a one-shot command's positional text may be instead.
FROM_STDIN = "the text (left out, or -: read from standard input)"


def _version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("jengine")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree
        return "0.0.0"


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="jengine", description="JAX-native LLM inference and serving engine"
    )
    parser.add_argument("--version", action="version", version=f"jengine {_version()}")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="start the OpenAI-compatible HTTP server")
    add_serve_args(serve)
    _add_chat_template_arg(serve)
    EngineArgs.add_cli_args(serve)

    generate = commands.add_parser("generate", help="complete one prompt offline")
    generate.add_argument("prompt", nargs="?", help=FROM_STDIN)
    generate.add_argument("--max-tokens", type=int, default=64)
    recommended = "default: the model's generation_config.json, else %s"
    generate.add_argument("--temperature", type=float, help=recommended % "1")
    generate.add_argument("--top-p", type=float, help=recommended % "1")
    generate.add_argument("--top-k", type=int, help=recommended % "0 (off)")
    generate.add_argument("--stream", action="store_true", help="print tokens as they come")
    EngineArgs.add_cli_args(generate)
    # One prompt, once: compile the shapes one request needs, when it needs them.
    generate.set_defaults(max_num_seqs=1, warmup=False)

    chat = commands.add_parser(
        "chat",
        help="answer one message through the model's chat template, streamed (or hold a "
        "conversation)",
    )
    chat.add_argument(
        "message",
        nargs="?",
        help="the message (left out: a conversation at a terminal, else read from standard "
        "input; -: read from standard input)",
    )
    chat.add_argument(
        "-i",
        "--interactive",
        action="store_true",
        help="a conversation: each line of input is a turn (the message, if given, is the first)",
    )
    chat.add_argument("--system", default=None, help="system prompt (default: the template's)")
    _add_chat_template_arg(chat)
    chat.add_argument("--max-tokens", type=int, default=256)
    chat.add_argument("--temperature", type=float, help=recommended % "0 (greedy)")
    chat.add_argument("--top-p", type=float, help=recommended % "1")
    chat.add_argument("--top-k", type=int, help=recommended % "0 (off)")
    EngineArgs.add_cli_args(chat)
    chat.set_defaults(max_num_seqs=1, warmup=False)

    bench = commands.add_parser(
        "bench",
        help="race jengine against its peers (transformers, llama.cpp); see bench/README.md",
    )
    # Optional only to argparse, whose error for a missing one named `options` as missing too.
    bench.add_argument("benchmark", nargs="?", choices=BENCHMARKS)
    bench.add_argument("options", nargs=argparse.REMAINDER, help="the benchmark's own flags")
    for command in (serve, generate, chat):
        _show_defaults(command)
    return parser


def _show_defaults(parser: argparse.ArgumentParser) -> None:
    """Every flag's help names its default where it has one and does not say it already
    (`%(default)s`: the value at --help time, after a command's set_defaults)."""
    for action in parser._actions:
        default, text = action.default, action.help
        if (
            not action.option_strings
            or default is None
            or default is False  # a store_true flag (not 0, which `in` would take for it)
            or default == argparse.SUPPRESS
            or text is argparse.SUPPRESS
            or "default" in (text or "")
        ):
            continue
        action.help = f"{text} (default: %(default)s)" if text else "default: %(default)s"


def cmd_serve(args: argparse.Namespace) -> None:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit("give the model once: positionally or with --model")
    if not (args.model_tag or args.model):
        args.model = default_model()
        logger.info(describe_default(args.model))
        # Clients name the bundled model by its folder name, not a site-packages path.
        args.served_model_name = args.served_model_name or [os.path.basename(args.model)]
    args.model = args.model_tag or args.model
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("error: --enable-auto-tool-choice needs --tool-call-parser")
    for line in flags_met_by_construction(args):
        logger.info(line)
    try:
        args.lora_modules = parse_lora_modules(args.lora_modules)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    if (args.lora_modules or args.allow_runtime_lora_updating) and not args.enable_lora:
        raise SystemExit("error: LoRA adapters need --enable-lora")
    for name, path in args.lora_modules.items():  # the rest is checked once the engine reads it
        if not os.path.isfile(os.path.join(path, "adapter_config.json")):
            raise SystemExit(f"error: --lora-modules {name}: {path!r} has no adapter_config.json")
    if args.host_rank > 0:
        # Not a server: this host runs host 0's steps on its devices (it imports jax).
        from jengine.engine.core import EngineCore
        from jengine.runner import distributed

        config = EngineArgs.from_cli_args(args).create_engine_config()  # bad flags: one line
        try:
            EngineCore(config).run_follower()
        except Exception:
            logger.exception("host %d failed", args.host_rank)
            distributed.exit_now(1)  # host 0 waits for this one: end it too
        return
    sock = _listen_socket(args.host, args.port)
    config = EngineArgs.from_cli_args(args).create_engine_config()
    # The engine processes start before this process imports the server (FastAPI,
    # transformers, the tokenizer: seconds): both start-ups then run side by side.
    from jengine.engine.mp_clients import AsyncMPClient

    # SIGTERM while the engine starts stops it as Ctrl-C does, through the `finally` below
    # (the engine stopped, its socket folder removed, exit code 0); Python's default ended
    # this process on the spot and left the folder in /tmp. Once the server serves, uvicorn
    # takes SIGTERM to drain it, and re-raises a second one (which cut the drain short)
    # after it stops: that too reaches the `finally` instead of killing the process. (Cut
    # short inside the constructor, the client's exit hook stops what it started.)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        engine_core = AsyncMPClient(config)
        try:
            from jengine.entrypoints.openai.api_server import run_server

            run_server(args, config, engine_core, sock)
        finally:
            engine_core.shutdown()
            sock.close()


def _raise_keyboard_interrupt(signum, frame):
    raise KeyboardInterrupt("terminated")


def _listen_socket(host: str | None, port: int) -> socket.socket:
    """Bound before the engine starts, so a taken port fails in a second, not after warmup."""
    host = host or "0.0.0.0"
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise SystemExit(f"error: cannot listen on {host}:{port}: {e}") from None
    return sock


def _one_shot_llm(args: argparse.Namespace):
    """The LLM of `generate` / `chat`: the flags' engine, the default model if none."""
    from jengine.pallas_kernels import prepare as prepare_kernels

    # First thing: a cold start's kernel build (seconds of the C++ compiler) then runs on
    # the other core while jengine, transformers and the weights load.
    prepare_kernels(args.attention_impl)
    from jengine import LLM

    e = EngineArgs.from_cli_args(args)
    if e.model is None:
        e.model = default_model()
        logger.info(describe_default(e.model))
    engine_kwargs = {f.name: getattr(e, f.name) for f in fields(e) if f.name != "model"}
    return LLM(e.model, **engine_kwargs)


def _stream(llm, prompt, params) -> str:
    """Print one request's text as it comes, then a newline; return the text."""
    from jengine.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    engine.add_request("0", prompt, params, output_kind=RequestOutputKind.DELTA)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            pieces.append(output.outputs[0].text)
            sys.stdout.write(pieces[-1])
            sys.stdout.flush()
    sys.stdout.write("\n")
    return "".join(pieces)


def _sampling_params(args: argparse.Namespace, recommended: dict | None = None):
    """The flags given, over the model's `recommended` sampling (`LLM.generate`'s default);
    without it, over SamplingParams' defaults: a check of the flags before the model loads."""
    from jengine import SamplingParams
    from jengine.generation_config import given_over

    given = {name: getattr(args, name) for name in ("temperature", "top_p", "top_k")}
    return SamplingParams(
        **given_over(recommended or {}, given),
        max_tokens=args.max_tokens,
        seed=args.seed,
    )


def _text_or_stdin(text: str | None, what: str) -> str:
    """A one-shot command's text: the argument, else what is piped in (before the model
    loads, so a missing text fails at once)."""
    if text is None or text == "-":
        if sys.stdin.isatty():
            raise SystemExit(f"error: give the {what}, or pipe it in on standard input")
        text = sys.stdin.read().strip()
    if not text:
        raise SystemExit(f"error: the {what} is empty")
    return _utf8(text, what)


def _utf8(text: str, what: str) -> str:
    """`text` from the command line or standard input, which Python decodes leaving bytes
    that are not UTF-8 as lone surrogates: a ValueError naming the first such byte."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raw = text.encode("utf-8", "surrogateescape")
        offset = len(text[: e.start].encode("utf-8", "surrogateescape"))
        raise ValueError(
            f"the {what} is not valid UTF-8: byte 0x{raw[offset]:02x} at byte {offset}"
        ) from None
    return text


def cmd_generate(args: argparse.Namespace) -> None:
    prompt = _text_or_stdin(args.prompt, "prompt")
    _sampling_params(args)  # a bad flag fails before the model loads
    llm = _one_shot_llm(args)
    params = _sampling_params(args, llm.llm_engine.sampling_defaults)
    if not args.stream:
        print(llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].text)
        return
    _stream(llm, prompt, params)


def _add_chat_template_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template, or a file holding one, to use instead of the model's",
    )


def cmd_chat(args: argparse.Namespace) -> None:
    from jengine.engine.input_processor import load_chat_template

    template = load_chat_template(args.chat_template)  # a bad name fails before loading
    conversation = args.interactive or (args.message is None and sys.stdin.isatty())
    message = None if conversation else _text_or_stdin(args.message, "message")
    _sampling_params(args)  # a bad flag fails before the model loads
    llm = _one_shot_llm(args)
    system = [] if args.system is None else [{"role": "system", "content": args.system}]
    # Unlike `generate`, a reply is greedy unless the model recommends a temperature: the
    # same question gets the same answer.
    params = _sampling_params(args, {"temperature": 0.0, **llm.llm_engine.sampling_defaults})

    def reply(messages: list[dict]) -> str:
        render = llm.llm_engine.input_processor.render_chat
        text, token_ids = render(messages, chat_template=template)
        return _stream(llm, {"prompt": text, "prompt_token_ids": token_ids}, params)

    if not conversation:
        reply([*system, {"role": "user", "content": message}])
        return
    _converse(reply, system, first=None if args.message == "-" else args.message)


def _converse(reply, system: list[dict], first: str | None) -> None:
    """`jengine chat` as a conversation: each line read is a user turn, answered with the
    turns before it. A turn the engine refuses (the conversation outgrew max_model_len)
    prints why and is dropped; `/clear` starts over; `/exit`, end of input or Ctrl-C ends."""
    at_terminal = sys.stdin.isatty()
    if at_terminal:
        print("(a conversation: /clear starts over, /exit or Ctrl-D ends it)", file=sys.stderr)
    history: list[dict] = []
    with contextlib.suppress(EOFError, KeyboardInterrupt):
        while True:  # piped turns: the replies alone, a line each
            line = first if first is not None else _read_turn(at_terminal)
            first = None
            if line.strip() == "/exit":
                return
            if line.strip() == "/clear":
                history = []
                continue
            if not line.strip():
                continue
            try:
                turn = {"role": "user", "content": _utf8(line, "line")}
                answer = reply([*system, *history, turn])
            except ValueError as e:
                print(f"error: {e}", file=sys.stderr)
                continue
            history += [turn, {"role": "assistant", "content": answer}]


def _read_turn(at_terminal: bool) -> str:
    """The next line of input (EOFError at its end). At a terminal the wait is in Python,
    polled: Ctrl-C's SIGINT may land on any of the engine's threads, and only the main
    thread running Python raises KeyboardInterrupt (`input()`'s read went on to Enter)."""
    if not at_terminal:
        return input("")
    sys.stderr.write("> ")  # where input() writes it: standard output holds replies only
    sys.stderr.flush()
    while not select.select([sys.stdin], [], [], 0.1)[0]:
        pass
    line = sys.stdin.readline()
    if not line:
        raise EOFError
    return line.removesuffix("\n")


def cmd_bench(args: argparse.Namespace) -> None:
    if args.benchmark is None:
        raise SystemExit(f"error: name a benchmark: {', '.join(BENCHMARKS)}")
    # The benchmarks ship as jengine.bench (the repository's bench/ folder).
    importlib.import_module(f"jengine.bench.{args.benchmark}").main(args.options)


# Commands that use transformers for tokenizers only (see jengine/torch_free.py).
_TORCH_FREE_COMMANDS = ("serve", "generate", "chat")


def main(argv: list[str] | None = None) -> None:
    args = make_parser().parse_args(argv)
    if args.command in _TORCH_FREE_COMMANDS:
        keep_torch_out()
    init_logging()
    try:
        run = {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "bench": cmd_bench}
        run[args.command](args)
    except ValueError as e:  # bad flags / config: one line, not a traceback
        raise SystemExit(f"error: {e}") from None
    except KeyboardInterrupt:  # Ctrl-C: the user's choice, not a failure to explain
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
