"""The scheduler alone, driven by random workloads with a fake model (chapters 06 and 07).

No tensors: each step's "sampled token" is a deterministic function of the sequence, so the
test can check that preemption and chunking never change a request's output, that every
invariant holds after every step, and that every block comes back.
"""

from hypothesis import given, settings
from hypothesis import strategies as st

# The graded tests' fake model and engine loop (chapters 06 and 07).
from mini_infer.course.graded.graded_fake_engine import expected_output, fake_step
from mini_infer.kv.block_pool import BlockPool, num_blocks_for
from mini_infer.kv.radix_cache import RadixCache
from mini_infer.sampling import SamplingParams
from mini_infer.scheduler import Scheduler
from mini_infer.sequence import Sequence

BLOCK = 4


def run(requests, num_blocks, budget, max_seqs, prefix_caching, abort_at=()):
    pool = BlockPool(num_blocks, BLOCK)
    cache = RadixCache(pool) if prefix_caching else None
    scheduler = Scheduler(
        pool, max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=10_000, prefix_cache=cache
    )
    seqs = []
    for i, (prompt, max_tokens) in enumerate(requests):
        seq = Sequence(str(i), prompt, SamplingParams(max_tokens=max_tokens), arrival=i)
        scheduler.add(seq)
        seqs.append(seq)
    steps = 0
    while scheduler.has_unfinished:
        out = fake_step(scheduler)
        assert not out.is_empty, "a step with unfinished requests scheduled nothing: the engine would hang"
        assert out.num_tokens <= budget
        steps += 1
        for index in abort_at:
            if steps == index[0] and index[1] < len(seqs):
                scheduler.finish(seqs[index[1]])
        scheduler.check_invariants()
        assert steps < 10_000
    cached = cache.num_cached_blocks if cache else 0
    assert pool.num_free_blocks + cached == num_blocks, "a block was lost"
    if cache:
        cache.reset()
    assert pool.num_free_blocks == num_blocks
    return seqs, scheduler


request_lists = st.lists(
    st.tuples(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 12)), min_size=1, max_size=10
)
# Prompts over two token values share prefixes, whole prompts included, far more often: the
# prefix cache's hard cases (the same blocks computed twice, by two requests or after a hit).
similar_request_lists = st.lists(
    st.tuples(st.lists(st.integers(0, 1), min_size=1, max_size=40), st.integers(1, 12)), min_size=1, max_size=10
)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.one_of(request_lists, similar_request_lists),
    extra_blocks=st.integers(0, 40),
    budget=st.integers(1, 40),
    max_seqs=st.integers(1, 8),
    prefix=st.booleans(),
)
def test_random_workloads_complete_unchanged(requests, extra_blocks, budget, max_seqs, prefix):
    # The pool always fits the largest request alone (smaller requests are refused at submission).
    need = max(num_blocks_for(len(p) + m, BLOCK) for p, m in requests)
    seqs, _ = run(requests, need + extra_blocks, budget, max_seqs, prefix)
    for seq, (prompt, max_tokens) in zip(seqs, requests):
        assert seq.is_finished
        assert seq.output_token_ids == expected_output(prompt, max_tokens)


@settings(max_examples=30, deadline=None)
@given(
    requests=request_lists,
    aborts=st.lists(st.tuples(st.integers(1, 20), st.integers(0, 9)), max_size=4),
    prefix=st.booleans(),
)
def test_aborts_free_everything(requests, aborts, prefix):
    need = max(num_blocks_for(len(p) + m, BLOCK) for p, m in requests)
    seqs, _ = run(requests, need + 2, 8, 4, prefix, abort_at=aborts)
    assert all(seq.is_finished for seq in seqs)


def test_pressure_preempts_latest_arrival():
    # Two requests that each grow to 3 blocks share a 4-block pool: the later one is preempted.
    seqs, scheduler = run([([1] * 4, 8), ([2] * 4, 8)], num_blocks=4, budget=16, max_seqs=4, prefix_caching=False)
    assert scheduler.num_preemptions >= 1
    assert [s.output_token_ids for s in seqs] == [expected_output([1] * 4, 8), expected_output([2] * 4, 8)]


def test_identical_prompts_in_a_tight_pool_share_the_cached_blocks():
    # The second request computes blocks the first one already cached: the last block of its
    # prompt after a hit on the rest (the last prompt token must give logits), or, with a
    # one-token prompt, the same generated tokens. Its copies duplicated the tree's, and the
    # tree's copies, stuck above the second request's newer blocks, could not be evicted: with
    # the pool just large enough for one request, it preempted itself and a step scheduled
    # nothing. It now takes the tree's copies and frees its own.
    for requests in ([([0] * 24, 1), ([0] * 24, 6)], [([0], 4), ([0], 9)]):
        need = max(num_blocks_for(len(p) + m, BLOCK) for p, m in requests)
        seqs, scheduler = run(requests, need, budget=1, max_seqs=1, prefix_caching=True)
        assert [s.output_token_ids for s in seqs] == [expected_output(p, m) for p, m in requests]
        assert scheduler.num_preemptions == 0


def test_decodes_are_scheduled_before_prefill_chunks():
    pool = BlockPool(64, BLOCK)
    scheduler = Scheduler(pool, max_num_batched_tokens=6, max_num_seqs=8, max_model_len=1000)
    first = Sequence("a", [1, 2, 3], SamplingParams(max_tokens=5), arrival=0)
    scheduler.add(first)
    out = scheduler.schedule()
    scheduler.update(out.scheduled, [[7]])
    scheduler.add(Sequence("b", list(range(40)), SamplingParams(max_tokens=5), arrival=1))
    out = scheduler.schedule()
    assert [(s.seq.request_id, s.num_new_tokens) for s in out.scheduled] == [("a", 1), ("b", 5)]


def test_prefix_cache_skips_shared_blocks():
    pool = BlockPool(64, BLOCK)
    cache = RadixCache(pool)
    scheduler = Scheduler(pool, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=1000, prefix_cache=cache)
    system = list(range(12))  # three full blocks
    scheduler.add(Sequence("a", system + [50, 51], SamplingParams(max_tokens=2), arrival=0))
    out = scheduler.schedule()
    scheduler.update(out.scheduled, [[1]])
    scheduler.add(Sequence("b", system + [60], SamplingParams(max_tokens=2), arrival=1))
    out = scheduler.schedule()
    b = next(s for s in out.scheduled if s.seq.request_id == "b")
    assert b.num_new_tokens == 1 and b.context_len == 13  # 12 tokens came from the cache
    assert scheduler.blocks.prefix_cache_hit_tokens == 12
    scheduler.check_invariants()


def test_a_refused_admission_leaves_the_pool_and_the_tree_as_they_were():
    """The block bookkeeping checks before it changes anything: a request that does not fit
    neither marks its cached prefix as used, nor splits the node it matches in part, nor evicts
    the blocks it would have needed, nor takes references."""
    pool = BlockPool(8, BLOCK)
    cache = RadixCache(pool)
    scheduler = Scheduler(pool, max_num_batched_tokens=100, max_num_seqs=8, max_model_len=1000, prefix_cache=cache)
    scheduler.add(Sequence("a", list(range(12)), SamplingParams(max_tokens=1), arrival=0))
    fake_step(scheduler)  # a finishes; its three prompt blocks stay in the tree, held by it alone
    scheduler.add(Sequence("b", [100] * 17, SamplingParams(max_tokens=8), arrival=1))
    fake_step(scheduler)  # b holds the five other blocks
    # c matches two of a's three blocks (a node matched in part) and needs three blocks more:
    # one evictable block and no free one cannot hold them.
    waiting = Sequence("c", list(range(8)) + [50] * 12, SamplingParams(max_tokens=1), arrival=2)
    scheduler.add(waiting)
    nodes, refs = cache.nodes(), [pool.ref_count(b) for b in range(pool.num_blocks)]
    out = scheduler.schedule()
    assert [s.seq.request_id for s in out.scheduled] == ["b"] and list(scheduler.waiting) == [waiting]
    assert cache.nodes() == nodes  # recency included, no split
    assert [pool.ref_count(b) for b in range(pool.num_blocks)] == refs
    assert scheduler.blocks.prefix_cache_query_tokens == 12 + 17  # c is counted when it is admitted


def test_the_scheduler_imports_neither_torch_nor_the_model_runner():
    """The policy is plain Python over sequences: the engine turns its output into model inputs."""
    import ast
    from pathlib import Path

    import mini_infer.scheduler

    tree = ast.parse(Path(mini_infer.scheduler.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not {m for m in imported if m.split(".")[0] == "torch" or m == "mini_infer.model_runner"}
