"""The benchmarks' own arithmetic and plumbing, without timing anything: output
comparison, the roofline model, the host-overhead loop, the README table, the CLI."""

import json
import subprocess
import sys

import pytest

from jengine.bench import common, overhead, report, roofline
from jengine.bench.workloads import BENCH_MODEL


def test_token_match_counts_up_to_the_first_difference():
    match = common.token_match([[1, 2, 3, 4], [5, 6]], [[1, 2, 9, 4], [5, 6]])
    assert match["identical_sequences"] == 1 and match["sequences"] == 2
    assert match["token_match_rate"] == pytest.approx((2 + 2) / (4 + 2))


def test_workload_flops_counts_layers_attention_and_sampled_logits():
    params = roofline.layer_params(BENCH_MODEL)
    assert params == 8 * (512 * 512 * 2 + 512 * 256 * 2 + 3 * 512 * 1408)
    lm_head = 512 * 32000
    one_token = roofline.workload_flops([1], 0)
    assert one_token == 2 * params + 4 * 8 * 512 * 1
    assert roofline.workload_flops([1], 1) == pytest.approx(
        2 * params * 2 + 4 * 8 * 512 * 3 + 2 * lm_head
    )
    assert roofline.weight_bytes(BENCH_MODEL) == (params + lm_head) * 4


def test_overhead_loop_runs_the_engine_host_path():
    result = overhead.step_times(num_running=8, steps=6, tokenizer=None)
    assert result["num_running"] == 8 and result["median_ms"] > 0
    assert set(result["parts_median_ms"]) == {"schedule", "runner", "update", "output_processing"}


def test_report_table_from_results(tmp_path, monkeypatch):
    (tmp_path / "throughput.json").write_text(
        json.dumps(
            {
                "results": [
                    {"engine": "jengine", "output_tok_per_s": 900.0},
                    {"engine": "jengine serve", "output_tok_per_s": 800.0},
                    {"engine": "transformers", "output_tok_per_s": 300.0},
                    {"engine": "llama.cpp", "output_tok_per_s": 450.0},
                ]
            }
        )
    )
    (tmp_path / "latency-smollm2.json").write_text(
        json.dumps(
            {
                "results": {
                    "jengine (Q4_1)": {"ttft_s": 0.3, "decode_tok_per_s": 80.0},
                    "jengine (F32)": {"ttft_s": 0.2, "decode_tok_per_s": 20.0},
                    "llama.cpp (Q4_1)": {"ttft_s": 0.4, "decode_tok_per_s": 100.0},
                    "llama.cpp (F32)": {"ttft_s": 0.25, "decode_tok_per_s": 50.0},
                }
            }
        )
    )
    (tmp_path / "throughput-smollm2.json").write_text(
        json.dumps(
            {
                "results": [
                    {"engine": "jengine (Q4_1)", "output_tok_per_s": 150.0},
                    {"engine": "jengine (F32)", "output_tok_per_s": 180.0},
                    {"engine": "jengine serve (Q4_1)", "output_tok_per_s": 140.0},
                    {"engine": "transformers", "output_tok_per_s": 90.0},
                    {"engine": "llama.cpp (Q4_1)", "output_tok_per_s": 70.0},
                ]
            }
        )
    )
    monkeypatch.setattr(report, "RESULTS_DIR", tmp_path)
    readme = tmp_path / "README.md"
    readme.write_text("# title\n")
    report.update_readme(readme)
    report.update_readme(readme)  # idempotent: the block is replaced, not appended
    text = readme.read_text()
    for start, _ in report.TABLES.values():
        assert text.count(start) == 1
    assert "| llama.cpp | 450 (jengine 2.00x) | 450 (jengine 1.78x) |" in text
    assert "| transformers | 300 (jengine 3.00x) |" in text
    # The GGUF table: a row per weights each engine ran, every peer's ratio against
    # jengine on the same weights (transformers dequantizes: F32), TTFT lower-is-better.
    assert "| jengine (F32) | 180 | — | 200 | 20 |" in text
    assert "| jengine (Q4_1) | 150 | 140 | 300 | 80 |" in text
    assert "| transformers | 90 (jengine 2.00x) | 90 | — | — |" in text
    assert "| llama.cpp (F32) | — | — | 250 (jengine 1.25x) | 50 (jengine 0.40x) |" in text
    assert (
        "| llama.cpp (Q4_1) | 70 (jengine 2.14x) | 70 (jengine 2.00x) | 400 (jengine 1.33x) "
        "| 100 (jengine 0.80x) |"
    ) in text


def test_cli_lists_every_benchmark():
    result = subprocess.run(
        [sys.executable, "-m", "jengine.entrypoints.cli", "bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0
    for name in ("throughput", "latency", "serve", "prefix", "overhead", "startup"):
        assert name in result.stdout


FAKE_LLAMA_BENCH = """#!{python}
# Dies as llama.cpp's AMX matmul did on an AMX Xeon VM unless repacking is off
# (`crashes` = {crashes}); otherwise prints a pp and a tg result and the flags it got.
import json, os, signal, sys
if {crashes} and "--repack" not in sys.argv:
    os.kill(os.getpid(), signal.SIGSEGV)
tests = [dict(n_prompt=8, n_gen=0, avg_ts=100.0, stddev_ts=0.0, args=sys.argv[1:]),
         dict(n_prompt=0, n_gen=4, avg_ts=50.0, stddev_ts=0.0, args=sys.argv[1:])]
print(json.dumps(tests))
"""


@pytest.mark.parametrize("crashes", [True, False])
def test_llama_cpp_runs_without_weight_repacking_only_where_it_crashes(tmp_path, crashes):
    """A llama-bench that dies of a signal with llama.cpp's weight repacking on: every tool
    then runs the file with it off and the result says why; one that runs gets no flag."""
    from jengine.bench.peers.llama_cpp import LlamaCpp, run_llama_bench
    from jengine.bench.peers.llama_server import LlamaServer

    bench = tmp_path / "llama-bench"
    bench.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable, crashes=crashes))
    bench.chmod(0o755)
    tools = LlamaCpp(server=str(bench), bench=str(bench), batched_bench=str(bench))
    gguf = str(tmp_path / "model.gguf")

    result = run_llama_bench(tools, gguf, n_prompt=8, n_gen=4, threads=2, repetitions=1)
    server = LlamaServer(tools, gguf, parallel=1, ctx_size=64, threads=2).command()
    if crashes:
        assert "SIGSEGV" in result["repacking_off"]
        assert result["raw"][0]["args"][-2:] == ["--repack", "0"]
        assert "--no-repack" in server
    else:
        assert result["repacking_off"] is None
        assert "--repack" not in result["raw"][0]["args"]
        assert "--no-repack" not in server
    assert result["tg_tok_per_s"] == 50.0
