"""`tokenmill serve` on a home whose models are not there: it prepares the bundled model before
it listens, or refuses to start in one line, before binding its port (jobs/serve/ready.py)."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import TEST_ENGINE
from tests.serve_server import READY, ROOT, Server, chat_line, jsonl, lines_of, wait_for


def _config(root, models):
    return {"db": f"sqlite:///{root / 'serve.db'}", "files": str(root / "files"), "work": str(root / "runs"),
            "models": models}


def test_a_served_model_missing_from_the_models_folder_stops_the_server_in_one_line_before_it_listens(tmp_path):
    models = tmp_path / "home" / "models"
    models.mkdir(parents=True)
    srv = Server(tmp_path, _config(tmp_path, {"my-model": {}}), env={"TOKENMILL_HOME": str(tmp_path / "home")})
    res = subprocess.run(srv.argv, cwd=ROOT, env=srv.env, capture_output=True, text=True, timeout=120)
    lines = (res.stdout + res.stderr).splitlines()
    assert res.returncode == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: served model 'my-model': unknown model 'my-model'") and str(models) in lines[0]
    assert not READY.search(res.stderr)  # it never said where it listens


@pytest.mark.engine
def test_a_fresh_models_folder_gets_the_bundled_model_prepared_then_the_server_runs_a_batch(tmp_path):
    home = tmp_path / "home"  # a fresh home: no models folder yet (TOKENMILL_HOME/models)
    cfg = _config(tmp_path, {"smollm2-135m": {"engine": dict(TEST_ENGINE), "sampling": {"max_tokens": 8}}})
    srv = Server(tmp_path, cfg, env={"TOKENMILL_HOME": str(home)}).start(timeout=300)
    try:
        said = srv.log.read_text().splitlines()  # one line, then where it listens: the conversion's output is logged
        assert len(said) == 2 and "preparing the bundled model smollm2-135m" in said[0] and READY.search(said[1]), said
        assert (home / "models" / "smollm2-135m" / "config.json").is_file()
        assert "smollm2-135m" in (home / "serve" / "logs" / "prepare-smollm2-135m.log").read_text()  # its output
        client = srv.client(srv.make_key("alice")["key"])
        with open(jsonl(tmp_path / "one.jsonl", [chat_line("a", "Say hello.", max_tokens=8)]), "rb") as fh:
            f = client.files.create(file=fh, purpose="batch")
        b = wait_for(client, client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                                   completion_window="24h").id, timeout=300)
        assert b.status == "completed" and b.request_counts.completed == 1, b
        out = lines_of(client, b.output_file_id)
        assert [o["custom_id"] for o in out] == ["a"] and out[0]["response"]["status_code"] == 200
        assert out[0]["response"]["body"]["usage"]["completion_tokens"] > 0
    finally:
        srv.stop()
