"""Run a Python program against tests in the reward sandbox and print the verdict as JSON.

    python -m jaxrlhf.sandbox --code FILE --tests FILE [--timeout S] [--cpu-seconds S]
        [--memory-mb N] [--max-processes N] [--max-file-mb N] [--output-kb N] [--folder-mb N] [--extract]

The run is the one the `sandboxed_python` reward rule makes (`jaxrlhf.rewards.sandbox`; what
it contains and what it does not: docs/agentic.md). `--extract` takes the program from FILE's last
```python fenced block, as the rule does with a response. Prints one JSON object on stdout:
`{"passed", "total", "status", "limit", "stderr_tail", "seconds", "failures", "isolation"}`.
Exit code 0 when every test passed, 1 otherwise; a missing or unreadable file or a bad limit prints
one `error: ...` line on stderr and exits with code 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Sequence

from jaxrlhf.rewards.rules import extract_program
from jaxrlhf.rewards.sandbox import SandboxLimits, run_sandboxed

EXIT_BAD_INPUT = 2


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    d = SandboxLimits()
    p = argparse.ArgumentParser(prog="python -m jaxrlhf.sandbox", description=__doc__.split("\n")[0])
    p.add_argument("--code", required=True, help="the program (a Python file, or a response with --extract)")
    p.add_argument("--tests", required=True, help="the tests: top-level asserts and/or test_* functions")
    p.add_argument("--timeout", type=float, default=d.timeout_seconds, help="wall-clock seconds for the run")
    p.add_argument("--cpu-seconds", type=float, default=d.cpu_seconds, help="CPU seconds per process")
    p.add_argument("--memory-mb", type=float, default=d.memory_bytes / 2**20, help="address space per process")
    p.add_argument("--max-processes", type=int, default=d.max_processes, help="processes and threads")
    p.add_argument("--max-file-mb", type=float, default=d.max_file_bytes / 2**20, help="largest file written")
    p.add_argument("--output-kb", type=float, default=d.output_bytes / 2**10, help="stdout + stderr cap")
    p.add_argument("--folder-mb", type=float, default=d.folder_bytes / 2**20,
                   help="the run's folder (a tmpfs of this size where mount namespaces work)")
    p.add_argument("--python", default=None, help="the interpreter (default: this one where the sandbox can run it)")
    p.add_argument("--extract", action="store_true", help="take the program from the last ```python block")
    return p.parse_args(argv)


def _read(path: str, what: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except FileNotFoundError:
        raise ValueError(f"{what} file not found: {path}") from None
    except IsADirectoryError:
        raise ValueError(f"{what} path is a folder, not a file: {path}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the {what} file {path}: {e}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    try:
        code = _read(args.code, "code")
        tests = _read(args.tests, "tests")
        limits = SandboxLimits(cpu_seconds=args.cpu_seconds, memory_bytes=int(args.memory_mb * 2**20),
                               max_processes=args.max_processes, max_file_bytes=int(args.max_file_mb * 2**20),
                               timeout_seconds=args.timeout, output_bytes=int(args.output_kb * 2**10),
                               folder_bytes=int(args.folder_mb * 2**20), python=args.python)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    verdict = run_sandboxed(extract_program(code) if args.extract else code, tests, limits)
    print(json.dumps(verdict.to_dict()))
    return 0 if verdict.status == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
