"""The paged KV cache: blocks and block tables (chapter 04), paged attention (05), the radix prefix cache (08)."""
