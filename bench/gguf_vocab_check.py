#!/usr/bin/env python
"""Our GGUF tokenizers against llama.cpp's own vocabulary tests.

llama.cpp ships vocabulary-only GGUF files of real models (``models/ggml-vocab-*.gguf``) with
test texts (``.inp``, split by ``__ggml_vocab_test__``) and the ids HF's tokenizer gives them
(``.out``, one line per text). The llama-cpp-python sdist vendors them:

    pip download --no-binary :all: --no-deps llama-cpp-python -d /tmp/lcp && tar xzf /tmp/lcp/*.tar.gz -C /tmp/lcp
    python bench/gguf_vocab_check.py /tmp/lcp/llama_cpp_python-*/vendor/llama.cpp/models

Prints one line per vocabulary; exits 1 when a supported vocabulary gives different ids.
Vocabularies whose tokenizer model or pre-tokenizer localllm does not support are listed as
refused, with the one-line reason a user would see.
"""

from __future__ import annotations

import sys
from pathlib import Path

from localllm.errors import LocalLLMError
from localllm.models.gguf_file import read_gguf
from localllm.tokenizer import Tokenizer

SEPARATOR = "\n__ggml_vocab_test__\n"


def check(path: Path) -> bool:
    fields, _ = read_gguf(path)
    kind = f"{fields.get('tokenizer.ggml.model')}/{fields.get('tokenizer.ggml.pre')}"
    inp, out = path.with_suffix(".gguf.inp"), path.with_suffix(".gguf.out")
    try:
        tok = Tokenizer.from_gguf_fields(fields, path.name)
    except LocalLLMError as e:
        print(f"{path.name} ({kind}): refused: {e}")
        return True
    if not (inp.is_file() and out.is_file()):
        print(f"{path.name} ({kind}): loads; no test texts")
        return True
    texts = inp.read_text(encoding="utf-8").split(SEPARATOR)
    texts[-1] = texts[-1].removesuffix(SEPARATOR.rstrip("\n"))
    wanted = out.read_text(encoding="utf-8").split("\n")
    misses = []
    for text, line in zip(texts, wanted):
        want = [int(x) for x in line.split()]
        got = tok.encode(text, add_special_tokens=False)
        if got != want:
            misses.append((text, got, want))
    print(f"{path.name} ({kind}): {len(texts) - len(misses)}/{len(texts)} texts give llama.cpp's ids")
    for text, got, want in misses[:3]:
        print(f"    {text[:40]!r}: got {got[:10]}, want {want[:10]}")
    return not misses


def main() -> int:
    if len(sys.argv) != 2 or not Path(sys.argv[1]).is_dir():
        print(__doc__, file=sys.stderr)
        return 2
    ok = [check(p) for p in sorted(Path(sys.argv[1]).glob("ggml-vocab-*.gguf"))]
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
