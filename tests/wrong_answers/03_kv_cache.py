"""Chapter 03's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "contiguous-bytes-solution": [
        # Only the keys: forgets the value buffer of the same shape.
        "return config.num_hidden_layers * max_len * config.num_key_value_heads * config.head_dim * dtype.itemsize",
        # Query heads instead of KV heads: grouped-query attention caches fewer heads than it queries.
        "return 2 * config.num_hidden_layers * max_len * config.num_attention_heads * config.head_dim * dtype.itemsize",
        # One layer's cache: forgets that every layer keeps its own keys and values.
        "return 2 * max_len * config.num_key_value_heads * config.head_dim * dtype.itemsize",
        # Builds the package's cache to measure it, which the exercise asks not to do.
        'return ContiguousKVCache(config, max_len, dtype, "meta").nbytes',
    ],
    "decode-step-solution": [
        # Attends over the cached rows only: the new token does not see its own key.
        """
if length >= k_buffer.shape[0]:
    raise ValueError(f"no row left for position {length}")
k_buffer[length] = k[0]
v_buffer[length] = v[0]
return attention(q, k_buffer[:length], v_buffer[:length], causal=True)
""",
        # Attends over the whole buffer, empty rows included.
        """
if length >= k_buffer.shape[0]:
    raise ValueError(f"no row left for position {length}")
k_buffer[length] = k[0]
v_buffer[length] = v[0]
return attention(q, k_buffer, v_buffer, causal=True)
""",
        # No room check: a full buffer fails with an IndexError, not the ValueError asked for.
        """
k_buffer[length] = k[0]
v_buffer[length] = v[0]
return attention(q, k_buffer[: length + 1], v_buffer[: length + 1], causal=True)
""",
        # Off by one: writes the new token over the last cached one, at row length - 1.
        """
if length >= k_buffer.shape[0]:
    raise ValueError(f"no row left for position {length}")
k_buffer[length - 1] = k[0]
v_buffer[length - 1] = v[0]
return attention(q, k_buffer[:length], v_buffer[:length], causal=True)
""",
    ],
    "contiguous-waste-solution": [
        # Never checks that a request fits its buffer.
        """
reserved = len(lengths) * max_len
return (reserved - sum(lengths)) / reserved if reserved else 0.0
""",
        # Divides by zero when there is no request.
        """
if any(n > max_len for n in lengths):
    raise ValueError(f"a request does not fit a buffer of {max_len}")
return 1 - sum(lengths) / (len(lengths) * max_len)
""",
        # The share of slots used, not the share wasted.
        """
if any(n > max_len for n in lengths):
    raise ValueError(f"a request does not fit a buffer of {max_len}")
reserved = len(lengths) * max_len
return sum(lengths) / reserved if reserved else 0.0
""",
        # Calls the package's own count (chapter 04's kv_cache_waste).
        """
from mini_infer.kv.block_pool import kv_cache_waste

return kv_cache_waste(lengths, 1, contiguous_max_len=max_len).contiguous_waste
""",
    ],
}
