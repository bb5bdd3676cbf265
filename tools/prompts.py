"""The 32 English prompts of about 200 characters that every experiment uses."""

from __future__ import annotations

from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.txt")


def load_prompts() -> list[str]:
    return [line for line in PROMPTS_FILE.read_text(encoding="utf-8").splitlines() if line]
