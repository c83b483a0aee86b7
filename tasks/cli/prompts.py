"""Prompt sets and their tokenisation (chat template, left padding)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DOMAINS = ("json", "code", "summarize", "qa", "chat", "creative")


class PromptFileError(ValueError):
    """A prompt file cannot be read."""


@dataclass(frozen=True)
class Prompt:
    id: str
    domain: str
    text: str


def builtin_prompts() -> list[Prompt]:
    """The small built-in set: three requests for each of json, code, summarize, qa, chat, creative."""
    text = resources.files("tasks").joinpath("data/builtin_prompts.jsonl").read_text("utf-8")
    return _parse_jsonl(text.splitlines(), "built-in prompts")


def _parse_jsonl(lines, source: str) -> list[Prompt]:
    prompts = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            prompts.append(Prompt(id=str(row.get("id", f"line-{number}")),
                                  domain=str(row.get("domain", "general")), text=str(row["prompt"])))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise PromptFileError(f"{source}, line {number}: expected a JSON object with a \"prompt\" "
                                  f"field (optional \"id\", \"domain\"): {exc}") from exc
    return prompts


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    """Prompts from a file (.jsonl: {"prompt", "domain"?, "id"?} per line; else one prompt per
    non-empty line), or the built-in set when path is None."""
    if path is None:
        return builtin_prompts()
    path = Path(path)
    if not path.is_file():
        raise PromptFileError(f"prompt file {str(path)!r} does not exist; pass a .jsonl or .txt file")
    lines = path.read_text("utf-8").splitlines()
    if path.suffix == ".jsonl":
        return _parse_jsonl(lines, str(path))
    return [Prompt(id=f"line-{n}", domain="general", text=line)
            for n, line in enumerate(lines, start=1) if line.strip()]


def encode(tokenizer, texts: list[str], chat: bool = True, device=None):
    """(input_ids [B, T], attention_mask [B, T]) left-padded; chat=True applies the chat template."""
    import torch        # here: the CLI imports this module at start-up, and most commands need no torch

    if chat and getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)
                 for text in texts]
    tokenizer.padding_side = "left"
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    ids, mask = batch["input_ids"], batch["attention_mask"]
    if device is not None:
        ids, mask = ids.to(device), mask.to(device)
    return ids, mask.to(torch.long)
