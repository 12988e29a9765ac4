"""Chapter 00's exercises answered wrongly, as a student plausibly would (see scripts/wrong_answers.py)."""

WRONG_ANSWERS = {
    "kv-bytes-solution": [
        # Only the keys: forgets that every token stores a value too.
        "return num_layers * num_kv_heads * head_dim * bytes_per_element",
    ],
    "blocks-needed-solution": [
        # Floor division: a partly filled last block is not counted.
        "return num_tokens // block_size",
        # Always one block more than the floor: right for 17 tokens, one too many for 16 and for 0.
        "return num_tokens // block_size + 1",
    ],
}
