"""``Model.tokenize`` on inputs at the edges, against llama.cpp's recorded answers
(tests/fixtures/tokenizer/smollm2.json, made by scripts/record_tokenizer_fixtures.py): texts of
whitespace only and of 10,000 characters, through the Python API (the Rust tests check the same
cases on the core). Lone surrogates have no UTF-8 form: they are rejected exactly as
``str.encode("utf-8")`` rejects them (what a llama-cpp-python user, who passes bytes, gets).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from kvserve import Model

FIXTURE = Path(__file__).parent / "fixtures" / "tokenizer" / "smollm2.json"


@pytest.fixture(scope="module")
def model(model_path: Path) -> Model:
    return Model.load(model_path, threads=1)


def _cases(keep: Callable[[str], bool]) -> list[dict]:
    cases = json.loads(FIXTURE.read_text(encoding="utf-8"))["cases"]
    return [c for c in cases if keep(c["text"])]


BLANK = _cases(lambda t: t != "" and t.isspace())
LONG = _cases(lambda t: len(t) >= 10_000)


@pytest.mark.parametrize(
    ("what", "cases", "at_least"), [("whitespace only", BLANK, 40), ("10k characters", LONG, 3)]
)
def test_edge_texts_match_llama_cpp(model: Model, what: str, cases: list, at_least: int) -> None:
    assert len(cases) >= at_least, f"the fixture has {len(cases)} {what} cases"
    bad = []
    for c in cases:
        got = model.tokenize(
            c["text"], add_special=c["add_special"], parse_special=c["parse_special"]
        )
        if got != c["tokens"]:
            bad.append(
                f"{c['text'][:40]!r}... ({len(c['text'])} chars): {got[:8]} vs {c['tokens'][:8]}"
            )
        elif not c["add_special"] and not c["parse_special"]:
            assert model.detokenize(got) == c["text"]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("text", ["\ud800", "a\udfffb", "\ud83d only half an emoji", "x\udce9"])
def test_lone_surrogates_are_rejected_like_str_encode(model: Model, text: str) -> None:
    with pytest.raises(UnicodeEncodeError) as want:
        text.encode("utf-8")
    with pytest.raises(UnicodeEncodeError) as got:
        model.tokenize(text)
    assert str(got.value) == str(want.value)
    assert isinstance(got.value, ValueError)
    with pytest.raises(UnicodeEncodeError):
        model.generate(text, max_tokens=1)
