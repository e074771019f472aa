"""CLI: bad input gives one clear line and a non-zero exit, never a traceback."""

from tests.conftest import write_parquet
from tests.helpers import assert_one_line_error, cli


def invoke(args, db):
    return cli(*args, "--db", db, catch_exceptions=False)


def test_missing_input_path(tmp_path, sqlite_url):
    res = invoke(["run", "--input", str(tmp_path / "nope.parquet"), "--output", str(tmp_path / "o")], sqlite_url)
    assert_one_line_error(res, 1, "does not exist", "nope.parquet")


def test_input_without_prompt_column_names_the_columns_found(tmp_path, sqlite_url):
    p = write_parquet(tmp_path / "x.parquet", [{"question": "hi", "idx": 1}])
    res = invoke(["run", "--input", str(p), "--output", str(tmp_path / "o")], sqlite_url)
    assert_one_line_error(res, 1, "no 'prompt' or 'messages' column", "question, idx")


def test_unknown_model(tmp_path, sqlite_url):
    p = write_parquet(tmp_path / "x.parquet", [{"prompt": "hi"}])
    res = invoke(["run", "--input", str(p), "--output", str(tmp_path / "o"), "--model", "no-such-model"], sqlite_url)
    assert_one_line_error(res, 1, "unknown model 'no-such-model'")


def test_unreachable_database_masks_password(tmp_path):
    p = write_parquet(tmp_path / "x.parquet", [{"prompt": "hi"}])
    url = "postgresql+psycopg2://bob:s3cret@127.0.0.1:1/nodb"
    res = invoke(["run", "--input", str(p), "--output", str(tmp_path / "o")], url)
    assert_one_line_error(res, 1, "cannot use database")
    assert "s3cret" not in res.output


def test_invalid_spec_values_name_the_key(tmp_path, sqlite_url):
    spec = tmp_path / "job.yaml"
    spec.write_text("input: a.parquet\noutput: out\nsampling:\n  max_tokens: -1\nengine:\n  colour: blue\n")
    res = invoke(["run", str(spec)], sqlite_url)
    assert_one_line_error(res, 2, "sampling.max_tokens", "engine.colour: unknown key")


def test_status_of_unknown_job(sqlite_url):
    res = cli("status", "nope", "--db", sqlite_url)
    assert_one_line_error(res, 1, "no job with id 'nope'")


def test_only_a_command_that_may_start_engines_stops_the_process_engines(tmp_path, sqlite_url, monkeypatch):
    # `cancel` run in the process of a running job (a test, an embedding program) once stopped its
    # engine: the job then stepped a fresh engine that never held its requests, for ever
    from tokenmill.transforms.engines import registry

    stopped = []
    monkeypatch.setattr(registry, "shutdown_all", lambda: stopped.append(1))
    cli("status", "nope", "--db", sqlite_url)
    cli("cancel", "nope", "--db", sqlite_url)
    cli("jobs", "--db", sqlite_url)
    assert stopped == []
    invoke(["run", "--input", str(tmp_path / "nope.parquet"), "--output", str(tmp_path / "o")], sqlite_url)
    assert stopped  # run may start engines: they are stopped however it ends
