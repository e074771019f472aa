"""The `EngineSession` contract, one suite that every engine passes: the tests' fake, the
test-only echo engine, the `openai` engine against the fault-injecting test server, the
`llamacpp` engine on the bundled GGUF (marker `llamacpp`) and vLLM on the small real model
(marker `engine`).  Each engine's class says how to start a session and what it is sent."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.echo_engine import EchoConfig, EchoSession
from tests.fakes import FakeSession
from tests.openai_server import FaultServer
from tokenmill.schemas import records as R
from tokenmill.transforms.engines.kinds import engine_of

PROMPT_IDS = [1, 2, 3, 4, 5, 6, 7, 8]


class EngineContract:
    """The protocol, asserted of `self.session` (made per test by the subclass's `start`)."""

    takes_text = False
    """The engine is sent the prompt's text (`add(..., source=...)`)."""
    max_tokens = 4

    @pytest.fixture
    def session(self, request):
        s = self.start(request)
        yield s
        s.shutdown()

    def start(self, request) -> Any:
        raise NotImplementedError

    def add(self, s, request_id: str, text: str = "Say hello to the contract suite") -> None:
        source = {"source": text} if self.takes_text else {}
        s.add(request_id, PROMPT_IDS, {"max_tokens": self.max_tokens, "temperature": 0.0}, **source)

    @staticmethod
    def drain(s, timeout_s: float = 120.0) -> list:
        done, deadline = [], time.monotonic() + timeout_s
        while s.num_unfinished() and time.monotonic() < deadline:
            done += s.step()
        return done

    def test_every_request_finishes_once_with_its_figures(self, session):
        t0 = time.time()
        for i in range(3):
            self.add(session, f"r{i}")
        assert session.num_unfinished() == 3 and session.max_num_seqs >= 1
        done = self.drain(session)
        assert sorted(f.request_id for f in done) == ["r0", "r1", "r2"] and session.num_unfinished() == 0
        for f in done:
            assert f.error_reason is None and f.error is None
            assert f.prompt_tokens > 0 and 1 <= f.output_tokens <= self.max_tokens and isinstance(f.text, str)
            assert f.finished_at >= t0 - 1
            for t in (f.ttft_s, f.tpot_s, f.e2e_s, f.queue_s):  # a figure the engine cannot measure is None
                assert t is None or t >= 0
            assert f.cached_tokens is None or f.cached_tokens >= 0
            assert f.token_count_source in R.TOKEN_COUNT_SOURCES

    def test_abort_forgets_requests_and_ignores_unknown_ids(self, session):
        self.add(session, "keep")
        self.add(session, "drop")
        session.abort(["drop", "never-added"])
        assert session.num_unfinished() == 1
        assert [f.request_id for f in self.drain(session)] == ["keep"]

    def test_info_says_the_device_and_the_load_time(self, session):
        info = session.info()
        assert info["device"] and info["load_s"] >= 0

    def test_a_killed_session_is_dead_and_its_step_raises(self, session):
        assert session.alive()
        session.kill()
        assert not session.alive()
        with pytest.raises(RuntimeError):  # refused when added, or when stepped
            self.add(session, "late")
            session.step()


class TestFakeSession(EngineContract):
    def start(self, request):
        return FakeSession()


class TestEchoEngine(EngineContract):
    takes_text = True

    def start(self, request):
        return EchoSession(EchoConfig(kind="echo"))


class TestOpenAIEngine(EngineContract):
    takes_text = True

    @pytest.fixture(autouse=True)
    def server(self):
        with FaultServer() as s:
            self.fault_server = s
            yield s

    def start(self, request):
        from tokenmill.transforms.engines.openai_config import OpenAIConfig
        from tokenmill.transforms.engines.openai_session import OpenAISession

        return OpenAISession(OpenAIConfig(kind="openai", base_url=self.fault_server.base_url, model="test-model",
                                          max_in_flight=2, request_timeout_s=5.0, max_retries=0))

    def test_its_engine_object_says_it_is_sent_text_and_measures_on_the_client(self):
        e = engine_of("openai")
        assert e.takes_text and not e.measures_prefix_cache and "client clock" in e.clocks["ttft_s"]


@pytest.mark.llamacpp
class TestLlamaCppEngine(EngineContract):
    takes_text = True

    def start(self, request):
        from tokenmill.transforms.engines.llamacpp_session import LlamaCppConfig, LlamaCppSession

        return LlamaCppSession(LlamaCppConfig(kind="llamacpp", max_in_flight=2, max_model_len=256))


@pytest.mark.engine
class TestVllmEngine(EngineContract):
    """The process's real engine (registry.get_session: loaded once per test process and
    kept for the other engine tests), so it is not killed here: tests/test_engine_owner.py
    kills real engines of their own."""

    def start(self, request):
        from tests.conftest import TEST_ENGINE
        from tokenmill.transforms.engines import registry
        from tokenmill.transforms.engines.vllm_config import VllmConfig

        model_path = request.getfixturevalue("model_path")
        self.real = registry.get_session(VllmConfig(**TEST_ENGINE), model_path)
        return _Kept(self.real)

    def test_a_killed_session_is_dead_and_its_step_raises(self, session):
        pytest.skip("the shared real engine is not killed here (tests/test_engine_owner.py kills its own)")


class _Kept:
    """The shared real engine, whose `shutdown` leaves it loaded for the next test."""

    def __init__(self, real):
        self._real = real

    def __getattr__(self, name):
        return getattr(self._real, name)

    def shutdown(self) -> None:
        pass
