"""SharedSession with a fake engine: a batch's share of the engine shrinks while online
requests run and grows back after, an online request takes a batch request's seat at once
(the batch still answers every row once), streamed text arrives step by step, a cancel frees
the sequence, and an engine's refusal ends a request instead of losing it."""

from __future__ import annotations

from tests.fakes import FakeSession
from tests.test_generate import cfg, prompts, run
from tokenmill.schemas import records as R
from tokenmill.transforms.batch_runner import BatchRunner
from tokenmill.transforms.batching import pack
from tokenmill.transforms.engines.protocol import Finished
from tokenmill.transforms.engines.shared_session import ONLINE_PRIORITY, OnlineRequest, SharedSession


class StreamingFake(FakeSession):
    """A fake that streams as vLLM's session does: `progress` holds each streamed request's
    text so far (one character a step), `add` takes `stream=` and `priority=`."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.progress: dict[str, tuple[str, int]] = {}
        self.priorities: dict[str, int] = {}

    def add(self, request_id, token_ids, sampling, *, stream=False, priority=0):
        super().add(request_id, token_ids, sampling)
        self.priorities[request_id] = priority
        if stream:
            self.progress[request_id] = ("", 0)

    def step(self):
        done = super().step()
        for f in done:
            if f.request_id in self.progress:
                del self.progress[f.request_id]
                f.text = "x" * (f.output_tokens or 0)
        for rid in self.progress:
            n = self.reqs[rid]["n"]
            self.progress[rid] = ("x" * n, n)
        return done

    def abort(self, ids):
        super().abort(ids)
        for i in ids:
            self.progress.pop(i, None)


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


class Client:
    """An online request's callbacks: the text pieces and the end."""

    def __init__(self, rid: str, shared: SharedSession, max_tokens: int = 3, token: int = 7):
        self.pieces: list[str] = []
        self.done: list[tuple[Finished | None, str | None]] = []
        self.request = OnlineRequest(rid, [token, 1], {"max_tokens": max_tokens}, lambda t, n: self.pieces.append(t),
                                     lambda f, e: self.done.append((f, e)))
        shared.submit(self.request)


def drive(shared: SharedSession, clients: list[Client], limit: int = 200) -> list[Finished]:
    out: list[Finished] = []
    for _ in range(limit):
        out += shared.step()
        if all(c.done for c in clients) and not shared.num_unfinished():
            return out
    raise AssertionError("the engine never finished")


def test_the_batch_share_shrinks_while_online_requests_run_and_grows_back_after_idle_s():
    clock = Clock()
    s = SharedSession(FakeSession(max_num_seqs=8), batch_floor=0.25, reserve_seqs=1, idle_s=2.0, clock=clock)
    assert s.max_num_seqs == 8  # no online traffic: the whole engine
    c = Client("on1", s, max_tokens=5)
    assert s.max_num_seqs == 8 - 1 - 1  # one online request and one spare seat
    drive(s, [c])
    assert c.done and c.done[0][1] is None
    assert s.max_num_seqs == 7  # within idle_s of the last online request: the spare seat kept
    clock.t = 2.5
    assert s.max_num_seqs == 8
    for i in range(10):
        Client(f"many{i}", s)
    assert s.max_num_seqs == 2  # never under batch_floor of the engine


def test_an_online_request_takes_a_batch_seat_at_once_and_the_batch_still_answers_every_row_once():
    inner = StreamingFake(max_num_seqs=4)
    shared = SharedSession(inner, batch_floor=0.5, reserve_seqs=0, idle_s=0.0)
    for i in range(4):
        shared.add(f"b{i}", [i, 1], {"max_tokens": 6})
    shared.step()
    assert inner.num_unfinished() == 4  # every seat is the batch's
    c = Client("on", shared, max_tokens=2)
    # its seat is the youngest batch request's: in the engine now, ahead of the batch
    assert "on" in inner.reqs and "b3" not in inner.reqs and inner.priorities["on"] == ONLINE_PRIORITY
    assert shared.preempted == 1 and shared.num_unfinished() == 4
    finished = shared.step() + shared.step()
    assert c.done and c.done[0][0] is not None and "".join(c.pieces) == c.done[0][0].text == "xx"
    finished += drive(shared, [c])
    assert sorted(f.request_id for f in finished) == ["b0", "b1", "b2", "b3"]  # each once, under its own id
    assert inner.num_unfinished() == 0


def test_a_batch_run_through_the_shared_engine_with_online_requests_between_answers_every_row_once():
    online: list[Client] = []

    class Arriving(FakeSession):  # an online request arrives every third engine step while the batch runs
        def step(self):
            if self.steps % 3 == 2 and len(online) < 5:
                online.append(Client(f"on{len(online)}", shared, max_tokens=2))
            return super().step()

    inner = Arriving(max_num_seqs=4)
    shared = SharedSession(inner, batch_floor=0.5, reserve_seqs=1, idle_s=0.0)
    rows, dead, _ = run(BatchRunner(cfg(max_inflight_batches=2), lambda: shared, lambda: shared),
                        pack(prompts(20, max_tokens=4), token_budget=4 * 7))
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(20)) and not dead
    drive(shared, online)
    assert len(online) == 5 and all(c.done[0][1] is None for c in online)
    assert shared.preempted > 0  # some arrived to a full engine and took a batch request's seat
    assert inner.max_inflight <= 4  # never more sequences than the engine's seats


def test_streamed_text_arrives_step_by_step_and_adds_up_to_the_answer():
    inner = StreamingFake(max_num_seqs=4)
    shared = SharedSession(inner)
    c = Client("s", shared, max_tokens=4)
    shared.pump(gap_s=0.0)
    shared.pump(gap_s=0.0)
    assert c.pieces == ["x", "x"] and not c.done
    drive(shared, [c])
    assert "".join(c.pieces) == "xxxx" and c.done[0][0].output_tokens == 4


def test_an_engine_that_does_not_stream_gives_the_whole_answer_once():
    shared = SharedSession(FakeSession(max_num_seqs=4))
    c = Client("w", shared, max_tokens=3, token=42)
    drive(shared, [c])
    assert c.pieces == ["echo:42"] and c.done[0][0].text == "echo:42"


def test_a_cancel_frees_the_sequence_in_the_engine_and_ends_nothing_else():
    inner = StreamingFake(max_num_seqs=4)
    shared = SharedSession(inner)
    keep, leave = Client("keep", shared, max_tokens=5), Client("leave", shared, max_tokens=50)
    shared.pump(gap_s=0.0)
    assert inner.num_unfinished() == 2
    assert shared.cancel("leave") and not shared.cancel("leave")
    assert inner.num_unfinished() == 1 and shared.state()["online"] == 1
    drive(shared, [keep])
    assert keep.done and not leave.done and shared.state()["engine_unfinished"] == 0


def test_the_pump_steps_only_when_no_batch_stepped_within_its_gap():
    clock = Clock()
    inner = FakeSession(max_num_seqs=4)
    shared = SharedSession(inner, clock=clock)
    assert shared.pump(gap_s=0.0) is False  # nothing online: nothing to do
    Client("o", shared, max_tokens=3)
    clock.t = 10.0
    shared.step()  # Generate's loop stepped just now
    steps = inner.steps
    assert shared.pump(gap_s=0.001) is True and inner.steps == steps
    clock.t = 11.0
    shared.pump(gap_s=0.001)
    assert inner.steps == steps + 1


def test_a_request_the_engine_rejects_ends_with_its_reason():
    shared = SharedSession(FakeSession(max_num_seqs=2, reject_token=13), batch_floor=0.5, reserve_seqs=0, idle_s=9.0)
    c = Client("bad", shared, token=13)
    assert c.done and c.done[0][0] is None and "out of vocabulary" in (c.done[0][1] or "")
    Client("hold", shared, max_tokens=3)  # online traffic: the batch's share is its floor, 1
    shared.add("b0", [1], {"max_tokens": 2})
    shared.add("b1", [13], {"max_tokens": 2})  # held: past the batch's share
    finished = []
    for _ in range(10):
        finished += shared.step()
    by_id = {f.request_id: f for f in finished}
    assert by_id["b1"].error_reason == R.BAD_REQUEST and by_id["b0"].error_reason is None


def test_shutdown_ends_the_online_requests_with_an_error():
    inner = FakeSession(max_num_seqs=2)
    shared = SharedSession(inner)
    c = Client("o", shared, max_tokens=9)
    shared.shutdown()
    assert inner.shut and c.done == [(None, "the engine was stopped")]
