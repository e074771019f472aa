"""`tokenmill tune`: the cheapest configuration that passes the quality gate, found on a
sample of the job's own prompts (docs/TUNE.md).

The spec as given is the reference.  Each candidate is that spec with some keys changed
(a search space YAML; `tune_space.yaml` is the default); candidates the preflight refuses
on this machine are dropped before anything runs.  The search is successive halving:
every candidate runs on a small sample, the cheaper half of those that pass the gate
runs on a sample twice as large, and so on up to `--sample` rows.  Every run is an
ordinary job in the database (`tune-<tune id>-<candidate>-n<rows>-r<repetition>`), so an
interrupted tune rerun with the same arguments reads the finished jobs back and runs
only the rest.

Each figure is measured `repeats` times (at least twice), interleaved (ref, A, B, ref,
A, B), and a difference is a win only when the ranges of the repetitions do not
overlap; otherwise it is a tie.

One concept a module: `space` (the space YAML, the candidates, the quantized checkpoints),
`cpu_screen` (the CPU dtype screen), `sample` (the sample and its rungs), `gate`,
`halving` (the search on known figures), `budget`, `tuner` (the candidates as jobs),
`result` (the table and the recommendation) and `render` (the files).  This package
exports the names a caller of the tune uses.
"""

from tokenmill.jobs.modeltools.tune.budget import Budget
from tokenmill.jobs.modeltools.tune.common import REFERENCE, CandidateFailed, TuneError, figures_of, mean
from tokenmill.jobs.modeltools.tune.cpu_screen import SLOW_DTYPE, screen_cpu_dtypes, screens_cpu_dtype
from tokenmill.jobs.modeltools.tune.gate import DEFAULT_GATE, GATE_METRICS, Gate, parse_gate
from tokenmill.jobs.modeltools.tune.halving import Entry, SearchLog, Verdict, beats, halve, pick, search, tied
from tokenmill.jobs.modeltools.tune.render import format_table, plot_figures, render_html, vs_reference, write_outputs
from tokenmill.jobs.modeltools.tune.result import TuneResult, build_table, recommendation
from tokenmill.jobs.modeltools.tune.sample import MIN_RUNG_ROWS, draw_sample, rung_file, rung_sizes, sample_digest
from tokenmill.jobs.modeltools.tune.space import (
                                                  DEFAULT_SPACE,
                                                  Candidate,
                                                  describe_changes,
                                                  load_space,
                                                  make_candidates,
                                                  make_checkpoints,
                                                  quantized_checkpoints,
                                                  set_path,
                                                  space_changes,
                                                  work_key,
)
from tokenmill.jobs.modeltools.tune.tuner import (
    DEFAULT_REPEATS,
    EVAL_MAX_TOKENS,
    EVAL_SET,
    TuneOptions,
    make_tune_id,
    tune,
)

__all__ = [
    "Budget", "REFERENCE", "CandidateFailed", "TuneError", "figures_of", "mean", "SLOW_DTYPE", "screen_cpu_dtypes",
    "screens_cpu_dtype", "DEFAULT_GATE", "GATE_METRICS", "Gate", "parse_gate", "Entry", "SearchLog", "Verdict",
    "beats", "halve", "pick", "search", "tied", "format_table", "plot_figures", "render_html", "vs_reference",
    "write_outputs", "TuneResult", "build_table", "recommendation", "MIN_RUNG_ROWS", "draw_sample", "rung_file",
    "rung_sizes", "sample_digest", "DEFAULT_SPACE", "Candidate", "describe_changes", "load_space", "make_candidates",
    "make_checkpoints", "quantized_checkpoints", "set_path", "space_changes", "work_key", "DEFAULT_REPEATS",
    "EVAL_MAX_TOKENS", "EVAL_SET", "TuneOptions", "make_tune_id", "tune",
]
