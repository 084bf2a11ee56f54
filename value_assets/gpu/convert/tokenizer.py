"""The actor's Hugging Face tokenizer, for importing text rollouts (core/rollouts.py's protocol).

Loaded from a local folder only (`local_files_only`: nothing is downloaded). Chat prompts are
rendered with the tokenizer's own chat template and the generation prompt appended, exactly as an
RL rollout engine renders them before sampling; the rendered text already holds the template's
special tokens, so it is encoded without adding more. A plain-text prompt is encoded as the
tokenizer does by default (with its BOS, where it has one), unless `--chat-template always` wraps
it as one user message. A response is encoded without special tokens and, by default, followed by
the EOS token the actor emitted to end it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from value_assets.core.backbone import TOKENIZER_FILES
from value_assets.core.errors import InputError, show


def has_tokenizer_files(folder: Path) -> bool:
    return any((folder / name).is_file() for name in TOKENIZER_FILES)


def tokenizer_sha256(folder: Path) -> str:
    """sha256 over (name, sha256) of the tokenizer files present, in name order."""
    h = hashlib.sha256()
    found = False
    for name in sorted(TOKENIZER_FILES):
        p = folder / name
        if p.is_file():
            found = True
            h.update(name.encode() + b"\0" + hashlib.sha256(p.read_bytes()).hexdigest().encode() + b"\n")
    if not found:
        raise InputError(str(folder), f"no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...) in this folder")
    return h.hexdigest()


class HFTokenizer:
    def __init__(self, folder: str | Path, *, append_eos: bool = True):
        from transformers import AutoTokenizer

        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise InputError(str(folder), "--tokenizer must be a local Hugging Face folder")
        self.sha256 = tokenizer_sha256(self.folder)
        try:
            self.tok = AutoTokenizer.from_pretrained(str(self.folder), local_files_only=True)
        except Exception as exc:  # noqa: BLE001 - transformers raises many types for a broken folder
            raise InputError(str(folder), f"cannot load the tokenizer: {type(exc).__name__}: {exc}") from None
        self.vocab_size = len(self.tok)
        # The context length the tokenizer's files state, where they state a real one (transformers
        # puts a huge placeholder, int(1e30), where they do not).
        limit = getattr(self.tok, "model_max_length", None)
        self.model_max_length = int(limit) if isinstance(limit, int) and 0 < limit < 1 << 31 else None
        self.append_eos = append_eos
        if append_eos and self.tok.eos_token_id is None:
            raise InputError(str(folder), "the tokenizer has no EOS token; use --no-eos")

    def render_prompt(self, prompt: Any, chat_template: str) -> tuple[str, bool]:
        has_template = bool(getattr(self.tok, "chat_template", None))
        messages = prompt if isinstance(prompt, list) else None
        if messages is None and chat_template == "always":
            messages = [{"role": "user", "content": prompt}]
        if messages is None or chat_template == "never":
            if messages is not None:
                raise InputError("--chat-template never", "a prompt given as chat messages needs the chat template")
            return prompt, False
        if not has_template:
            raise InputError(str(self.folder), "the prompt is chat messages but the tokenizer has no chat template")
        try:
            text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as exc:  # noqa: BLE001 - the template is input here: a Jinja syntax error, its own
            # raise_exception (an unknown role, a misplaced system message), or an error inside it
            raise InputError(
                f"{self.folder} chat template", f"refused this prompt: {type(exc).__name__}: {exc}"
            ) from None
        if not isinstance(text, str) or not text:
            raise InputError(f"{self.folder} chat template", f"rendered this prompt as {show(text)}, not a text")
        return text, True

    def encode_prompt(self, text: str, templated: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=not templated)["input_ids"])

    def encode_response(self, text: str) -> list[int]:
        ids = list(self.tok(text, add_special_tokens=False)["input_ids"])
        if self.append_eos and ids:
            ids.append(int(self.tok.eos_token_id))
        return ids
