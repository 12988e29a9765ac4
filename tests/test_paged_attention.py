"""Paged attention equals dense attention; the paged forward equals the reference model (chapter 05)."""

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM

from mini_infer.config import ModelConfig
from mini_infer.kv.paged_attention import PagedAttention, PagedKVCache, build_metadata
from mini_infer.layers import attention
from mini_infer.model import FullAttention, Qwen2Model
from mini_infer.model_runner import ModelRunner, SequenceInput

BLOCK = 4  # small blocks make every boundary case common


def _config(heads: int, kv_heads: int, head_dim: int = 8) -> ModelConfig:
    return ModelConfig(
        vocab_size=10,
        hidden_size=heads * head_dim,
        intermediate_size=8,
        num_hidden_layers=1,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=512,
        rope_theta=1e4,
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        torch_dtype=None,
    )


@settings(max_examples=40, deadline=None)
@given(
    data=st.data(),
    heads_kv=st.sampled_from([(2, 2), (4, 2), (6, 1), (14, 2)]),  # (14, 2): Qwen2.5-0.5B
    num_prefill=st.integers(0, 3),
    num_batched=st.integers(0, 4),
    batch_q=st.integers(1, 3),
)
def test_paged_equals_dense(data, heads_kv, num_prefill, num_batched, batch_q):
    """Random ragged batches: chunks with and without cached context (starting mid-block),
    and a batched group of Q new tokens per sequence (decode when Q = 1)."""
    if num_prefill + num_batched == 0:
        return
    heads, kv_heads = heads_kv
    config = _config(heads, kv_heads)
    cache = PagedKVCache(config, num_blocks=64, block_size=BLOCK, dtype=torch.float32, device="cpu")
    free_blocks = list(range(64))
    random.Random(data.draw(st.integers(0, 1000))).shuffle(free_blocks)
    sequences = []  # (context_len, num_new, block_table, K, V)
    for i in range(num_prefill + num_batched):
        new = data.draw(st.integers(2, 12)) if i < num_prefill else batch_q
        cached = data.draw(st.integers(0, 13))
        ctx = cached + new
        table = [free_blocks.pop() for _ in range(-(-ctx // BLOCK))]
        k, v = torch.randn(ctx, kv_heads, 8), torch.randn(ctx, kv_heads, 8)
        for pos in range(cached):  # the cached prefix is already in the pool
            cache.k[0, :, table[pos // BLOCK], pos % BLOCK] = k[pos]
            cache.v[0, :, table[pos // BLOCK], pos % BLOCK] = v[pos]
        sequences.append((ctx, new, table, k, v))
    prefills, batched = sequences[:num_prefill], sequences[num_prefill:]
    meta = build_metadata(
        prefills=[(new, ctx, table) for ctx, new, table, _, _ in prefills],
        batch=[(ctx, table) for ctx, _, table, _, _ in batched],
        batch_query_len=batch_q,
        cache=cache,
        num_heads=heads,
    )
    q = torch.randn(sum(s[1] for s in sequences), heads, 8)
    new_k = torch.cat([k[ctx - new :] for ctx, new, _, k, _ in sequences])
    new_v = torch.cat([v[ctx - new :] for ctx, new, _, _, v in sequences])
    out = PagedAttention(cache, meta)(0, q, new_k, new_v)
    start = 0
    for _ctx, new, _, k, v in sequences:
        expected = attention(q[start : start + new], k, v, causal=True)
        torch.testing.assert_close(out[start : start + new], expected, rtol=1e-5, atol=1e-5)
        start += new


@pytest.mark.parametrize("batch_q", [1, 3])
def test_large_group_is_cut_into_buckets_each_padded_to_its_own_longest(batch_q):
    """70 sequences (4 buckets), contexts in no particular order: every bucket is padded only
    to its own longest context, and the result still equals dense attention per sequence."""
    heads, kv_heads, num_seqs = 4, 2, 70
    config = _config(heads, kv_heads)
    rng = random.Random(batch_q)
    cache = PagedKVCache(config, num_blocks=1024, block_size=BLOCK, dtype=torch.float32, device="cpu")
    free_blocks = list(range(1024))
    rng.shuffle(free_blocks)
    sequences = []
    for _ in range(num_seqs):
        ctx = rng.randint(batch_q, 50)
        table = [free_blocks.pop() for _ in range(-(-ctx // BLOCK))]
        k, v = torch.randn(ctx, kv_heads, 8), torch.randn(ctx, kv_heads, 8)
        for pos in range(ctx - batch_q):
            cache.k[0, :, table[pos // BLOCK], pos % BLOCK] = k[pos]
            cache.v[0, :, table[pos // BLOCK], pos % BLOCK] = v[pos]
        sequences.append((ctx, table, k, v))
    meta = build_metadata(
        prefills=[],
        batch=[(ctx, table) for ctx, table, _, _ in sequences],
        batch_query_len=batch_q,
        cache=cache,
        num_heads=heads,
    )

    buckets = meta.buckets
    assert [(b.start, b.end) for b in buckets] == [(0, 18), (18, 35), (35, 52), (52, 70)]
    group = heads // kv_heads
    for b in buckets:
        rows = b.end - b.start
        width = max(-(-ctx // BLOCK) for ctx, _, _, _ in sequences[b.start : b.end])
        # The pool rows of KV head 0 are the bucket's tables, each padded to its own width only.
        assert b.pool_rows.shape == (kv_heads * rows * width,)
        assert b.pool_rows[: rows * width].tolist() == meta.block_tables[b.start : b.end, :width].flatten().tolist()
        assert b.bias.shape == (1, rows, group * batch_q if batch_q > 1 else 1, width * BLOCK)

    q = torch.randn(num_seqs * batch_q, heads, 8)
    new_k = torch.cat([k[-batch_q:] for _, _, k, _ in sequences])
    new_v = torch.cat([v[-batch_q:] for _, _, _, v in sequences])
    out = PagedAttention(cache, meta)(0, q, new_k, new_v)
    for i, (_, _, k, v) in enumerate(sequences):
        rows = slice(i * batch_q, (i + 1) * batch_q)
        torch.testing.assert_close(out[rows], attention(q[rows], k, v, causal=True), rtol=1e-5, atol=1e-5)


def test_slot_mapping_by_hand():
    # Sequence A: 3 new tokens after 2 cached, blocks [7, 2]; B: decode at position 5, blocks [4, 9].
    cache = PagedKVCache(_config(2, 2), num_blocks=16, block_size=4, dtype=torch.float32, device="cpu")
    meta = build_metadata(prefills=[(3, 5, [7, 2])], batch=[(6, [4, 9])], batch_query_len=1, cache=cache, num_heads=2)
    # A's positions 2,3,4 -> 7*4+2, 7*4+3, 2*4+0; B's position 5 -> 9*4+1.
    assert meta.slot_mapping.tolist() == [30, 31, 8, 37]
    assert meta.block_tables.tolist() == [[7, 2], [4, 9]]
    (bucket,) = meta.buckets
    assert bucket.bias.shape == (1, 1, 1, 8)  # one query: a single row, broadcast over the group
    assert (bucket.bias[0, 0, 0] == 0).tolist() == [True] * 6 + [False] * 2  # -inf past position 5
    (span,) = meta.prefills
    assert span.bias is not None and span.bias.shape == (1, 1, 3, 5)  # 3 queries over 5 keys, causal


@pytest.fixture(scope="module")
def pair(model_dirs):
    model_dir = model_dirs["untied-gqa4"]
    ours = Qwen2Model.from_pretrained(model_dir, torch.float32, show_progress=False)
    theirs = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return ours, theirs


def test_flat_forward_mixing_prefill_chunk_and_decodes_matches_transformers(pair):
    model, hf = pair
    config = model.config
    cache = PagedKVCache(config, num_blocks=40, block_size=16, dtype=torch.float32, device="cpu")
    lengths = [40, 23, 9, 17]
    seqs = [torch.randint(0, config.vocab_size, (n,)) for n in lengths]
    tables = [[3, 11, 5], [0, 8], [20], [30, 31]]
    with torch.no_grad():
        references = [hf(s[None]).logits[0] for s in seqs]

    # Step 1: prefill everything but the last token of each sequence; sequence 0 only up to 21.
    first = [21, 22, 8, 16]
    ids = torch.cat([s[:n] for s, n in zip(seqs, first)])
    positions = torch.cat([torch.arange(n) for n in first])
    meta = build_metadata(
        prefills=[(n, n, t) for n, t in zip(first, tables)],
        batch=[],
        batch_query_len=1,
        cache=cache,
        num_heads=config.num_attention_heads,
    )
    model.forward(ids, positions, PagedAttention(cache, meta))

    # Step 2, one flat batch: sequence 0's chunk 21..40 (starts mid-block) and three decodes.
    ids = torch.cat([seqs[0][21:], seqs[1][22:], seqs[2][8:], seqs[3][16:]])
    positions = torch.cat([torch.arange(21, 40), torch.tensor([22, 8, 16])])
    meta = build_metadata(
        prefills=[(19, 40, tables[0])],
        batch=[(23, tables[1]), (9, tables[2]), (17, tables[3])],
        batch_query_len=1,
        cache=cache,
        num_heads=config.num_attention_heads,
    )
    logits = model.compute_logits(model.forward(ids, positions, PagedAttention(cache, meta)))
    torch.testing.assert_close(logits[:19], references[0][21:], rtol=0, atol=1e-4)
    for row, ref in zip(logits[19:], references[1:]):
        torch.testing.assert_close(row, ref[-1], rtol=0, atol=1e-4)
    # And the reference forward of our own model agrees too.
    own = model.compute_logits(model.forward(seqs[0], torch.arange(40), FullAttention()))
    torch.testing.assert_close(logits[:19], own[21:], rtol=0, atol=1e-4)


def test_prepare_lays_out_chunks_then_the_batched_group_and_keeps_rows_in_input_order(pair):
    """The ForwardBatch of a mixed step: a prompt chunk that does not sample, a verification with
    two guesses, two decodes and a last prompt chunk; the group (Q = 1 here: the most common
    count) is sorted by context, logit rows follow the inputs' order."""
    model, _ = pair
    cache = PagedKVCache(model.config, num_blocks=40, block_size=16, dtype=torch.float32, device="cpu")
    runner = ModelRunner(model, cache)
    inputs = [
        SequenceInput([1, 2, 3, 4], 0, [0], samples=False),  # a prompt chunk short of the end
        SequenceInput([5], 20, [1, 2], samples=True, draft_token_ids=[6, 7]),  # verifies two guesses
        SequenceInput([8], 30, [3, 4], samples=True),  # decode, longer context
        SequenceInput([9], 10, [5], samples=True),  # decode, shorter context
        SequenceInput([10, 11], 3, [6], samples=True),  # a prompt's last chunk
    ]
    batch = runner.prepare(inputs)
    # Prefill spans (every input whose count is not Q = 1) in input order, then the decodes by context.
    assert batch.input_ids.tolist() == [1, 2, 3, 4, 5, 6, 7, 10, 11, 9, 8]
    assert batch.positions.tolist() == [0, 1, 2, 3, 20, 21, 22, 3, 4, 10, 30]
    assert batch.query_lens == (4, 3, 1, 1, 2) and batch.context_lens == (4, 23, 31, 11, 5)
    assert batch.rows_of == (range(0, 0), range(0, 3), range(3, 4), range(4, 5), range(5, 6))
    # Rows 0-2 verify at tokens 4, 5, 6 (positions 20-22); then 8, 9 and the chunk's last token.
    assert batch.logits_indices.tolist() == [4, 5, 6, 10, 9, 8]
    assert batch.draft_token_ids == ((), (6, 7), (), (), ())
    assert batch.num_tokens == 11 and batch.num_logits == 6
    assert batch.attended_tokens == 4 * 4 + 3 * 23 + 31 + 11 + 2 * 5
    assert batch.attention.batch_start == 9 and batch.attention.batch_query_len == 1
    assert runner.execute(batch).shape == (6, model.config.vocab_size)
