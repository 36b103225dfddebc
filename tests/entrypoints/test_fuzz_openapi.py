"""Schemathesis against the server's own /openapi.json: property-based cases on every
route (its coverage phase, then fuzzing), bounded in count and time, on 127.0.0.1 only.
No response may be a 5xx, every response must match its documented status, content type,
headers and schema, and the server must still serve a normal request afterwards."""

import re
import subprocess
import sys
from pathlib import Path

import httpx2
import pytest

from tests.entrypoints.remote_server import API_KEY, MODEL_NAME, SERVER_ARGS, RemoteServer

CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance"
)


@pytest.fixture(scope="module")
def server(tiny_model):
    with RemoteServer(tiny_model, [*SERVER_ARGS, "--api-key", API_KEY]) as remote:
        yield remote


def test_schemathesis_finds_no_5xx_and_no_schema_violation(server, tmp_path):
    schemathesis = Path(sys.executable).with_name("st")
    run = subprocess.run(
        [
            str(schemathesis),
            "run",
            server.url_for("openapi.json"),
            "--checks",
            CHECKS,
            "--max-examples",
            "10",
            "--max-time",
            "30",
            "--seed",
            "17",
            "--generation-database",
            "none",
            "--request-timeout",
            "60",
            "--header",
            f"Authorization: Bearer {API_KEY}",
            "--no-color",
            "--report-dir",
            str(tmp_path),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,  # its cache folder lands there, not in the checkout
    )
    assert run.returncode == 0, run.stdout[-8000:] + run.stderr[-2000:]
    assert "Operations:       12 selected / 12 total" in run.stdout
    counts = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
    assert counts and counts.group(1) == counts.group(2), run.stdout[-3000:]
    assert int(counts.group(1)) >= 100  # every case of a real run, all passed
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 4}
    response = httpx2.post(server.url_for("v1/completions"), json=body, headers=headers)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
