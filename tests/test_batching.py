from tokenmill.schemas.records import TokenizedPrompt
from tokenmill.transforms.batching import default_token_budget, order_prompts, pack, plan_batches
from tokenmill.transforms.tokenize import prefix_key


def tp(i, ids, max_tokens=10):
    return TokenizedPrompt(id=f"p{i}", input_file=0, input_row=i, token_ids=ids, prefix_key=prefix_key(ids, 4, 2), max_tokens=max_tokens)


def test_prefix_key_aligns_to_whole_blocks():
    shared = list(range(100, 108))  # two blocks of 4
    a = prefix_key(shared + [1, 2, 3], block_size=4, blocks=2)
    b = prefix_key(shared + [9, 9, 9, 9, 9], block_size=4, blocks=2)
    c = prefix_key([100, 101, 102, 103, 0, 0, 0, 0, 5], block_size=4, blocks=2)
    assert a == b  # same two leading blocks
    assert a != c  # second block differs


def test_pack_respects_token_budget_and_keeps_oversized_prompt_alone():
    ps = [tp(i, [1] * 10) for i in range(5)]  # 20 budget tokens each
    batches = pack(ps, token_budget=45)
    assert [len(b.prompts) for b in batches] == [2, 2, 1]
    assert all(b.tokens <= 45 for b in batches)
    big = pack([tp(9, [1] * 100)], token_budget=45)
    assert len(big) == 1 and len(big[0].prompts) == 1


def test_prefix_ordering_puts_shared_prefixes_next_to_each_other():
    doc_a, doc_b = [7] * 8, [8] * 8
    ps = [tp(0, doc_a + [1]), tp(1, doc_b + [1]), tp(2, doc_a + [2]), tp(3, doc_b + [2])]
    ordered = order_prompts(ps, "prefix")
    keys = [p.token_ids[:8] for p in ordered]
    assert keys in ([doc_a, doc_a, doc_b, doc_b], [doc_b, doc_b, doc_a, doc_a])
    assert [p.id for p in order_prompts(ps, "none")] == ["p0", "p1", "p2", "p3"]
    assert [len(p.token_ids) for p in order_prompts([tp(0, [1]), tp(1, [1, 1, 1])], "length")] == [3, 1]


def test_default_budget_keeps_max_num_seqs_full():
    ps = [tp(i, [1] * 10, max_tokens=10) for i in range(100)]
    assert default_token_budget(ps, max_num_seqs=8) == 160
    batches = plan_batches(ps, ordering="length", token_budget=None, max_num_seqs=8)
    assert [len(b.prompts) for b in batches][:3] == [8, 8, 8]


def test_cpu_slots_split_cores_without_overlap():
    from tokenmill.transforms.engines.cpu import cpu_slot_cores

    assert [cpu_slot_cores(i, 2, [0, 1]) for i in range(2)] == [[0], [1]]
    assert [cpu_slot_cores(i, 3, [0, 1, 2, 3, 4, 5, 6]) for i in range(3)] == [[0, 1, 2], [3, 4], [5, 6]]
    assert [cpu_slot_cores(i, 3, [4, 5]) for i in range(3)] == [[4], [5], [4]]


def test_each_worker_process_claims_its_own_slot_and_binds_its_cores(tmp_path):
    # Two processes claiming slots of one group get different slots and disjoint cores.
    import json
    import subprocess
    import sys

    code = (
        "import json,os,sys,time;from tokenmill.transforms.engines.cpu import claim_cpu_slot;"
        f"s,c=claim_cpu_slot(2,'g',{str(tmp_path)!r});print(json.dumps([s,c,os.environ['VLLM_CPU_OMP_THREADS_BIND']]),flush=True);"
        "time.sleep(3)"
    )
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(2)]
    got = [json.loads(p.stdout.readline()) for p in procs]
    for p in procs:
        p.wait()
    assert sorted(g[0] for g in got) == [0, 1]
    assert not set(got[0][1]) & set(got[1][1]) or len(got[0][1]) == 1 == len(set(got[0][1] + got[1][1]))
    assert all(g[2] == ",".join(map(str, g[1])) for g in got)
