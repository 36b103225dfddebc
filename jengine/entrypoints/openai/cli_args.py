"""`jengine serve`'s own flags (the engine's are EngineArgs'), by vLLM's names.

Where it sits: cli.py's `serve` parser takes them; `api_server.run_server` hands them to
`build_app`. Jax-free.

Promises: a vLLM flag jengine takes means what it means in vLLM; the vLLM flags whose
purpose jengine meets by construction (`--trust-remote-code`: no checkpoint code ever runs;
`--enable-chunked-prefill`: prefill is always chunked; `--disable-log-requests`: requests
are not logged; `--enforce-eager`: no CUDA graphs to turn off) are taken, and the start-up
log says so, so that a vLLM command line starts a jengine server.
"""

import argparse
import json
import logging
import os

DEFAULT_MAX_REQUEST_BODY_BYTES = 16 * 1024 * 1024
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
# vLLM's flags whose purpose jengine meets by construction: flag -> why it changes nothing.
MET_BY_CONSTRUCTION = {
    "trust_remote_code": "jengine runs no code from checkpoints",
    "enable_chunked_prefill": "jengine always chunks prefill",
    "disable_log_requests": "jengine does not log requests",
    "enforce_eager": "jengine has no CUDA graphs to turn off",
}
# vLLM's LLM(...) arguments whose purpose jengine meets by construction -> why (taken, and
# logged, so scripts written for vLLM start as they are, as `jengine serve` takes the flags).
MET_OFFLINE = {
    **MET_BY_CONSTRUCTION,
    "disable_log_stats": "the offline LLM logs no periodic stats",
    "swap_space": "preemption recomputes; nothing is swapped to the host",
}


def take_met_offline(llm_kwargs: dict) -> None:
    """Take the MET_OFFLINE arguments out of `LLM(...)`'s keywords, logging why each
    changes nothing."""
    for name in sorted(llm_kwargs.keys() & MET_OFFLINE):
        value = llm_kwargs.pop(name)
        logging.getLogger("jengine.entrypoints.llm").info(
            "%s=%r changes nothing: %s", name, value, MET_OFFLINE[name]
        )


def port(value: str) -> int:
    port = int(value)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0-65535, got {port}")
    return port


def _number(kind: type, above: float | None = None, at_least: float | None = None):
    """An argparse type: a `kind` number above `above` or at least `at_least`."""

    def parse(value: str):
        number = kind(value)
        if (above is not None and not number > above) or (
            at_least is not None and not number >= at_least
        ):
            bound = f"above {above}" if above is not None else f"at least {at_least}"
            raise argparse.ArgumentTypeError(f"must be {bound}, got {value}")
        return number

    parse.__name__ = kind.__name__  # argparse's "invalid int value: 'x'"
    return parse


def _json_strings(value: str) -> list[str]:
    """The CORS flags: a JSON list of strings (a bare string once matched origins by
    substring)."""
    try:
        items = json.loads(value)
    except json.JSONDecodeError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"a JSON list of strings, e.g. '[\"*\"]', got {value}")
    return items


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        help="an HF checkpoint folder, a .gguf file, or smollm2 / shakespeare",
    )
    serve.add_argument("--host", default=None, help="address to bind (default: all)")
    serve.add_argument("--port", type=port, default=8000)
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) clients use (default: the model path); the first is reported",
    )
    serve.add_argument(
        "--api-key",
        default=os.environ.get("JENGINE_API_KEY"),
        help="require `Authorization: Bearer KEY` on /v1, /tokenize, /detokenize and /metrics "
        "(env JENGINE_API_KEY)",
    )
    serve.add_argument(
        "--allowed-origins",
        type=_json_strings,
        default=[],
        help="CORS: origins allowed to call the server from a browser, as JSON ('[\"*\"]' for "
        'any); default none (no CORS headers, unlike vLLM\'s "*")',
    )
    for flag in ("--allowed-methods", "--allowed-headers"):
        serve.add_argument(flag, type=_json_strings, default=["*"], help="CORS, JSON list")
    serve.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials")
    serve.add_argument(
        "--max-queued-requests",
        type=_number(int, at_least=0),
        default=None,
        help="answer 429 (with Retry-After) to requests beyond max_num_seqs running plus this "
        "many queued sequences (default: queue without bound)",
    )
    serve.add_argument(
        "--max-request-body-bytes",
        type=_number(int, above=0),
        default=DEFAULT_MAX_REQUEST_BODY_BYTES,
        help="answer 413 to larger request bodies",
    )
    serve.add_argument(
        "--shutdown-timeout",
        type=_number(float, at_least=0),
        default=DEFAULT_SHUTDOWN_TIMEOUT,
        help="on SIGTERM/SIGINT, seconds running requests may take to finish before they "
        "end with an error",
    )
    serve.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical", "trace"],
    )
    serve.add_argument("--disable-uvicorn-access-log", action="store_true")
    serve.add_argument("--disable-log-stats", action="store_true")
    serve.add_argument(
        "--log-stats-interval",
        type=_number(float, above=0),
        default=10.0,
        help="seconds between stats lines (--disable-log-stats: none)",
    )
    serve.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='tool_choice "auto": find tool calls in replies with --tool-call-parser',
    )
    serve.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"])
    serve.add_argument(
        "--return-tokens-as-token-ids",
        action="store_true",
        help='logprob tokens as "token_id:<id>" for requests that do not say',
    )
    serve.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        help="usage.prompt_tokens_details.cached_tokens: prompt tokens the prefix cache served",
    )
    serve.add_argument(
        "--enable-request-id-headers",
        action="store_true",
        help="every response carries X-Request-Id: the request's own header, else a fresh id",
    )
    serve.add_argument(
        "--reasoning-parser",
        choices=["deepseek_r1", "qwen3"],
        help="move the text between <think> and </think> into reasoning_content",
    )
    serve.add_argument(
        "--lora-modules",
        nargs="+",
        action="extend",
        metavar="NAME=PATH",
        help="LoRA adapters (PEFT folders) served by name, as name=path or JSON "
        '{"name": ..., "path": ...} (with --enable-lora)',
    )
    serve.add_argument(
        "--allow-runtime-lora-updating",
        action="store_true",
        help="POST /v1/load_lora_adapter and /v1/unload_lora_adapter change the adapters",
    )
    serve.add_argument(
        "--response-role",
        default="assistant",
        help="the role of chat replies when the request adds the generation prompt",
    )
    serve.add_argument(
        "--exclude-tools-when-tool-choice-none",
        action="store_true",
        help='tool_choice "none": leave the tools out of the chat template (default: the '
        "template still sees them, as in vLLM)",
    )
    for name, why in MET_BY_CONSTRUCTION.items():
        flag = "--" + name.replace("_", "-")
        serve.add_argument(flag, action="store_true", help=f"vLLM's; no effect: {why}")


def flags_met_by_construction(args: argparse.Namespace) -> list[str]:
    """The start-up log's lines for the vLLM flags given that change nothing here."""
    return [
        f"--{name.replace('_', '-')} changes nothing: {why}"
        for name, why in MET_BY_CONSTRUCTION.items()
        if getattr(args, name, False)
    ]
