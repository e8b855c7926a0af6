"""The decoding engine: continuous batching of one attention-DP group, the paged KV pools, the radix prefix cache
and HiCache's L3."""
