"""OpenAI wire compatibility, pure: requests parsed as OpenAI's server parses them, worker errors turned into
OpenAI errors, worker responses made to conform to OpenAI's response schemas."""
