"""The imperative shell: the serving engine (`serve.engine`: sessions, continuous batching, the
radix prefix cache, directives in flight), sampling, chat layouts, policies and edit detection,
durable sessions (`serve.snapshot`, `serve.forgotten`), the OpenAI-compatible HTTP server
(`serve.http`), serving across hosts (`serve.multihost`) and replicas behind a router
(`serve.cluster`), and the serving demo (`python -m serve`)."""
