"""BatchRunner with a fake engine: feeding across batch tails, poison isolation, rejected rows."""


from tests.fakes import FakeSession
from tokenmill.schemas import records as R
from tokenmill.schemas.config import BatchingConfig, SamplingDefaults
from tokenmill.schemas.records import TokenizedPrompt
from tokenmill.transforms.batch_runner import BatchRunner, GenerateConfig
from tokenmill.transforms.batching import pack
from tokenmill.transforms.engines.vllm_config import VllmConfig


def cfg(**batching):
    return GenerateConfig(
        job_id="j", run_id="r", model_name="m", model_path="/x", engine=VllmConfig(),
        sampling=SamplingDefaults(), batching=BatchingConfig(**batching),
    )


def prompts(n, max_tokens=3, first=None):
    return [
        TokenizedPrompt(id=f"p{i}", input_file=0, input_row=i, token_ids=[first(i) if first else i + 1000, 1, 2],
                        prefix_key="00", max_tokens=max_tokens)
        for i in range(n)
    ]


def run(runner, batches):
    rows, dead, stats = [], [], []
    for r, d, s in runner.run(batches):
        rows += r
        dead += d
        stats.append(s)
    return rows, dead, stats


def test_next_batch_is_admitted_while_the_current_tail_decodes():
    s = FakeSession(max_num_seqs=4)
    # batch 1: one long request (the straggler) and three short; batch 2: four short
    ps = prompts(8)
    ps[0].max_tokens = 20
    batches = pack(ps, token_budget=4 * 6)
    runner = BatchRunner(cfg(max_inflight_batches=2), lambda: s, lambda: s)
    rows, dead, stats = run(runner, batches)
    assert len(rows) == 8 and not dead
    # an engine that says nothing of its counts (vLLM's session, this fake) gives its own: "engine"
    assert {r["token_count_source"] for r in rows} == {R.TOKENS_BY_ENGINE}
    # the straggler did not hold back batch 2: the engine saw more requests than batch 1 had
    assert s.max_inflight > len(batches[0].prompts)
    assert s.steps < 20 + 3  # batch 2 overlapped with the straggler's decode
    assert sorted(st["requests"] for st in stats) == sorted(len(b.prompts) for b in batches)


class Restarting:
    """An engine slot that starts a fresh FakeSession(**kw) on restart, keeping them all."""

    def __init__(self, **kw):
        self.kw = kw
        self.sessions = []
        self.restart()

    def current(self):
        return self.sessions[-1]

    def restart(self):
        self.sessions.append(FakeSession(**self.kw))
        return self.sessions[-1]


def test_poison_row_is_isolated_and_the_rest_answered():
    slot = Restarting(max_num_seqs=8, poison_token=1003)
    sessions = slot.sessions
    runner = BatchRunner(cfg(), lambda: slot.current() if slot.current().alive() else slot.restart(), slot.restart)
    rows, dead, _ = run(runner, pack(prompts(8), token_budget=1000))
    assert sorted(r["id"] for r in rows) == sorted(f"p{i}" for i in range(8) if i != 3)
    assert [(d.id, d.reason) for d in dead] == [("p3", R.ENGINE_ERROR)]
    assert len(sessions) > 1  # the engine was restarted after it died


def test_row_the_engine_rejects_is_a_bad_request_dead_letter():
    s = FakeSession(max_num_seqs=8, reject_token=1002)
    runner = BatchRunner(cfg(), lambda: s, lambda: s)
    rows, dead, _ = run(runner, pack(prompts(5), token_budget=1000))
    assert len(rows) == 4
    assert [(d.id, d.reason) for d in dead] == [("p2", R.BAD_REQUEST)]
    assert "out of vocabulary" in dead[0].message


def test_cancel_stops_admitting_new_batches():
    s = FakeSession(max_num_seqs=2)
    calls = {"n": 0}

    def cancelled():
        calls["n"] += 1
        return calls["n"] > 1  # first batch admitted, then cancel

    runner = BatchRunner(cfg(max_inflight_batches=1), lambda: s, lambda: s, cancelled=cancelled)
    rows, dead, stats = run(runner, pack(prompts(6), token_budget=2 * 6))
    assert runner.cancelled
    assert len(rows) == 2 and len(stats) == 1


def test_engine_idle_is_measured_when_a_batch_waits_behind_a_tail():
    def straggler_batches():
        ps = prompts(8)
        ps[0].max_tokens = 20
        return pack(ps, token_budget=4 * 6)

    ticks = iter(range(10**6))
    s = FakeSession(max_num_seqs=4)
    held = BatchRunner(cfg(max_inflight_batches=1), lambda: s, lambda: s, clock=lambda: float(next(ticks)))
    _, _, stats = run(held, straggler_batches())
    # one batch at a time: the straggler decodes alone while batch 2 waits
    assert stats[0]["engine_idle_s"] > 0

    ticks2 = iter(range(10**6))
    s2 = FakeSession(max_num_seqs=4)
    fed = BatchRunner(cfg(max_inflight_batches=3), lambda: s2, lambda: s2, clock=lambda: float(next(ticks2)))
    _, _, stats2 = run(fed, straggler_batches())
    # every batch admitted up front: no batch ever waited while the engine had free slots
    assert sum(st["engine_idle_s"] for st in stats2) == 0


def test_a_step_that_never_returns_is_ended_by_the_watchdog_and_the_row_isolated():
    # The frozen engine blocks inside step(), where the between-steps deadline check never
    # runs; the watchdog kills it, the batch is bisected on fresh engines, and only the
    # row that froze it becomes an engine_timeout dead letter.
    slot = Restarting(max_num_seqs=8, block_token=1002)
    sessions = slot.sessions
    runner = BatchRunner(cfg(batch_timeout_s=0.3), slot.current, slot.restart)
    rows, dead, _ = run(runner, pack(prompts(6), token_budget=100))
    assert sorted(r["id"] for r in rows) == ["p0", "p1", "p3", "p4", "p5"]
    assert [(d.id, d.reason) for d in dead] == [("p2", R.ENGINE_TIMEOUT)]
    assert "blocked past 0.3 s" in dead[0].message
    assert sum(s.killed.is_set() for s in sessions) >= 2  # the batch's engine, then each retry holding p2


def test_a_units_last_batches_decode_while_the_next_unit_is_fed():
    # advance() returns once every fed batch is in the engine, not once it is answered:
    # the tail of unit 1 is still decoding when unit 2 is fed, so the engine does not run
    # dry at the boundary; every row is still answered once and the in-flight bound holds.
    s = FakeSession(max_num_seqs=4)
    runner = BatchRunner(cfg(max_inflight_batches=2), lambda: s, lambda: s)
    unit1 = pack(prompts(8), token_budget=4 * 6, batch_prefix="u1-")
    unit2 = pack([TokenizedPrompt(id=f"q{i}", input_file=1, input_row=i, token_ids=[2000 + i, 1, 2], prefix_key="00",
                                  max_tokens=3) for i in range(8)], token_budget=4 * 6, batch_prefix="u2-")
    assert [len(b.prompts) for b in unit1 + unit2] == [4, 4, 4, 4]
    runner.feed(unit1)
    first = list(runner.advance())
    assert s.num_unfinished() > 0 and runner.in_flight >= 1  # unit 1's tail is still in the engine
    assert "u1-1" not in [st["batch_id"] for _, _, st in first]
    runner.feed(unit2)
    rest = list(runner.advance()) + list(runner.drain())
    assert "u1-1" in [st["batch_id"] for _, _, st in rest]  # answered after unit 2 was fed
    answered = [r["id"] for rows, _, _ in first + rest for r in rows]
    assert sorted(answered) == sorted([f"p{i}" for i in range(8)] + [f"q{i}" for i in range(8)])
    assert runner.in_flight == 0 and s.num_unfinished() == 0
    assert s.max_inflight <= 2 * 4  # never more than max_inflight_batches batches in the engine
    assert runner.admitted_rows == runner.generated_rows == 16
    runner.close()


# ---------------------------------------------------------------- n samples per row


class Recording(FakeSession):
    """A fake that keeps each request's sampling, and gives up on request ids in `give_up`."""

    def __init__(self, *a, give_up=(), **kw):
        super().__init__(*a, **kw)
        self.sampling: dict[str, dict] = {}
        self.give_up = set(give_up)

    def add(self, request_id, token_ids, sampling, **_):
        super().add(request_id, token_ids, sampling)
        self.sampling[request_id] = sampling

    def step(self):
        out = super().step()
        for f in out:
            if f.request_id in self.give_up:
                f.error_reason, f.error = R.SERVER_ERROR, "HTTP 500 (after 4 attempts)"
        return out


def sampled(n, k=3, seed=10):
    return [TokenizedPrompt(id=f"p{i}", input_file=0, input_row=i, token_ids=[i + 1000, 1, 2], prefix_key="00",
                            max_tokens=3, sampling={"n": k, "seed": seed}, samples=k) for i in range(n)]


def test_a_row_asking_for_n_samples_is_n_output_rows_seeded_apart():
    s = Recording(max_num_seqs=8)
    rows, dead, stats = run(BatchRunner(cfg(), lambda: s, lambda: s), pack(sampled(4), token_budget=1000))
    assert not dead
    assert sorted((r["id"], r["sample"]) for r in rows) == [(f"p{i}", j) for i in range(4) for j in range(3)]
    seeds = sorted(v["seed"] for v in s.sampling.values())
    assert seeds == sorted([10, 11, 12] * 4) and all("n" not in v for v in s.sampling.values())  # no engine is sent n
    assert sum(st["requests"] for st in stats) == 4  # a batch's requests are its rows
    assert sampled(1)[0].budget_tokens == 3 + 3 * 3  # the prompt once, each sample's output


def test_a_row_whose_sample_fails_is_one_dead_letter_and_none_of_its_samples():
    s = Recording(max_num_seqs=8, give_up={"b0.1~2"})
    rows, dead, _ = run(BatchRunner(cfg(), lambda: s, lambda: s),
                        [R.Batch("b0", sampled(3))])
    assert sorted({r["id"] for r in rows}) == ["p0", "p2"] and len(rows) == 6
    assert [(d.id, d.reason) for d in dead] == [("p1", R.SERVER_ERROR)]
    rejected = FakeSession(max_num_seqs=8, reject_token=1001)
    rows, dead, _ = run(BatchRunner(cfg(), lambda: rejected, lambda: rejected), [R.Batch("b1", sampled(2))])
    assert [(d.id, d.reason) for d in dead] == [("p1", R.BAD_REQUEST)] and {r["id"] for r in rows} == {"p0"}


def test_a_poison_row_with_samples_is_isolated_and_the_others_keep_all_theirs():
    slot = Restarting(max_num_seqs=8, poison_token=1002)
    runner = BatchRunner(cfg(), lambda: slot.current() if slot.current().alive() else slot.restart(), slot.restart)
    rows, dead, _ = run(runner, pack(sampled(5), token_budget=1000))
    assert [(d.id, d.reason) for d in dead] == [("p2", R.ENGINE_ERROR)]
    assert sorted((r["id"], r["sample"]) for r in rows) == [(f"p{i}", j) for i in (0, 1, 3, 4) for j in range(3)]
