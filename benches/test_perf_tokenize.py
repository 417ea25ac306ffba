"""Tokenization speed: a short chat-sized text and a ~2k-token document, with the default
model's tokenizer (SmolLM2's BPE). Gemma 3's SentencePiece tokenizer joins the parameters once
``kvserve.Model`` loads gemma3 files (issue #7).

Group ``tokenize``; one benchmark per (tokenizer, text). The texts are fixed here (not grown to a
token count), so two commits tokenize the same bytes; ``extra_info`` records the token count.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvserve import Model

SHORT = "Hi! Could you tell me what the capital of France is, and why it's called that?"

PARAGRAPH = (
    "In 1887, the harbour of Port Ellery handled 4,312 ships; by 1923 that number had fallen to "
    "1,050, and the town's merchants—who had once boasted of \"the finest quay north of the "
    'river"—turned to fishing, tourism and, briefly, the manufacture of bicycle frames. '
    "Today the old customs house (built 1851, restored 2004) is a museum: €6 for adults, free "
    "for children under 12. Its café serves crème brûlée, naïve paintings line the stairs, and "
    "a sign reads: 'Mind the step → exit'. def main(): return sum(x**2 for x in range(10))\n"
)
# ~2,000 tokens with SmolLM2's tokenizer (~100 tokens a paragraph); the number is recorded.
LONG = "".join(f"{i}. {PARAGRAPH}" for i in range(20))


@pytest.fixture(scope="module")
def models(model_path: Path) -> dict[str, Model]:
    return {"smollm2": Model(model_path)}


@pytest.mark.benchmark(group="tokenize")
@pytest.mark.parametrize("text", ["short", "2k"])
@pytest.mark.parametrize("tokenizer", ["smollm2"])
def test_tokenize(benchmark, models: dict[str, Model], tokenizer: str, text: str) -> None:
    model = models[tokenizer]
    source = SHORT if text == "short" else LONG
    ids = benchmark(model.tokenize, source)
    assert model.detokenize(ids).endswith(source[-20:])  # it tokenized the whole text
    benchmark.extra_info["tokens"] = len(ids)
