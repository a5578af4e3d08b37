"""The bounds a pass-through body meets before kvgate forwards it (--passthrough-paths).

The gated routes' bounds hold here too, so that a route kvgate does not gate is no cheaper way to
load the backend's API server, the process that also serves completions:
- the body size limit and the client timeouts (read_body, as on every route);
- a JSON body holding text that is not Unicode is a 400 naming the field (kvgate/json_text.py), the
  same answer the gated routes give; vLLM decides a JSON body by FastAPI's rule (no
  Content-Type, or `application/json` or `+json`), and so does kvgate;
- POST /tokenize and /detokenize: the body is parsed as a gated body is (the JSON value limit,
  413: 15 million token ids to detokenize fit in 32 MiB);
- POST /detokenize: more token ids than max_model_len are refused (400 naming `tokens`). vLLM
  0.32.0 decodes any number (DetokenizeRequest.build_tok_params: max_total_tokens=None): 499,998
  ids took a Llama tokenizer's decode 3.5 s on this loaded 2-core machine, on the API server that
  serves completions; no request of the model holds more than max_model_len tokens, prompt and
  output together, so no ids a request of it used or produced are refused;
- POST /tokenize, where kvgate has the model's tokenizer: the body is prepared as a gated chat or
  prompt is (RequestPipeline.check_passthrough, route "tokenize" in kvgate/vllm_routes.py): parsed
  and its chat rendered under the same limits, work budget and worker, and a prompt certainly
  longer than max_model_len tokens (the characters-per-token bound, kvgate/tokens.py) refused
  before the backend tokenizes it. vLLM 0.32.0's /tokenize counts any length
  (TokenizeCompletionRequest/TokenizeChatRequest.build_tok_params: max_total_tokens=None): a
  30 MiB prompt cost its API server 15.9 s, 160,000 messages the simulator's 49.5 s. Nothing
  that long can be served on any route, so kvgate refuses it, as it refuses it on the generation
  routes. Without the tokenizer files kvgate knows no such bound, and the body size and value
  limits are all it holds a /tokenize body to.
A body a gated route would prepare in a worker process is checked in one (RequestPipeline.check_passthrough):
its parse holds the GIL as long as a gated body's.
"""

from __future__ import annotations

from email.message import Message

from kvgate.errors import InvalidField
from kvgate.json_text import refuse_invalid_text
from kvgate.openai import parse_json_object

TOKENIZE_PATH = "/tokenize"
DETOKENIZE_PATH = "/detokenize"
PARSED_PATHS = frozenset({TOKENIZE_PATH, DETOKENIZE_PATH})


def is_json(content_type: str | None) -> bool:
    """Whether FastAPI (fastapi/routing.py, the version vLLM 0.32.0 runs) parses a body with this
    Content-Type as JSON: none at all, or a `json` or `+json` subtype of `application`."""
    if not content_type:
        return True
    message = Message()
    message["content-type"] = content_type
    subtype = message.get_content_subtype()
    return message.get_content_maintype() == "application" and (subtype == "json" or subtype.endswith("+json"))


def check_passthrough_body(
    method: str, path: str, content_type: str | None, body: bytes, max_model_len: int | None = None
) -> None:
    """A domain error (400, 413) for a pass-through body that must not reach the backend."""
    if not body or not is_json(content_type):
        return
    if method == "POST" and path in PARSED_PATHS:
        parsed = parse_json_object(body)  # the value limit, and invalid text, as on a gated route
        tokens = parsed.get("tokens")
        ids = len(tokens) if path == DETOKENIZE_PATH and isinstance(tokens, list) else 0
        if max_model_len is not None and ids > max_model_len:
            raise InvalidField(
                f"'tokens' holds {ids:,} token ids, more than this model's maximum context "
                f"length of {max_model_len:,} tokens: no request to it holds that many, and kvgate "
                "does not send the backend the work of detokenizing them.",
                "tokens",
                "detokenize_too_long",
            )
        return
    refuse_invalid_text(body)
