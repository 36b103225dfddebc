"""The benchmark table and plots, built from the committed JSON in bench/results/.

Where it sits: after `jengine bench ...` runs have written their results, `python -m
bench.report` rewrites the tables between the `bench-table` markers in README.md (engine
rows, workload columns, each peer's ratio to jengine; a second table for SmolLM2's GGUF,
with llama.cpp on the file as it is and on an F32 copy) and draws
`bench/results/throughput.png` (output tok/s per engine, workload A) and
`bench/results/serve.png` (TTFT p99 and output tok/s against the arrival rate). Nothing
here measures: it only reads what the benchmarks wrote, so the README cannot drift from
the JSON.

    python -m bench.report [--readme README.md]
"""

import argparse
import json
import re
from pathlib import Path

from .common import RESULTS_DIR, same_weights

# README table -> (the JSON files' suffix, its markers): the benchmark model, and SmolLM2's
# GGUF (`jengine bench throughput|latency --model smollm2 --out ...-smollm2.json`).
TABLES = {
    "": ("<!-- bench-table:start -->", "<!-- bench-table:end -->"),
    "-smollm2": ("<!-- bench-table-smollm2:start -->", "<!-- bench-table-smollm2:end -->"),
}


def load(name: str) -> dict | None:
    path = RESULTS_DIR / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _cell(value: float | None, ours: float | None, fmt: str, higher_is_better: bool) -> str:
    if value is None:
        return "—"
    text = fmt.format(value)
    if ours is None or value == ours:
        return text
    ratio = ours / value if higher_is_better else value / ours
    return f"{text} (jengine {ratio:.2f}x)"


def columns(suffix: str = "") -> list[tuple[str, dict, str, bool]]:
    """(heading, engine -> figure, format, higher is better) for every result on disk."""
    found = []
    throughput = load(f"throughput{suffix}")
    if throughput:
        rates = {r["engine"]: r["output_tok_per_s"] for r in throughput["results"]}
        offline = {e: rate for e, rate in rates.items() if not e.startswith("jengine serve")}
        found.append(("A: `LLM.generate` / peer, output tok/s", offline, "{:.0f}", True))
        # The server's figure in its jengine row ("jengine serve (Q4_1)" -> "jengine (Q4_1)").
        serve_rows = {
            e.replace("jengine serve", "jengine"): r
            for e, r in rates.items()
            if e.startswith("jengine serve")
        }
        if serve_rows:
            peers = {e: r for e, r in offline.items() if not e.startswith("jengine")}
            served = peers | serve_rows
            found.append(("A: `jengine serve` / peer, output tok/s", served, "{:.0f}", True))
    latency = load(f"latency{suffix}")
    if latency:
        results = latency["results"]
        ttft = {e: 1000 * r["ttft_s"] for e, r in results.items()}
        found.append(("C: TTFT, ms", ttft, "{:.0f}", False))
        decode = {e: r["decode_tok_per_s"] for e, r in results.items()}
        found.append(("C: decode, tok/s", decode, "{:.0f}", True))
    if suffix:
        return found
    serve = load("serve")
    if serve:
        peak = {}
        for engine, key in (("jengine", "jengine serve"), ("llama.cpp", "llama-server")):
            sweep = serve["results"].get(key)
            peak[engine] = max(r["output_tok_per_s"] for r in sweep) if sweep else None
        found.append(("serving: peak output tok/s", peak, "{:.0f}", True))
    prefix = load("prefix")
    if prefix:
        found.append(("prefix cache speed-up", {"jengine": prefix["speedup"]}, "{:.1f}x", True))
    return found


def table(suffix: str = "") -> str:
    cols = columns(suffix)
    lines = [
        "| engine | " + " | ".join(c[0] for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    rows = {e for c in cols for e in c[1]}
    ours = sorted(e for e in rows if e.startswith("jengine"))
    engines = ours + ["transformers"] + sorted(e for e in rows if e.startswith("llama"))
    # Each peer's cell carries jengine's ratio on the same weights (bench/common.py).
    base = {peer: row for row, peer in same_weights(ours, engines[len(ours) :])}
    for engine in engines:
        cells = [
            _cell(c[1].get(engine), c[1].get(base[engine]) if engine in base else None, c[2], c[3])
            for c in cols
        ]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_readme(readme: Path) -> None:
    text = readme.read_text()
    for suffix, (start, end) in TABLES.items():
        if not columns(suffix):
            continue
        block = f"{start}\n{table(suffix)}\n{end}"
        if start in text:
            pattern = re.escape(start) + ".*?" + re.escape(end)
            text = re.sub(pattern, lambda _, block=block: block, text, flags=re.S)
        else:
            text = text.rstrip() + "\n\n" + block + "\n"
    readme.write_text(text)


def plot() -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    throughput = load("throughput")
    if throughput:
        names = [r["engine"] for r in throughput["results"]]
        rates = [r["output_tok_per_s"] for r in throughput["results"]]
        figure, axes = plt.subplots(figsize=(6, 3.5))
        axes.bar(names, rates, color="#4c72b0")
        axes.set_ylabel("output tokens / s")
        axes.set_title("Workload A (128 requests, 128 tokens out), 2-core CPU")
        figure.tight_layout()
        written.append(RESULTS_DIR / "throughput.png")
        figure.savefig(written[-1], dpi=120)
    serve = load("serve")
    if serve:
        figure, (ttft, tokens) = plt.subplots(1, 2, figsize=(10, 3.5))
        for name, sweep in serve["results"].items():
            rates = [r["rate"] for r in sweep]
            ttft.plot(rates, [1000 * r["ttft_s"]["p99"] for r in sweep], marker="o", label=name)
            tokens.plot(rates, [r["output_tok_per_s"] for r in sweep], marker="o", label=name)
        ttft.set(xlabel="arrival rate (req/s)", ylabel="TTFT p99 (ms)", yscale="log")
        tokens.set(xlabel="arrival rate (req/s)", ylabel="output tokens / s")
        ttft.legend()
        figure.tight_layout()
        written.append(RESULTS_DIR / "serve.png")
        figure.savefig(written[-1], dpi=120)
    return written


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    args = parser.parse_args(argv)
    update_readme(Path(args.readme))
    for suffix in TABLES:
        print(table(suffix))
    for path in plot():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
