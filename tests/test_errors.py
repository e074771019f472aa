"""One line per error (schemas/errors.first_line), also for a traceback a runner reports
of an error raised in one of its worker processes."""

from tokenmill.schemas.errors import first_line

WORKER_TRACEBACK = """Traceback (most recent call last):
  File "apache_beam/runners/common.py", line 1498, in process
    return self.do_fn_invoker.invoke_process(windowed_value)
  File "tokenmill/transforms/generate.py", line 229, in setup
    raise WorkerCheckError(f"worker on host {socket.gethostname()}: {problems}")
tokenmill.transforms.generate.WorkerCheckError: worker on host gpu-7: model 'smol' is not in /models [while running 'Generate/ParDo']
"""


def test_a_plain_message_gives_its_first_line_and_an_empty_one_the_type():
    assert first_line(ValueError("the key is wrong\nmore detail")) == "the key is wrong"
    assert first_line(KeyError()) == "KeyError"
    assert len(first_line(ValueError("x" * 500))) == 300


def test_a_workers_traceback_gives_the_error_it_ends_with_not_its_header():
    line = first_line(RuntimeError(WORKER_TRACEBACK))
    assert line.startswith("WorkerCheckError: worker on host gpu-7: model 'smol' is not in /models")
    assert first_line("Traceback (most recent call last):\n  File \"x\"\n") == "Traceback (most recent call last):"
