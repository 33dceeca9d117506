"""Schemathesis over every operation of the OpenAPI document ``mlxr serve`` publishes, as a client
would run it: the ``schemathesis run`` command against a live server, every phase (examples,
coverage, fuzzing, stateful) and every check, ``--max-examples`` cases per operation and mode.

The server serves a tiny random GGUF model (written here) with every built-in API (OpenAI with the
Responses API, Ollama, Anthropic, rerank), replies capped at a few tokens, on loopback; half of the
generated bodies name that model (``schema_fuzz_hooks.py``), so they reach generation rather than a
404; Ollama's create
goes over it too, naming a blob uploaded first (not an adapter: the engine reads it and refuses it),
with ``runtime_adapters`` on and the data folder in the run's scratch folder. Counted from schemathesis's report: cases, failures by check and operation, 5xx replies, and
schema mismatches: every failure but the expected ones, a valid body refused for a rule no JSON
schema can state (:data:`mlxr_core.testing.schema_fuzz.UNSTATABLE`: the model's context or
vocabulary, a grammar's syntax ...) and a response made with ``store: false`` not found afterwards
(the stateful phase links every created response to its GET). Schemathesis reports one failure
of a kind per operation, so one such refusal can hide another; the test suite's fuzzing
(``tests/plugins/apis/test_fuzz_schema.py``) checks every case.

    python bench/schema_fuzz.py --max-examples 1000 --out bench/results/schema_fuzz_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schema_fuzz_hooks import BLOB, BLOB_DIGEST

from mlxr_core.testing.schema_fuzz import UNSTATABLE
from mlxr_core.testing.serving import serve_command, start
from mlxr_core.testing.tiny import write_tiny_llama_gguf

#: Checks left out: authentication checks (this server runs without keys).
EXCLUDED = ("ignored_auth", "object_level_authorization")
OPERATION = re.compile(r"^_{3,} (\w+ \S+) _{3,}$")
CHECK = re.compile(r"^- (ST\d+) (.+)$")
STATUS = re.compile(r"^\[(\d{3})\]")


def serve(folder: Path) -> tuple[subprocess.Popen[str], str, list[str]]:
    model = write_tiny_llama_gguf(folder / "tiny.gguf")
    config = folder / "server.yaml"
    os.environ["MLXR_DATA_DIR"] = str(folder / "data")  # Ollama's blobs and created adapters
    config.write_text(json.dumps({
        "models": [{"path": str(model), "name": "tiny", "context_length": 256, "runtime_adapters": True}],
        "apis": ["openai", "ollama", "anthropic", "rerank"],
        "server": {"max_tokens_cap": 4, "access_log": False,
                   "responses_store": {"path": str(folder / "responses.sqlite3")}},
    }))  # fmt: skip
    process, url, lines = start(serve_command(config))
    blob = urllib.request.Request(f"{url}/api/blobs/{BLOB_DIGEST}", data=BLOB, method="POST")
    urllib.request.urlopen(blob, timeout=60).close()  # named by the hooks' create bodies
    return process, url, lines


def failures(output: str) -> list[dict[str, Any]]:
    """Each failure schemathesis printed: operation, check code and title, status, reply body."""
    found: list[dict[str, Any]] = []
    operation = ""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if match := OPERATION.match(line):
            operation = match[1]
        elif match := CHECK.match(line):
            found.append({"operation": operation, "code": match[1], "title": match[2].strip()})
        elif (match := STATUS.match(line)) and found:
            body = next((later.strip().strip("`") for later in lines[i + 1 : i + 4] if later.strip()), "")
            found[-1].update(status=int(match[1]), body=body[:500])
        elif line.strip().startswith("curl ") and found and "request" not in found[-1]:
            found[-1]["request"] = line.strip()
    return found


def is_mismatch(failure: dict[str, Any]) -> bool:
    """Every failure but a valid body refused for a rule no JSON schema can state, and a response
    created with ``store: false`` not found afterwards (as the document says it is not kept)."""
    if failure["code"] == "ST202" and UNSTATABLE.search(failure.get("body", "")):
        return False
    return not (failure["code"] == "ST302" and '"store": false' in failure.get("request", ""))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-examples", type=int, default=100, help="cases per operation and mode")
    parser.add_argument("--phases", default="examples,coverage,fuzzing,stateful")
    parser.add_argument("--workers", default="1", help="more than 1 trips a thread-safety bug in schemathesis 4.32's coverage phase")
    parser.add_argument("--only", help="operations whose path matches this regex (all by default)")
    parser.add_argument("--out", type=Path, help="write the summary here as JSON, schemathesis's output next to it (.log)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        process, url, lines = serve(folder)
        report = folder / "report.json"
        started = time.perf_counter()
        try:
            command = [
                sys.executable, "-m", "schemathesis.cli", "run", f"{url}/schema/openapi.json",
                "--checks", "all", "--exclude-checks", ",".join(EXCLUDED), "--phases", args.phases,
                "--max-examples", str(args.max_examples), "--workers", args.workers,
                "--request-timeout", "60", "--generation-deterministic", "--continue-on-failure",
                "--output-truncate", "false", "--no-color",
                "--report", "json", "--report-json-path", str(report),
            ]  # fmt: skip
            command += ["--include-path-regex", args.only] if args.only else []
            hooks = {"SCHEMATHESIS_HOOKS": "schema_fuzz_hooks", "PYTHONPATH": os.pathsep.join(
                [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}  # fmt: skip
            run = subprocess.run(command, capture_output=True, text=True, cwd=folder, env={**os.environ, **hooks})
        finally:
            process.terminate()
            status = process.wait(60)
        seconds = time.perf_counter() - started
        totals = json.loads(report.read_text()) if report.exists() else {}
    found = failures(run.stdout)
    mismatches = [failure for failure in found if is_mismatch(failure)]
    summary = {
        "max_examples": args.max_examples, "phases": args.phases, "seconds": round(seconds, 1),
        "operations": totals.get("operations", {}).get("tested"), "cases": totals.get("test_cases", {}).get("generated"),
        "server_errors": sum(failure.get("status", 0) >= 500 for failure in found),
        "mismatches": mismatches, "expected": [failure for failure in found if not is_mismatch(failure)],
        "runtime_errors": totals.get("errors", []), "schemathesis_exit": run.returncode, "server_exit": status,
        "tracebacks_in_server_log": "".join(lines).count("Traceback"),
    }  # fmt: skip
    print(run.stdout[-4000:], run.stderr[-2000:], json.dumps(summary, indent=2), sep="\n")
    if args.out:
        args.out.write_text(json.dumps(summary, indent=2) + "\n")
        args.out.with_suffix(".log").write_text(run.stdout + run.stderr)
    clean = bool(totals) and not mismatches and not summary["server_errors"] and not summary["runtime_errors"]
    return 0 if clean and status == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
