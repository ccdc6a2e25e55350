"""The mock engine's cost model: how long one scheduler step would take on the modelled GPU.

A roofline-style model of one forward pass of a continuous batch (see docs/worker.md for the
derivation and the public vLLM figures it is checked against). Defaults model an 8B dense model
(Llama-3-8B / Qwen3-8B class, bf16) on one H100 SXM:

    step = overhead
         + max(weights_read, compute_per_token · scheduled_tokens)     # memory- vs compute-bound
         + kv_read_per_token · context tokens read by attention
         + prefill_attention · Σ chunk_tokens · (tokens before the chunk + chunk_tokens / 2)

- weights_read: every step streams the weights once (16 GB / 3.35 TB/s ≈ 4.8 ms): the floor
  of a decode step, which is why decode is memory-bound and batching is nearly free.
- compute_per_token: 2·8e9 FLOPs per token at ~50 % of 989 dense bf16 TFLOPS ≈ 32 µs; prefill
  of uncached tokens is compute-bound, so TTFT grows linearly with *uncached* prompt tokens.
- kv_read_per_token: 128 KiB of K/V per token (32 layers · 8 KV heads · 128 · 2 · bf16) at
  3.35 TB/s ≈ 39 ns per context token per step: decode slows as batch × context grows.
- prefill_attention: the quadratic term of causal attention over the prompt.
- kv_transfer: disaggregated decode loads the prompt's KV instead of recomputing it:
  latency + bytes / link bandwidth (NIXL over 400 Gb/s RDMA ≈ 50 GB/s).
"""

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CostModel:
    overhead_s: float = 0.0015
    weights_read_s: float = 0.0048
    compute_per_token_s: float = 32e-6
    kv_read_per_token_s: float = 39e-9
    prefill_attention_s: float = 2.0e-9
    kv_transfer_latency_s: float = 0.001
    kv_bytes_per_token: int = 131_072
    kv_transfer_bandwidth: float = 50e9

    def step_time(
        self,
        scheduled_tokens: int,
        decode_context_tokens: int,
        prefill_chunks: list[tuple[int, int]],
    ) -> float:
        """Seconds for one forward pass.

        scheduled_tokens: every token computed this step (prefill chunks + one per decode);
        decode_context_tokens: Σ context length of the decoding sequences (KV read);
        prefill_chunks: (tokens before the chunk, chunk length) per prefilling sequence.
        """
        if scheduled_tokens <= 0:
            return 0.0
        attention = sum(chunk * (before + chunk / 2) for before, chunk in prefill_chunks)
        return (
            self.overhead_s
            + max(self.weights_read_s, self.compute_per_token_s * scheduled_tokens)
            + self.kv_read_per_token_s * decode_context_tokens
            + self.prefill_attention_s * attention
        )

    def transfer_time(self, tokens: int) -> float:
        """Seconds to pull `tokens` tokens of KV from a prefill engine."""
        if tokens <= 0:
            return 0.0
        return (
            self.kv_transfer_latency_s
            + tokens * self.kv_bytes_per_token / self.kv_transfer_bandwidth
        )
