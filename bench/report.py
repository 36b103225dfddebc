"""The benchmark table and plots, built from the committed JSON in bench/results/.

Where it sits: after `jengine bench ...` runs have written their results, `python -m
bench.report` rewrites the table between the `bench-table` markers in README.md (engine
rows, workload columns, each peer's ratio to jengine) and draws
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

from .common import RESULTS_DIR

START, END = "<!-- bench-table:start -->", "<!-- bench-table:end -->"
ENGINES = ("jengine", "transformers", "llama.cpp")


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


def columns() -> list[tuple[str, dict, str, bool]]:
    """(heading, engine -> figure, format, higher is better) for every result on disk."""
    found = []
    throughput = load("throughput")
    if throughput:
        rates = {r["engine"]: r["output_tok_per_s"] for r in throughput["results"]}
        offline = {e: rates.get(e) for e in ENGINES}
        found.append(("A: `LLM.generate` / peer, output tok/s", offline, "{:.0f}", True))
        if "jengine serve" in rates:
            served = dict(offline, jengine=rates["jengine serve"])
            found.append(("A: `jengine serve` / peer, output tok/s", served, "{:.0f}", True))
    latency = load("latency")
    if latency:
        results = latency["results"]
        found.append(("C: TTFT, ms", {e: 1000 * results[e]["ttft_s"] if e in results else None
                                      for e in ENGINES}, "{:.0f}", False))  # fmt: skip
        found.append(("C: decode, tok/s", {e: results[e]["decode_tok_per_s"] if e in results
                                          else None for e in ENGINES}, "{:.0f}", True))  # fmt: skip
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


def table() -> str:
    cols = columns()
    lines = [
        "| engine | " + " | ".join(c[0] for c in cols) + " |",
        "|---" * (len(cols) + 1) + "|",
    ]
    for engine in ENGINES:
        cells = [_cell(c[1].get(engine), c[1].get("jengine"), c[2], c[3]) for c in cols]
        lines.append(f"| {engine} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def update_readme(readme: Path) -> None:
    text = readme.read_text()
    block = f"{START}\n{table()}\n{END}"
    if START in text:
        text = re.sub(re.escape(START) + ".*?" + re.escape(END), lambda _: block, text, flags=re.S)
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--readme", default=str(Path(__file__).resolve().parents[1] / "README.md"))
    args = parser.parse_args(argv)
    update_readme(Path(args.readme))
    print(table())
    for path in plot():
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
