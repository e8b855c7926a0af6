"""Which request fields SGLang 0.5.23 knows, per endpoint: the rest it ignores (and the simulator logs them).

Read from the wheel: SGLang answers unknown top-level fields on ``/generate``, ``/v1/completions`` and
``/v1/chat/completions`` by ignoring them (FastAPI parses the body into a dataclass or a pydantic model without
``extra="forbid"``; only the ``Decision*`` models of ``/v1/decisions`` forbid extras), while the JSON contract's
``SamplingParams`` rejects unknown keys. tests/conformance/test_sglang_requests.py checks these sets against the
pinned wheel.
"""

from __future__ import annotations


def _words(text: str) -> frozenset[str]:
    return frozenset(text.split())


# Every field of SGLang 0.5.23's ``GenerateReqInput`` (``sglang/srt/managers/io_struct.py``). FastAPI parses the
# ``/generate`` body into that dataclass and drops any other key, and the JSON contract gate
# (``sglang/srt/entrypoints/api_contract.py``: ``GenerateRequest``, "unknown keys ignored") lets them through, so
# SGLang ignores unknown top-level fields (e.g. the ``model`` that SGLang's router ``smg`` sends). The simulator
# ignores them too and logs them at debug level.
GENERATE_FIELDS = _words(
    """rid session_id text input_ids input_embeds image_data video_data audio_data mm_hashes mm_content_hashes
    use_audio_in_video video_config sampling_params watermark return_logprob logprob_start_len top_logprobs_num
    token_ids_logprob return_sampling_mask sampling_logprobs_mode return_text_in_logprobs return_flat_raw_top_logprobs
    return_flat_raw_output_top_logprobs return_flat_raw_top_logprobs_b64 stream log_metrics return_hidden_states
    return_routed_experts routed_experts_start_len return_indexer_topk modalities session_params lora_path lora_id
    custom_logit_processor positional_embed_overrides bootstrap_host bootstrap_port bootstrap_room bootstrap_pair_key
    decode_tp_size routed_dp_rank data_parallel_rank disagg_prefill_dp_rank routing_key conversation_id
    http_worker_ipc background require_reasoning max_thinking_tokens priority extra_key no_logs custom_labels
    return_bytes return_entropy return_prompt_token_ids external_trace_header received_time need_wait_for_mm_inputs
    num_items_assigned encoder_urls max_dynamic_patch min_dynamic_patch image_max_dynamic_patch
    video_max_dynamic_patch images_config mm_processor_kwargs multi_item_delimiter_indices token_indices_to_pool
    cache_salt kv_hints"""
)
# ``sampling_params`` keys of the JSON contract's ``SamplingParams`` ("unknown keys rejected"), in its order
# (``_FIELDS_SamplingParams`` in ``sglang/api/v1/api_types.py``): an unknown key is a 400 with serde's text.
SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim",
    "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark", "choice",
)  # fmt: skip

# ``CompletionRequest`` (with its base ``PDRoutingFields``) in ``sglang/srt/entrypoints/openai/protocol.py``.
COMPLETION_FIELDS = _words(
    """bootstrap_host bootstrap_port bootstrap_room routed_dp_rank disagg_prefill_dp_rank model prompt best_of echo
    frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream stream_options suffix
    temperature top_p user return_hidden_states return_routed_experts routed_experts_start_len
    return_cached_tokens_details return_spec_tokens_details return_token_ids top_k min_p min_tokens json_schema regex
    ebnf repetition_penalty stop_token_ids stop_regex no_stop_trim ignore_eos skip_special_tokens lora_path session_id
    session_params response_format custom_params custom_logit_processor watermark images_config mm_processor_kwargs
    data_parallel_rank rid extra_key cache_salt priority custom_labels"""
)
# ``ChatCompletionRequest`` (with ``PDRoutingFields``), same file.
CHAT_FIELDS = _words(
    """bootstrap_host bootstrap_port bootstrap_room routed_dp_rank disagg_prefill_dp_rank messages model
    frequency_penalty logit_bias logprobs top_logprobs max_tokens max_completion_tokens n presence_penalty
    response_format seed stop stream stream_options temperature top_p user tools tool_choice parallel_tool_calls
    return_hidden_states return_routed_experts routed_experts_start_len return_cached_tokens_details
    return_spec_tokens_details return_prompt_token_ids return_token_ids return_meta_info return_input_ids_in_sglext
    return_output_ids_in_sglext return_sampling_mask sampling_logprobs_mode return_flat_raw_output_top_logprobs
    return_flat_raw_top_logprobs_b64 reasoning_effort thinking task top_k min_p min_tokens regex ebnf
    repetition_penalty stop_token_ids stop_regex no_stop_trim ignore_eos continue_final_message skip_special_tokens
    lora_path session_id session_params separate_reasoning stream_reasoning chat_template_kwargs max_dynamic_patch
    min_dynamic_patch use_audio_in_video images_config video_config mm_processor_kwargs custom_logit_processor
    custom_params watermark input_ids rid extra_key cache_salt priority data_parallel_rank"""
)


def ignored_fields(body: dict[str, object], known: frozenset[str]) -> tuple[str, ...]:
    """The body's top-level fields SGLang ignores on this endpoint, sorted (for a debug log line)."""
    return tuple(sorted(set(body) - known))
