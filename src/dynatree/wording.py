"""Small helpers for messages and tables a person reads."""


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """'1 prompt', '3 prompts' (`plural` for irregular nouns)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
