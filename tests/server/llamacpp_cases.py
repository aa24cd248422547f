"""Which of llama.cpp's server unit tests apply to simmer, and which of their assertions are about their
model rather than their server. Shared by the runner (tests/server/api/test_llamacpp_server_tests.py) and the
shim it loads into their run (tests/server/llamacpp_shim.py).

- NOT_APPLICABLE: cases that depend on what only llama-server has (slots, /props, /completion's native
  fields, serving under any model name, its command-line switches, its own error shapes), each with its
  reason; the shim skips them, and a key that matches no collected case stops the run (no stale entries).
- RELAXED: assertions of what stories260K, the model those tests run, says and counts (text regexes, token
  counts, its BOS id), and llama-server's build number in `system_fingerprint`; the runner rewrites each,
  found exactly once, into the shape it stands for.
"""

from __future__ import annotations

import re

import pytest

ANY_NAME = (
    "llama-server serves its one model under any `model` name (and its alias); simmer serves its models by "
    "their ids and answers another name with 404 model_not_found"
)
NATIVE = (
    "llama-server's native /completion endpoint and its fields (content, timings, generation_settings, "
    "n_probs, tokens, stop_type)"
)
SLOTS = "llama-server's slots (/slots, n_slots, id_slot, kv_unified)"
PROPS = "llama-server's /props"
CLI = "a llama-server command-line switch with no simmer equivalent"
TEMPLATE = (
    "llama-server's server-side chat template override (--chat-template, --chat-template-file); simmer "
    "renders the model's own template"
)
CTX_ERROR = (
    "llama-server's own context error (type exceed_context_size_error, n_prompt_tokens, n_ctx); simmer "
    "answers OpenAI's 400 context_length_exceeded (tests/server/api/test_context_overflow.py)"
)
VERBOSE = "llama-server's debug fields (__verbose, timings_per_token, return_progress, prompt_progress)"
CORS_ALL = (
    "llama-server answers a CORS preflight from any origin and its 'localhost' keyword; simmer allows only "
    "the origins SIMMER_CORS_ORIGINS lists"
)
ANTHROPIC_KEY = "Anthropic's X-Api-Key header; simmer takes the key as a Bearer token"
STATIC = "llama-server's web UI files (/sw.js, /manifest.webmanifest, /_app/version.json)"
PREFILL = (
    "an assistant prefill continued by llama-server (continue_final_message); simmer answers after the "
    "last turn"
)
HUB = "another model, from the Hugging Face Hub"
MEDIA = "images (multimodal models and --media-path)"

# node id (or its prefix, up to the parameters) -> why the case does not apply to simmer
NOT_APPLICABLE: dict[str, str] = {
    "unit/test_basic.py::test_server_multiple_addresses": CLI + " (several --host addresses)",
    "unit/test_basic.py::test_server_props": PROPS,
    "unit/test_basic.py::test_server_models": ANY_NAME + " (the /models list names the alias)",
    "unit/test_basic.py::test_server_slots": SLOTS,
    "unit/test_basic.py::test_load_split_model": NATIVE + "; a split GGUF from the Hub",
    "unit/test_basic.py::test_no_ui": CLI + " (--no-ui)",
    "unit/test_basic.py::test_server_model_aliases_and_tags": ANY_NAME + " (--alias, --tags)",
    "unit/test_chat_completion.py::test_chat_completion[codellama70b-*]": ANY_NAME,
    "unit/test_chat_completion.py::test_chat_completion[*-chatml]": TEMPLATE,
    "unit/test_chat_completion.py::test_chat_completion[*-This is not a chat template, it is]": TEMPLATE,
    "unit/test_chat_completion.py::test_chat_completion_cached_tokens": SLOTS
    + " (n_slots 1; the counts are stories260K's)",
    "unit/test_chat_completion.py::test_chat_completion_with_openai_library": ANY_NAME,
    "unit/test_chat_completion.py::test_chat_template": TEMPLATE + "; " + VERBOSE,
    "unit/test_chat_completion.py::test_chat_template_assistant_prefill": TEMPLATE + "; " + VERBOSE,
    "unit/test_chat_completion.py::test_chat_template_continue_final_message_vllm_compat": PREFILL,
    "unit/test_chat_completion.py::test_chat_template_continue_final_message_mutual_exclusion": PREFILL,
    "unit/test_chat_completion.py::test_apply_chat_template": TEMPLATE + " (command-r)",
    "unit/test_chat_completion.py::test_invalid_chat_completion_req[messages7]": PREFILL
    + " (llama-server refuses two trailing assistant turns)",
    "unit/test_chat_completion.py::test_logprobs": ANY_NAME,
    "unit/test_chat_completion.py::test_logprobs_stream": ANY_NAME,
    "unit/test_chat_completion.py::test_logit_bias": ANY_NAME,
    "unit/test_chat_completion.py::test_context_size_exceeded": CTX_ERROR,
    "unit/test_chat_completion.py::test_context_size_exceeded_stream": CTX_ERROR,
    "unit/test_chat_completion.py::test_return_progress": VERBOSE,
    "unit/test_chat_completion.py::test_chat_completions_token_count": "llama-server's "
    "/chat/completions/input_tokens",
    "unit/test_chat_completion.py::test_verbose_debug": VERBOSE,
    "unit/test_completion.py::test_completion": NATIVE,
    "unit/test_completion.py::test_completion_stream": NATIVE,
    "unit/test_completion.py::test_completion_stream_vs_non_stream": NATIVE,
    "unit/test_completion.py::test_completion_with_openai_library": ANY_NAME,
    "unit/test_completion.py::test_completion_stream_with_openai_library": ANY_NAME,
    "unit/test_completion.py::test_completion_stream_with_openai_library_stops": HUB + " (Phi-3.5-mini)",
    "unit/test_completion.py::test_consistent_result_same_seed": NATIVE + "; " + SLOTS,
    "unit/test_completion.py::test_different_result_different_seed": NATIVE + "; " + SLOTS,
    "unit/test_completion.py::test_consistent_result_different_batch_size": NATIVE + " (--batch-size)",
    "unit/test_completion.py::test_nocache_long_input_prompt": NATIVE,
    "unit/test_completion.py::test_json_prompt_no_mtmd": NATIVE + " (a JSON prompt object)",
    "unit/test_completion.py::test_json_prompt_mtm_error_when_not_supported": NATIVE + "; " + MEDIA,
    "unit/test_completion.py::test_completion_with_tokens_input": NATIVE + " (token prompts, batches)",
    "unit/test_completion.py::test_completion_parallel_slots": SLOTS,
    "unit/test_completion.py::test_completion_unified": SLOTS,
    "unit/test_completion.py::test_completion_response_fields": NATIVE + " (response_fields)",
    "unit/test_completion.py::test_n_probs": NATIVE,
    "unit/test_completion.py::test_n_probs_stream": NATIVE,
    "unit/test_completion.py::test_n_probs_post_sampling": NATIVE,
    "unit/test_completion.py::test_n_probs_post_backend_sampling": NATIVE + " (backend sampling)",
    "unit/test_completion.py::test_logit_bias": NATIVE,
    "unit/test_completion.py::test_cancel_request": SLOTS,
    "unit/test_completion.py::test_completion_prompt_cache": NATIVE + "; " + SLOTS,
    "unit/test_compat_oai_responses.py::test_responses_with_openai_library": ANY_NAME,
    "unit/test_compat_oai_responses.py::test_responses_stream_with_openai_library": ANY_NAME,
    "unit/test_compat_oai_responses.py::test_responses_stream_with_llama_telemetry": VERBOSE,
    "unit/test_security.py::test_access_static_assets_without_api_key": STATIC,
    "unit/test_security.py::test_correct_api_key": NATIVE + " (its /completions)",
    "unit/test_security.py::test_correct_api_key_anthropic_header": ANTHROPIC_KEY,
    "unit/test_security.py::test_openai_library_correct_api_key": ANY_NAME,
    "unit/test_security.py::test_cors_options": CORS_ALL,
    "unit/test_security.py::test_cors_origins_localhost_reflects": CORS_ALL,
    "unit/test_security.py::test_cors_origins_localhost_rejects": CORS_ALL + " (the router preset: no model)",
    "unit/test_security.py::test_cors_origins_defaults_to_localhost_with_tools_enabled": CLI + " (--tools)",
    "unit/test_security.py::test_cors_proxy_only_forwards_explicit_proxy_headers": CLI + " (--ui-mcp-proxy)",
    "unit/test_security.py::test_local_media_file": MEDIA,
}


MODEL_TEXT = "what stories260K says (llama.cpp's test model); here a shape: some text"
MODEL_COUNT = "stories260K's token counts; here a shape: a positive count"
BUILD = "llama-server's build number (b1234) in system_fingerprint; simmer's names its variant"
# (file, assertion as written, as run here, why)
STOPS = "whether the model stops before max_tokens (stories260K never does); here: length, or stop sooner"
RELAXED: list[tuple[str, str, str, str]] = [
    (
        "unit/test_chat_completion.py",
        '    assert res.body["system_fingerprint"].startswith("b")\n'
        "    # we no longer reflect back the model name, see https://github.com/ggml-org/llama.cpp/pull/17668\n"
        '    # assert res.body["model"] == model if model is not None else server.model_alias\n'
        '    assert res.body["usage"]["prompt_tokens"] == n_prompt\n'
        '    assert res.body["usage"]["completion_tokens"] == n_predicted\n'
        '    choice = res.body["choices"][0]\n'
        '    assert "assistant" == choice["message"]["role"]\n'
        '    assert match_regex(re_content, choice["message"]["content"]), f\'Expected {re_content}, got '
        '{choice["message"]["content"]}\'\n'
        '    assert choice["finish_reason"] == finish_reason\n',
        '    assert res.body["system_fingerprint"]\n'
        '    assert res.body["usage"]["prompt_tokens"] > 0\n'
        '    choice = res.body["choices"][0]\n'
        '    assert "assistant" == choice["message"]["role"]\n'
        '    assert choice["message"]["content"]\n'
        '    n, stopped = res.body["usage"]["completion_tokens"], choice["finish_reason"] == "stop"\n'
        '    assert (choice["finish_reason"], n) == (finish_reason, n_predicted) or '
        "(stopped and n < n_predicted)\n",
        f"{BUILD}; {MODEL_COUNT}; {MODEL_TEXT}; {STOPS}",
    ),
    (
        "unit/test_chat_completion.py",
        '            assert data["system_fingerprint"].startswith("b")\n'
        '            assert data["model"] == "llama-test-model"\n',
        '            assert data["system_fingerprint"]\n'
        '            assert data["model"] == server.model_alias\n',
        f"{BUILD}; llama-server's --alias renames the model, simmer names it by its id (the shim's alias)",
    ),
    (
        "unit/test_chat_completion.py",
        "                assert match_regex(re_content, content)\n"
        '                assert choice["finish_reason"] == finish_reason\n',
        "                assert content\n"
        '                assert choice["finish_reason"] in (finish_reason, "stop")\n',
        f"{MODEL_TEXT}; {STOPS}",
    ),
    (
        "unit/test_tokenize.py",
        '    assert res_tok.body["tokens"][0] == bosId\n',
        '    assert res_tok.body["tokens"]\n',
        "stories260K's tokenizer adds its BOS (id 1); SmolLM2's GGUF says add_bos_token false, so no BOS "
        "comes first, in llama.cpp too",
    ),
]


def matches(key: str, nodeid: str) -> bool:
    """`key` names a test (all its parameter sets) or one case; `*` stands for any text."""
    if "[" not in key and nodeid.startswith(key + "["):
        return True
    return re.fullmatch(re.escape(key).replace(r"\*", ".*"), nodeid) is not None


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    used: set[str] = set()
    for item in items:
        for key, reason in NOT_APPLICABLE.items():
            if matches(key, item.nodeid):
                used.add(key)
                item.add_marker(pytest.mark.skip(reason=f"not applicable: {reason}"))
                break
    stale = sorted(set(NOT_APPLICABLE) - used)
    if stale:
        raise pytest.UsageError(f"NOT_APPLICABLE entries that match no collected case: {stale}")
