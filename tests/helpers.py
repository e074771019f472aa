"""Helpers shared by the CLI and job tests: invoking the CLI, building a job spec,
and the "exactly one `error:` line, no traceback" check."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from click.testing import CliRunner, Result

from tokenmill.jobs.cli import main
from tokenmill.schemas.config import JobSpec, load_spec


def cli(*args: Any, catch_exceptions: bool = True) -> Result:
    """`tokenmill ARGS...` in-process (arguments turned into strings)."""
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=catch_exceptions)


def one_error_line(res: Result, *, alone: bool = False) -> str:
    """The one `error:` line a failed command printed (and no traceback);
    with `alone`, the command printed nothing else either."""
    assert "Traceback" not in res.output, res.output
    printed = res.output.strip().splitlines()
    lines = [line for line in printed if line.startswith("error:")]
    assert len(lines) == 1, res.output
    if alone:
        assert len(printed) == 1, res.output
    return lines[0]


def assert_one_line_error(res: Result, code: int, *parts: str, alone: bool = False) -> str:
    """Exit code `code` and one `error:` line containing every one of `parts`
    (with `alone`, the only line printed)."""
    assert res.exit_code == code, res.output
    line = one_error_line(res, alone=alone)
    for p in parts:
        assert p in line, line
    return line


def job_spec(input: str | Path, output: str | Path, **keys: Any) -> JobSpec:
    """A validated job spec from an input, an output and any other spec keys."""
    return load_spec({"input": str(input), "output": str(output), **keys})


def stale_output_job(eng, job_id: str) -> None:
    """A failed job `job_id` that holds one output row of another input (a job id reused on a
    different input): a rerun's row counts cannot reconcile."""
    from tokenmill.schemas import storage as S
    from tokenmill.schemas import tables as T

    S.JobStore(eng).claim(job_id, {"spec": {}, "total": 1})
    with eng.begin() as c:
        c.execute(T.outputs.insert().values(job_id=job_id, id="stale", input_file=0, input_row=9, text="old",
                                            prompt_tokens=1, output_tokens=1, cached_tokens=0))
        c.execute(T.jobs.update().values(status="failed", owner=None, heartbeat_at=None))


class RecordingEngine:
    """A stand-in for a served model's engine process (jobs/serve/engines.py): records what it
    was handed, `(batch id, job id, output format)`; `gone` launches fail first, as a process
    that died since `alive()` said otherwise."""

    def __init__(self):
        self.running, self.submitted, self.gone = None, [], 0

    def alive(self):
        return True

    def launch(self, batch_id, spec, db_url):
        if self.gone:
            self.gone -= 1
            return False
        self.running = batch_id
        self.submitted.append((batch_id, spec["job_id"], spec["output_format"]))
        return True

    @property
    def launched(self) -> list[str]:
        """The batch ids handed over, in order."""
        return [s[0] for s in self.submitted]
