"""The OpenAI-compatible routes of the generation server (docs/design.md, "The generation server")."""

from __future__ import annotations


def add_openai_routes(app, served) -> None:
    """/v1/completions and /v1/chat/completions, and each agent episode's own."""
