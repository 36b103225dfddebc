"""The OpenAI-compatible HTTP server (FastAPI). Never imports jax: see api_server.py."""
