"""The built-in sample of natural text that quality is measured on when none is given: the
`--int8` report, W8A8's SmoothQuant calibration without `--calibrate`, and `dsc eval`.

compiler/data/sample.txt holds passages of English prose in the public domain (openings of
Pride and Prejudice, A Tale of Two Cities, Moby-Dick, Alice's Adventures in Wonderland, A
Scandal in Bohemia, Jane Eyre, A Christmas Carol and Frankenstein; the Gettysburg Address, the
Declaration of Independence, Walden and the close of On the Origin of Species), two written
for it, and some Python, C and SQL: about 3,000 tokens for a 50K-word BPE vocabulary. Random
tokens are no text: a model's logits on them are flat and its quantization error looks several
times larger than on what it is used for.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from dsc.errors import UserError


def sample_text() -> str:
    return files("dsc.compiler").joinpath("data/sample.txt").read_text(encoding="utf-8")


def read_text(path: str | Path | None) -> str:
    """The text of `path` (UTF-8), or the built-in sample for None."""
    if path is None:
        return sample_text()
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UserError(f"{path}: text file not found") from None
    except (UnicodeDecodeError, IsADirectoryError) as e:
        raise UserError(f"{path}: not a UTF-8 text file ({type(e).__name__})") from None
    if not text.strip():
        raise UserError(f"{path}: the text is empty")
    return text


def load_tokenizer(folder: Path):
    """The `tokenizers` tokenizer of `folder/tokenizer.json`, or None without one."""
    path = Path(folder) / "tokenizer.json"
    if not path.is_file():
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(path))


def token_chunks(ids: list[int], count: int, length: int) -> list[list[int]]:
    """The first `count` consecutive chunks of `length` tokens of `ids` (fewer where it is short).
    The sample interleaves prose and code, so its first chunks hold both."""
    return [ids[i : i + length] for i in range(0, min(len(ids), count * length), length)]


# the quantization reports' inputs (compiler/int8_report.py; --auto-precision measures on the same)
REPORT_PROMPTS = 4  # prompts the report evaluates (the first calibration prompts, or sample-text chunks)
REPORT_TOKENS = 128  # ... of this many tokens: rows x tokens is the cost (and bounds the KV cache)
POSITIONS = REPORT_TOKENS // 2  # evaluated positions per prompt (its last ones, after 64 of context)


def random_prompts(vocab: int, batch: int = 3, seed: int = 0, max_len: int = 11) -> list[list[int]]:
    """`batch` prompts of random token ids, of lengths max_len, max_len - 4, ... (at least 2)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    lens = [max(2, max_len - 4 * i) for i in range(batch)]
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lens]


def report_inputs(tokenizer_folder: Path, vocab: int, max_seq: int) -> tuple[list[list[int]], str]:
    """The report's prompts without --calibrate, and where they come from: REPORT_PROMPTS chunks
    of REPORT_TOKENS tokens of the built-in sample, else (no tokenizer) three random prompts."""
    prompts = sample_prompts(tokenizer_folder, REPORT_PROMPTS, min(REPORT_TOKENS, max_seq - 1), vocab)
    if prompts is None:
        return random_prompts(vocab, batch=3), "random tokens"
    return prompts, "sample text"


def sample_prompts(tokenizer_folder: Path, count: int, length: int, vocab: int) -> list[list[int]] | None:
    """Chunks of the built-in sample, tokenized with the checkpoint's tokenizer; None when it
    has none (or its ids do not fit the model's vocabulary)."""
    tok = load_tokenizer(tokenizer_folder)
    if tok is None:
        return None
    ids = tok.encode(sample_text(), add_special_tokens=False).ids
    if not ids or max(ids) >= vocab:
        return None
    return token_chunks(ids, count, length)
