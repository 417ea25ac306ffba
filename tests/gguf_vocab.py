"""A vocabulary oracle independent of the engine: token pieces read from the GGUF file with the
``gguf`` package (byte-level BPE pieces mapped back to bytes; SentencePiece pieces with the
escaped space and byte tokens)."""

from __future__ import annotations

from pathlib import Path


def _gpt2_byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's byte -> printable-unicode map used in byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


class Vocab:
    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        reader = GGUFReader(path)

        def field(key: str) -> object:
            f = reader.fields.get(key)
            return None if f is None else f.contents()

        self.model = str(field("tokenizer.ggml.model"))
        tokens = field("tokenizer.ggml.tokens")
        assert isinstance(tokens, list)
        self.tokens: list[str] = [str(t) for t in tokens]
        self.add_bos = field("tokenizer.ggml.add_bos_token")
        self.bos = field("tokenizer.ggml.bos_token_id")
        self.eos = field("tokenizer.ggml.eos_token_id")
        self._bytes = _gpt2_byte_decoder()

    def piece(self, token: int) -> bytes:
        text = self.tokens[token]
        if self.model == "gpt2":
            return bytes(self._bytes[c] for c in text)
        if self.model == "llama":
            if text.startswith("<0x") and text.endswith(">") and len(text) == 6:
                return bytes([int(text[3:5], 16)])
            return text.replace("\u2581", " ").encode()
        raise AssertionError(f"no vocabulary oracle for tokenizer model {self.model!r}")

    def text(self, tokens: list[int]) -> str:
        return b"".join(self.piece(t) for t in tokens).decode("utf-8", errors="replace")
