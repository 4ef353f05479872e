"""The CPU backend's OpenAI endpoint, laid out as vLLM lays out its OpenAI
entrypoints: the app (`app`: `build_app`, the model list, tokenize and
detokenize), the chat and completions routes (`chat`, `completions`), what
the routes share (`requests`), vLLM's request and response shapes
(`protocol`), its errors (`errors`), streaming (`stream`) and tool-call
parsers (`tool_parsers`, whose names `HFEngine.check_settings` checks
before any engine starts)."""
