"""SGLang 0.5.23's request and response contract, pure: the fields it knows, the ``/generate`` type gate, parsing
of native and OpenAI bodies, and the response shapes. The worker takes a parsed request and returns an outcome."""
