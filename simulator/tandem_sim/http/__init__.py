"""The HTTP front of the simulated worker: SGLang 0.5.23's ``http_server.py`` routes, OpenAI streaming, health."""
