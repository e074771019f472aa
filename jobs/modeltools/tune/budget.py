"""The tune's time budget, counted as the stored wall time of its jobs."""

from __future__ import annotations

from tokenmill.jobs.modeltools.tune.common import mean


class Budget:
    """The tune's time, counted as the stored wall time of its jobs, so a resumed tune
    has the same budget left as the interrupted one had."""

    def __init__(self, seconds: float | None):
        self.seconds = seconds
        self.spent = 0.0
        self.runs: list[tuple[int, float, float]] = []  # (rows, job wall s, generation wall s)

    def add(self, rows: int, wall_s: float, gen_s: float) -> None:
        self.spent += wall_s
        self.runs.append((rows, wall_s, gen_s))

    def spend(self, wall_s: float) -> None:
        """Wall time of a job that is not one of the sample's runs (an eval-set job): spent,
        but not a run the estimate of a rung is made from."""
        self.spent += wall_s

    def job_fits(self) -> bool:
        return self.seconds is None or self.spent < self.seconds

    def estimate(self, rows: int) -> float:
        """One run of `rows` rows: the fixed part (start-up, load, export) as measured,
        plus generation scaled by rows."""
        if not self.runs:
            return 0.0
        fixed = mean([max(w - g, 0.0) for _, w, g in self.runs]) or 0.0
        per_row = mean([g / max(n, 1) for n, _, g in self.runs]) or 0.0
        return fixed + per_row * rows

    def rung_fits(self, rows: int, jobs: int) -> bool:
        return self.seconds is None or self.spent + self.estimate(rows) * jobs <= self.seconds
